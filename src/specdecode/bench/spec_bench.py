"""Spec-Bench runner: methods interleaved per prompt, greedy outputs checked against plain decoding,
per-category speedups in Spec-Bench's layout."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdecode.bench.methods import PLAIN_KINDS, EngineMethod
from specdecode.bench.runs import Method
from specdecode.errors import InvalidRequestError

# a copy of hemingkx/Spec-Bench's data/spec_bench/question.jsonl, with its Apache-2.0 LICENSE beside it
DEFAULT_QUESTIONS = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"
REFERENCE = "plain"  # our plain decoding in the bench's dtype: every speedup and greedy check is against it


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    prompt: str  # the first turn: Spec-Bench's single-turn speed runs use it alone
    turns: tuple[str, ...] = ()  # every turn (MT-Bench's questions have two)


def load_questions(path: Path = DEFAULT_QUESTIONS, categories: list[str] | None = None,
                   per_category: int | None = None) -> list[Question]:
    """A deterministic subset: the first `per_category` questions of each category (file order),
    ordered round robin over the categories."""
    if not Path(path).is_file():
        raise InvalidRequestError(f"no questions file at {path}")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    known = {r["category"] for r in rows}
    unknown = sorted(set(categories or ()) - known)
    if unknown:
        raise InvalidRequestError(f"unknown categories {unknown}; the file has {sorted(known)}")
    taken: dict[str, int] = defaultdict(int)
    picked = []  # (rank within its category, file order, question)
    for i, r in enumerate(rows):
        cat = r["category"]
        if categories and cat not in categories:
            continue
        if per_category is not None and taken[cat] >= per_category:
            continue
        picked.append((taken[cat], i, Question(int(r["question_id"]), cat, r["turns"][0], tuple(r["turns"]))))
        taken[cat] += 1
    # round robin over categories: a run cut short still covers every category evenly
    return [q for _, _, q in sorted(picked, key=lambda t: t[:2])]


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def own_baseline(name: str) -> str:
    """The plain decoding a method must reproduce token for token: ours for ours, the peer's own for peers."""
    kind, sep, dtype = name.partition(":")
    family = "hf-plain" if kind.startswith("hf-") else "llama-cpp" if kind.startswith("llama-cpp") else "plain"
    return family + sep + dtype


