"""A GGUF file's quantized blocks run as stored (`--quant gguf-int8`) on CPUs without AMX: int8 activations, as
llama.cpp's own Q8 activations, times the file's codes with their exact block scales (models/gguf_blocks.py), in
AVX-512 (VNNI) or AVX2 integer instructions, or in scalar code, all with the same arithmetic (gguf_int8.cpp).
Nothing is re-quantized: `dequantized()` gives `gguf.quants.dequantize`'s numbers bit for bit. Every output is
computed the same way whatever the number of rows (row-invariant). `reference_mm` is the arithmetic in torch.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from specdecode.kernels.build import build, build_for_cpu
from specdecode.kernels.w4a8 import reference_quantize_activations
from specdecode.models.block_linear import BlockLinear
from specdecode.models.gguf_blocks import BlockFormat, Codes

REGISTER = 32  # inputs per register of codes
SPAN = 256  # inputs per activation scale
SOURCE = Path(__file__).with_name("gguf_int8.cpp")
HEADERS = (Path(__file__).with_name("int8_act.h"), Path(__file__).with_name("simd.h"))
NO_INT8, NO_INT16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.int16)  # a format's absent buffers


@cache
def extension(isa_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled kernel (this CPU's path), or None where it cannot be built here. isa_flags: extra compiler flags,
    e.g. ("-mno-avx512f",) builds the AVX2 path on an AVX-512 CPU (tests)."""
    return build_for_cpu({"avx2"} if not isa_flags else set(),
                         lambda: build("gguf_int8", (SOURCE,), isa_flags, HEADERS,
                                       "a GGUF file's blocks are then dequantized"))


def register_bytes(bits: int) -> int:
    return {4: 16, 5: 20, 6: 24, 8: 32}[bits]


def _high(high: torch.Tensor, bits: int) -> torch.Tensor:
    """Bits 4 and up of registers' codes [..., 32] -> their bytes [..., 4 or 8] (layout in gguf_int8.cpp)."""
    if bits == 5:
        word = (high << torch.arange(32)).sum(-1, keepdim=True)  # bit j: input j
        return (word >> (8 * torch.arange(4))) & 0xFF
    shape = high.shape[:-1]
    return (high.view(*shape, 4, 8) << (2 * torch.arange(4)).view(4, 1)).sum(-2)  # byte i, bits 2k: input 8k + i


