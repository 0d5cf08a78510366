"""A GGUF file's quantized blocks run as stored (`--quant gguf`), on AMX tiles: the model the file defines.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors keep their codes and their float16 block scales
(models/gguf_blocks.py: `w = d * sc * (code + bias) + dm * m`, exact in float32); nothing is re-quantized, and
`dequantized()` gives `gguf.quants.dequantize`'s numbers bit for bit. `gguf_amx.cpp` computes with them as
int4_amx.cpp does: up to 16 rows per tile multiply, so a verify step costs about what one row does, and each row
the same operations whatever the number of rows (row-invariant). `reference_mm` is the same arithmetic in torch.
A layer may stack tensors of different types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k): one part
per run of equal types, their outputs side by side.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from specdecode.errors import InvalidRequestError
from specdecode.kernels.int4_amx import CHUNK, TILE, extension, from_tile_order, nibble_words, tile_order, \
    unpack_nibbles
from specdecode.models.gguf_blocks import FORMATS, BlockFormat, Codes, QuantizedTensor, concat_rows
from specdecode.models.linear import Linear


PACK_ROWS = 4096  # rows packed at a time (a multiple of 16): the temporaries of a 151936-row lm_head stay small


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


class Part(nn.Module):
    """One run of equal block types: its buffers, its format and its real width."""

    lo: torch.Tensor  # buffers (register_buffer); hi, d, sc, dm, m too, where the format has them

    def __init__(self, qtype: GGMLQuantizationType, buffers: dict[str, torch.Tensor], width: int) -> None:
        super().__init__()
        self.fmt = FORMATS[qtype]
        self.names = tuple(buffers)
        for name, t in buffers.items():
            self.register_buffer(name, t)
        self.register_buffer("qtype", torch.tensor(int(qtype)))  # kept to rebuild the layer (weight cache)
        self.register_buffer("width", torch.tensor(width))
        self.out_features = width

    def buffers_by_name(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}

    def mm(self, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return gguf_amx_mm(rows, self.fmt, self.buffers_by_name(), out_dtype)[:, :self.out_features]

    def dequantized(self) -> torch.Tensor:
        return unpack(self.fmt, self.buffers_by_name(), self.out_features).dequantize()


class GgufLinear(Linear):
    """A GGUF file's blocks as stored, on AMX tiles; the file's dense tensors stay dense."""

    kind = "gguf"
    help = "a GGUF file's own blocks as stored (Q4_K, Q6_K, Q8_0, Q5_0, ...), no re-quantization"
    bits = 4
    requires = "a GGUF file and a CPU with AMX-BF16 (Sapphire Rapids or later) and a C++ compiler"
    head = "gguf"
    native = True
    row_invariant = True

    def __init__(self, parts: list[Part], bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(sum(p.out_features for p in parts), parts[0].lo.shape[1] * CHUNK, bias, dtype)
        self.parts = nn.ModuleList(parts)  # their buffers in the state_dict
        self.part_list = parts

    @classmethod
    def available(cls) -> bool:
        return extension() is not None

    @classmethod
    def bytes_per_weight(cls) -> float:
        return 0.5 + 6 / 256 + 2 / 32  # Q4_K: the codes, d and dm per 256, sc and m per 32

    @classmethod
    def from_blocks(cls, tensors: list[QuantizedTensor], bias: torch.Tensor | None, dtype: torch.dtype) -> GgufLinear:
        """Tensors stacked along their outputs (q, k, v), each of a supported block type."""
        if not cls.available():
            raise InvalidRequestError(f"--quant gguf needs {cls.requires}; use --quant none here")
        runs: list[list[QuantizedTensor]] = []
        for t in tensors:
            if runs and runs[-1][0].qtype == t.qtype:
                runs[-1].append(t)
            else:
                runs.append([t])
        parts = []
        for run in runs:
            stacked = concat_rows(run) if len(run) > 1 else run[0]
            chunks = [pack(stacked.rows_between(r, r + PACK_ROWS).codes())  # bounded temporaries
                      for r in range(0, stacked.shape[0], PACK_ROWS)]
            buffers = {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}
            parts.append(Part(stacked.qtype, buffers, stacked.shape[0]))
        return cls(parts, bias, dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 0) -> Linear:
        raise InvalidRequestError("--quant gguf runs a GGUF file's own blocks: it cannot quantize other weights")

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> GgufLinear:
        if not cls.available():
            raise InvalidRequestError(f"--quant gguf needs {cls.requires}; use --quant none here")
        count = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("parts."))
        parts = []
        for i in range(count):
            own = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"parts.{i}.")}
            qtype, width = GGMLQuantizationType(int(own.pop("qtype"))), int(own.pop("width"))
            parts.append(Part(qtype, own, width))
        return cls(parts, tensors.get("bias"), dtype)

    def kernel_name(self) -> str:
        return "GgufLinear(" + "+".join(p.fmt.name for p in self.part_list) + ")"

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.part_list])

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        outs = [p.mm(rows, out_dtype) for p in self.part_list]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.contiguous().to(rows.dtype)
