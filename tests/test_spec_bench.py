"""The Spec-Bench runner's mechanics on tiny models: subset, interleaving, mismatch detection, arithmetic."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.spec_bench import first_mismatch, load_questions, run, summarize
from specdecode.builder import build_generator


@pytest.fixture
def questions_file(tmp_path):
    rows = [{"question_id": i, "category": cat, "turns": [f"Say {cat} {i}.", "again"]}
            for i, cat in enumerate(["qa", "qa", "math", "qa", "math", "rag"])]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_subset_is_deterministic_first_turn_only(questions_file):
    qs = load_questions(questions_file, categories=["qa", "math"], per_category=2)
    assert [(q.question_id, q.category) for q in qs] == [(0, "qa"), (1, "qa"), (2, "math"), (4, "math")]
    assert qs[0].prompt == "Say qa 0."


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_methods_interleave_agree_and_summary_arithmetic(tiny_pair, questions_file):
    target, draft = tiny_pair
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    gens = {"plain": build_generator(target, drafter="none"), "ngram": build_generator(target, drafter="ngram"),
            "model": build_generator(target, draft=draft, drafter="model")}
    qs = load_questions(questions_file, per_category=1)
    rows = run(qs, gens, max_new_tokens=10, progress=False)
    assert [r["method"] for r in rows] == ["plain", "ngram", "model"] * len(qs)  # A B C, A B C
    assert all(r["mismatch_at"] is None for r in rows)  # greedy: every method equals plain
    s = summarize(rows)
    for m in gens:
        mine = [r for r in rows if r["method"] == m]
        plain_t = sum(r["seconds"] for r in rows if r["method"] == "plain")
        assert s[m]["overall_speedup"] == pytest.approx(plain_t / sum(r["seconds"] for r in mine))
        assert s[m]["mean_accepted_tokens"] == pytest.approx(
            sum(r["new_tokens"] for r in mine) / sum(r["target_forward_passes"] for r in mine))
    assert s["plain"]["overall_speedup"] == pytest.approx(1.0)


def test_mismatch_is_reported(tiny_pair, questions_file):
    rows = [{"question_id": 1, "category": "qa", "method": "plain", "new_tokens": 3, "seconds": 1.0,
             "target_forward_passes": 3, "acceptance_rate": 0.0, "draft_seconds": 0.0, "mismatch_at": None},
            {"question_id": 1, "category": "qa", "method": "ngram", "new_tokens": 3, "seconds": 0.5,
             "target_forward_passes": 2, "acceptance_rate": 0.5, "draft_seconds": 0.1, "mismatch_at": 2}]
    s = summarize(rows)
    assert s["ngram"]["mismatches"] == [(1, 2)]
    assert s["ngram"]["overall_speedup"] == pytest.approx(2.0)
    assert s["ngram"]["mean_accepted_tokens"] == pytest.approx(1.5)
