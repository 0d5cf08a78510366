"""Real-model checks (slow: pulls ~1.6 GB on first use). Run with `pytest -m slow`."""

from __future__ import annotations

import pytest
import torch

from specdecode.bench.spec_bench import DEFAULT_QUESTIONS, load_questions
from specdecode.builder import build_generator, load_draft, load_target
from specdecode.kernels import int4_amx
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
    kind, gamma = ("model", None) if drafter == "adaptive" else (drafter, 4 if drafter == "model" else 8)
    plain = build_generator(target, drafter="none")
    spec = build_generator(target, draft=draft, drafter=kind, gamma=gamma)
    for prompt in spec_bench_prompts(20):
        a = plain.generate(prompt, chat=True, max_new_tokens=48)
        b = spec.generate(prompt, chat=True, max_new_tokens=48)
        assert a.token_ids == b.token_ids, prompt


@pytest.mark.skipif(int4_amx.extension() is None, reason="needs a CPU with AMX-BF16")
def test_greedy_speculative_equals_plain_with_an_int4_amx_target():
    """Our AMX kernel in bit-exact mode, with the draft --draft-quant auto gives (its lm_head quantized too)."""
    target = load_target("qwen2.5-coder-1.5b-instruct", dtype="bfloat16", quant="int4-amx")
    draft = load_draft("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
    plain = build_generator(target, drafter="none")
    specs = [build_generator(target, draft=draft, drafter=d) for d in ("model", "hybrid")]
    for prompt in spec_bench_prompts(20):
        expected = plain.generate(prompt, chat=True, max_new_tokens=48).token_ids
        for spec in specs:
            assert spec.generate(prompt, chat=True, max_new_tokens=48).token_ids == expected, prompt


def test_spec_bench_40_prompts_256_tokens_no_greedy_mismatch(tmp_path):
    """Issue 8's check on the default pair: 3 prompts per category (39), 256 new tokens, greedy; every
    drafter's output equals plain decoding token for token (the bench records the first mismatch)."""
    from specdecode.bench.spec_bench import benchmark

    summary = benchmark(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                        methods=["plain", "ngram", "model", "hybrid"], dtype="bfloat16", per_category=3,
                        max_new_tokens=256, out=tmp_path, progress=False)
    assert {m: s["mismatches"] for m, s in summary["methods"].items()} == {m: [] for m in summary["methods"]}


def test_batched_serving_equals_single_requests_on_the_real_pair():
    """Eight Spec-Bench prompts through the batching scheduler (bf16; linears chunked as measured on this CPU)
    give the tokens each gives alone."""
    from specdecode.serving.scheduler import build_scheduler
    from specdecode.engine import GenerationResult

    target = load_target("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
    draft = load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=8, max_context=2048)
    prompts = spec_bench_prompts(8)
    results = {}
    for i, p in enumerate(prompts):
        seq = scheduler.gen.prepare(p, chat=True, max_new_tokens=48)
        scheduler.submit(seq, lambda e, i=i: results.__setitem__(i, e) if isinstance(e, GenerationResult) else None)
    while scheduler.active or scheduler.waiting:
        scheduler.step()
    plain = build_generator(target, drafter="none", max_context=2048)
    for i, p in enumerate(prompts):
        assert results[i].token_ids == plain.generate(p, chat=True, max_new_tokens=48).token_ids, p


def test_the_catalog_files_blocks_give_gguf_numbers_exactly():
    """Every block type of the catalog's files, on real tensors: our codes and scales and each native kernel's
    packing dequantize to gguf's reference numbers bit for bit."""
    import gguf
    from gguf.quants import dequantize

    from specdecode.kernels import gguf_amx, gguf_int8
    from specdecode.models.gguf_blocks import QuantizedTensor, supported
    from specdecode.models.gguf_loader import read_raw

    seen = set()
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        for t in gguf.GGUFReader(resolve(name)).tensors:
            if len(t.shape) != 2 or not supported(t.tensor_type) or (name, t.tensor_type) in seen:
                continue
            seen.add((name, t.tensor_type))
            rows = min(int(t.shape[1]), 512)
            q = QuantizedTensor(read_raw(t)[:rows], t.tensor_type, (rows, int(t.shape[0])))
            want = torch.from_numpy(dequantize(q.raw.numpy(), t.tensor_type)).reshape(q.shape)
            assert torch.equal(q.dequantize(), want), (name, t.name)
            for module in (gguf_amx, gguf_int8):  # packing is torch: no kernel needed
                back = module.unpack(q.fmt, module.pack(q.codes()), rows)
                assert torch.equal(back.dequantize(), want), (name, t.name, module.__name__)
    assert {qt.name for _, qt in seen} >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"}
