"""A GGUF draft's blocks in at most 4 bits (`--draft-quant gguf-q4`): the `gguf-int8` kernel on the file's blocks,
those stored wider (Q5_0, Q8_0, Q6_K, ... : the 0.5B's files keep most of their 896-wide matrices in Q5_0 and the
output in Q8_0) re-quantized to Q4_0 by gguf's own quantizer. A drafted token then reads about a quarter fewer
bytes; a draft's precision changes only how often its tokens are accepted, never the output.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from gguf import GGMLQuantizationType as T

from specdecode.kernels.gguf_int8 import GgufInt8Linear
from specdecode.models.block_linear import BlockLinear
from specdecode.models.gguf_blocks import QuantizedTensor

NARROW = T.Q4_0  # what wider blocks become
KEPT = {T.Q4_0, T.Q4_1, T.Q4_K}  # already this narrow


def narrowed(t: QuantizedTensor) -> QuantizedTensor:
    """`t` itself where it is 4-bit (or its rows do not split into Q4_0's blocks of 32), else re-quantized to Q4_0."""
    return t if t.qtype in KEPT or t.shape[1] % 32 else t.requantized(NARROW)


class GgufQ4Linear(GgufInt8Linear):
    """A GGUF file's blocks, those wider than 4 bits re-quantized to Q4_0, times int8 activations (a draft's)."""

    kind = "gguf-q4"
    help = "a GGUF draft's blocks, those wider than 4 bits re-quantized to Q4_0 (gguf-int8's kernel; drafts only)"
    head = "gguf-q4"
    native_dtypes: ClassVar[tuple[str, ...]] = ()  # not the file's own precision: never a target's `--quant file`

    @classmethod
    def from_blocks(cls, tensors: list[QuantizedTensor], bias: torch.Tensor | None,
                    dtype: torch.dtype) -> BlockLinear:
        return super().from_blocks([narrowed(t) for t in tensors], bias, dtype)
