"""The C++ decode ops (kernels/decode_ops.cpp): each output row is the same whatever the number of rows
(torch.equal), the numbers are PyTorch's up to rounding, bad input gets a clear error, and the decoder keeps
greedy speculative decoding lossless on both of its paths (C++ ops and PyTorch ops)."""

from __future__ import annotations

import pytest
import torch

from specdecode.builder import build_generator, load_target
from specdecode.kernels import decode_ops
from specdecode.models import decoder
from specdecode.models.loading import load_model
from tests.conftest import save_tiny, tiny_hf_model, tiny_tokenizer
from tests.test_int4_amx import needs_amx
from tests.test_lossless import random_prompts

needs_ops = pytest.mark.skipif(decode_ops.extension() is None, reason="needs a CPU with AVX-512 or AVX2 + FMA, and g++")
DTYPES = [torch.float32, torch.bfloat16]


def assert_rows_invariant(op, rows: torch.Tensor, *rest) -> torch.Tensor:
    """op on all rows, on every prefix of them, and on each row alone: the same bits for every row."""
    full = op(rows, *rest)
    for k in range(1, rows.shape[0]):
        assert torch.equal(op(rows[:k], *rest), full[:k]), f"rows 0..{k - 1} alone differ"
    for i in range(rows.shape[0]):
        assert torch.equal(op(rows[i:i + 1], *rest)[0], full[i]), f"row {i} alone differs"
    return full


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 100, 1536])  # 100: a tail shorter than a vector
def test_rms_norm_is_row_invariant_and_matches_pytorch(cpu_build, dtype, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(17, width, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    out = assert_rows_invariant(decode_ops.rms_norm, x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, decoder.rms_norm(x, w, 1e-6), atol=1e-5 if dtype == torch.float32 else 0.02,
                               rtol=1e-5 if dtype == torch.float32 else 0.01)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1000, 8960])  # 1000: a task segment ends inside a row
