"""The runtime's linear layers: one interface, so quantized kernels replace the dense one without the model knowing.

The model code only calls `layer(x)`; which kernel runs is decided when the weights are loaded
(`make_linear`). Subclasses implement `_matmul(rows) -> [n, out]`; the base adds the bias (our W4A8 kernel
takes the bias and the cast itself, so its layers skip the base's extra ops).
"""

from __future__ import annotations

from operator import itemgetter

import torch
from torch import nn

from specdecode.errors import InvalidRequestError
from specdecode.kernels import int4_amx, w4a8

QUANTS = ("none", "int8", "int4", "int4-amx", "int8-amx", "w4a8", "w6a8", "w8a8")
GROUPED = ("int4", "int4-amx")  # the kinds that take a group size: "int4-g64"
# kinds whose kernel is our C++ build
OUR_KERNELS = {"w4a8": w4a8, "w6a8": w4a8, "w8a8": w4a8, "int4-amx": int4_amx, "int8-amx": int4_amx}
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 32


class Linear(nn.Module):
    quant: str  # what `make_linear` was given, e.g. "int4-g64": enough to rebuild the layer from its state_dict
    row_invariant = False  # True: each output row is computed the same way whatever the number of rows (our kernels)

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype  # dtype: of activations
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class DenseLinear(Linear):
    """y = x W^T + b, computed as (W @ x^T)^T.

    On the CPUs we measured (see shared/CPU.md), `W @ x.T` keeps the cost of k <= 8 rows close to
    that of one row, while `F.linear` grows with k; for a single row `torch.mv` reads bf16 weights
    at 1.5x the speed of either (Xeon with AMX, torch 2.13).
    """

    quant = "none"
    COLUMN_BLOCK = 8  # float32 GEMMs compute a last, partial block of columns (rows of x) by other code

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[0], weight.shape[1], bias, weight.dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        if n == 1:  # draft steps; never in bit-exact mode, which pads
            return torch.mv(self.weight, rows[0]).unsqueeze(0)
        if self.weight.dtype == torch.float32 and n > self.COLUMN_BLOCK and n % self.COLUMN_BLOCK:
            # on AVX2 (Zen 3, torch 2.13) row 8 of a 9-row float32 matmul differs from the same row at position 0:
            # whole blocks keep a bit-exact step's rows independent of their position
            rows = torch.cat([rows, rows.new_zeros(self.COLUMN_BLOCK - n % self.COLUMN_BLOCK, rows.shape[1])])
        return (self.weight @ rows.T).T[:n]