def run(questions: list[Question], methods: list[Method], encode: Callable[[str | list[dict]], list[int]],
        eos_ids: list[int], *, max_new_tokens: int = 128, temperature: float = 0.0, repeats: int = 1,
        out: Path | None = None, progress: bool = True, turns: int = 1,
        decode: Callable[[list[int]], str] | None = None) -> list[dict]:
    """Every method on every question, interleaved (A B C, A B C, ...) so drift hits all alike; one warm-up
    run per method first, not counted. Rows are appended to `out/results.jsonl` as they come.

    turns 2: each question's second turn follows its first (a conversation: the first turn, plain decoding's
    answer to it through `decode`, the second turn), as its own row (category "CATEGORY, turn 2"); questions
    without a second turn have one row.

    Drafters that learn across requests (suffix) start each repeat knowing nothing, not even the warm-up.

    Outputs are checked against plain decoding where they must equal it: every method when greedy, our
    methods when sampling with Gumbel coupling (the peers' samples are not coupled)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    assert methods and methods[0].name == REFERENCE, "our plain decoding runs first: it is the reference"
    prompts = {q.question_id: encode(q.prompt) for q in questions}
    for m in methods:
        m.run(prompts[questions[0].question_id], 8, temperature, 0, eos_ids)
    rows: list[dict] = []
    first: dict[int, list[int]] = {}  # plain decoding's answer to each first turn
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        count = sum(min(turns, max(len(q.turns), 1)) for q in questions)
        task = bar.add_task("spec-bench", total=count * len(methods) * repeats)
        for rep in range(repeats):
            for m in methods:
                if isinstance(m, EngineMethod):
                    m.forget()
            for q, turn in [(q, t) for q in questions for t in range(min(turns, max(len(q.turns), 1)))]:
                ids = prompts[q.question_id]
                if turn:
                    assert decode is not None, "a second turn needs the first answer's text"
                    ids = encode([{"role": "user", "content": q.turns[0]},
                                  {"role": "assistant", "content": decode(first[q.question_id])},
                                  {"role": "user", "content": q.turns[1]}])
                done: dict[str, list[int]] = {}
                for m in methods:
                    bar.update(task, description=f"q{q.question_id} {m.name}")
                    r = m.run(ids, max_new_tokens, temperature, q.question_id * 1000 + rep + 100 * turn, eos_ids)
                    done[m.name] = r.token_ids
                    if m.name == REFERENCE and not turn:
                        first[q.question_id] = r.token_ids
                    row = {"question_id": q.question_id, "turn": turn + 1,
                           "category": q.category + (f", turn {turn + 1}" if turn else ""), "method": m.name,
                           "repeat": rep, "prompt_tokens": len(ids), "new_tokens": len(r.token_ids),
                           "seconds": r.seconds, "target_forward_passes": r.target_forward_passes,
                           "drafted_by_position": r.drafted_by_position,
                           "accepted_by_position": r.accepted_by_position, "draft_seconds": r.draft_seconds,
                           "token_ids": r.token_ids, "mismatch_at": None, "differs_from_plain_at": None}
                    if temperature == 0 or (isinstance(m, EngineMethod) and m.coupling == "gumbel"):
                        base = own_baseline(m.name)
                        if base in done and base != m.name:
                            row["mismatch_at"] = first_mismatch(done[base], r.token_ids)
                        row["differs_from_plain_at"] = first_mismatch(done[REFERENCE], r.token_ids)
                    rows.append(row)
                    if out is not None:
                        with open(out / "results.jsonl", "a") as f:
                            f.write(json.dumps(row) + "\n")
                    bar.advance(task)
    return rows


def complete_rows(rows: list[dict]) -> list[dict]:
    """The rows of (question, turn, repeat) that every method finished: what a run cut short can report."""
    methods = {r["method"] for r in rows}
    done: dict[tuple, set] = defaultdict(set)
    for r in rows:
        done[(r["question_id"], r.get("turn", 1), r.get("repeat", 0))].add(r["method"])
    return [r for r in rows if done[(r["question_id"], r.get("turn", 1), r.get("repeat", 0))] == methods]


def _speed(rs: list[dict]) -> float:
    return sum(r["new_tokens"] for r in rs) / max(1e-9, sum(r["seconds"] for r in rs))


def time_split(rs: list[dict]) -> tuple[float, float] | None:
    """(ms per prompt token, ms per new token): the least-squares fit of each row's seconds on its prompt and new
    tokens (no intercept), the same for every method, peers included, where only the total time is known. It says
    whether a method loses on prefill or on decoding. None when the rows cannot separate the two."""
    pp = sum(r.get("prompt_tokens", 0) ** 2 for r in rs)
    nn = sum(r["new_tokens"] ** 2 for r in rs)
    pn = sum(r.get("prompt_tokens", 0) * r["new_tokens"] for r in rs)
    ps = sum(r.get("prompt_tokens", 0) * r["seconds"] for r in rs)
    ns = sum(r["new_tokens"] * r["seconds"] for r in rs)
    det = pp * nn - pn * pn
    if det <= 1e-9 * pp * nn:
        return None
    return 1e3 * (ps * nn - ns * pn) / det, 1e3 * (ns * pp - ps * pn) / det


def summarize(rows: list[dict]) -> dict:
    """Per method: speedup = tokens/s(method) / tokens/s(baseline) on the same prompts, which is
    time(plain) / time(method) whenever the outputs are identical (greedy, lossless) and stays fair when a
    peer's answer has another length; mean accepted tokens = generated tokens / target forward passes."""
    by: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[r["method"]][r["category"]].append(r)
    everything = {m: [r for rs in cats.values() for r in rs] for m, cats in by.items()}
    methods: dict[str, dict] = {}
    for m, cats in by.items():
        rs = everything[m]
        drafted = _sum_lists(r.get("drafted_by_position", []) for r in rs)
        draft_seconds = sum(r.get("draft_seconds", 0.0) for r in rs)
        accepted = _sum_lists(r.get("accepted_by_position", []) for r in rs)
        methods[m] = {
            "categories": {c: {"speedup": _speed(x) / _speed(by[REFERENCE][c]), "tokens_per_second": _speed(x)}
                           for c, x in cats.items()},
            "tokens_per_second": _speed(rs),
            "speedup_vs_plain": _speed(rs) / _speed(everything[REFERENCE]),
            "speedup_vs_hf_plain": _speed(rs) / _speed(everything["hf-plain"]) if "hf-plain" in by else None,
            "mean_accepted_tokens": (sum(r["new_tokens"] for r in rs)
                                     / max(1, sum(r["target_forward_passes"] for r in rs))),
            "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else None,
            "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
            "draft_time_share": draft_seconds / max(1e-9, sum(r["seconds"] for r in rs)),
            "ms_per_prompt_token_and_new_token": time_split(rs),
            # the draft's seconds (its catch-up prefills included) per token it proposed
            "draft_ms_per_drafted_token": 1e3 * draft_seconds / sum(drafted) if sum(drafted) else None,
            "baseline": own_baseline(m),
            "mismatches": [[r["question_id"], r["mismatch_at"]] for r in rs if r.get("mismatch_at") is not None],
            "differs_from_plain": sum(r.get("differs_from_plain_at") is not None for r in rs),
            "prompts": len(rs),
        }
    plains = [m for m in methods if m.partition(":")[0] in PLAIN_KINDS]
    drafting = [m for m in methods if m not in plains]
    fastest_plain = max(plains, key=lambda m: methods[m]["tokens_per_second"])
    summary = {"methods": methods, "fastest_plain": fastest_plain, "best": None, "headline_speedup": None}
    if drafting:
        best = max(drafting, key=lambda m: methods[m]["tokens_per_second"])
        summary["best"] = best
        summary["headline_speedup"] = methods[best]["tokens_per_second"] / methods[fastest_plain]["tokens_per_second"]
    return summary


