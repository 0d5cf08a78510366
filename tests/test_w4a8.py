"""The W4A8 C++ kernel and its int8- and 6-bit-weight twins W8A8 and W6A8: exactly the pure-torch reference's
arithmetic, bit-exact across k, close to the float matmul."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import w4a8
from specdecode.kernels.w4a8 import W4A8Linear, W6A8Linear, W8A8Linear
from specdecode.models.linear import invariant_rows
from tests.conftest import emulated_avx512_build, use_cpu_build

SHAPES = [(96, 64), (40, 96), (33, 100), (70, 1536), (24, 200)]  # widths that are not multiples of 32 or 64 too
PACKERS = {"w4": w4a8.quantize_weight, "w6": w4a8.quantize_weight6, "w8": w4a8.quantize_weight8}


def kernel_of(ext, weights):
    """The extension's kernel for these packed weights (int4, 6-bit or int8)."""
    return getattr(ext, w4a8.KERNEL_OF[type(weights)])


def mm(ext, x, weights):
    return kernel_of(ext, weights)(x, *weights)


def reference(ext, x, weights):
    """The pure-torch reference in the lanes this build of the kernel sums (which also says its arithmetic)."""
    return w4a8.reference_mm(x, weights, ext.lanes(4 if isinstance(weights, w4a8.Int4Weights) else 8))


@pytest.fixture(scope="module", params=["native", "avx512-emulated"])
def ext(request):
    """Each test on this CPU's build of the kernel, then on its AVX-512 (VNNI) path, emulated (conftest)."""
    if request.param == "avx512-emulated":
        return emulated_avx512_build()
    module = w4a8.extension()
    assert module is not None, "the C++ kernel did not build (see the warning): g++ and ninja are needed"
    return module


@pytest.fixture(autouse=True)
def _layers_use_the_build_under_test(request, monkeypatch):
    """A test of a build: the layers it makes (W4A8Linear, ...) call that build too. Other tests: this CPU's."""
    if "ext" in request.fixturenames:
        use_cpu_build(monkeypatch, request.getfixturevalue("ext"))


def _case(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=g) * 0.05
    weight[0, :32] = 0  # an all-zero weight block
    x = torch.randn(16, K, generator=g)
    x[1, :32] = 0  # an all-zero activation block
    x[2, 5] = 40.0  # an outlier
    return weight, x


