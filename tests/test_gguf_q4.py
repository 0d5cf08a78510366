"""`gguf-q4`: a GGUF draft's blocks, the wider ones re-quantized to Q4_0 by gguf's own quantizer, on gguf-int8."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from specdecode.builder import load_target, native_kind
from specdecode.errors import InvalidRequestError
from specdecode.kernels import gguf_int8
from specdecode.kernels.gguf_q4 import GgufQ4Linear, narrowed
from specdecode.models.gguf_blocks import QuantizedTensor, random_tensor
from specdecode.models.loading import load_model
from tests.gguf_files import Q5_0_MIX, write_model
from tests.test_gguf_native import _gguf
from tests.test_quant import assert_greedy_speculative_equals_plain

needs_avx2 = pytest.mark.skipif(gguf_int8.extension() is None, reason="needs a CPU with AVX2 and g++")


def _tensor(qtype: Q) -> QuantizedTensor:
    return random_tensor(qtype, 32, 256, seed=3)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0, Q.Q6_K, Q.Q5_K])
def test_wider_blocks_become_ggufs_own_q4_0_of_their_numbers(qtype: Q) -> None:
    t = _tensor(qtype)
    q4 = narrowed(t)
    assert q4.qtype == Q.Q4_0 and q4.shape == t.shape
    assert np.array_equal(q4.raw.numpy(), quantize(_gguf(t).numpy(), Q.Q4_0))
    assert (_gguf(q4) - _gguf(t)).abs().max() <= _gguf(t).abs().max() / 7  # half a step of 16 at most


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K])
def test_four_bit_blocks_stay_as_stored(qtype: Q) -> None:
    t = _tensor(qtype)
    assert narrowed(t) is t


@needs_avx2
def test_the_layer_runs_the_narrowed_numbers() -> None:
    tensors = [_tensor(Q.Q5_0), _tensor(Q.Q4_K)]
    layer = GgufQ4Linear.from_blocks(tensors, None, torch.float32)
    want = torch.cat([_gguf(narrowed(t)) for t in tensors])
    assert torch.equal(layer.dequantized(), want)
    x = torch.randn(3, 256)
    assert torch.allclose(layer(x), x @ want.T, rtol=0.05, atol=0.05 * float((x @ want.T).abs().max()))


def test_it_is_never_a_targets_precision() -> None:
    assert not GgufQ4Linear.native_dtypes  # what `native_kind` (a target's --quant file) requires
    assert native_kind("float32") != "gguf-q4" and native_kind("bfloat16") != "gguf-q4"
    with pytest.raises(InvalidRequestError, match="for drafts"):
        load_target("qwen2.5-coder-1.5b-instruct", quant="gguf-q4")


@needs_avx2
def test_greedy_speculative_with_a_gguf_q4_draft_equals_plain(tmp_path) -> None:
    target_path, draft_path = write_model(tmp_path / "t.gguf", Q5_0_MIX), \
        write_model(tmp_path / "d.gguf", Q5_0_MIX, perturb=0.05)
    target = load_model(target_path, quant="gguf-int8", head_quant="gguf-int8", decode_width=9, with_tokenizer=False)
    draft = load_model(draft_path, quant="gguf-q4", head_quant="gguf-q4", with_tokenizer=False)
    assert isinstance(draft.model.lm_head, GgufQ4Linear)
    assert all(p.fmt.name in ("Q4_0", "Q4_1", "Q4_K") for m in draft.model.blocks[0].children()
               if isinstance(m, GgufQ4Linear) for p in m.part_list)
    assert_greedy_speculative_equals_plain(target, draft, "model", gammas=(1, 4, None), prompts=8)
