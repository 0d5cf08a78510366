"""Real-model checks (slow: pulls ~1.6 GB on first use). Run with `pytest -m slow`."""

from __future__ import annotations

import pytest
import torch

from specdecode.bench.spec_bench import DEFAULT_QUESTIONS, load_questions
from specdecode.builder import build_generator, load_target
from specdecode.models.catalog import resolve
from specdecode.models.loading import load_model

pytestmark = pytest.mark.slow


def spec_bench_prompts(n: int) -> list[str]:
    qs = load_questions(DEFAULT_QUESTIONS, per_category=2)
    return [q.prompt for q in qs][:n]


def test_smollm2_greedy_matches_transformers_gguf_loading():
    from transformers import AutoModelForCausalLM

    path = resolve("smollm2-135m-instruct")
    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    gen = build_generator(ours, drafter="none")
    prompt = "The three primary colors are"
    result = gen.generate(prompt, max_new_tokens=24, eos_ids=[])
    ids = ours.tokenizer(prompt, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result.token_ids == ref
    assert "red" in result.text.lower() or "blue" in result.text.lower()  # fluent, on topic


@pytest.mark.parametrize("case", ["smollm2-ngram", "pair-model", "pair-ngram", "pair-adaptive"])
def test_greedy_speculative_equals_plain_on_spec_bench(case):
    if case.startswith("smollm2"):
        target, draft, dtype = load_target("smollm2-135m-instruct"), None, "float32"
    else:
        dtype = "bfloat16"
        target = load_target("qwen2.5-coder-1.5b-instruct", dtype=dtype)
        draft = load_model("qwen2.5-coder-0.5b-instruct", dtype=dtype) if "ngram" not in case else None
    drafter = case.split("-")[1]
    kind, adaptive = ("model", True) if drafter == "adaptive" else (drafter, False)
    plain = build_generator(target, drafter="none")
    spec = build_generator(target, draft=draft, drafter=kind, adaptive=adaptive)
    for prompt in spec_bench_prompts(20):
        a = plain.generate(prompt, chat=True, max_new_tokens=48)
        b = spec.generate(prompt, chat=True, max_new_tokens=48)
        assert a.token_ids == b.token_ids, prompt