@pytest.mark.parametrize("span", [32, 256])
@pytest.mark.parametrize("N,K", SHAPES)
def test_activation_quantization_equals_the_reference(ext, N, K, span):
    _, x = _case(N, K)
    Kp = w4a8.padded_width(K)
    q, scale = ext.quantize_activations(x, Kp, span)
    q_ref, scale_ref = w4a8.reference_quantize_activations(x, Kp, span)
    assert scale.shape == (16, -(-Kp // span))
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("bits", PACKERS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_kernel_equals_the_reference_for_every_k(ext, N, K, bits):
    weight, x = _case(N, K)
    weights = PACKERS[bits](weight)
    for k in range(1, 17):
        assert torch.equal(mm(ext, x[:k], weights), reference(ext, x[:k], weights)), k


@pytest.mark.parametrize("layer", [W4A8Linear, W6A8Linear, W8A8Linear])
@pytest.mark.parametrize("N,K", SHAPES[:3])
def test_each_row_is_what_it_is_alone(ext, N, K, layer):
    weight, x = _case(N, K, seed=1)
    weights = layer.pack(weight)
    alone = torch.cat([mm(ext, x[t:t + 1], weights) for t in range(16)])
    for k in (*range(1, 17), 40):  # 40: a prefill, five chunks of 8 tokens
        x_k = x[:k] if k <= 16 else torch.cat([x, x.flip(0), x])[:k]
        want = alone[:k] if k <= 16 else torch.cat([alone, alone.flip(0), alone])[:k]
        assert torch.equal(mm(ext, x_k, weights), want), k
    # and the measured group size of the server is the whole range asked
    assert invariant_rows(layer.quantize(weight), 9, 4) == 4


@pytest.mark.parametrize("bits", PACKERS)
def test_a_long_prefill_equals_small_calls(ext, bits):
    """Over a megabyte of activations the kernel allocates them per call instead of reusing its scratch: same rows."""
    weight, _ = _case(24, 1000, seed=3)
    x = torch.randn(2000, 1000, generator=torch.Generator().manual_seed(3))
    assert x.shape[0] * w4a8.padded_width(1000) > 1.5 * 2**20  # well over the kernel's kScratchBytes (2**20)
    weights = PACKERS[bits](weight)
    assert torch.equal(mm(ext, x, weights), torch.cat([mm(ext, part, weights) for part in x.split(8)]))


def test_int4_quantization_has_integer_sub_scales_and_is_close(ext):
    weight, x = _case(64, 600, seed=2)  # 600: three super-blocks, the last one partial
    weights = w4a8.quantize_weight(weight)
    assert weights.d.shape == (64, 3) and weights.sub.shape == (64, 24) and weights.corr.shape == (64, 3)
    # each block's scale is d * its int8 sub-scale, and corr is what the kernel's + 128 on activations adds
    assert torch.equal(weights.scale, (weights.d.repeat_interleave(8, dim=1) * weights.sub.float())[:, :20])
    q = w4a8.unpack(weights.packed).long() - 8  # [64, 640]
    sums = torch.nn.functional.pad(q, (0, 768 - 640)).view(64, 24, 32).sum(-1)  # padding blocks: sub 0
    assert torch.equal(weights.corr.long(), 128 * (weights.sub.long() * sums).view(64, 3, 8).sum(-1))
    deq = w4a8.dequantize(weights, 600)
    step = weights.scale.abs().repeat_interleave(32, dim=1)[:, :600]
    err = (deq - weight).abs()
    assert (err <= 1.5 * step).all() and err.mean() < step.mean() / 3
    assert int(q.min()) == -8 and int(q.max()) <= 7
    exact = x @ weight.T
    err = (ext.w4a8_mm(x, *weights) - exact).norm() / exact.norm()
    assert err < 0.15  # int4 weights and int8 activations: about 8% on Gaussian weights
    # integer sub-scales cost little: within 5% of the error of a float scale per block (Q4_0)
    assert (deq - weight).norm() < 1.05 * (_q4_0(weight) - weight).norm()


def _q4_0(weight: torch.Tensor) -> torch.Tensor:
    """Dequantized int4 weights with a float scale per block of 32 (extreme -> -8), for comparison."""
    w = torch.nn.functional.pad(weight, (0, -weight.shape[1] % 32))
    w = w.view(w.shape[0], -1, 32)
    scale = w.gather(-1, w.abs().argmax(-1, keepdim=True)) / -8
    q = torch.where(scale != 0, torch.round(w / scale), 0).clamp(-8, 7)
    return (q * scale).view(w.shape[0], -1)[:, :weight.shape[1]]


def test_int4_kernel_sums_super_blocks_in_integers_exactly(ext):
    """Extreme weights and activations: the integer sums must not saturate or overflow (|q + 128| * 8 * 2 in
    vpmaddubsw's int16, sub-scales up to 127)."""
    if ext.lanes(4) != 8:
        pytest.skip("this build takes the per-block VNNI arithmetic for int4")
    weight = torch.full((8, 512), -1.0)
    weight[1] = 1.0
    weight[2, ::2] = 1.0  # alternating signs
    weight[3, 32:64] = 1e-2  # in the super-block of -1 blocks: a small sub-scale beside large ones
    weight[4, 0] = 1e-3  # a near-zero weight among -1s: q = 0 beside the -8s
    x = torch.full((3, 512), 1.0)
    x[1] = -1.0
    x[2, ::3] = -1.0
    weights = w4a8.quantize_weight(weight)
    assert weights.sub[3, 0] == 127 and 0 < abs(int(weights.sub[3, 1])) <= 2
    got = ext.w4a8_mm(x, *weights)
    assert torch.equal(got, reference(ext, x, weights))
    exact = x @ w4a8.dequantize(weights, 512).T
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)


def test_int8_weights_are_q8_0_like_and_close(ext):
    weight, x = _case(64, 256, seed=2)
    weights = w4a8.quantize_weight8(weight)
    packed, scale = weights
    assert packed.dtype == torch.int8 and packed.shape == (64, 256) and int(packed.abs().max()) == 127
    deq = w4a8.dequantize(weights, 256)
    step = scale.repeat_interleave(32, dim=1)[:, :256]
    assert ((deq - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(w4a8.unpack(packed)[:, :256].float() * step, deq)  # the register order undone
    exact = x @ weight.T
    err = (ext.w8a8_mm(x, *weights) - exact).norm() / exact.norm()
    assert err < 0.02  # int8 weights and int8 activations: about 1% on Gaussian weights


@pytest.mark.parametrize("layer", [W4A8Linear, W6A8Linear, W8A8Linear])
def test_quantizing_by_row_chunks_equals_quantizing_at_once(layer, monkeypatch):
    """A large head is quantized QUANTIZE_ROWS rows at a time: the same weights as in one piece."""
    weight, _ = _case(100, 300, seed=4)
    whole = layer.quantize(weight).weights
    monkeypatch.setattr(w4a8, "QUANTIZE_ROWS", 32)  # 100 rows: three full chunks and a short one
    chunked = layer.quantize(weight).weights
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole, strict=True))


def test_6bit_weights_are_int8_ones_of_7_bits(ext):
    """W6A8 is W8A8's arithmetic on q in -31..31: the same bits as the int8 kernel on the same q, 48 bytes per pair."""
    weight, x = _case(64, 300, seed=7)  # 300: a partial last pair
    weights = w4a8.quantize_weight6(weight)
    packed, scale = weights
    assert packed.dtype == torch.uint8 and packed.shape == (64, 5 * 48) and scale.shape == (64, 10)
    as8 = weights.as_int8()
    assert int(as8.packed.abs().max()) == 31
    for k in (1, 3, 8, 9, 16):
        assert torch.equal(ext.w6a8_mm(x[:k], *weights), ext.w8a8_mm(x[:k], *as8)), k
    deq = w4a8.dequantize(weights, 300)  # close to the weights: no position packed into another's place
    step = scale.repeat_interleave(32, dim=1)[:, :300]
    assert ((deq - weight).abs() <= step / 2 + 1e-7).all()
    exact = x @ weight.T
    assert (ext.w6a8_mm(x, *weights) - exact).norm() / exact.norm() < 0.04


# every instruction-set path this CPU can run, each against the same reference
ISA_PATHS = [((), None), (("-mno-avx512f",), "avx2"), (("-mno-avx512f", "-mno-avx2", "-mno-fma"), "scalar")]


@pytest.mark.parametrize("flags,path", ISA_PATHS, ids=["native", "avx2", "scalar"])
def test_every_isa_path_equals_the_reference(flags, path):
    from specdecode.cpu import cpu_info

    if path == "avx2" and "avx2" not in cpu_info()[1]:
        pytest.skip("this CPU has no AVX2")
    variant = w4a8.extension(flags)
    assert variant is not None, f"the {path or 'native'} build failed"
    if path:
        assert variant.simd_path() == path
    for N, K in SHAPES[1:4]:
        weight, x = _case(N, K, seed=4)
        for bits, pack in PACKERS.items():
            weights = pack(weight)
            for k in (1, 2, 7, 8, 9, 16):
                got = mm(variant, x[:k], weights)
                assert torch.equal(got, reference(variant, x[:k], weights)), (bits, N, K, k)


@pytest.mark.parametrize("bits", PACKERS)
def test_nan_inf_and_tiny_activations_behave_as_the_reference(ext, bits):
    weight, x = _case(24, 200, seed=5)
    x = x[:6].clone()
    x[0, 3] = float("nan")  # its block's scale is NaN: that token's outputs are NaN
    x[1, 40] = float("inf")
    x[2, :64] = 1e-39  # denormal: the scale underflows, q must still be clamped to +-127
    x[2, 70] = -3e-39
    weights = PACKERS[bits](weight)
    got, want = mm(ext, x, weights), reference(ext, x, weights)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[0].isnan().all() and got[3:].isfinite().all()
    for span in (32, 256):
        q, _ = ext.quantize_activations(x, w4a8.padded_width(200), span)
        assert torch.equal(q, w4a8.reference_quantize_activations(x, w4a8.padded_width(200), span)[0])


def test_bad_shapes_give_clear_errors(ext):
    weights = w4a8.quantize_weight(torch.randn(8, 64))
    packed, scale, d, sub, corr = weights
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.w4a8_mm(torch.randn(2, 200), *weights)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.w4a8_mm(torch.randn(2, 64).to(torch.float16), *weights)
    with pytest.raises(RuntimeError, match="bias must be"):
        ext.w4a8_mm(torch.randn(2, 64), *weights, torch.zeros(7))
    with pytest.raises(RuntimeError, match=r"wscale must be"):
        ext.w4a8_mm(torch.randn(2, 64), packed, scale.flatten(), d, sub, corr)
    with pytest.raises(RuntimeError, match=r"super-block scales must be"):
        ext.w4a8_mm(torch.randn(2, 64), packed, scale, d, sub[:, :4], corr)
    with pytest.raises(ValueError, match="do not fit"):  # the fallback refuses what the kernel refuses
        w4a8.reference_mm(torch.randn(2, 200), weights)
    with pytest.raises(RuntimeError, match="int8"):  # int4-packed weights in the int8 kernel
        ext.w8a8_mm(torch.randn(2, 64), packed, scale)
    with pytest.raises(RuntimeError, match="span"):
        ext.quantize_activations(torch.randn(2, 64), 64, 64)
    six = w4a8.quantize_weight6(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="48 bytes per pair"):  # int4-packed weights in the 6-bit kernel
        ext.w6a8_mm(torch.randn(2, 64), packed, six.scale)


def test_the_layer_casts_and_adds_its_bias(ext, monkeypatch):
    weight, x = _case(40, 96)
    xb, bias = x[:3].to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    layer = W4A8Linear.quantize(weight.to(torch.bfloat16), bias)
    y = layer(xb)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 40)
    weights = w4a8.quantize_weight(weight.to(torch.bfloat16))
    # bfloat16 inputs as their float32 values; the bias added to the float32 sum; one rounding to bfloat16
    assert torch.equal(y, (mm(ext, xb.float(), weights) + bias.float()).to(torch.bfloat16))
    assert torch.equal(y, (reference(ext, xb.float(), weights) + bias.float()).to(torch.bfloat16))
    int8 = W8A8Linear.quantize(weight.to(torch.bfloat16), bias)
    assert torch.equal(int8(xb), (mm(ext, xb.float(), int8.weights) + bias.float()).to(torch.bfloat16))
    # dtypes the kernel does not take go through float32 (xb is exact in float16)
    assert torch.equal(layer(xb.half()), (mm(ext, xb.float(), weights) + bias.float()).half())
    monkeypatch.setattr(w4a8, "extension", lambda *flags: None)  # no compiler: the reference, same arithmetic
    want = w4a8.reference_mm(xb.float(), weights) + bias.float()
    assert torch.equal(layer(xb), want.to(torch.bfloat16))
    assert torch.equal(layer(xb.half()), want.half())
    assert torch.equal(layer(xb.view(3, 1, 96)), want.to(torch.bfloat16).view(3, 1, 40))
    assert layer(xb[:0].view(0, 1, 96)).shape == (0, 1, 40)


@pytest.mark.parametrize("bits", PACKERS)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_any_leading_shape_and_bias_dtype(ext, bits, bias_dtype, out_dtype):
    """The layer hands the kernel its [B, T, K] input as it comes (contiguous or not) and its bias in the model's
    dtype: the float32 sum plus the bias's float32 value, rounded once, row by row as for [k, K]."""
    weight, x = _case(40, 96, seed=6)
    weights = PACKERS[bits](weight)
    bias = None if bias_dtype is None else torch.randn(40).to(bias_dtype)
    plus = 0 if bias is None else bias.float()

    def want(rows):  # [k, K] -> [k, N]
        return (mm(ext, rows, weights) + plus).to(out_dtype)

    kernel = kernel_of(ext, weights)
    x3 = x[:12].view(3, 4, 96).transpose(0, 1)  # [4, 3, 96], not contiguous
    assert torch.equal(kernel(x3, *weights, bias, out_dtype), want(x3.reshape(12, 96)).view(4, 3, 40))
    assert torch.equal(kernel(x[5], *weights, bias, out_dtype), want(x[5:6])[0])  # one row, [K]
    assert kernel(x[:0].view(2, 0, 96), *weights, bias, out_dtype).shape == (2, 0, 40)
    if bits == "w4" and bias is not None and bias_dtype != torch.float16:  # the layer, and its torch fallback
        layer = W4A8Linear(weights, 96, bias, bias_dtype)
        xl = x3.to(bias_dtype)
        rows = mm(ext, xl.reshape(12, 96).float(), weights) + plus
        assert torch.equal(layer(xl), rows.to(bias_dtype).view(4, 3, 40))
        assert layer(xl[:, :0]).shape == (4, 0, 40)


def test_an_empty_width_gives_the_bias(ext):
    weights = w4a8.quantize_weight(torch.zeros(8, 0))
    bias = torch.arange(8.0)
    assert torch.equal(ext.w4a8_mm(torch.zeros(5, 0), *weights, bias), bias.expand(5, 8))


def test_the_block_scales_are_kept_only_where_the_kernel_reads_them(ext):
    weight, x = _case(40, 200)
    full = w4a8.quantize_weight(weight)
    compact = full._replace(scale=full.scale[:, :0])
    super_path = ext.lanes(4) == 8
    layer = W4A8Linear.quantize(weight)
    assert layer.scale.shape == ((40, 0) if super_path else full.scale.shape)  # 0.125 bytes per weight less
    assert torch.equal(compact.block_scales(), full.scale)  # computed again: the same float products d * sub
    assert torch.equal(layer.dequantized(), w4a8.dequantize(full, 200))
    assert torch.equal(layer._matmul(x), mm(ext, x, full))
    assert torch.equal(w4a8.reference_mm(x, compact, 16), w4a8.reference_mm(x, full, 16))
    if super_path:
        assert torch.equal(mm(ext, x, compact), mm(ext, x, full))
    else:  # the per-block arithmetic reads them
        with pytest.raises(RuntimeError, match="wscale must be"):
            mm(ext, x, compact)
    # a layer restored from weights packed for the other path gets what this kernel reads
    restored = W4A8Linear(full if super_path else compact, 200, None, torch.float32)
    assert restored.scale.shape == layer.scale.shape and torch.equal(restored._matmul(x), layer._matmul(x))