def test_silu_mul_is_row_invariant_and_matches_pytorch(cpu_build, dtype, width):
    gate_up = (torch.randn(17, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    out = assert_rows_invariant(decode_ops.silu_mul, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 0.05,
                               rtol=1e-5 if dtype == torch.float32 else 0.01)


def attention_case(dtype: torch.dtype, hd: int, T: int = 9, B: int = 2, H: int = 6, KVH: int = 2, seed: int = 0):
    """Random new tokens for B sequences in cache rows (2, 0) of 3, after contexts of 300 and 200 tokens."""
    g = torch.Generator().manual_seed(seed)
    cap = 512
    k_cache = torch.randn(3, KVH, cap, hd, generator=g).to(dtype)
    v_cache = torch.randn(3, KVH, cap, hd, generator=g).to(dtype)
    qkv = torch.randn(B, T, (H + 2 * KVH) * hd, generator=g).to(dtype)
    rows = torch.tensor([2, 0][:B])
    slots = torch.tensor([300, 200][:B]).view(B, 1) + torch.arange(T).view(1, T)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([slots.unsqueeze(-1).float() * inv_freq] * 2, dim=-1)  # [B, T, hd]
    mask = torch.arange(cap).view(1, 1, cap) <= slots.unsqueeze(-1)
    return dict(qkv=qkv, cos=emb.cos(), sin=emb.sin(), k_cache=k_cache, v_cache=v_cache, rows=rows, slots=slots,
                mask=mask, heads=H, kv_heads=KVH)


def pytorch_attention(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder's PyTorch path on the same inputs: (output [B, T, H * hd], k_cache, v_cache)."""
    qkv, H, KVH = case["qkv"], case["heads"], case["kv_heads"]
    B, T, _ = qkv.shape
    hd = case["k_cache"].shape[-1]
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
    q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    cos, sin = (case[n].unsqueeze(1).to(qkv.dtype) for n in ("cos", "sin"))
    q = q * cos + decoder.rotate_half(q) * sin
    k = k * cos + decoder.rotate_half(k) * sin
    index = case["rows"].view(B, 1)
    k_cache.permute(0, 2, 1, 3)[index, case["slots"]] = k.transpose(1, 2)
    v_cache.permute(0, 2, 1, 3)[index, case["slots"]] = v.transpose(1, 2)
    blocks = list(case["mask"].unsqueeze(1).split(decoder.ATTN_BLOCK, dim=-1))
    out = decoder.blocked_attention(q, k_cache, v_cache, case["rows"], blocks)
    return out.transpose(1, 2).reshape(B, T, H * hd), k_cache, v_cache


def run_ops(case: dict, b: slice = slice(None), t: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """decode_ops.rope_attention on sequences b, tokens t of the case, on fresh copies of the caches."""
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    out = decode_ops.rope_attention(case["qkv"][b, t], case["cos"][b, t], case["sin"][b, t], k_cache, v_cache,
                                    case["rows"][b], case["slots"][b, t], case["mask"][b, t], case["heads"],
                                    case["kv_heads"])
    return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [16, 48, 64, 96, 128, 256])
def test_rope_attention_matches_pytorch(cpu_build, dtype, hd):
    case = attention_case(dtype, hd)
    out, k_cache, v_cache = run_ops(case)
    ref, ref_k, ref_v = pytorch_attention(case)
    assert torch.equal(v_cache, ref_v)  # values are copied as they are
    tol = 1e-5 if dtype == torch.float32 else 0.02  # bf16: PyTorch ropes in bf16, the kernel in float32
    torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attention_rows_do_not_depend_on_the_other_rows(cpu_build, dtype):
    case = attention_case(dtype, 64)
    full, k_full, v_full = run_ops(case)
    for k in range(1, 10):  # the first k tokens of the step, as a verify step of k tokens would send them
        out, k_cache, _ = run_ops(case, t=slice(0, k))
        assert torch.equal(out, full[:, :k])
    for b in range(2):  # each sequence alone, as an unbatched step
        assert torch.equal(run_ops(case, b=slice(b, b + 1))[0][0], full[b])
    # a token alone after its predecessors were written one at a time (plain decoding)
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    for t in range(9):
        one = decode_ops.rope_attention(case["qkv"][:, t:t + 1], case["cos"][:, t:t + 1], case["sin"][:, t:t + 1],
                                        k_cache, v_cache, case["rows"], case["slots"][:, t:t + 1],
                                        case["mask"][:, t:t + 1], case["heads"], case["kv_heads"])
        assert torch.equal(one[:, 0], full[:, t])
    assert torch.equal(k_cache, k_full) and torch.equal(v_cache, v_full)


def test_rope_attention_ignores_unseen_keys_and_the_mask_width(cpu_build):
    case = attention_case(torch.bfloat16, 64)
    full = run_ops(case)[0]
    narrow = dict(case, mask=case["mask"][..., :320].contiguous())  # every seen slot is below 309
    assert torch.equal(run_ops(narrow)[0], full)
    noisy = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    noisy["k_cache"][:, :, 400:] = 1e30  # unseen slots: garbage must not leak into any row
    noisy["v_cache"][:, :, 400:] = float("nan")
    assert torch.equal(run_ops(noisy)[0], full)


def test_a_key_some_rows_do_not_see_never_reaches_them(cpu_build):
    """As with a token tree: row 0 does not see slot 5, the others do. Whatever slot 5 holds, row 0 gets
    what it gets when no row sees slot 5; and a mask width that is not a multiple of 16 changes nothing."""
    case = attention_case(torch.float32, 64, B=1)
    case["mask"] = case["mask"][..., :317].clone()  # seen slots end at 308
    case["mask"][0, 0, 5] = False
    alone = run_ops(dict(case, mask=case["mask"].clone().index_fill_(2, torch.tensor([5]), False)))[0]
    for junk in (float("nan"), 1e30, -1e30):
        noisy = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
        noisy["k_cache"][0, :, 5], noisy["v_cache"][0, :, 5] = junk, junk  # row 2 of the cache is sequence 0
        noisy["k_cache"][2, :, 5], noisy["v_cache"][2, :, 5] = junk, junk
        out = run_ops(noisy)[0]
        assert torch.equal(out[0, 0], alone[0, 0]), junk


def test_decode_ops_refuse_bad_input(cpu_build):
    case = attention_case(torch.float32, 64)
    with pytest.raises(RuntimeError, match="head_dim"):
        decode_ops.rope_attention(case["qkv"][..., :-4 * 10], case["cos"][..., :60], case["sin"][..., :60],
                                  case["k_cache"][..., :60].contiguous(), case["v_cache"][..., :60].contiguous(),
                                  case["rows"], case["slots"], case["mask"], 6, 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        decode_ops.rms_norm(torch.ones(2, 64, dtype=torch.float16), torch.ones(64, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="slot out of range"):
        bad = dict(case, slots=case["slots"] + 1000)
        run_ops(bad)
    with pytest.raises(RuntimeError, match="two sequences in one cache row"):
        run_ops(dict(case, rows=torch.tensor([2, 2])))
    with pytest.raises(RuntimeError, match="width"):
        decode_ops.rope_attention(case["qkv"], case["cos"], case["sin"], case["k_cache"], case["v_cache"],
                                  case["rows"], case["slots"], case["mask"], 5, 2)


@needs_ops
def test_decode_steps_run_the_ops_and_prefills_do_not(tiny_pair, monkeypatch):
    target = tiny_pair[0].model
    assert target.fused_ops and not target.rows_independent  # dense float32 linears: bit-exact pads
    calls = []
    real = decode_ops.rope_attention
    monkeypatch.setattr(decode_ops, "rope_attention", lambda qkv, *a: calls.append(qkv.shape[1]) or real(qkv, *a))
    build_generator(tiny_pair[0], drafter="none").generate(list(range(1, 31)), max_new_tokens=4, eos_ids=[])
    layers = len(target.blocks)
    assert calls == [9] * 4 * layers  # the 29-token prefill took PyTorch's ops; each step 9 padded rows


@needs_ops
def test_the_invariance_check_catches_a_linear_that_wrongly_claims_row_invariance(tiny_pair):
    """Test of the test: with every block linear flagged row-invariant nothing is padded, so a linear whose
    rows depend on the row count must show up as mismatches between 1-token and k-token steps."""
    from specdecode.models.linear import DenseLinear
    from tests.test_runtime import _invariance_mismatches

    class Claims(DenseLinear):
        row_invariant = True

        def _matmul(self, rows):
            return super()._matmul(rows) * (1 + 1e-6 * rows.shape[0])

    model = load_model(tiny_pair[0].source, decode_width=9).model
    for block in model.blocks:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(block, name, Claims(getattr(block, name).weight, getattr(block, name).bias))
    assert model.rows_independent
    assert _invariance_mismatches(model) > 0


@needs_ops
@pytest.mark.parametrize("quant,head", [pytest.param("int4-amx", "int8-amx", marks=needs_amx), ("w4a8", "w6a8")])
def test_targets_of_our_int4_kernels_run_unpadded(tiny_pair, quant, head):
    target = load_target(str(tiny_pair[0].source), dtype="bfloat16", quant=quant).model
    assert target.fused_ops and target.rows_independent and target.decode_width == 9
    assert target.lm_head.quant == head and target.lm_head.row_invariant


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # a qkv bias, and none
def test_the_one_call_w4a8_layer_gives_the_bits_of_the_per_op_path(cpu_build, tmp_path, monkeypatch, arch, dtype):
    """kernels/layer.cpp runs a W4A8 layer in one call: the same logits and cache writes as the layer's ops called
    one by one from Python, for batches in any cache rows and steps of 1..16 tokens."""
    hf = tiny_hf_model(arch, seed=3, hidden=128, layers=2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):  # transformers initializes them to zero
                p.normal_(0, 0.5)
    save_tiny(tmp_path, hf, tiny_tokenizer())
    model = load_model(tmp_path, dtype=dtype, quant="w4a8").model
    assert_one_call_layers_give_the_per_op_bits(model, "w4a8", monkeypatch)


def assert_one_call_layers_give_the_per_op_bits(model, kind: str, monkeypatch) -> None:
    """`model`'s one-call layers (kernels/layer.cpp's `kind`_layer), then its per-op path: the same logits and cache
    writes for a batch in cache rows 2 and 0 and steps of 1..16 tokens, and every step ran the one-call layers."""
    assert model.fused_ops and all(block.one_call == kind for block in model.blocks)
    one_layer = getattr(decode_ops, f"{kind}_layer")
    calls = []
    monkeypatch.setattr(decode_ops, f"{kind}_layer", lambda *args: calls.append(1) or one_layer(*args))
    tokens = torch.randint(0, 64, (2, 47), generator=torch.Generator().manual_seed(2))
    runs = []
    for one_call in (kind, ""):
        for block in model.blocks:
            block.one_call = one_call
        cache, outs = model.new_cache(3, 256), []
        rows, start = torch.tensor([2, 0]), torch.tensor([0, 0])
        for T in (16, 1, 4, 9, 1, 16):
            outs.append(model(tokens[:, int(start[0]):int(start[0]) + T], start, cache, rows=rows))
            start = start + T
        runs.append((outs, cache))
    assert len(calls) == 6 * len(model.blocks)  # every step ran the one-call layers, then none did
    (fast, fast_cache), (slow, slow_cache) = runs
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert torch.equal(fast_cache.k, slow_cache.k) and torch.equal(fast_cache.v, slow_cache.v)


@needs_ops
def test_one_call_layers_only_where_every_linear_is_w4a8_without_a_bias_the_kernel_would_drop(tiny_pair):
    from specdecode.kernels.w4a8 import W4A8Linear, W8A8Linear
    from specdecode.models.linear import make_linear

    block = load_target(str(tiny_pair[0].source), dtype="bfloat16", quant="w4a8").model.blocks[0]
    parts = dict(cfg=block.cfg, qkv=block.qkv, o=block.o, gate_up=block.gate_up, down=block.down,
                 attn_norm=block.attn_norm.data, mlp_norm=block.mlp_norm.data)
    assert decoder.Block(**parts).one_call
    o = block.o.dequantized().to(torch.bfloat16)
    for other in (make_linear(o, None, "int4"), W8A8Linear.quantize(o), W4A8Linear.quantize(o, torch.ones(len(o)))):
        assert not decoder.Block(**{**parts, "o": other}).one_call, type(other).__name__


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculative_equals_plain_with_pytorch_ops(tiny_pair, drafter):
    """The PyTorch path (CPUs without AVX2 + FMA, GPUs, long prefills) stays lossless where the ops exist too."""
    target = load_model(tiny_pair[0].source, decode_width=9)
    draft = load_model(tiny_pair[1].source)
    target.model.fused_ops = draft.model.fused_ops = False
    plain = build_generator(target, drafter="none")
    prompts = random_prompts(12, 64, seed=9)
    expected = [plain.generate(p, max_new_tokens=20, eos_ids=[]).token_ids for p in prompts]
    for gamma in (2, 5):
        spec = build_generator(target, draft=draft, drafter=drafter, gamma=gamma)
        assert [spec.generate(p, max_new_tokens=20, eos_ids=[]).token_ids for p in prompts] == expected


@needs_ops
def test_the_two_paths_give_close_logits(tiny_pair):
    model = load_model(tiny_pair[0].source, decode_width=9).model
    tokens = torch.tensor([random_prompts(1, 64, seed=4)[0][:8]])
    outs = []
    for fused in (True, False):
        model.fused_ops = fused
        outs.append(model(tokens, torch.tensor([0]), model.new_cache(1, 64)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
