"""A GGUF file's quantized blocks run as stored (`--quant gguf-int8`) on CPUs without AMX: int8 activations, as
llama.cpp's own Q8 activations, times the file's codes with their exact block scales (models/gguf_blocks.py), in
AVX-512 (VNNI) or AVX2 integer instructions, or in scalar code, all with the same arithmetic (gguf_int8.cpp).
Nothing is re-quantized: `dequantized()` gives `gguf.quants.dequantize`'s numbers bit for bit. Every output is
computed the same way whatever the number of rows (row-invariant). `reference_mm` is the arithmetic in torch.
"""

from __future__ import annotations

from functools import cache, cached_property
from types import ModuleType
from typing import ClassVar

import torch

from specdecode.cpu import cpu_info
from specdecode.kernels.build import cpu_extension
from specdecode.kernels.w4a8 import reference_quantize_activations
from specdecode.models.block_linear import BlockLinear
from specdecode.models.gguf_blocks import BlockFormat, Codes

REGISTER = 32  # inputs per register of codes
TILE = 16  # rows per tile
SPAN = 256  # inputs per activation scale
NO_INT8, NO_INT16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.int16)  # a format's absent buffers


@cache
def extension(isa_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """Our CPU library, which holds the kernel (this CPU's path), or None where it cannot be built here or the CPU
    lacks AVX2. isa_flags: extra compiler flags, e.g. ("-mno-avx512f",) builds the AVX2 path on an AVX-512 CPU
    (tests)."""
    return cpu_extension(isa_flags) if isa_flags or "avx2" in cpu_info()[1] else None


def register_bytes(bits: int) -> int:
    """Bytes of one register (32 inputs) of a tile's 16 rows."""
    return TILE * {4: 16, 5: 20, 6: 24, 8: 32}[bits]


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N / 16 (rounded up), 16, ...], zero rows padding the last tile."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, TILE, *t.shape[1:])