class Int8Linear(Linear):
    """Weight-only int8, symmetric per output channel: W ~ q * scale. `torch._weight_int8pack_mm`."""

    quant = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(q.shape[0], q.shape[1], bias, scale.dtype)
        self.register_buffer("q", q)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out], in the activations' dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        w = weight.float()
        scale = (w.abs().amax(1).clamp(min=1e-10) / 127).to(weight.dtype)  # as the kernel will see it
        return cls((w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8), scale, bias)

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

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(scale_zero.shape[1], scale_zero.shape[0] * group, bias, dtype)
        self.group = group
        self.register_buffer("packed", packed)  # torch's CPU int4 layout
        self.register_buffer("scale_zero", scale_zero)  # [in / group, out, 2] bf16

    @property
    def quant(self) -> str:
        return f"int4-g{self.group}"

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = DEFAULT_INT4_GROUP) -> "Int4Linear":
        q, scale, zero = int4_groups(weight, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(packed, scale_zero, group, bias, weight.dtype)

    def dequantized(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self._matmul_bf16(eye).T.float()

    def _matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scale_zero)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self._matmul_bf16(rows.to(torch.bfloat16)).to(rows.dtype)


class Int4AmxLinear(Linear):
    """The numbers of `Int4Linear` in our AMX kernel (kernels/int4_amx.py): up to 16 rows for the cost of one."""

    row_invariant = True

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, out_features: int,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(out_features, packed.shape[1] * int4_amx.CHUNK, bias, dtype)
        self.group = group
        self.register_buffer("packed", packed)  # [out padded to 16 / 16, in / 32, 256] uint8
        self.register_buffer("scale_zero", scale_zero)  # [out padded / 16, in / group, 32] int16 (bf16 bits)
        self.register_buffer("width", torch.tensor(out_features))  # the padding hides it: kept to rebuild the layer

    @property
    def quant(self) -> str:
        return f"int4-amx-g{self.group}"

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = DEFAULT_INT4_GROUP) -> "Int4AmxLinear":
        q, scale, zero = int4_groups(weight, group)
        _require_amx()
        return cls(*int4_amx.pack(q, scale, zero), group, weight.shape[0], bias, weight.dtype)

    def dequantized(self) -> torch.Tensor:
        return int4_amx.dequantize(self.packed, self.scale_zero, self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        y = int4_amx.int4_amx_mm(rows, self.packed, self.scale_zero, self.group, out_dtype)
        return y[:, :self.out_features].contiguous().to(rows.dtype)  # no copy where the width is a multiple of 16


class Int8AmxLinear(Linear):
    """Weight-only int8, symmetric per output channel (W ~ q * scale, scale a bf16 value), in our AMX kernel.

    The int4-amx machinery twice per weight: q + 128 is split into two nibbles, each dequantized through a table
    into its own tile (16 * (hi - 8) and lo - 8, exact in bf16), and x * 8 * scale restores the offset. The scale
    is per channel, so no rescale per group: k <= 16 rows cost about what one does. Row-invariant like int4-amx.
    An int4-amx target's lm_head (llama.cpp keeps its output layer wider than its blocks too).
    """

    quant = "int8-amx"
    row_invariant = True

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(out_features, packed.shape[1] * int4_amx.CHUNK, bias, dtype)
        self.register_buffer("packed", packed)  # [out padded to 16 / 16, in / 32, 2, 256] uint8
        self.register_buffer("scale", scale)  # [out padded] float32 (bf16 values)
        self.register_buffer("width", torch.tensor(out_features))

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8AmxLinear":
        _require_amx("int8-amx")
        if weight.shape[1] % int4_amx.CHUNK:
            raise InvalidRequestError(f"int8-amx needs a width that is a multiple of {int4_amx.CHUNK}; this layer "
                                      f"is {weight.shape[1]} wide")
        w = weight.float()
        scale = (w.abs().amax(1, keepdim=True).clamp(min=1e-10) / 127).to(torch.bfloat16).float()  # [N, 1]
        q = (w / scale).round().clamp(-127, 127)
        return cls(*int4_amx.pack_int8(q, scale.squeeze(1)), weight.shape[0], bias, weight.dtype)

    def dequantized(self) -> torch.Tensor:
        return int4_amx.dequantize_int8(self.packed, self.scale, self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        y = int4_amx.int8_amx_mm(rows, self.packed, self.scale, out_dtype)
        return y[:, :self.out_features].contiguous().to(rows.dtype)


def _require_amx(kind: str = "int4-amx") -> None:
    if not kernel_available(kind):
        fallback = "int4" if kind == "int4-amx" else "int8"
        raise InvalidRequestError(f"--quant {kind} needs a CPU with AMX-BF16 (Sapphire Rapids or later) and a "
                                  f"C++ compiler; use --quant {fallback} here")


class W4A8Linear(Linear):
    """int4 weights (symmetric, blocks of 32 with int8 sub-scales of a float per 256) x int8 activations (per
    token): integer dot products in our C++ kernel (kernels/w4a8.py), so that a verify step of k <= 8 rows costs
    about what one row does."""

    quant = "w4a8"
    pack = staticmethod(w4a8.quantize_weight)
    Weights = w4a8.Int4Weights
    _take = staticmethod(itemgetter(*Weights._fields))  # the buffers (or saved tensors) that make its Weights

    @property
    def row_invariant(self) -> bool:  # the C++ kernel is; its pure-torch stand-in is not promised to be
        return w4a8.extension() is not None

    def __init__(self, weights: w4a8.Weights, in_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(weights.packed.shape[0], in_features, bias, dtype)
        if isinstance(weights, w4a8.Int4Weights):  # the float block scales only where this CPU's kernel reads them
            weights = w4a8.for_this_kernel(weights)
        for name, tensor in weights._asdict().items():  # see w4a8.Int4Weights / Int8Weights
            self.register_buffer(name, tensor)
        self.register_buffer("width", torch.tensor(in_features))  # the padding hides it: kept to rebuild the layer

    @property
    def weights(self) -> w4a8.Weights:  # read at every call: a few hundred times per step
        return self.Weights._make(self._take(self._buffers))

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "W4A8Linear":
        return cls(cls.pack(weight), weight.shape[1], bias, weight.dtype)

    def dequantized(self) -> torch.Tensor:
        return w4a8.dequantize(self.weights, self.in_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return w4a8.w4a8_mm(rows, self.weights, dtype=rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the shape, bias and cast in the kernel: one call per layer
        return w4a8.w4a8_mm(x, self.weights, self.bias, x.dtype)


class W8A8Linear(W4A8Linear):
    """int8 weights (symmetric, blocks of 32, as llama.cpp's Q8_0) x int8 activations in the same kernel: wider than
    w4a8 blocks and row-invariant like them."""

    quant = "w8a8"
    pack = staticmethod(w4a8.quantize_weight8)
    Weights = w4a8.Int8Weights
    _take = staticmethod(itemgetter(*Weights._fields))


class W6A8Linear(W4A8Linear):
    """6-bit weights (symmetric, blocks of 32) x int8 activations, W8A8's arithmetic on 7 bits per weight instead of
    9: a w4a8 target's lm_head, wider than its blocks (as llama.cpp's Q4_K_M keeps a 6-bit output layer)."""

    quant = "w6a8"
    pack = staticmethod(w4a8.quantize_weight6)
    Weights = w4a8.Int6Weights
    _take = staticmethod(itemgetter(*Weights._fields))


OUR_INT8_ACTIVATIONS = {cls.quant: cls for cls in (W4A8Linear, W6A8Linear, W8A8Linear)}  # one kernel, three widths


def parse_quant(quant: str) -> tuple[str, int]:
    """'none' | 'int8' | 'int4[-g32|-g64|-g128]' | 'int4-amx[-gG]' | 'int8-amx' | 'w4a8' | 'w6a8' | 'w8a8' -> (kind,
    group)."""
    kind, sep, group = quant.partition("-g")
    if kind not in QUANTS or (sep and (kind not in GROUPED or not group.isdigit())):
        raise InvalidRequestError(f"unknown quantization {quant!r}; choose none, int8, int4, int4-g32/64/128, "
                                  "int4-amx (same, with -gG), int8-amx, w4a8, w6a8, w8a8 or auto")
    if sep and int(group) not in INT4_GROUP_SIZES:
        raise InvalidRequestError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group}")
    return kind, int(group) if sep else DEFAULT_INT4_GROUP


def kernel_available(quant: str) -> bool:
    """False where `quant` runs one of our C++ kernels and it did not build or this CPU cannot run it
    (w4a8 would then run its pure-torch reference, which is never fast)."""
    kind = parse_quant(quant)[0]
    return kind not in OUR_KERNELS or OUR_KERNELS[kind].extension() is not None


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quant: str = "none") -> Linear:
    kind, group = parse_quant(quant)
    if kind == "int8":
        return Int8Linear.quantize(weight, bias)
    if kind == "int4":
        return Int4Linear.quantize(weight, bias, group)
    if kind == "int4-amx":
        return Int4AmxLinear.quantize(weight, bias, group)
    if kind == "int8-amx":
        return Int8AmxLinear.quantize(weight, bias)
    if kind in OUR_INT8_ACTIVATIONS:
        return OUR_INT8_ACTIVATIONS[kind].quantize(weight, bias)
    return DenseLinear(weight, bias)


def restore_linear(quant: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Linear:
    """Rebuild a layer from its `state_dict()` and its `quant`, without quantizing again (weight cache)."""
    kind, group = parse_quant(quant)
    bias = tensors.get("bias")
    if kind == "int8":
        return Int8Linear(tensors["q"], tensors["scale"], bias)
    if kind == "int4":
        return Int4Linear(tensors["packed"], tensors["scale_zero"], group, bias, dtype)
    if kind == "int4-amx":  # a cache written on another CPU, or a kernel that no longer builds
        _require_amx()
        return Int4AmxLinear(tensors["packed"], tensors["scale_zero"], group, int(tensors["width"]), bias, dtype)
    if kind == "int8-amx":
        _require_amx(kind)
        return Int8AmxLinear(tensors["packed"], tensors["scale"], int(tensors["width"]), bias, dtype)
    if kind in OUR_INT8_ACTIVATIONS:
        cls = OUR_INT8_ACTIVATIONS[kind]
        return cls(cls.Weights._make(cls._take(tensors)), int(tensors["width"]), bias, dtype)
    return DenseLinear(tensors["weight"], bias)


def invariant_rows(layer: Linear, width: int, max_multiple: int, seed: int = 0) -> int:
    """The largest m <= max_multiple such that every matmul of n * width rows (n <= m) gives each row
    exactly what a matmul of `width` rows gives it. Measured, since it depends on the CPU's kernels.

    A matmul kernel's reduction order depends on the shapes, not on the values, so random rows of the
    layer's own shape and dtype answer for every input.
    """
    x = torch.randn(width * max_multiple, layer.in_features, generator=torch.Generator().manual_seed(seed))
    x = x.to(device=next(iter(layer.state_dict().values())).device, dtype=layer.dtype)
    alone = torch.cat([layer._matmul(chunk) for chunk in x.split(width)])
    for n in range(2, max_multiple + 1):
        if not torch.equal(layer._matmul(x[:n * width]), alone[:n * width]):
            return n - 1
    return max_multiple
