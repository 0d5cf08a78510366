"""Weight-only int8 / int4 linears: round-trip error, kernel = dequantized reference, bit-exact greedy decoding."""

from __future__ import annotations

import pytest
import torch

from specdecode import cli
from specdecode.builder import build_generator, load_target
from specdecode.errors import InvalidRequestError
from specdecode.models.linear import Int4Linear, Int8Linear, make_linear, parse_quant
from specdecode.models.loading import load_model
from tests.test_lossless import random_prompts
from tests.test_runtime import _invariance_mismatches


def _weight(out: int = 96, inp: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_round_trip_within_half_a_step():
    w = _weight()
    layer = Int8Linear(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((layer.dequantized() - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group):
    w = _weight()
    layer = Int4Linear(w, group=group)
    g = w.reshape(w.shape[0], -1, group)
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(w.shape)
    err = (layer.dequantized() - w).abs()
    # half a quantization step, plus the bf16 rounding of the stored scale and zero point
    assert (err <= step / 2 + 2**-8 * (w.abs() + step * 8) + 1e-6).all()
    assert err.mean() < step.mean() / 3  # and not systematically off


@pytest.mark.parametrize("quant", ["int8", "int4", "int4-g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_dequantized_matmul(quant, dtype):
    w = _weight().to(dtype)
    layer = make_linear(w, torch.randn(96).to(dtype), quant)
    x = torch.randn(5, 256).to(dtype)
    reference = x.float() @ layer.dequantized().T + layer.bias.float()
    torch.testing.assert_close(layer(x).float(), reference, atol=0.02, rtol=0.02)
    assert layer(x).dtype == dtype


def test_bad_quantization_arguments():
    for bad in ["int3", "int8-g32", "int4-gx", "fp8"]:
        with pytest.raises(InvalidRequestError, match="unknown quantization"):
            parse_quant(bad)
    with pytest.raises(InvalidRequestError, match="group size"):
        Int4Linear(_weight(), group=48)
    with pytest.raises(InvalidRequestError, match="multiple"):
        Int4Linear(_weight(inp=96), group=64)


def test_cli_rejects_a_bad_quant(tiny_pair, capsys):
    target, _ = tiny_pair
    assert cli.main(["generate", "--target", str(target.source), "--drafter", "ngram", "--prompt", "abc",
                     "--quant", "int3"]) == 2
    assert "unknown quantization" in capsys.readouterr().err
    # the tiny model is 64 wide: int4 in groups of 128 cannot split it
    assert cli.main(["generate", "--target", str(target.source), "--drafter", "ngram", "--prompt", "abc",
                     "--quant", "int4-g128"]) == 2
    assert "multiple" in capsys.readouterr().err


@pytest.fixture(scope="module", params=[("float32", "int8"), ("bfloat16", "int8"), ("float32", "int4"),
                                        ("bfloat16", "int4")], ids=lambda p: "-".join(p))
def quantized_pair(request, tiny_pair):
    dtype, quant = request.param
    return (load_target(str(tiny_pair[0].source), dtype=dtype, quant=quant),
            load_model(tiny_pair[1].source, dtype=dtype, quant=quant))


def test_quantized_forward_is_invariant_to_the_step_width(quantized_pair):
    assert _invariance_mismatches(quantized_pair[0].model) == 0


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_quantized_greedy_speculative_equals_plain(quantized_pair, drafter):
    target, draft = quantized_pair
    plain = build_generator(target, drafter="none")
    prompts = random_prompts(12, 64, seed=5)
    expected = [plain.generate(p, max_new_tokens=20, eos_ids=[]).token_ids for p in prompts]
    accepted = 0
    for gamma in (1, 4, 8):
        spec = build_generator(target, draft=draft, drafter=drafter, gamma=gamma)
        for p, e in zip(prompts, expected):
            r = spec.generate(p, max_new_tokens=20, eos_ids=[])
            assert r.token_ids == e
            accepted += r.stats.accepted_tokens
    assert accepted > 0
