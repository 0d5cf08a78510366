"""The W4A8 C++ kernel and its int8-weight twin W8A8: exactly the pure-torch reference's arithmetic, bit-exact
across k, close to the float matmul."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import w4a8
from specdecode.models.linear import W4A8Linear, W8A8Linear, invariant_rows

SHAPES = [(96, 64), (40, 96), (33, 100), (70, 1536), (24, 200)]  # widths that are not multiples of 32 or 64 too
PACKERS = {"w4": w4a8.quantize_weight, "w8": w4a8.quantize_weight8}


def mm(ext, x, packed, scale):
    """The extension's kernel for these packed weights (int4: uint8, int8: int8)."""
    return (ext.w8a8_mm if packed.dtype == torch.int8 else ext.w4a8_mm)(x, packed, scale)


def reference(ext, x, packed, scale):
    """The pure-torch reference in the lanes this build of the kernel sums."""
    return w4a8.reference_mm(x, packed, scale, ext.lanes(8 if packed.dtype == torch.int8 else 4))


@pytest.fixture(scope="module")
def ext():
    module = w4a8.extension()
    assert module is not None, "the C++ kernel did not build (see the warning): g++ and ninja are needed"
    return module


def _case(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=g) * 0.05
    weight[0, :32] = 0  # an all-zero weight block
    x = torch.randn(16, K, generator=g)
    x[1, :32] = 0  # an all-zero activation block
    x[2, 5] = 40.0  # an outlier
    return weight, x


@pytest.mark.parametrize("N,K", SHAPES)
def test_activation_quantization_equals_the_reference(ext, N, K):
    _, x = _case(N, K)
    Kp = w4a8.padded_width(K)
    q, scale = ext.quantize_activations(x, Kp)
    q_ref, scale_ref = w4a8.reference_quantize_activations(x, Kp)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("bits", PACKERS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_kernel_equals_the_reference_for_every_k(ext, N, K, bits):
    weight, x = _case(N, K)
    packed, scale = PACKERS[bits](weight)
    for k in range(1, 17):
        assert torch.equal(mm(ext, x[:k], packed, scale), reference(ext, x[:k], packed, scale)), k


@pytest.mark.parametrize("layer", [W4A8Linear, W8A8Linear])
@pytest.mark.parametrize("N,K", SHAPES[:3])
def test_each_row_is_what_it_is_alone(ext, N, K, layer):
    weight, x = _case(N, K, seed=1)
    packed, scale = layer.pack(weight)
    alone = torch.cat([mm(ext, x[t:t + 1], packed, scale) for t in range(16)])
    for k in range(1, 17):
        assert torch.equal(mm(ext, x[:k], packed, scale), alone[:k]), k
    # and the measured group size of the server is the whole range asked
    assert invariant_rows(layer.quantize(weight), 9, 4) == 4


def test_quantization_is_q4_0_like_and_close(ext):
    weight, x = _case(64, 256, seed=2)
    packed, scale = w4a8.quantize_weight(weight)
    deq = w4a8.dequantize(packed, scale, 256)
    step = scale.abs().repeat_interleave(32, dim=1)[:, :256]
    err = (deq - weight).abs()
    # half a step, except values near the opposite extreme, which clamp at 7 (as in Q4_0): one step
    assert (err <= step + 1e-7).all() and err.mean() < step.mean() / 3
    u = w4a8.unpack(packed)
    assert ((err <= step / 2 + 1e-7) | (u[:, :256] == 15)).all()
    assert int(u.min()) >= 0 and int(u.max()) <= 15 and (u[:, :256] == 0).any()  # the extreme maps to -8
    exact = x @ weight.T
    err = (ext.w4a8_mm(x, packed, scale) - exact).norm() / exact.norm()
    assert err < 0.15  # int4 weights and int8 activations: about 8% on Gaussian weights


def test_int8_weights_are_q8_0_like_and_close(ext):
    weight, x = _case(64, 256, seed=2)
    packed, scale = w4a8.quantize_weight8(weight)
    assert packed.dtype == torch.int8 and packed.shape == (64, 256) and int(packed.abs().max()) == 127
    deq = w4a8.dequantize(packed, scale, 256)
    step = scale.repeat_interleave(32, dim=1)[:, :256]
    assert ((deq - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(w4a8.unpack(packed)[:, :256].float() * step, deq)  # the register order undone
    exact = x @ weight.T
    err = (ext.w8a8_mm(x, packed, scale) - exact).norm() / exact.norm()
    assert err < 0.02  # int8 weights and int8 activations: about 1% on Gaussian weights


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
            packed, scale = pack(weight)
            for k in (1, 2, 7, 8, 9, 16):
                got = mm(variant, x[:k], packed, scale)
                assert torch.equal(got, reference(variant, x[:k], packed, scale)), (bits, N, K, k)


@pytest.mark.parametrize("bits", PACKERS)
def test_nan_inf_and_tiny_activations_behave_as_the_reference(ext, bits):
    weight, x = _case(24, 200, seed=5)
    x = x[:6].clone()
    x[0, 3] = float("nan")  # its block's scale is NaN: that token's outputs are NaN
    x[1, 40] = float("inf")
    x[2, :64] = 1e-39  # denormal: the scale underflows, q must still be clamped to +-127
    x[2, 70] = -3e-39
    packed, scale = PACKERS[bits](weight)
    got, want = mm(ext, x, packed, scale), reference(ext, x, packed, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[0].isnan().all() and got[3:].isfinite().all()
    q, _ = ext.quantize_activations(x, w4a8.padded_width(200))
    assert torch.equal(q, w4a8.reference_quantize_activations(x, w4a8.padded_width(200))[0])


def test_bad_shapes_give_clear_errors(ext):
    packed, scale = w4a8.quantize_weight(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.w4a8_mm(torch.randn(2, 200), packed, scale)
    with pytest.raises(RuntimeError, match="float32"):
        ext.w4a8_mm(torch.randn(2, 64).to(torch.bfloat16), packed, scale)
    with pytest.raises(RuntimeError, match=r"wscale must be"):
        ext.w4a8_mm(torch.randn(2, 64), packed, scale.flatten())
    with pytest.raises(ValueError, match="do not fit"):  # the fallback refuses what the kernel refuses
        w4a8.reference_mm(torch.randn(2, 200), packed, scale)
    with pytest.raises(RuntimeError, match="int8"):  # int4-packed weights in the int8 kernel
        ext.w8a8_mm(torch.randn(2, 64), packed, scale)


def test_the_layer_casts_and_adds_its_bias(ext):
    weight, x = _case(40, 96)
    bias = torch.randn(40)
    layer = W4A8Linear.quantize(weight.to(torch.bfloat16), bias.to(torch.bfloat16))
    y = layer(x[:3].to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 40)
    packed, scale = w4a8.quantize_weight(weight.to(torch.bfloat16))
    want = (ext.w4a8_mm(x[:3].to(torch.bfloat16).float(), packed, scale).to(torch.bfloat16) + bias.to(torch.bfloat16))
    assert torch.equal(y, want)
