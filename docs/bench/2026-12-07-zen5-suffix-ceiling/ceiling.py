"""How fast can drafting from past answers be on this CPU? Replays a `specdecode bench --turns 2` run's plain
answers (greedy: every lossless method emits exactly these tokens) through the suffix cache, costing each step with
the target's forward of that width measured here (T new tokens after 300 of context, median of 9), decode steps only
(no prefill):

- `suffix` and `suffix-chain` as they draft, their lengths chosen by the cost model fed those timings;
- two ceilings that know the answer: each step drafts exactly the tokens that will be accepted, from the longest
  match's continuation, or from the best continuation among every match of the context's last two tokens that the
  cache's index holds. No drafter that copies from what the index finds can beat the second;
- the same under a flat verify (every width costs what one token does), for CPUs whose verify rows are free.

The bench's ratios count prefill too, which no drafter speeds up: the last column puts each ratio over all turns
on the bench's scale, adding the run's own prefill time (the least-squares split of plain's rows into seconds per
prompt token and per new token, as `bench` reports it).

    .venv/bin/python docs/bench/2026-12-07-zen5-suffix-ceiling/ceiling.py \
        docs/bench/2026-12-07-zen5-one-call/multiturn/results.jsonl
"""

import json
import sys
import time

import torch

from specdecode.bench.spec_bench import load_questions, time_split
from specdecode.builder import build_generator
from specdecode.draft_lengths import MAX_GAMMA, CostModel, DraftLengths, GammaSchedule
from specdecode.drafting.base import Draft, DraftRequest
from specdecode.drafting.suffix import SuffixDrafter
from specdecode.models.catalog import DEFAULT_TARGET
from specdecode.verification.sampling import SamplingParams

torch.set_num_threads(2)
rows = [json.loads(line) for line in open(sys.argv[1])]
plain = [r for r in rows if r["method"] == "plain"]
g = build_generator(DEFAULT_TARGET, drafter="suffix")

# the target's forward per width
cache = g.target.new_cache(1, 1024)
g.target(torch.randint(0, 1000, (1, 300)), torch.tensor([0]), cache, num_logits=1)
ms = {}
for T in range(1, MAX_GAMMA + 2):
    times = []
    for _ in range(9):
        start = time.perf_counter()
        g.target(torch.randint(0, 1000, (1, T)), torch.tensor([300]), cache)
        times.append(time.perf_counter() - start)
    ms[T] = sorted(times)[4] * 1e3
print("target forward, ms by width:", " ".join(f"{T}: {t:.1f}" for T, t in ms.items()))

# the run's conversations, in its order
questions = {q.question_id: q for q in load_questions(per_category=None)}
answers = {(r["question_id"], r["turn"]): r["token_ids"] for r in plain}
turns = []
for r in plain:
    q = questions[r["question_id"]]
    if r["turn"] == 1:
        prompt = g.encode(q.prompt, chat=True)
    else:
        first = g.tokenizer.decode(answers[(q.question_id, 1)], skip_special_tokens=True)
        prompt = g.encode([{"role": "user", "content": q.turns[0]}, {"role": "assistant", "content": first},
                           {"role": "user", "content": q.turns[1]}])
    turns.append((r["turn"], prompt, r["token_ids"]))


def kept(draft: Draft, answer: list[int]) -> int:
    """Nodes a greedy verify keeps: the path that follows the answer."""
    at, n = -1, 0
    while n < len(answer) - 1:  # the last token always comes from the target
        at = next((i for i, p in enumerate(draft.parent_of) if p == at and draft.tokens[i] == answer[n]), None)
        if at is None:
            break
        n += 1
    return n


def replay(cost: dict[int, float], policy: str) -> tuple[float, float, float, float]:
    """Plain's decode time over the policy's, all turns, first turns, second turns; and tokens per step."""
    drafter = SuffixDrafter(tree=policy == "suffix")
    costs = CostModel()
    totals = {0: [0.0, 0.0], 1: [0.0, 0.0], 2: [0.0, 0.0]}
    steps = tokens = 0
    for turn, prompt, answer in turns:
        context, pos, seconds = list(prompt), 0, 0.0
        lengths = DraftLengths(GammaSchedule(8, True, maximum=MAX_GAMMA), costs, True)
        costs.start_sequence()
        drafter.reset(0)
        while pos < len(answer):
            if policy in ("suffix", "suffix-chain"):
                gamma = lengths.next(MAX_GAMMA)
                draft = drafter.propose_batch([DraftRequest(0, context, gamma, SamplingParams(0.0),
                                                            torch.Generator())])[0]
                n = kept(draft, answer[pos:])
                width = 1 + len(draft.tokens)
                lengths.observe(width, cost[width] / 1e3, len(draft.tokens), n, 0.0, max(draft.depths(), default=0))
            else:  # a ceiling: draft exactly what will be kept
                drafter._sync(0, context)
                found = drafter.cache.continuations(context, MAX_GAMMA)
                if policy == "ceiling: longest match":
                    found = [max(found, key=lambda f: f[1])] if found else []
                n = max((kept(Draft(c, None), answer[pos:]) for c, _ in found), default=0)
                width = 1 + n
            seconds += cost[width]
            context += answer[pos:pos + n + 1]
            pos += n + 1
            steps += 1
        tokens += len(answer)
        for k in (0, turn):
            totals[k][0] += len(answer) * cost[1]
            totals[k][1] += seconds
    return (*(p / s for p, s in totals.values()), tokens / steps)


unmatched = SuffixDrafter()
misses = 0
for _, prompt, answer in turns:  # positions where the cache finds no earlier occurrence of the last two tokens
    unmatched.reset(0)
    for pos in range(len(answer)):
        unmatched._sync(0, prompt + answer[:pos])
        misses += not unmatched.cache.continuations(prompt + answer[:pos], 1)
print(f"answer tokens after two tokens the cache has not seen before: {misses} of {sum(len(t[2]) for t in turns)}")
prefill_ms, decode_ms = time_split(plain) or (0.0, 0.0)
prefill = sum(r["prompt_tokens"] for r in plain) * prefill_ms
decode = sum(r["new_tokens"] for r in plain) * decode_ms
print(f"the run's plain rows: {prefill_ms:.1f} ms per prompt token, {decode_ms:.1f} per new token")
flat = {T: ms[1] for T in ms}
print("| policy | verify | all turns | first turns | second turns | tokens per step | all turns, prefill counted |")
print("|---|---|---|---|---|---|---|")
for label, cost in (("this CPU", ms), ("flat", flat)):
    for policy in ("suffix", "suffix-chain", "ceiling: longest match", "ceiling: best match"):
        ratios = replay(cost, policy)
        counted = (prefill + decode) / (prefill + decode / ratios[0])
        print(f"| {policy} | {label} | " + " | ".join(f"{x:.2f}" + ("x" if i < 3 else "")
                                                      for i, x in enumerate(ratios)) + f" | {counted:.2f}x |")
