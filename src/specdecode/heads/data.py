"""Training text for a drafting head, found on this machine or written by the target itself; never benchmark data.

- Conversations the target writes: it composes a user turn from its chat template's user prefix (sampled), then
  answers it (greedy and sampled in turn), generated in batches through the engine's own decode step.
- Local text: the user's own files and folders where given (their code base, their documents), else the source
  files and documentation of the Python installation (standard library and installed packages, this package and its
  benchmark data excluded); in a seeded order.
Both come as chunks of token ids; the head learns the target's distribution on them, not the text's next tokens.
"""

from __future__ import annotations

import functools
import json
import random
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from specdecode.drafting.none import NoDrafter
from specdecode.engine import SpeculativeGenerator
from specdecode.models.decoder import Transformer
from specdecode.step import decode_step

SUFFIXES = (".py", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 200_000
MIN_CHUNK = 64  # tokens; shorter pieces are dropped
MARK = "\x00"  # stands for the user's text in the chat template


def template_parts(tokenizer) -> tuple[str, str]:
    """The chat template's text before a user turn, and between that turn and the assistant's answer ("" and ""
    without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    messages = [{"role": "user", "content": MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, after = text.split(MARK)
    return before, after


def write_conversations(target: Transformer, tokenizer, count: int, seed: int, batch: int = 8,
                        question_tokens: int = 64, answer_tokens: int = 256,
                        on_done=None) -> list[list[int]]:
    """`count` conversations (token ids of the whole chat, template included) the target writes itself: a sampled
    user turn, then its answer, greedy for even ones and sampled at temperature 0.7 for odd ones."""
    before, after = template_parts(tokenizer)
    gen = SpeculativeGenerator(target, NoDrafter(), tokenizer)
    prefix = tokenizer.encode(before, add_special_tokens=False)
    rng = random.Random(seed)
    # a template with no text before a user turn (a raw model's) starts each conversation from a random token
    starts = [prefix or [rng.randrange(target.config.vocab_size)] for _ in range(count)]
    questions = _generate(gen, starts, [dict(temperature=1.0, seed=seed * 100_003 + i) for i in range(count)],
                          question_tokens, batch, None)
    prompts = [s + q + tokenizer.encode(after, add_special_tokens=False) for s, q in zip(starts, questions)]
    answers = _generate(gen, prompts, [dict(temperature=0.0 if i % 2 == 0 else 0.7, seed=seed * 7919 + i)
                                       for i in range(count)], answer_tokens, batch, on_done)
    return [p + a for p, a in zip(prompts, answers)]


def greedy_continued(target: Transformer, tokenizer, pieces: list[list[int]]) -> list[list[int]]:
    """Each piece's first half continued by the target's greedy choices to the piece's length (held-out chains: a
    drafter sees there exactly what drafting would give it)."""
    gen = SpeculativeGenerator(target, NoDrafter(), tokenizer)
    prompts = [p[:max(len(p) // 2, 1)] for p in pieces]
    out = _generate(gen, prompts, [dict(temperature=0.0)] * len(prompts), max(len(p) for p in pieces) // 2 + 1,
                    len(prompts), None, eos=False)
    return [(p + o)[:len(piece)] for p, o, piece in zip(prompts, out, pieces)]


def _generate(gen: SpeculativeGenerator, prompts: list[list[int]], params: list[dict], max_new: int, batch: int,
              on_done, eos: bool = True) -> list[list[int]]:
    """Each prompt's continuation (up to eos, not included, unless `eos` is False), decoded `batch` sequences at a
    time."""
    cache = gen.target.new_cache(batch, max(len(p) for p in prompts) + max_new + 16)
    out: list[list[int]] = [[] for _ in prompts]
    todo = list(range(len(prompts)))
    drafter = NoDrafter()
    while todo:
        group, todo = todo[:batch], todo[batch:]
        seqs = {}
        for row, i in enumerate(group):
            seq = gen.prepare(list(prompts[i]), max_new_tokens=max_new, eos_ids=None if eos else [], **params[i])
            seq.row = row
            seq.prefill(gen.target, cache)
            seqs[seq] = i
        active = list(seqs)
        while active:
            decode_step(gen.target, cache, drafter, active)
            active = [s for s in active if s.finish is None]
        for seq, i in seqs.items():
            out[i] = list(seq.out)
            if on_done is not None:
                on_done(len(seq.out))
    return out


@functools.cache
def local_files(seed: int, roots: tuple[Path, ...] = ()) -> list[Path]:
    """Text files under `roots` (files or folders; default: this Python installation, this package and its benchmark
    data excluded) in a seeded order."""
    if not roots:
        paths = sysconfig.get_paths()
        roots = tuple(sorted({Path(paths["stdlib"]), Path(paths["purelib"])}))
    own = Path(__file__).resolve().parents[1]
    files = []
    for root in roots:
        for f in [root] if root.is_file() else sorted(root.rglob("*")):
            if (f == root or f.suffix in SUFFIXES) and own not in f.resolve().parents and f.is_file():
                try:
                    if f.stat().st_size <= MAX_FILE_BYTES:
                        files.append(f)
                except OSError:
                    continue
    random.Random(seed).shuffle(files)
    return files


def text_chunks(tokenizer, seed: int, length: int, roots: tuple[Path, ...] = ()) -> Iterator[list[int]]:
    """Windows of `length` tokens from the local files, in a seeded order."""
    for f in local_files(seed, roots):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        for i in range(0, len(ids), length):
            if len(ids[i:i + length]) >= MIN_CHUNK:
                yield ids[i:i + length]


def chunks(conversations: list[list[int]], tokenizer, seed: int, length: int, roots: tuple[Path, ...] = (),
           text_per_conversation: int = 2) -> Iterator[list[int]]:
    """The training stream: each conversation (cut to `length`), then `text_per_conversation` text chunks, until
    the conversations run out; then text only."""
    text = text_chunks(tokenizer, seed, length, roots)
    for conv in conversations:
        yield conv[:length]
        for _ in range(text_per_conversation):
            if (c := next(text, None)) is not None:
                yield c
    yield from text


def load_or_write_conversations(path: Path, target: Transformer, tokenizer, count: int, seed: int,
                                on_done=None) -> tuple[list[list[int]], float]:
    """The conversations saved at `path` if they are the ones asked for (same count and seed), else written now and
    saved (a resumed run does not write them again); and the seconds writing them took."""
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("count") == count and saved.get("seed") == seed:
            return saved["conversations"], saved.get("seconds", 0.0)
    t = time.perf_counter()
    convs = write_conversations(target, tokenizer, count, seed, on_done=on_done) if count else []
    seconds = time.perf_counter() - t
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"count": count, "seed": seed, "seconds": seconds, "conversations": convs}))
    return convs, seconds


def token_counts(chunk_iter: Iterator[list[int]], vocab: int, tokens: int) -> torch.Tensor:
    """How often each token id occurs in the first `tokens` tokens of a stream: [vocab] int64."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    seen = 0
    for c in chunk_iter:
        counts += torch.bincount(torch.tensor(c), minlength=vocab)[:vocab]
        seen += len(c)
        if seen >= tokens:
            break
    return counts
