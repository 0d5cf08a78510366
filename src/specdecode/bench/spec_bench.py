"""Spec-Bench runner: our methods interleaved per prompt, greedy mismatch check, per-category summary."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specdecode.builder import build_generator, load_target
from specdecode.engine import SpeculativeGenerator
from specdecode.models.loading import load_model

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
METHODS = ("plain", "ngram", "model", "adaptive")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    prompt: str  # first turn only, as Spec-Bench's single-turn speed runs do


def load_questions(path: Path, categories: list[str] | None = None, per_category: int | None = None) -> list[Question]:
    """A deterministic subset: the first `per_category` questions of each category, in file order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    taken: dict[str, int] = defaultdict(int)
    out = []
    for r in rows:
        cat = r["category"]
        if categories and cat not in categories:
            continue
        if per_category is not None and taken[cat] >= per_category:
            continue
        taken[cat] += 1
        out.append(Question(int(r["question_id"]), cat, r["turns"][0]))
    return out


def build_methods(target: str, draft: str, methods: list[str], dtype: str, gamma: int) -> dict[str, SpeculativeGenerator]:
    tgt = load_target(target, dtype=dtype)
    dft = load_model(draft, dtype=dtype) if {"model", "adaptive"} & set(methods) else None
    spec = {"plain": dict(drafter="none"), "ngram": dict(drafter="ngram", gamma=gamma),
            "model": dict(drafter="model", gamma=gamma), "adaptive": dict(drafter="model", adaptive=True)}
    return {m: build_generator(tgt, draft=dft, **spec[m]) for m in methods}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(questions: list[Question], gens: dict[str, SpeculativeGenerator], *, max_new_tokens: int = 128,
        out: Path | None = None, progress: bool = True) -> list[dict]:
    """Run every method on every question, methods interleaved per prompt; one warm-up run first.

    Each row's `mismatch_at` is its first token differing from the first method's (put `plain` first).
    """
    from rich.progress import Progress

    for g in gens.values():  # warm-up, not counted
        g.generate(questions[0].prompt, chat=True, max_new_tokens=8)
    rows = []
    with Progress(disable=not progress) as bar:
        task = bar.add_task("spec-bench", total=len(questions) * len(gens))
        for q in questions:
            ref = None
            for name, g in gens.items():
                r = g.generate(q.prompt, chat=True, max_new_tokens=max_new_tokens)
                row = {"question_id": q.question_id, "category": q.category, "method": name,
                       "new_tokens": r.stats.new_tokens, "seconds": r.stats.total_seconds,
                       "target_forward_passes": r.stats.target_forward_passes,
                       "mean_accepted_length": r.stats.mean_accepted_length,
                       "acceptance_rate": r.stats.acceptance_rate,
                       "accepted_by_position": r.stats.accepted_by_position,
                       "drafted_by_position": r.stats.drafted_by_position,
                       "draft_seconds": r.stats.draft_seconds, "verify_seconds": r.stats.verify_seconds,
                       "token_ids": r.token_ids}
                if ref is None:
                    ref = r.token_ids
                row["mismatch_at"] = first_mismatch(ref, r.token_ids)
                rows.append(row)
                bar.advance(task)
            if out is not None:
                with open(out / "results.jsonl", "a") as f:
                    for row in rows[-len(gens):]:
                        f.write(json.dumps(row) + "\n")
    return rows


def _totals(rs: list[dict], base: list[dict]) -> dict:
    t = sum(r["seconds"] for r in rs)
    return {"speedup": sum(r["seconds"] for r in base) / t,
            "tokens_per_second": sum(r["new_tokens"] for r in rs) / t,
            "mean_accepted_tokens": sum(r["new_tokens"] for r in rs) / max(1, sum(r["target_forward_passes"] for r in rs))}


def summarize(rows: list[dict]) -> dict:
    """Per method and category: speedup = time(plain) / time(method) on the same prompts;
    mean accepted tokens = generated tokens / target forward passes."""
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[r["method"]][r["category"]].append(r)
    base = by["plain"]
    summary = {}
    for method, cats in by.items():
        allr = [r for rs in cats.values() for r in rs]
        overall = _totals(allr, [r for rs in base.values() for r in rs])
        summary[method] = {
            "categories": {cat: _totals(rs, base[cat]) for cat, rs in cats.items()},
            "overall_speedup": overall["speedup"],
            "tokens_per_second": overall["tokens_per_second"],
            "mean_accepted_tokens": overall["mean_accepted_tokens"],
            "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in allr),
            "draft_time_share": sum(r["draft_seconds"] for r in allr) / sum(r["seconds"] for r in allr),
            "mismatches": [(r["question_id"], r["mismatch_at"]) for r in allr if r["mismatch_at"] is not None],
        }
    return summary


def markdown_table(summary: dict) -> str:
    cats = sorted({c for s in summary.values() for c in s["categories"]})
    lines = ["| method | " + " | ".join(cats) + " | #mean accepted tokens | tokens/s | speedup vs plain | mismatches |",
             "|---" * (len(cats) + 5) + "|"]
    for m, s in summary.items():
        lines.append(f"| {m} | " + " | ".join(f"{s['categories'][c]['speedup']:.2f}x" for c in cats)
                     + f" | {s['mean_accepted_tokens']:.2f} | {s['tokens_per_second']:.2f} | {s['overall_speedup']:.2f}x"
                     + f" | {len(s['mismatches'])} |")
    return "\n".join(lines)