def _sum_lists(lists) -> list[int]:
    total: list[int] = []
    for xs in lists:
        total += [0] * (len(xs) - len(total))
        for i, x in enumerate(xs):
            total[i] += x
    return total


def markdown_table(summary: dict) -> str:
    """Spec-Bench's layout: rows = methods, columns = categories, then #mean accepted tokens and totals.
    ★ marks the fastest plain configuration, the baseline of the headline."""
    methods = summary["methods"]
    cats = sorted({c for s in methods.values() for c in s["categories"]})
    head = ["method", *cats, "#mean accepted tokens", "tokens/s", "speedup vs plain", "vs hf-plain",
            "ms per prompt / new token (fit)", "greedy mismatches vs own plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in methods.items():
        hf = f"{s['speedup_vs_hf_plain']:.2f}x" if s["speedup_vs_hf_plain"] is not None else "–"
        mark = " ★" if m == summary["fastest_plain"] else ""
        base = "–" if s["baseline"] == m else f"{len(s['mismatches'])} of {s['prompts']}"
        split = s.get("ms_per_prompt_token_and_new_token")
        split = f"{split[0]:.1f} / {split[1]:.1f}" if split else "–"
        cells = [f"{m}{mark}",
                 *(f"{s['categories'][c]['speedup']:.2f}x" if c in s["categories"] else "–" for c in cats),
                 f"{s['mean_accepted_tokens']:.2f}", f"{s['tokens_per_second']:.2f}",
                 f"{s['speedup_vs_plain']:.2f}x", hf, split, base]
        lines.append("| " + " | ".join(cells) + " |")
    if summary["best"]:
        lines.append("")
        lines.append(f"Headline: {summary['best']} at {summary['headline_speedup']:.2f}x the fastest plain "
                     f"decoding measured ({summary['fastest_plain']}).")
    return "\n".join(lines)


def benchmark(*, target: str, draft: str, methods: list[str], dtype: str = "auto", quant: str = "file",
              gamma: int | None = None, draft_vocab: int | None = None,
              questions_path: Path = DEFAULT_QUESTIONS, categories: list[str] | None = None,
              per_category: int | None = 2, max_new_tokens: int = 128, temperature: float = 0.0, repeats: int = 1,
              out: Path = Path("bench_out"), bit_exact: bool = True, coupling: str = "rejection",
              progress: bool = True, turns: int = 1, log=print) -> dict:
    """The whole `specdecode bench`: load, run interleaved, write results.jsonl, summary.json, table.md, PNGs.
    dtype 'auto': the target's, as `generate` chooses it on this CPU (for the methods that name none)."""
    import datetime
    import platform

    import torch

    from specdecode.bench.methods import EngineMethod, build_methods, parse_methods
    from specdecode.bench.runtime import cpu_name
    from specdecode.builder import VERIFY_WIDTH, resolve_dtype
    from specdecode.verification.sampling import SamplingParams

    SamplingParams(temperature, coupling=coupling)
    if max_new_tokens <= 0 or repeats <= 0 or (per_category is not None and per_category <= 0):
        raise InvalidRequestError("--max-new-tokens, --repeats and --per-category must be >= 1")
    if turns not in (1, 2):
        raise InvalidRequestError(f"--turns must be 1 or 2, got {turns}")
    dtype = resolve_dtype(dtype, VERIFY_WIDTH)
    specs = parse_methods(methods, dtype, quant)
    questions = load_questions(questions_path, categories, per_category)
    if not questions:
        raise InvalidRequestError("no questions selected")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("")
    machine = {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
               "date": datetime.datetime.now().isoformat(timespec="seconds")}
    log(f"CPU: {machine['cpu']} ({machine['capability']}), {machine['threads']} threads, torch {machine['torch']}")
    log(f"{len(questions)} prompts × {len(specs)} methods × {repeats} repeat(s), {max_new_tokens} new tokens, "
        f"temperature {temperature}")
    built = build_methods(specs, target, draft, dtype, quant, gamma=gamma, bit_exact=bit_exact, coupling=coupling,
                          draft_vocab=draft_vocab, log=log)
    config = {"target": target, "draft": draft, "draft_vocab": draft_vocab, "dtype": dtype, "quant": quant,
              "gamma": gamma, "methods": [m.name for m in built],
              "categories": sorted({q.category for q in questions}), "prompts": len(questions),
              "max_new_tokens": max_new_tokens, "temperature": temperature, "repeats": repeats,
              "bit_exact": bit_exact, "coupling": coupling, "turns": turns}
    (out / "run.json").write_text(json.dumps({"config": config, "machine": machine}, indent=2))
    assert isinstance(built[0], EngineMethod)  # parse_methods puts our plain decoding first
    reference = built[0].generator  # our plain decoding: its tokenizer and chat template encode every prompt
    run(questions, built, lambda p: reference.encode(p, chat=True), sorted(reference.eos_ids),
        max_new_tokens=max_new_tokens, temperature=temperature, repeats=repeats, out=out, progress=progress,
        turns=turns, decode=lambda ids: reference.tokenizer.decode(ids, skip_special_tokens=True))
    return report(out)


def report(out: Path) -> dict:
    """summary.json, table.md and the plots from `out/results.jsonl` and `out/run.json`; for a run cut
    short, from the prompts every method finished."""
    from specdecode.bench.plots import write_plots

    out = Path(out)
    if not (out / "results.jsonl").is_file() or not (out / "run.json").is_file():
        raise InvalidRequestError(f"{out} holds no benchmark run (results.jsonl and run.json)")
    meta = json.loads((out / "run.json").read_text())
    all_rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    rows = complete_rows(all_rows)
    if not rows:
        raise InvalidRequestError(f"{out}: no prompt was finished by every method yet")
    summary = summarize(rows)
    cfg, machine = meta["config"], meta["machine"]
    done = len({(r["question_id"], r.get("repeat", 0)) for r in rows})
    summary.update(meta, prompts_finished=done)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    planned = cfg["prompts"] * cfg["repeats"]
    cut = "" if done == planned else f" (cut short: {done} of {planned})"
    title = f"{done} prompts{cut}, {cfg['max_new_tokens']} new tokens, {cfg['dtype']}"
    (out / "table.md").write_text(f"{machine['cpu']}, {machine['date'][:10]}; {title}\n\n{markdown_table(summary)}\n")
    write_plots(rows, summary, out, f"{title}, {machine['cpu']}")
    return summary
