"""How often the target keeps a token the draft model gives probability p: runs the draft (as `generate` loads it)
over each prompt and plain decoding's answer of a `specdecode bench` run, in one forward per prompt (the draft reads
the last 256 tokens of the prompt, as it drafts), and counts, per tenth of the draft's probability of its own greedy
next token, how often that token is plain decoding's. Greedy verification keeps a drafted token exactly when it is.

    .venv/bin/python docs/bench/2026-12-07-zen5-path-stop/calibration.py RUN/results.jsonl
"""

import json
import sys

import torch

from specdecode.bench.spec_bench import load_questions
from specdecode.builder import build_generator
from specdecode.drafting.model import WINDOW
from specdecode.models.catalog import DEFAULT_TARGET

torch.set_num_threads(2)
rows = [json.loads(line) for line in open(sys.argv[1])]
plain = [r for r in rows if r["method"] == "plain"]
g = build_generator(DEFAULT_TARGET, drafter="model")
draft = g.drafter.model
questions = {q.question_id: q for q in load_questions(per_category=None)}
answers = {(r["question_id"], r.get("turn", 1)): r["token_ids"] for r in plain}
counts = [[0, 0] for _ in range(10)]  # per tenth of probability: tokens, kept
for r in plain:
    q = questions[r["question_id"]]
    if r.get("turn", 1) == 1:
        prompt = g.encode(q.prompt, chat=True)
    else:
        first = g.tokenizer.decode(answers[(q.question_id, 1)], skip_special_tokens=True)
        prompt = g.encode([{"role": "user", "content": q.turns[0]}, {"role": "assistant", "content": first},
                           {"role": "user", "content": q.turns[1]}])
    ids = prompt[-WINDOW:] + r["token_ids"]
    cache = draft.new_cache(1, len(ids))
    with torch.no_grad():
        logits = g.drafter._on_target_vocab(draft(torch.tensor([ids]), torch.tensor([0]), cache,
                                                  num_logits=len(ids))[0])
    at = len(ids) - len(r["token_ids"]) - 1  # the logits after the prompt's last token predict the first answer token
    probs = torch.softmax(logits[at:at + len(r["token_ids"])], -1)
    p, token = probs.max(-1)
    for pi, ti, answer in zip(p.tolist(), token.tolist(), r["token_ids"]):
        b = min(int(pi * 10), 9)
        counts[b][0] += 1
        counts[b][1] += ti == answer
print("| draft's probability | tokens | kept by the target |")
print("|---|---|---|")
for b, (n, kept) in enumerate(counts):
    if n:
        print(f"| {b / 10:.1f}-{(b + 1) / 10:.1f} | {n} | {kept / n:.2f} |")
