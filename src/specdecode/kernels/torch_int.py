"""torch's own weight-only kernels: int8 per output channel and int4 in groups (`torch._weight_int*pack_mm`)."""

from __future__ import annotations

import torch

from specdecode.errors import InvalidRequestError
from specdecode.models.linear import Linear

INT4_GROUP_SIZES = (32, 64, 128)  # the first is the default


class Int8Linear(Linear):
    """Weight-only int8, symmetric per output channel: W ~ q * scale. `torch._weight_int8pack_mm`."""

    kind = "int8"
    help = "per output channel; torch's kernel"
    bits = 8
    q: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(q.shape[0], q.shape[1], bias, scale.dtype)
        self.register_buffer("q", q)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out], in the activations' dtype

    @classmethod
    def bytes_per_weight(cls) -> float:
        return 1.0 + 2 / 1536  # + a bf16 scale per row of 1536

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 0) -> Int8Linear:
        w = weight.float()
        scale = (w.abs().amax(1).clamp(min=1e-10) / 127).to(weight.dtype)  # as the kernel will see it
        return cls((w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8), scale, bias)

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> Int8Linear:
        return cls(tensors["q"], tensors["scale"], tensors.get("bias"))

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.q, self.scale)


def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group` inputs: W ~ (q - 8) * scale + zero, q in 0..15.
    [N, K] -> (q [N, K] int32, scale [N, K / group], zero [N, K / group] float32 holding bf16 values)."""
    out_features, in_features = weight.shape
    if group not in INT4_GROUP_SIZES:
        raise InvalidRequestError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group}")
    if in_features % group:
        raise InvalidRequestError(f"int4 with group size {group} needs a width that is a multiple of it; "
                                  f"this layer is {in_features} wide")
    w = weight.float().reshape(out_features, in_features // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    # scale and zero as the kernels will see them (bf16), then q against exactly those
    scale = ((hi - lo).clamp(min=1e-10) / 15).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = ((w - (zero - 8 * scale)) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    return q, scale.squeeze(-1), zero.squeeze(-1)


class Int4Linear(Linear):
    """Weight-only int4, asymmetric in groups of `group` inputs: W ~ q * scale + min, q in 0..15.

    Packed for `torch.ops.aten._weight_int4pack_mm_for_cpu`, which takes bf16 activations and
    (scale, zero) pairs with zero = min + 8 * scale (it computes (q - 8) * scale + zero).
    """

    kind = "int4"
    help = "asymmetric groups, bf16 scales; torch's kernel"
    bits = 4
    group_sizes = INT4_GROUP_SIZES
    packed: torch.Tensor  # buffers (register_buffer)
    scale_zero: torch.Tensor

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(scale_zero.shape[1], scale_zero.shape[0] * group, bias, dtype)
        self.group = group
        self.register_buffer("packed", packed)  # torch's CPU int4 layout
        self.register_buffer("scale_zero", scale_zero)  # [in / group, out, 2] bf16

    @classmethod
    def bytes_per_weight(cls) -> float:
        return 0.5 + 4 / 32  # + a bf16 scale and zero per group of 32

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = INT4_GROUP_SIZES[0]) -> Int4Linear:
        q, scale, zero = int4_groups(weight, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(packed, scale_zero, group, bias, weight.dtype)

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> Int4Linear:
        return cls(tensors["packed"], tensors["scale_zero"], group, tensors.get("bias"), dtype)

    def dequantized(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self._matmul_bf16(eye).T.float()

    def _matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scale_zero)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self._matmul_bf16(rows.to(torch.bfloat16)).to(rows.dtype)