def _per_tile(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, n] -> [N / 16, n, 16]: a block's (or group's) 16 rows side by side."""
    return _tiles(t).transpose(1, 2).contiguous()


def pack(codes: Codes) -> dict[str, torch.Tensor]:
    """Codes of an [N, K] tensor -> the kernel's buffers (layout at the top of gguf_int8.cpp)."""
    fmt = codes.fmt
    N, K = codes.q.shape
    u = _tiles(codes.q).to(torch.int64).view(-1, TILE, K // REGISTER, 8, 4)  # [tiles, row, register, slice, i]
    if fmt.bits == 8:
        parts = [u]  # the file's int8 + 128
    else:
        nibbles = (u & 15).view(-1, TILE, K // REGISTER, 4, 2, 4)
        parts = [nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)]  # vector v: slices 2v, 2v + 1
        high = u >> 4
        if fmt.bits == 5:  # bit j: slice j
            parts.append((high << torch.arange(8).view(8, 1)).sum(-2, keepdim=True))
        elif fmt.bits == 6:  # vector w, bits 2k: slice 4w + k
            parts.append((high.view(-1, TILE, K // REGISTER, 2, 4, 4) << (2 * torch.arange(4)).view(4, 1)).sum(-2))
    # [tiles, row, register, vector, i] -> [tiles, register, vector, row, i]
    words = torch.cat([p.permute(0, 2, 3, 1, 4) for p in parts], 2).to(torch.uint8)
    out = {"w": words.reshape(words.shape[0], -1).contiguous(), "d": _per_tile(codes.d.view(torch.int16))}
    if codes.dm is not None and codes.m is not None:
        out["dm"] = _per_tile(codes.dm.view(torch.int16))
    if fmt.block == 256:  # integer sub-scales (and mins) per group; the block-32 types have sc = m = 1
        out["sc"] = _per_tile(codes.sc)
        if codes.m is not None:
            out["m"] = _per_tile(codes.m.view(torch.int8))
    return out


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of `_per_tile`, the first `rows` rows."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:rows]


def unpack(fmt: BlockFormat, buffers: dict[str, torch.Tensor], rows: int) -> Codes:
    """The inverse of `pack`: the first `rows` rows."""
    w = buffers["w"]
    regs = w.shape[1] // register_bytes(fmt.bits)
    r = w.view(-1, regs, register_bytes(fmt.bits) // (TILE * 4), TILE, 4).permute(0, 3, 1, 2, 4).to(torch.int64)
    if fmt.bits == 8:
        q = r
    else:
        low = r[..., :4, :]
        q = torch.stack([low & 15, low >> 4], -2).flatten(-3, -2)  # [tiles, row, register, slice, i]
        if fmt.bits == 5:
            q = q | (((r[..., 4:5, :] >> torch.arange(8).view(8, 1)) & 1) << 4)
        elif fmt.bits == 6:
            q = q | ((((r[..., 4:6, :].unsqueeze(-2) >> (2 * torch.arange(4)).view(4, 1)) & 3) << 4).flatten(-3, -2))
    q = q.reshape(-1, regs * REGISTER)[:rows].to(torch.uint8)
    groups = q.shape[1] // fmt.group
    ones = torch.ones(rows, groups, dtype=torch.int8)
    has_offsets = "dm" in buffers
    return Codes(fmt, q, _rows(buffers["d"], rows).view(torch.float16),
                 _rows(buffers["sc"], rows) if "sc" in buffers else ones,
                 _rows(buffers["dm"], rows).view(torch.float16) if has_offsets else None,
                 (_rows(buffers["m"], rows).view(torch.uint8) if "m" in buffers else ones.view(torch.uint8))
                 if has_offsets else None)


def reference_mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's arithmetic in torch: exact integer sums per block, then its float32 steps block after block, a
    fused multiply-add done in float64 (rounded twice, where the kernel rounds once): [k, K] -> [k, N (whole tiles)]
    float32, within an ulp or so of the kernel's. For tests."""
    codes = unpack(fmt, buffers, buffers["w"].shape[0] * TILE)
    N, K = codes.q.shape
    q, a = reference_quantize_activations(x.float(), K, SPAN)  # [k, K] int8, [k, spans]
    q = q.to(torch.int64).view(-1, 1, K // fmt.block, fmt.block)
    values = codes.q.to(torch.int64) + fmt.bias  # [N, K]
    sc = codes.sc.to(torch.int64).repeat_interleave(fmt.group, 1)
    blocks = K // fmt.block
    J = ((values * sc).view(1, N, blocks, fmt.block) * q).sum(-1)  # [k, N, blocks]
    M = None
    if codes.dm is not None and codes.m is not None:
        M = (codes.m.to(torch.int64).repeat_interleave(fmt.group, 1).view(1, N, blocks, fmt.block) * q).sum(-1)
    span_of = torch.arange(blocks) * fmt.block // SPAN
    acc = torch.zeros(x.shape[0], N, dtype=torch.float32)
    for s in range(blocks):
        scale = a[:, span_of[s]].view(-1, 1)  # [k, 1]
        acc = (J[..., s].float().double() * (codes.d[:, s].float() * scale).double() + acc.double()).float()
        if M is not None and codes.dm is not None:
            acc = (M[..., s].float().double() * (codes.dm[:, s].float() * scale).double() + acc.double()).float()
    return acc


def kernel_args(fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> tuple:
    """A packed tensor as the C++ kernel takes it, after x: w, d, dm, sc, m (empty where the format has none), then
    its bits, block, group and code bias."""
    return (buffers["w"], buffers["d"], buffers.get("dm", NO_INT16), buffers.get("sc", NO_INT8),
            buffers.get("m", NO_INT8), fmt.bits, fmt.block, fmt.group, fmt.bias)


def gguf_int8_mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor],
                 out_dtype: torch.dtype = torch.float32, isa_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """x [k, K] float32 or bfloat16 times a packed tensor -> [k, N (whole tiles)] in out_dtype."""
    ext = extension(isa_flags)
    if ext is None:
        raise RuntimeError("--quant gguf-int8 needs an AVX2 CPU and a C++ compiler here")
    return ext.gguf_int8_mm(x, *kernel_args(fmt, buffers)).to(out_dtype)


class GgufInt8Linear(BlockLinear):
    """A GGUF file's blocks as stored, times int8 activations (CPUs without AMX)."""

    kind = "gguf-int8"
    help = "a GGUF file's own blocks as stored, int8 activations (AVX2 and AVX-512 CPUs, as llama.cpp)"
    requires = "a GGUF file and a CPU with AVX2 and a C++ compiler"
    head = "gguf-int8"
    native_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")  # quantized to int8 either way
    pack = staticmethod(pack)
    unpack = staticmethod(unpack)
    mm = staticmethod(gguf_int8_mm)

    @staticmethod
    def inputs(fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> int:
        return buffers["w"].shape[1] // register_bytes(fmt.bits) * REGISTER

    @classmethod
    def available(cls) -> bool:
        return extension() is not None

    @cached_property
    def layer_parts(self) -> list[tuple]:
        """Each part as the one-call layer takes it (kernels/layer.cpp's `Part`): the kernel's arguments and its width,
        for a model on the CPU: built once."""
        return [(*kernel_args(p.fmt, p.buffers_by_name()), p.out_features) for p in self.part_list]
