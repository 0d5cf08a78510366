"""The AMX int4 kernel: the pure-torch reference's arithmetic, bit-exact across k, the numbers of --quant int4."""

from __future__ import annotations

import pytest
import torch

from specdecode.errors import InvalidRequestError
from specdecode.kernels import int4_amx
from specdecode.kernels.int4_amx import Int4AmxLinear
from specdecode.kernels.torch_int import Int4Linear, int4_groups
from specdecode.models.linear import invariant_rows, make_linear

needs_amx = pytest.mark.skipif(int4_amx.extension() is None, reason="needs a CPU with AMX-BF16 and g++")
SHAPES = [(32, 64, 32), (40, 128, 64), (50, 256, 128), (16, 96, 32), (24, 320, 32)]  # N not a multiple of 16 too


def _case(N: int, K: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=g) * 0.05
    weight[0, :group] = 0  # an all-zero group
    weight[1, 3] = 1.0  # an outlier
    x = torch.randn(20, K, generator=g)
    x[1, :group] = 0
    x[2, 5] = 40.0
    return weight, x.to(torch.bfloat16), int4_amx.pack(*int4_groups(weight, group))


@pytest.mark.parametrize("N,K,group", SHAPES)
def test_packing_round_trips_and_holds_the_int4_numbers(N, K, group):
    weight, _, (packed, scale_zero) = _case(N, K, group)
    q, scale, zero = int4_groups(weight, group)
    q2, scale2, zero2 = int4_amx.unpack(packed, scale_zero)
    assert torch.equal(q2[:N], q) and torch.equal(scale2[:N], scale) and torch.equal(zero2[:N], zero)
    assert torch.equal(q2[N:], torch.full_like(q2[N:], 8)) and not scale2[N:].any()  # padding outputs are 0
    if N % 16 == 0:  # torch's layout needs that; ours pads
        # the same weights as torch's int4 layer (whose dequantized() goes through a bf16 matmul: bf16 rounding)
        torch.testing.assert_close(int4_amx.dequantize(packed, scale_zero, N), Int4Linear.quantize(weight, None, group)
                                   .dequantized(), rtol=2 ** -8, atol=1e-6)
    step = (scale.repeat_interleave(group, 1) / 2 + 1e-6)
    assert ((int4_amx.dequantize(packed, scale_zero, N) - weight).abs() <= step).all()


