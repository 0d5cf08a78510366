"""The Spec-Bench runner's mechanics on tiny models: subset, interleaving, mismatch detection, arithmetic,
the files a run writes, and the transformers peers on the same weights."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from specdecode.bench.methods import EngineMethod, MethodSpec, RunOutput, parse_methods
from specdecode.bench.spec_bench import (DEFAULT_QUESTIONS, benchmark, first_mismatch, load_questions,
                                         markdown_table, own_baseline, report, run, summarize, time_split)
from specdecode.builder import build_generator
from specdecode.errors import InvalidRequestError

from .conftest import CHAT


@pytest.fixture
def questions_file(tmp_path):
    rows = [{"question_id": i, "category": cat, "turns": [f"Say {cat} {i}.", "again"]}
            for i, cat in enumerate(["qa", "qa", "math", "qa", "math", "rag"])]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_subset_is_deterministic_first_turn_only(questions_file):
    qs = load_questions(questions_file, categories=["qa", "math"], per_category=2)
    # the first two of each category, round robin over the categories
    assert [(q.question_id, q.category) for q in qs] == [(0, "qa"), (2, "math"), (1, "qa"), (4, "math")]
    assert qs[0].prompt == "Say qa 0."
    with pytest.raises(InvalidRequestError, match="unknown categories"):
        load_questions(questions_file, categories=["poetry"])


def test_the_shipped_spec_bench_copy():
    qs = load_questions(DEFAULT_QUESTIONS)
    assert len(qs) == 480 and len({q.category for q in qs}) == 13
    assert (DEFAULT_QUESTIONS.parent / "LICENSE").exists()
    assert len(load_questions(DEFAULT_QUESTIONS, per_category=2)) == 26


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_method_names_and_baselines():
    specs = parse_methods(["ngram", "hf-plain:float32", "model"], "bfloat16")
    assert specs[0] == MethodSpec("plain", "bfloat16")  # the reference is always there, first
    assert [s.name("bfloat16") for s in specs] == ["plain", "hf-plain:float32", "ngram", "model"]  # plain ones first
    assert own_baseline("model") == "plain" and own_baseline("ngram:float32") == "plain:float32"
    specs = parse_methods(["model:int4", "plain:float32:int8", "ngram:int8"], "bfloat16")
    assert [s.name("bfloat16") for s in specs] == ["plain", "plain:float32:int8", "plain:int4", "plain:int8",
                                                  "model:int4", "ngram:int8"]  # missing baselines added
    assert specs[4] == MethodSpec("model", "bfloat16", "int4") and own_baseline("model:int4") == "plain:int4"
    with pytest.raises(InvalidRequestError, match="peers run their own weights"):
        parse_methods(["hf-plain:int4"], "float32")
    assert own_baseline("hf-assisted") == "hf-plain" and own_baseline("llama-cpp-prompt-lookup") == "llama-cpp"
    with pytest.raises(InvalidRequestError, match="unknown method"):
        parse_methods(["eagle2"], "float32")
    with pytest.raises(InvalidRequestError, match="neither a dtype"):
        parse_methods(["plain:float16"], "float32")
    with pytest.raises(InvalidRequestError, match="twice"):
        parse_methods(["ngram", "ngram"], "float32")
    # --quant: our methods that name no quantization take it, the reference plain too; peers keep their own
    specs = parse_methods(["ngram", "llama-cpp", "model:none"], "bfloat16", "w4a8")
    assert specs[0] == MethodSpec("plain", "bfloat16", "w4a8") and MethodSpec("llama-cpp", "bfloat16", "none") in specs
    assert [s.name("bfloat16", "w4a8") for s in specs] == ["plain", "llama-cpp", "plain:none", "ngram", "model:none"]


def _methods(tiny_pair, coupling: str = "rejection"):
    target, draft = tiny_pair
    target.tokenizer.chat_template = CHAT
    return [EngineMethod("plain", build_generator(target, drafter="none"), coupling),
            EngineMethod("ngram", build_generator(target, drafter="ngram"), coupling),
            EngineMethod("model", build_generator(target, draft=draft, drafter="model"), coupling)]


def test_methods_interleave_agree_and_summary_arithmetic(tiny_pair, questions_file):
    methods = _methods(tiny_pair)
    qs = load_questions(questions_file, per_category=1)
    encode = lambda p: methods[0].generator.encode(p, chat=True)  # noqa: E731
    rows = run(qs, methods, encode, [], max_new_tokens=10, repeats=2, progress=False)
    assert [r["method"] for r in rows] == ["plain", "ngram", "model"] * len(qs) * 2  # A B C, A B C
    assert all(r["mismatch_at"] is None and r["differs_from_plain_at"] is None for r in rows)
    s = summarize(rows)["methods"]
    for m in ("plain", "ngram", "model"):
        mine = [r for r in rows if r["method"] == m]
        plain_t = sum(r["seconds"] for r in rows if r["method"] == "plain")
        # identical outputs: the tokens/s ratio is the time ratio on the same prompts
        assert s[m]["speedup_vs_plain"] == pytest.approx(plain_t / sum(r["seconds"] for r in mine))
        assert s[m]["mean_accepted_tokens"] == pytest.approx(
            sum(r["new_tokens"] for r in mine) / sum(r["target_forward_passes"] for r in mine))
    assert s["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert s["model"]["acceptance_by_position"] and all(0 <= a <= 1 for a in s["model"]["acceptance_by_position"])


def test_a_second_turn_follows_plain_decodings_first_answer(tiny_pair, questions_file):
    target, _ = tiny_pair
    methods = _methods(tiny_pair)[:1] + [EngineMethod("suffix", build_generator(target, drafter="suffix"))]
    qs = load_questions(questions_file, per_category=1)
    gen = methods[0].generator
    rows = run(qs, methods, lambda p: gen.encode(p, chat=True), [], max_new_tokens=10, progress=False, turns=2,
               decode=lambda ids: gen.tokenizer.decode(ids))
    assert len(rows) == 2 * 2 * len(qs) and all(r["mismatch_at"] is None for r in rows)
    for q in qs:
        first, second = [r for r in rows if r["question_id"] == q.question_id and r["method"] == "plain"]
        assert (first["turn"], second["turn"], second["category"]) == (1, 2, f"{q.category}, turn 2")
        conversation = [{"role": "user", "content": q.turns[0]},
                        {"role": "assistant", "content": gen.tokenizer.decode(first["token_ids"])},
                        {"role": "user", "content": q.turns[1]}]
        assert second["prompt_tokens"] == len(gen.encode(conversation))
    assert set(summarize(rows)["methods"]["suffix"]["categories"]) >= {"qa, turn 2", "math, turn 2"}


@pytest.mark.parametrize("coupling", ["rejection", "gumbel"])
def test_sampled_runs_check_only_coupled_outputs(tiny_pair, questions_file, coupling):
    methods = _methods(tiny_pair, coupling)
    qs = load_questions(questions_file, per_category=1)
    rows = run(qs, methods, lambda p: methods[0].generator.encode(p, chat=True), [], max_new_tokens=10,
               temperature=0.8, progress=False)
    assert len(rows) == 3 * len(qs)
    checked = [r for r in rows if r["differs_from_plain_at"] is not None or r["mismatch_at"] is not None]
    assert checked == []  # gumbel: our seeded outputs equal plain seeded decoding; rejection: nothing compared
    if coupling == "rejection":  # independent samples: some output differs from plain's, unnoticed by design
        plain = {r["question_id"]: r["token_ids"] for r in rows if r["method"] == "plain"}
        assert any(r["token_ids"] != plain[r["question_id"]] for r in rows if r["method"] != "plain")


@dataclass
class Corrupting:
    """A method that returns a wrong token at one position: the runner must report it."""

    name: str
    inner: EngineMethod
    at: int

    def run(self, *args) -> RunOutput:
        r = self.inner.run(*args)
        r.token_ids[self.at] = (r.token_ids[self.at] + 1) % 64
        return r


def test_a_wrong_token_is_reported_with_its_position(tiny_pair, questions_file):
    plain, ngram, _ = _methods(tiny_pair)
    qs = load_questions(questions_file, per_category=1)
    rows = run(qs, [plain, Corrupting("ngram", ngram, 3)], lambda p: plain.generator.encode(p, chat=True), [],
               max_new_tokens=8, progress=False)
    summary = summarize(rows)
    assert summary["methods"]["ngram"]["mismatches"] == [[q.question_id, 3] for q in qs]
    assert "3 of 3" in markdown_table(summary)


def test_summary_arithmetic_by_hand():
    def row(method, cat, tokens, seconds, passes, mismatch=None):
        return {"question_id": 1, "category": cat, "method": method, "new_tokens": tokens, "seconds": seconds,
                "target_forward_passes": passes, "mismatch_at": mismatch}
    rows = [row("plain", "qa", 10, 2.0, 10), row("ngram", "qa", 10, 1.0, 4),
            row("plain", "math", 10, 1.0, 10), row("ngram", "math", 10, 2.0, 8, mismatch=2),
            row("hf-plain", "qa", 10, 4.0, 10), row("hf-plain", "math", 10, 4.0, 10)]
    s = summarize(rows)
    ngram = s["methods"]["ngram"]
    assert ngram["categories"]["qa"]["speedup"] == pytest.approx(2.0)
    assert ngram["categories"]["math"]["speedup"] == pytest.approx(0.5)
    assert ngram["speedup_vs_plain"] == pytest.approx(1.0)  # 20 tokens in 3 s both
    assert ngram["speedup_vs_hf_plain"] == pytest.approx(8 / 3)
    assert ngram["mean_accepted_tokens"] == pytest.approx(20 / 12)
    assert ngram["mismatches"] == [[1, 2]]
    assert s["fastest_plain"] == "plain" and s["best"] == "ngram"
    assert s["headline_speedup"] == pytest.approx(1.0)
    assert "plain ★" in markdown_table(s)
    assert ngram["ms_per_prompt_token_and_new_token"] is None  # no prompt lengths: nothing to separate


def test_time_split_recovers_prefill_and_decode_costs():
    rows = [{"question_id": i, "category": "qa", "method": "plain", "prompt_tokens": p, "new_tokens": n,
             "seconds": 0.02 * p + 0.05 * n, "target_forward_passes": n, "mismatch_at": None}
            for i, (p, n) in enumerate([(50, 128), (300, 128), (120, 40), (80, 128)])]
    assert time_split(rows) == pytest.approx((20.0, 50.0))
    assert time_split(rows[:1]) is None  # one row: any split fits
    assert "20.0 / 50.0" in markdown_table(summarize(rows))


def test_benchmark_writes_its_outputs_with_the_transformers_peers(pair_dirs, tmp_path):
    target, draft = pair_dirs
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"Tell {c} {i}."]})
                               for i, c in enumerate(["qa", "rag", "qa"])))
    out = tmp_path / "out"
    logs = []
    summary = benchmark(target=target, draft=draft, dtype="float32", methods=["ngram", "model", "hf-plain",
                        "hf-assisted", "hf-prompt-lookup"], questions_path=qfile, per_category=1, max_new_tokens=12,
                        out=out, draft_vocab=40, progress=False, log=logs.append)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 6  # 2 prompts (one per category) x 6 methods, the reference first
    assert {r["method"] for r in rows} == {"plain", "ngram", "model", "hf-plain", "hf-assisted", "hf-prompt-lookup"}
    config = json.loads((out / "summary.json").read_text())["config"]
    assert config["prompts"] == 2 and config["draft_vocab"] == 40
    assert summary["methods"]["model"]["draft_ms_per_drafted_token"] > 0  # its draft model: 40 token ids, lossless
    assert summary["methods"]["plain"]["draft_ms_per_drafted_token"] is None
    for png in ("speedup_by_category.png", "acceptance_by_position.png", "tokens_per_second.png"):
        assert (out / png).stat().st_size > 1000
    assert "#mean accepted tokens" in (out / "table.md").read_text()
    # a run cut short reports the prompts every method finished
    (out / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:-1]))
    cut = report(out)
    assert cut["prompts_finished"] == 1 and all(s["prompts"] == 1 for s in cut["methods"].values())
    assert "cut short: 1 of 2" in (out / "table.md").read_text()
    for m in ("ngram", "model"):
        assert summary["methods"][m]["mismatches"] == []
    # transformers counts one target forward per produced token when it does not draft
    assert summary["methods"]["hf-plain"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert summary["methods"]["hf-assisted"]["mean_accepted_tokens"] > 1.0


def test_benchmark_rejects_bad_arguments(pair_dirs, tmp_path):
    target, draft = pair_dirs
    with pytest.raises(InvalidRequestError):
        benchmark(target=target, draft=draft, methods=["plain"], max_new_tokens=0, out=tmp_path)
    with pytest.raises(InvalidRequestError):
        benchmark(target=target, draft=draft, methods=["plain"], temperature=-1, out=tmp_path)
