"""The model runtime: parity with transformers, rollback, bit-exact fixed width, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.errors import ModelLoadError
from specdecode.models.config import UnsupportedArchitectureError
from specdecode.models.decoder import ATTN_BLOCK
from specdecode.models.loading import load_model
from tests.conftest import corrupt_json, save_tiny, tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved(request, tmp_path_factory):
    hf = tiny_hf_model(request.param, seed=3, vocab=96)
    return hf, save_tiny(tmp_path_factory.mktemp(request.param), hf)


@pytest.mark.parametrize("width", [None, 9])
def test_logits_match_transformers_for_prompt_and_k_token_steps(saved, width):
    hf, path = saved
    model = load_model(path, decode_width=width, with_tokenizer=False).model
    ids = torch.randint(0, 96, (1, 290), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = model.new_cache(1, 320)
    out = model(ids[:, :150], torch.tensor([0]), cache)
    assert (out - ref[:, :150]).abs().max() <= 1e-4
    pos = 150
    for k in [1, 3, 8, 2, 16, 1, 5, 9, 40, 1]:  # crosses attention block boundaries
        out = model(ids[:, pos:pos + k], torch.tensor([pos]), cache)
        assert (out - ref[:, pos:pos + k]).abs().max() <= 1e-4, f"k={k} at {pos}"
        pos += k


def test_rollback_equals_fresh_run(saved):
    _, path = saved
    model = load_model(path, with_tokenizer=False).model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (1, 200), generator=g)
    other = torch.randint(0, 96, (1, 30), generator=g)
    cache = model.new_cache(1, 256)
    model(ids[:, :170], torch.tensor([0]), cache)
    model(ids[:, 170:200], torch.tensor([170]), cache)  # n = 200 tokens
    rolled = model(other, torch.tensor([140]), cache)  # roll back m = 60, run different tokens
    fresh_cache = model.new_cache(1, 256)
    fresh = model(torch.cat([ids[:, :140], other], 1), torch.tensor([0]), fresh_cache)[:, 140:]
    assert (rolled - fresh).abs().max() <= 1e-5
    # the cache itself now holds what a fresh run of the same tokens writes
    torch.testing.assert_close(cache.k[:, :, :, :170], fresh_cache.k[:, :, :, :170], atol=1e-5, rtol=0)


def _invariance_mismatches(model, total: int = 2 * ATTN_BLOCK + 40, seed: int = 0) -> int:
    """Rows whose logits differ between 1-token steps and random-width steps over the same tokens."""
    rnd = random.Random(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(seed))
    c1, c2 = model.new_cache(1, total + 16), model.new_cache(1, total + 16)
    model(ids[:, :20], torch.tensor([0]), c1)
    model(ids[:, :20], torch.tensor([0]), c2)
    one = [model(ids[:, p:p + 1], torch.tensor([p]), c1)[0, 0] for p in range(20, total)]
    bad, p = 0, 20
    while p < total:
        k = min(rnd.randint(1, 9), total - p)
        out = model(ids[:, p:p + k], torch.tensor([p]), c2)[0]
        bad += sum(not torch.equal(out[j], one[p - 20 + j]) for j in range(k))
        p += k
    return bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bit_exact_width_makes_logits_independent_of_step_width(saved, dtype):
    _, path = saved
    model = load_model(path, dtype=dtype, decode_width=9, with_tokenizer=False).model
    assert _invariance_mismatches(model) == 0


def test_invariance_check_catches_a_width_dependent_forward(saved):
    """Test of the test: fp32 without the fixed width takes different kernels per width."""
    _, path = saved
    model = load_model(path, dtype="float32", decode_width=None, with_tokenizer=False).model
    assert _invariance_mismatches(model) > 0


def test_unknown_architecture_is_named(tmp_path):
    path = save_tiny(tmp_path / "m", tiny_hf_model("llama"))
    corrupt_json(path / "config.json", "architectures", ["FalconForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(path, with_tokenizer=False)


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(ModelLoadError, match="neither an existing path nor a catalog model name"):
        load_model(tmp_path / "nowhere", with_tokenizer=False)
    path = save_tiny(tmp_path / "m", tiny_hf_model("qwen2"))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(path, with_tokenizer=False)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(path, with_tokenizer=False)


def test_bad_dtype_and_device(saved):
    _, path = saved
    with pytest.raises(ModelLoadError, match="float32, bfloat16"):
        load_model(path, dtype="float16", with_tokenizer=False)
    with pytest.raises(ModelLoadError, match="device"):
        load_model(path, device="tpu", with_tokenizer=False)


def test_a_chain_tree_mask_equals_the_causal_default(saved):
    """Token trees will pass their ancestor mask; a chain (lower-triangular) must equal plain causal."""
    _, path = saved
    model = load_model(path, decode_width=9, with_tokenizer=False).model
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    c1, c2 = model.new_cache(1, 64), model.new_cache(1, 64)
    for c in (c1, c2):
        model(ids[:, :34], torch.tensor([0]), c)
    plain = model(ids[:, 34:40], torch.tensor([34]), c1)
    chain = torch.ones(6, 6, dtype=torch.bool).tril().unsqueeze(0)
    assert torch.equal(model(ids[:, 34:40], torch.tensor([34]), c2, tree_mask=chain), plain)


def test_runtime_bench_reports_the_draft_step_as_a_fraction_of_the_target(tiny_pair, capsys):
    from specdecode.bench.runtime import run_runtime_bench

    target, draft = (str(m.source) for m in tiny_pair)
    rows = run_runtime_bench([target], ["float32"], ks=[1, 2], repeats=1, with_hf=False, bit_exact=False,
                             context=20, draft=draft, draft_vocab=32)
    drafts = [r for r in rows if r["engine"] == "specdecode draft"]
    assert len(drafts) == 1 and drafts[0]["head_rows"] == 32 and set(drafts[0]["ms"]) == {1, 2}
    (ours,) = [r for r in rows if r["engine"] == "specdecode"]
    assert ours["draft_step_fraction"] == drafts[0]["ms"][1] / ours["ms"][1]
    assert "draft one-token step / " in capsys.readouterr().out


def test_runtime_bench_runs_a_gguf_as_its_file_stores_it(tmp_path, capsys):
    from specdecode.bench.runtime import run_runtime_bench
    from specdecode.builder import native_kind
    from tests.gguf_files import Q4_K_M, write_model

    path = str(write_model(tmp_path / "m.gguf", Q4_K_M))
    rows = run_runtime_bench([path], ["float32"], ks=[1, 2], repeats=1, with_hf=False, bit_exact=False, context=8,
                             quants=["file", "none"])
    assert [(r["quant"], r["kernel"]) for r in rows] == [("file", native_kind("float32") or "none"), ("none", "none")]
    assert "| file (" in capsys.readouterr().out or native_kind("float32") is None