def _from_high(b: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `_high`: [..., 4 or 8] bytes -> [..., 32] bits 4 and up."""
    if bits == 5:
        word = (b << (8 * torch.arange(4))).sum(-1, keepdim=True)
        return (word >> torch.arange(32)) & 1
    return ((b.unsqueeze(-2) >> (2 * torch.arange(4)).view(4, 1)) & 3).flatten(-2)


def pack(codes: Codes) -> dict[str, torch.Tensor]:
    """Codes of an [N, K] tensor -> the kernel's buffers (layout at the top of gguf_int8.cpp)."""
    fmt, q = codes.fmt, codes.q
    N, K = q.shape
    if fmt.bits == 8:
        words = (q.to(torch.int16) + fmt.bias).to(torch.int8).view(torch.uint8)  # code + bias: the file's int8
    else:
        unit = 64 if fmt.block == 256 else REGISTER  # K types: pairs of registers
        u = q.view(N, K // unit, unit).to(torch.int64)
        half = unit // 2
        lo = (u[..., :half] & 15) | ((u[..., half:] & 15) << 4)
        hi = _high(u.view(N, K // unit, unit // REGISTER, REGISTER) >> 4, fmt.bits).flatten(-2) if fmt.bits > 4 \
            else lo[..., :0]
        words = torch.cat([lo, hi], -1).to(torch.uint8)
    out = {"w": words.reshape(N, -1).contiguous(), "d": codes.d.view(torch.int16).contiguous()}
    if codes.dm is not None and codes.m is not None:
        out["dm"] = codes.dm.view(torch.int16).contiguous()
    if fmt.block == 256:  # integer sub-scales (and mins) per group; the block-32 types have sc = m = 1
        out["sc"] = codes.sc.contiguous()
        if codes.m is not None:
            out["m"] = codes.m.view(torch.int8).contiguous()
    return out


def unpack(fmt: BlockFormat, buffers: dict[str, torch.Tensor], rows: int) -> Codes:
    """The inverse of `pack`."""
    w = buffers["w"][:rows]
    N = w.shape[0]
    if fmt.bits == 8:
        q = (w.view(torch.int8).to(torch.int16) - fmt.bias).to(torch.uint8)
    else:
        unit = 64 if fmt.block == 256 else REGISTER
        r = w.view(N, -1, unit // REGISTER * register_bytes(fmt.bits)).to(torch.int64)
        half = unit // 2
        lo = r[..., :half]
        q = torch.cat([lo & 15, lo >> 4], -1)
        if fmt.bits > 4:
            high = r[..., half:].view(*r.shape[:2], unit // REGISTER, -1)
            q = q | (_from_high(high, fmt.bits).flatten(-2) << 4)
        q = q.reshape(N, -1).to(torch.uint8)
    groups = q.shape[1] // fmt.group
    ones = torch.ones(N, groups, dtype=torch.int8)
    has_offsets = "dm" in buffers
    return Codes(fmt, q, buffers["d"][:rows].view(torch.float16), buffers["sc"][:rows] if "sc" in buffers else ones,
                 buffers["dm"][:rows].view(torch.float16) if has_offsets else None,
                 (buffers["m"][:rows].view(torch.uint8) if "m" in buffers else ones.view(torch.uint8))
                 if has_offsets else None)


def reference_mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kernel's arithmetic in torch: exact integer sums per block, then its float32 steps, except that the
    lanes of a block are added first (the kernel keeps 8 lanes apart): [k, K] -> [k, N] float32, within a few ulps
    of the kernel's. For tests."""
    codes = unpack(fmt, buffers, buffers["w"].shape[0])
    N, K = codes.q.shape
    q, a = reference_quantize_activations(x.float(), K, SPAN)  # [k, K] int8, [k, spans]
    values = codes.q.to(torch.int64) + fmt.bias  # [N, K]
    sc = codes.sc.to(torch.int64).repeat_interleave(fmt.group, 1)
    blocks = K // fmt.block
    J = ((values * sc).view(1, N, blocks, fmt.block) * q.to(torch.int64).view(-1, 1, blocks, fmt.block)).sum(-1)
    span_of = torch.arange(blocks) * fmt.block // SPAN
    acc = J.double() * (codes.d.float().view(1, N, blocks) * a[:, span_of].view(-1, 1, blocks)).double()
    if codes.dm is not None and codes.m is not None:
        m = codes.m.to(torch.int64).repeat_interleave(fmt.group, 1).view(1, N, blocks, fmt.block)
        M = (m * q.to(torch.int64).view(-1, 1, blocks, fmt.block)).sum(-1)
        acc = acc + M.double() * (codes.dm.float().view(1, N, blocks) * a[:, span_of].view(-1, 1, blocks)).double()
    return acc.sum(-1).float()


def gguf_int8_mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor],
                 out_dtype: torch.dtype = torch.float32, isa_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """x [k, K] float32 or bfloat16 times a packed tensor -> [k, N] in out_dtype."""
    ext = extension(isa_flags)
    if ext is None:
        raise RuntimeError("--quant gguf-int8 needs an AVX2 CPU and a C++ compiler here")
    y = ext.gguf_int8_mm(x, buffers["w"], buffers["d"], buffers.get("dm", NO_INT16), buffers.get("sc", NO_INT8),
                         buffers.get("m", NO_INT8), fmt.bits, fmt.block, fmt.group, fmt.bias if fmt.bits < 8 else 0)
    return y.to(out_dtype)


class GgufInt8Linear(BlockLinear):
    """A GGUF file's blocks as stored, times int8 activations (CPUs without AMX)."""

    kind = "gguf-int8"
    help = "a GGUF file's own blocks as stored, int8 activations (AVX2 and AVX-512 CPUs, as llama.cpp)"
    requires = "a GGUF file and a CPU with AVX2 and a C++ compiler"
    head = "gguf-int8"
    native_dtypes = ("float32", "bfloat16")  # quantized to int8 either way
    pack = staticmethod(pack)
    unpack = staticmethod(unpack)
    mm = staticmethod(gguf_int8_mm)

    @staticmethod
    def inputs(fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> int:
        return buffers["w"].shape[1] // register_bytes(fmt.bits) * REGISTER

    @classmethod
    def available(cls) -> bool:
        return extension() is not None
