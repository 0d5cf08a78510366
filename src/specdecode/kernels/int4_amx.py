"""int4 weights x bf16 activations on AMX tiles: a verify step of k <= 16 rows at about the cost of one row.

The same int4 numbers as `--quant int4` (asymmetric groups, bf16 scale and zero), in our own layout and
kernel (`int4_amx.cpp`): torch's int4 kernel grows with k (`specdecode doctor` times both); this one
dequantizes each weight once to bf16 and lets one AMX tile multiply serve up to 16 rows. `reference_mm` does
the same float operations in the same order with torch, except inside one 32-input tile multiply, where the
order and rounding of the additions are the hardware's
(the tests allow a few ulps of the products' magnitude there, and compare rows across k with `torch.equal`).
Only CPUs with AMX-BF16 (Sapphire Rapids and later) run it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from specdecode.errors import InvalidRequestError
from specdecode.kernels.build import build, build_for_cpu
from specdecode.kernels.torch_int import INT4_GROUP_SIZES, int4_groups
from specdecode.models.linear import Linear

CHUNK = 32  # inputs per tile multiply
TILE = 16  # outputs per tile
SOURCES = (Path(__file__).with_name("int4_amx.cpp"), Path(__file__).with_name("gguf_amx.cpp"))
HEADER = Path(__file__).with_name("amx.h")


@cache
def extension() -> ModuleType | None:
    """The compiled kernel where this CPU can run it, else None."""
    return build_for_cpu({"amx_bf16", "amx_tile", "avx512bw"},
                         lambda: build("amx", SOURCES, headers=(HEADER,),
                                       without="int4-amx, int8-amx and gguf on AMX are unavailable"))


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15, scale and zero [N, K / group] (bf16 values) -> (packed [Np / 16, K / 32, 256] uint8,
    scale_zero [Np / 16, K / group, 32] int16: the bf16 bits of 16 scales then 16 zeros); N padded to Np, a
    multiple of 16, with zero weights. The layout is described in int4_amx.cpp."""
    pad = -q.shape[0] % TILE
    u = tile_order(q, pad_value=8)
    scale, zero = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) for t in (scale, zero))
    Np, G = q.shape[0] + pad, scale.shape[1]
    sz = torch.stack([scale.view(Np // TILE, TILE, G), zero.view(Np // TILE, TILE, G)], 1)  # [tile, 2, n, G]
    sz = sz.permute(0, 3, 1, 2).reshape(Np // TILE, G, 2 * TILE).to(torch.bfloat16).view(torch.int16)
    return nibble_words(u), sz.contiguous()


def tile_order(q: torch.Tensor, pad_value: int = 0) -> torch.Tensor:
    """q [N, K] -> [N padded / 16, K / 32, L = 4, word = 32, nibble i = 4] int32: each weight at its place in the
    packed layout (word w of load L, nibble i: output 16 * tile + w / 2, input 32 * chunk + 2 * (4L + i) + w % 2)."""
    N, K = q.shape
    q = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, -N % TILE), value=pad_value)
    # [tile, n, chunk, L, i, parity] -> [tile, chunk, L, word = 2n + parity, nibble i]
    return (q.view(-1, TILE, K // CHUNK, 4, 4, 2).permute(0, 2, 3, 1, 5, 4).reshape(-1, K // CHUNK, 4, 32, 4))


def nibble_words(u: torch.Tensor) -> torch.Tensor:
    """`tile_order`'s values in 0..15 -> the packed bytes [N padded / 16, K / 32, 256] uint8."""
    words = u[..., 0] | (u[..., 1] << 4) | (u[..., 2] << 8) | (u[..., 3] << 12)
    return torch.stack([words & 0xFF, words >> 8], -1).to(torch.uint8).reshape(u.shape[0], u.shape[1], 256)


def unpack(packed: torch.Tensor, scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: (q [Np, K] int32, scale [Np, G], zero [Np, G] float32)."""
    T, C = packed.shape[:2]
    q = from_tile_order(unpack_nibbles(packed))
    sz = scale_zero.view(torch.bfloat16).float().view(T, -1, 2, TILE).permute(0, 3, 1, 2)  # [tile, n, G, 2]
    sz = sz.reshape(T * TILE, -1, 2)
    return q, sz[..., 0].contiguous(), sz[..., 1].contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `nibble_words`."""
    T, C = packed.shape[:2]
    words = packed.view(T, C, 4, 32, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)
    return torch.stack([(words >> (4 * i)) & 0xF for i in range(4)], -1)  # [tile, chunk, L, word, i]


def from_tile_order(u: torch.Tensor) -> torch.Tensor:
    """The inverse of `tile_order`: [N padded, K]."""
    T, C = u.shape[:2]
    return u.view(T, C, 4, TILE, 2, 4).permute(0, 3, 1, 2, 5, 4).reshape(T * TILE, C * CHUNK)


def dequantize(packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int) -> torch.Tensor:
    q, scale, zero = unpack(packed, scale_zero)
    group = q.shape[1] // scale.shape[1]
    w = (q - 8).float().view(q.shape[0], -1, group) * scale[..., None] + zero[..., None]
    return w.view(q.shape[0], -1)[:out_features]


def reference_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """What the kernel computes, operation for operation (see int4_amx.cpp), with the additions inside a tile
    multiply done left to right: [k, K] bf16 -> [k, Np] float32. One vector step per input: for tests."""
    q, scale, zero = unpack(packed, scale_zero)
    x = x.float()
    w = (q - 8).float().T  # [K, Np], exact
    acc = torch.zeros(x.shape[0], q.shape[0])
    for g in range(scale.shape[1]):
        c = torch.zeros_like(acc)
        xs = torch.zeros(x.shape[0], 1)
        for i in range(g * group, (g + 1) * group):
            c = c + x[:, i:i + 1] * w[i]  # the product is exact in fp32 (8 x 4 significant bits)
            xs = xs + x[:, i:i + 1]
        acc = acc + c * scale[:, g]
        acc = acc + xs * zero[:, g]
    return acc


def int4_amx_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [k, K] (any float dtype, rounded to bf16) times the packed weights -> [k, Np] float32, or bfloat16
    (rounded in the kernel as `.to(torch.bfloat16)` would, denormals aside)."""
    if group not in (32, 64, 128):
        raise ValueError(f"the int4-amx kernel takes groups of 32, 64 or 128 inputs, not {group}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the int4-amx kernel writes float32 or bfloat16, not {out_dtype}")
    ext = extension()
    if ext is None:
        raise RuntimeError("the int4-amx kernel needs a CPU with AMX-BF16; use --quant int4 here")
    return ext.int4_amx_mm(x.to(torch.bfloat16).contiguous(), packed, scale_zero, group, out_dtype == torch.bfloat16)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int in -127..127 and scale [N] (bf16 values) -> (packed [Np / 16, K / 32, 2, 256] uint8: per chunk
    the high then the low nibbles of q + 128 in `pack`'s layout; scale [Np] float32), N padded to a multiple of 16."""
    u = q.to(torch.int32) + 128
    unused = torch.ones(q.shape[0], q.shape[1] // CHUNK)  # pack's scale and zero: int8 has its own scale
    hi, _ = pack(u >> 4, unused, unused)
    lo, _ = pack(u & 15, unused, unused)
    scale = torch.nn.functional.pad(scale.float(), (0, hi.shape[0] * TILE - q.shape[0]))
    return torch.stack([hi, lo], dim=2).contiguous(), scale.contiguous()


def dequantize_int8(packed: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    unused = torch.zeros(packed.shape[0], packed.shape[1], 2 * TILE, dtype=torch.int16)  # no int4 scales here
    hi, _, _ = unpack(packed[:, :, 0].contiguous(), unused)
    lo, _, _ = unpack(packed[:, :, 1].contiguous(), unused)
    return ((hi * 16 + lo - 128).float() * scale[:, None])[:out_features]


def int8_amx_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [k, K] (rounded to bf16) times int8 weights packed by `pack_int8` -> [k, Np] float32 or bfloat16:
    sum over the row of x * q in AMX tiles (four chains, added in order), times the channel's scale."""
    ext = extension()
    if ext is None:
        raise RuntimeError("the int8-amx kernel needs a CPU with AMX-BF16; use --quant int8 here")
    return ext.int8_amx_mm(x.to(torch.bfloat16).contiguous(), packed, scale, out_dtype == torch.bfloat16)


class Int4AmxLinear(Linear):
    """The numbers of `Int4Linear` in our AMX kernel: up to 16 rows for the cost of one."""

    kind = "int4-amx"
    help = "the int4 numbers in our AMX kernel: k <= 16 rows cost about one; the lm_head then int8-amx"
    bits = 4
    group_sizes = INT4_GROUP_SIZES
    requires = "a CPU with AMX-BF16 (Sapphire Rapids or later) and a C++ compiler"
    head = "int8-amx"
    row_invariant = True
    packed: torch.Tensor  # buffers (register_buffer)
    scale_zero: torch.Tensor

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, out_features: int,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(out_features, packed.shape[1] * CHUNK, bias, dtype)
        self.group = group
        self.register_buffer("packed", packed)  # [out padded to 16 / 16, in / 32, 256] uint8
        self.register_buffer("scale_zero", scale_zero)  # [out padded / 16, in / group, 32] int16 (bf16 bits)
        self.register_buffer("width", torch.tensor(out_features))  # the padding hides it: kept to rebuild the layer

    @classmethod
    def available(cls) -> bool:
        return extension() is not None

    @classmethod
    def bytes_per_weight(cls) -> float:
        return 0.5 + 4 / 32  # + a bf16 scale and zero per group of 32

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = INT4_GROUP_SIZES[0]) -> Int4AmxLinear:
        q, scale, zero = int4_groups(weight, group)
        _require_amx(cls)
        return cls(*pack(q, scale, zero), group, weight.shape[0], bias, weight.dtype)

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> Int4AmxLinear:
        _require_amx(cls)  # a cache written on another CPU, or a kernel that no longer builds
        return cls(tensors["packed"], tensors["scale_zero"], group, int(tensors["width"]), tensors.get("bias"),
                   dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.packed, self.scale_zero, self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        y = int4_amx_mm(rows, self.packed, self.scale_zero, self.group, out_dtype)
        return y[:, :self.out_features].contiguous().to(rows.dtype)  # no copy where the width is a multiple of 16


class Int8AmxLinear(Linear):
    """Weight-only int8, symmetric per output channel (W ~ q * scale, scale a bf16 value), in our AMX kernel.

    The int4-amx machinery twice per weight: q + 128 is split into two nibbles, each dequantized through a table
    into its own tile (16 * (hi - 8) and lo - 8, exact in bf16), and x * 8 * scale restores the offset. The scale
    is per channel, so no rescale per group: k <= 16 rows cost about what one does. Row-invariant like int4-amx.
    An int4-amx target's lm_head (llama.cpp keeps its output layer wider than its blocks too).
    """

    kind = "int8-amx"
    help = "per-channel int8 on the same tiles"
    bits = 8
    requires = Int4AmxLinear.requires
    row_invariant = True
    packed: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(out_features, packed.shape[1] * CHUNK, bias, dtype)
        self.register_buffer("packed", packed)  # [out padded to 16 / 16, in / 32, 2, 256] uint8
        self.register_buffer("scale", scale)  # [out padded] float32 (bf16 values)
        self.register_buffer("width", torch.tensor(out_features))

    @classmethod
    def available(cls) -> bool:
        return extension() is not None

    @classmethod
    def bytes_per_weight(cls) -> float:
        return 1.0 + 4 / 1536  # + a float scale per row of 1536

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 0) -> Int8AmxLinear:
        _require_amx(cls)
        if weight.shape[1] % CHUNK:
            raise InvalidRequestError(f"int8-amx needs a width that is a multiple of {CHUNK}; this layer "
                                      f"is {weight.shape[1]} wide")
        w = weight.float()
        scale = (w.abs().amax(1, keepdim=True).clamp(min=1e-10) / 127).to(torch.bfloat16).float()  # [N, 1]
        q = (w / scale).round().clamp(-127, 127)
        return cls(*pack_int8(q, scale.squeeze(1)), weight.shape[0], bias, weight.dtype)

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> Int8AmxLinear:
        _require_amx(cls)
        return cls(tensors["packed"], tensors["scale"], int(tensors["width"]), tensors.get("bias"), dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.packed, self.scale, self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        y = int8_amx_mm(rows, self.packed, self.scale, out_dtype)
        return y[:, :self.out_features].contiguous().to(rows.dtype)


def _require_amx(cls: type[Linear]) -> None:
    if not cls.available():
        fallback = "int4" if cls.kind == "int4-amx" else "int8"
        raise InvalidRequestError(f"--quant {cls.kind} needs {cls.requires}; use --quant {fallback} here")
