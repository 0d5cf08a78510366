"""A GGUF file's quantized blocks run as stored (`--quant gguf`), on AMX tiles: the model the file defines.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors keep their codes and their float16 block scales
(models/gguf_blocks.py: `w = d * sc * (code + bias) + dm * m`, exact in float32); nothing is re-quantized, and
`dequantized()` gives `gguf.quants.dequantize`'s numbers bit for bit. `gguf_amx.cpp` computes with them as
int4_amx.cpp does: up to 16 rows per tile multiply, so a verify step costs about what one row does, and each row
the same operations whatever the number of rows (row-invariant). `reference_mm` is the same arithmetic in torch.
A layer may stack tensors of different types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k): one part
per run of equal types, their outputs side by side (models/block_linear.py).
"""

from __future__ import annotations

import torch

from specdecode.kernels.int4_amx import CHUNK, TILE, extension, from_tile_order, nibble_words, tile_order, \
    unpack_nibbles
from specdecode.models.block_linear import BlockLinear
from specdecode.models.gguf_blocks import BlockFormat, Codes



def hi_shift(bits: int) -> int:
    """Bits per nibble position in `hi` (0: 4-bit codes have no `hi`)."""
    return 0 if bits == 4 else 2 if bits <= 6 else 4


def pack(codes: Codes) -> dict[str, torch.Tensor]:
    """Codes of an [N, K] tensor -> the kernel's buffers (layout in gguf_amx.cpp), N padded to a multiple of 16."""
    fmt = codes.fmt
    u = tile_order(codes.q)  # [T, C, 4, 32, 4]
    T = u.shape[0]
    out = {"lo": nibble_words(u & 15)}
    hs = hi_shift(fmt.bits)
    if hs:
        words = (u[..., 0] >> 4) | ((u[..., 1] >> 4) << hs) | ((u[..., 2] >> 4) << 2 * hs) | \
            ((u[..., 3] >> 4) << 3 * hs)  # [T, C, 4, 32]
        out["hi"] = (words.to(torch.uint8) if hs == 2 else
                     torch.stack([words & 0xFF, words >> 8], -1).to(torch.uint8)).reshape(T, u.shape[1], -1)

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [T, G, 16]
        t = torch.nn.functional.pad(t, (0, 0, 0, T * TILE - t.shape[0]))
        return t.view(T, TILE, -1).transpose(1, 2).contiguous()

    out["d"] = per_tile(codes.d.view(torch.int16))
    out["sc"] = per_tile(codes.sc)
    if codes.dm is not None and codes.m is not None:
        out["dm"], out["m"] = per_tile(codes.dm.view(torch.int16)), per_tile(codes.m)
    return out


def unpack(fmt: BlockFormat, buffers: dict[str, torch.Tensor], rows: int) -> Codes:
    """The inverse of `pack`."""
    u = unpack_nibbles(buffers["lo"])
    hs = hi_shift(fmt.bits)
    if hs:
        h = buffers["hi"].view(*u.shape[:3], 32, -1).to(torch.int32)
        words = h[..., 0] if hs == 2 else h[..., 0] | (h[..., 1] << 8)
        u = u | torch.stack([((words >> (hs * i)) & ((1 << hs) - 1)) << 4 for i in range(4)], -1)

    def from_tile(t: torch.Tensor) -> torch.Tensor:  # [T, G, 16] -> [rows, G]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:rows].contiguous()

    has_offsets = "dm" in buffers
    return Codes(fmt, from_tile_order(u)[:rows].to(torch.uint8), from_tile(buffers["d"]).view(torch.float16),
                 from_tile(buffers["sc"]),
                 from_tile(buffers["dm"]).view(torch.float16) if has_offsets else None,
                 from_tile(buffers["m"]) if has_offsets else None)


def reference_mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the kernel computes, operation for operation, with the additions inside a tile multiply done left to
    right: [k, K] -> [k, N padded] float32. One vector step per input: for tests."""
    codes = unpack(fmt, buffers, buffers["lo"].shape[0] * TILE)
    x = x.to(torch.bfloat16).float()
    lifted = hi_shift(fmt.bits) == 2  # the tile holds 128 + code (gguf_amx.cpp)
    values = (codes.q.float() + (128 if lifted else fmt.bias)).T  # [K, Np], exact
    scales, offsets = codes.scales(), codes.offsets()
    if lifted:
        offsets = scales * float(fmt.bias - 128) if offsets is None else offsets - scales * float(128 - fmt.bias)
    acc = torch.zeros(x.shape[0], values.shape[1])
    for g in range(scales.shape[1]):
        c = torch.zeros_like(acc)
        xs = torch.zeros(x.shape[0], 1)
        for i in range(g * fmt.group, (g + 1) * fmt.group):
            c = c + x[:, i:i + 1] * values[i]
            xs = xs + x[:, i:i + 1]
        acc = acc + c * scales[:, g]
        if offsets is not None:
            acc = acc + xs * offsets[:, g]
    return acc


def gguf_amx_mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor],
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [k, K] (rounded to bf16) times a packed tensor -> [k, N padded] float32 or bfloat16."""
    ext = extension()
    if ext is None:
        raise RuntimeError("--quant gguf runs on AMX here; this CPU or build has none")
    empty = torch.empty(0, dtype=torch.uint8)
    return ext.gguf_amx_mm(x.to(torch.bfloat16).contiguous(), buffers["lo"], buffers.get("hi", empty), buffers["d"],
                           buffers["sc"], buffers.get("dm", torch.empty(0, dtype=torch.int16)),
                           buffers.get("m", empty), fmt.group, fmt.block, fmt.bits, fmt.bias,
                           out_dtype == torch.bfloat16)


class GgufLinear(BlockLinear):
    """A GGUF file's blocks as stored, on AMX tiles."""

    kind = "gguf"
    help = "a GGUF file's own blocks as stored (Q4_K, Q6_K, Q8_0, Q5_0, ...) on AMX tiles, bf16 activations"
    requires = "a GGUF file and a CPU with AMX-BF16 (Sapphire Rapids or later) and a C++ compiler"
    head = "gguf"
    native_dtypes = ("bfloat16",)
    pack = staticmethod(pack)
    unpack = staticmethod(unpack)
    mm = staticmethod(gguf_amx_mm)

    @staticmethod
    def inputs(fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> int:
        return buffers["lo"].shape[1] * CHUNK

    @classmethod
    def available(cls) -> bool:
        return extension() is not None