@pytest.mark.parametrize("N,K,group", SHAPES[:2])
def test_the_reference_is_the_dequantized_matmul(N, K, group):
    weight, x, (packed, scale_zero) = _case(N, K, group)
    torch.testing.assert_close(int4_amx.reference_mm(x, packed, scale_zero, group)[:, :N],
                               x.float() @ int4_amx.dequantize(packed, scale_zero, N).T, rtol=1e-5, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("N,K,group", SHAPES)
def test_kernel_is_the_reference_up_to_the_order_of_additions_in_a_tile(N, K, group):
    """Inside one TDPBF16PS the hardware orders and rounds the 32 additions its own way (the last bit of a
    partial sum now and then); everything else is the same operations. So: equal within a few ulps of the sum
    of the products' magnitudes, and equal for integer-valued inputs, where every partial sum is exact."""
    _, x, (packed, scale_zero) = _case(N, K, group)
    q, scale, zero = int4_amx.unpack(packed, scale_zero)
    weights = (q - 8).float().abs() * scale.repeat_interleave(group, 1) + zero.abs().repeat_interleave(group, 1)
    magnitude = x.float().abs() @ weights.T
    reference = int4_amx.reference_mm(x, packed, scale_zero, group)
    for k in range(1, 21):  # more than one 16-row tile too
        y = int4_amx.int4_amx_mm(x[:k], packed, scale_zero, group)
        assert ((y - reference[:k]).abs() <= 8 * 2 ** -24 * magnitude[:k] + 1e-30).all(), k
    bf16 = int4_amx.int4_amx_mm(x, packed, scale_zero, group, torch.bfloat16)
    assert torch.equal(bf16, int4_amx.int4_amx_mm(x, packed, scale_zero, group).to(torch.bfloat16))
    integers = torch.randint(-20, 20, (9, K)).to(torch.bfloat16)
    assert torch.equal(int4_amx.int4_amx_mm(integers, packed, scale_zero, group),
                       int4_amx.reference_mm(integers, packed, scale_zero, group))


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_what_it_is_alone(threads):
    weight, x, (packed, scale_zero) = _case(200, 384, 32, seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([int4_amx.int4_amx_mm(x[t:t + 1], packed, scale_zero, 32) for t in range(20)])
        for k in range(1, 21):
            assert torch.equal(int4_amx.int4_amx_mm(x[:k], packed, scale_zero, 32), alone[:k]), k
    finally:
        torch.set_num_threads(before)
    assert invariant_rows(Int4AmxLinear.quantize(weight), 9, 4) == 4


@needs_amx
def test_the_layer_pads_casts_and_adds_its_bias():
    weight, x, _ = _case(40, 128, 32)
    bias = torch.randn(40)
    layer = make_linear(weight, bias, "int4-amx-g64")
    assert isinstance(layer, Int4AmxLinear) and layer.quant == "int4-amx-g64"
    y = layer(x[:3].float())
    assert y.shape == (3, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y, x[:3].float() @ layer.dequantized().T + bias, rtol=1e-5, atol=1e-4)
    head = make_linear(weight, None, "int4-amx")  # bf16 in, bf16 out, the 8 padding outputs dropped
    y16 = head(x[:3])
    assert y16.dtype == torch.bfloat16 and y16.shape == (3, 40) and y16.is_contiguous()
    assert torch.equal(y16, head(x[:3].float()).to(torch.bfloat16))


def test_without_amx_the_quant_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(int4_amx, "extension", lambda: None)
    with pytest.raises(InvalidRequestError, match="AMX"):
        make_linear(torch.randn(32, 64), None, "int4-amx")
    with pytest.raises(RuntimeError, match="AMX"):
        int4_amx.int4_amx_mm(torch.randn(1, 64), *_case(32, 64, 32)[2], 32)


def test_bad_shapes_and_groups_give_clear_errors():
    with pytest.raises(InvalidRequestError, match="multiple"):
        make_linear(torch.randn(32, 96), None, "int4-amx-g64")
    with pytest.raises(InvalidRequestError, match="group size"):
        make_linear(torch.randn(32, 96), None, "int4-amx-g48")
    _, _, (packed, scale_zero) = _case(32, 256, 256 // 2)
    with pytest.raises(ValueError, match="groups of 32, 64 or 128"):  # the kernel's buffers hold 4 groups of 128
        int4_amx.int4_amx_mm(torch.randn(1, 256), *int4_amx.pack(*int4_groups(torch.randn(32, 256), 128)), 256)
    if int4_amx.extension() is not None:
        with pytest.raises(RuntimeError, match="width"):
            int4_amx.int4_amx_mm(torch.randn(1, 96), packed, scale_zero, 128)


# ---- int8-amx: int8 per-channel weights through the same tiles, two nibbles per weight ----

@pytest.mark.parametrize("N,K", [(40, 64), (16, 96), (130, 320)])
def test_int8_packing_round_trips(N, K):
    weight, _, _ = _case(N, K, 32)
    scale = (weight.abs().amax(1) / 127).to(torch.bfloat16).float()
    q = (weight / scale[:, None]).round().clamp(-127, 127)
    packed, scale_p = int4_amx.pack_int8(q, scale)
    assert packed.shape == (-(-N // 16), K // 32, 2, 256) and not scale_p[N:].any()
    assert torch.equal(int4_amx.dequantize_int8(packed, scale_p, N), q * scale[:, None])


@needs_amx
@pytest.mark.parametrize("N,K", [(40, 64), (130, 320), (64, 1536)])
def test_int8_kernel_is_the_dequantized_matmul_and_row_invariant(N, K):
    weight, x, _ = _case(N, K, 32, seed=2)
    layer = make_linear(weight.to(torch.bfloat16), None, "int8-amx")
    w = layer.dequantized()
    assert ((w - weight.to(torch.bfloat16).float()).abs() <= layer.scale[:N, None] / 2 + 1e-6).all()  # int8's error
    magnitude = x.float().abs() @ w.abs().T
    y = int4_amx.int8_amx_mm(x, layer.packed, layer.scale)[:, :N]
    assert ((y - x.float() @ w.T).abs() <= 16 * 2 ** -24 * magnitude * (K // 32) + 1e-30).all()
    alone = torch.cat([layer(x[t:t + 1]) for t in range(20)])
    for k in range(1, 21):
        assert torch.equal(layer(x[:k]), alone[:k]), k
    assert torch.equal(int4_amx.int8_amx_mm(x, layer.packed, layer.scale, torch.bfloat16),
                       int4_amx.int8_amx_mm(x, layer.packed, layer.scale).to(torch.bfloat16))


@needs_amx
def test_int8_amx_refuses_widths_that_are_not_a_multiple_of_32():
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        make_linear(torch.randn(16, 48), None, "int8-amx")


@needs_amx
def test_many_rows_give_each_row_what_it_gets_alone():
    """Prefills and server batches send more than one 16-row tile: rows must not notice."""
    weight, _, (packed, scale_zero) = _case(48, 256, 64, seed=3)
    x = torch.randn(45, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    alone = torch.cat([int4_amx.int4_amx_mm(x[t:t + 1], packed, scale_zero, 64) for t in range(45)])
    for k in (32, 33, 45):
        for out_dtype in (torch.float32, torch.bfloat16):
            got = int4_amx.int4_amx_mm(x[:k], packed, scale_zero, 64, out_dtype)
            assert torch.equal(got, alone[:k].to(out_dtype)), (k, out_dtype)
