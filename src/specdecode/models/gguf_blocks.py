"""GGUF's quantized blocks as integer codes and their exact scales, so kernels can run a file's weights as stored.

Every block type read here is, per group of 16 or 32 inputs, `w = scale * (code + bias) + offset` with
`scale = d * sc` and `offset = dm * m`: d, dm float16 per block (of 32) or super-block (of 256) as stored, sc and
m small integers per group (1 where the type has none). The products are exact in float32, and `dequantize`
repeats `gguf.quants.dequantize`'s float operations, so it gives its numbers bit for bit (tested per type).

    type  group  block  bits  bias  offset          type  group  block  bits  bias  offset
    Q4_0    32     32     4    -8    -              Q8_0    32     32     8  -128    -
    Q4_1    32     32     4     0    m              Q4_K    32    256     4     0    -dmin * m
    Q5_0    32     32     5   -16    -              Q5_K    32    256     5     0    -dmin * m
    Q5_1    32     32     5     0    m              Q6_K    16    256     6   -32    -
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import Q4_K, quantize
from torch import nn


@dataclass(frozen=True)
class BlockFormat:
    name: str
    group: int  # inputs per scale
    block: int  # inputs per stored float16 d (and dm)
    bits: int  # of the unsigned code
    bias: int  # value = code + bias
    offset: bool  # a per-group offset dm * m


FORMATS: dict[T, BlockFormat] = {
    T.Q4_0: BlockFormat("Q4_0", 32, 32, 4, -8, False),
    T.Q4_1: BlockFormat("Q4_1", 32, 32, 4, 0, True),
    T.Q5_0: BlockFormat("Q5_0", 32, 32, 5, -16, False),
    T.Q5_1: BlockFormat("Q5_1", 32, 32, 5, 0, True),
    T.Q8_0: BlockFormat("Q8_0", 32, 32, 8, -128, False),
    T.Q4_K: BlockFormat("Q4_K", 32, 256, 4, 0, True),
    T.Q5_K: BlockFormat("Q5_K", 32, 256, 5, 0, True),
    T.Q6_K: BlockFormat("Q6_K", 16, 256, 6, -32, False),
}


@dataclass
class Codes:
    """One tensor's blocks unpacked: codes [N, K] uint8 (0 .. 2^bits - 1), d [N, K / block] float16, sc [N, K / group]
    int8, and for formats with an offset dm [N, K / block] float16 and m [N, K / group] uint8."""

    fmt: BlockFormat
    q: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    dm: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def scales(self) -> torch.Tensor:  # [N, K / group] float32, exact
        return self.d.float().repeat_interleave(self.fmt.block // self.fmt.group, 1) * self.sc.float()

    def offsets(self) -> torch.Tensor | None:  # [N, K / group] float32, exact
        if self.dm is None or self.m is None:
            return None
        return self.dm.float().repeat_interleave(self.fmt.block // self.fmt.group, 1) * self.m.float()

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: gguf's numbers bit for bit (scale * value, then + offset, as gguf orders them)."""
        N, K = self.q.shape
        g = self.fmt.group
        w = self.scales()[..., None] * (self.q.view(N, K // g, g).float() + self.fmt.bias)
        offsets = self.offsets()
        if offsets is not None:
            w = w + offsets[..., None]
        return w.view(N, K)


DEQUANTIZE_ROWS = 8192


@dataclass
class QuantizedTensor:
    """A 2-D GGUF tensor kept as the file's bytes: raw [N, bytes per row] uint8, logical shape (N, K)."""

    raw: torch.Tensor
    qtype: T
    shape: tuple[int, int]

    @property
    def fmt(self) -> BlockFormat:
        return FORMATS[self.qtype]

    def rows(self, n: int) -> QuantizedTensor:
        return QuantizedTensor(self.raw[:n].clone(), self.qtype, (n, self.shape[1]))

    def rows_between(self, start: int, end: int) -> QuantizedTensor:  # a view
        end = min(end, self.shape[0])
        return QuantizedTensor(self.raw[start:end], self.qtype, (end - start, self.shape[1]))

    def codes(self) -> Codes:
        return decode(self.raw, self.qtype, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """gguf's float32 numbers, cast to `dtype`; DEQUANTIZE_ROWS rows at a time, so a 151936-row head does not
        need several float32 copies of itself at once."""
        out = torch.empty(self.shape, dtype=dtype)
        for r in range(0, self.shape[0], DEQUANTIZE_ROWS):
            out[r:r + DEQUANTIZE_ROWS] = self.rows_between(r, r + DEQUANTIZE_ROWS).codes().dequantize()
        return out

    def requantized(self, qtype: T) -> QuantizedTensor:
        """The same tensor re-quantized to `qtype` by gguf's own quantizer (from its float32 numbers),
        DEQUANTIZE_ROWS rows at a time."""
        parts = [quantize(self.rows_between(r, r + DEQUANTIZE_ROWS).codes().dequantize().numpy(), qtype)
                 for r in range(0, self.shape[0], DEQUANTIZE_ROWS)]
        return QuantizedTensor(torch.from_numpy(np.concatenate(parts)), qtype, self.shape)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` (any shape) -> [*ids.shape, K]: an embedding read from the blocks."""
        flat = ids.reshape(-1).to(self.raw.device)
        rows = decode(self.raw[flat].cpu(), self.qtype, (flat.numel(), self.shape[1])).dequantize()
        return rows.view(*ids.shape, self.shape[1])


def random_tensor(qtype: T, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> QuantizedTensor:
    """Random blocks (every code and sub-scale bit pattern) with float16 d, and m or dmin, drawn so that weights are
    about `scale` in size: for timing kernels (`specdecode doctor`) and tests."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)

    def f16(spread: float, positive: bool = False) -> np.ndarray:
        v = rng.standard_normal((raw.shape[0], 1)) * spread
        return (np.abs(v) if positive else v).astype(np.float16).view(np.uint8)

    if block == 32:  # d (codes up to 2^bits), then Q4_1 / Q5_1's m
        raw[:, 0:2] = f16(scale / 8)
        if qtype in (T.Q4_1, T.Q5_1):
            raw[:, 2:4] = f16(scale)
    elif qtype in (T.Q4_K, T.Q5_K):  # d, dmin, then 6-bit sub-scales and mins
        raw[:, 0:2], raw[:, 2:4] = f16(scale / 256, positive=True), f16(scale / 64, positive=True)
    else:  # Q6_K: int8 sub-scales, then d last
        raw[:, 208:210] = f16(scale / 1024)
    return QuantizedTensor(torch.from_numpy(raw.reshape(rows, -1)), qtype, (rows, cols))


def supported(qtype: T) -> bool:
    return qtype in FORMATS


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack tensors of one type along their rows (q, k and v into one qkv layer)."""
    if len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("only tensors of one block type and width are stacked")
    raw = torch.cat([p.raw for p in parts])
    return QuantizedTensor(raw, parts[0].qtype, (raw.shape[0], parts[0].shape[1]))


def decode(raw: torch.Tensor, qtype: T, shape: tuple[int, int]) -> Codes:
    """The blocks of raw [N, bytes per row] uint8 -> Codes (the same unpacking as gguf's dequantizers)."""
    fmt = FORMATS[qtype]
    N, K = shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    b = raw.contiguous().numpy().reshape(N * K // block, type_size)
    n = b.shape[0]
    ones = np.ones((n, block // fmt.group), np.int8)
    dm = m = None
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        d, rest = b[:, :2], b[:, 2:]
        if qtype in (T.Q4_1, T.Q5_1):
            dm, rest = rest[:, :2], rest[:, 2:]
            m = ones.view(np.uint8)
        if qtype in (T.Q5_0, T.Q5_1):
            qh = np.ascontiguousarray(rest[:, :4]).view(np.uint32) >> np.arange(32, dtype=np.uint32)
            rest = rest[:, 4:]
            high = (qh & 1).astype(np.uint8) << 4
        else:
            high = np.zeros((n, 32), np.uint8)
        low = (rest.reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F
        q, sc = low.reshape(n, 32) | high, ones
    elif qtype == T.Q8_0:
        d, q, sc = b[:, :2], (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), ones
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin, scales, rest = b[:, :2], b[:, 2:4], b[:, 4:16], b[:, 16:]
        sc8, m = Q4_K.get_scale_min(np.ascontiguousarray(scales))
        sc = sc8.astype(np.int8)
        dm = (np.ascontiguousarray(dmin).view(np.float16) * np.float16(-1)).view(np.uint8)  # exact negation
        if qtype == T.Q5_K:
            qh, rest = rest[:, :32], rest[:, 32:]
            high = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4
        else:
            high = np.zeros((n, 8, 32), np.uint8)
        low = (rest.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        q = low.reshape(n, 8, 32) | high
    elif qtype == T.Q6_K:
        ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:]
        low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q, sc = low.reshape(n, 256) | (high.reshape(n, 256) << 4), scales.view(np.int8)
    else:
        raise ValueError(f"no block format for {qtype.name}")

    def t(a: np.ndarray, cols: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(N, cols)

    return Codes(fmt, t(q, K), t(d, 2 * K // block).view(torch.float16), t(sc, K // fmt.group),
                 None if dm is None else t(dm, 2 * K // block).view(torch.float16),
                 None if m is None else t(m, K // fmt.group))


class BlockEmbedding(nn.Module):
    """An embedding kept as a GGUF tensor's blocks: a lookup decodes its rows (gguf's float32 numbers), then casts them
    to `dtype`, so the table costs the file's bytes instead of a dense copy."""

    raw: torch.Tensor  # buffers (register_buffer)
    qtype: torch.Tensor
    width: torch.Tensor

    def __init__(self, tensor: QuantizedTensor, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.register_buffer("raw", tensor.raw)  # stays on the CPU: decoded there
        self.register_buffer("qtype", torch.tensor(int(tensor.qtype)))
        self.register_buffer("width", torch.tensor(tensor.shape[1]))
        self.dtype = dtype
        self.device = device or torch.device("cpu")  # where the rows go

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | None = None) -> BlockEmbedding:
        return cls(QuantizedTensor(tensors["raw"], T(int(tensors["qtype"])),
                                   (tensors["raw"].shape[0], int(tensors["width"]))), dtype, device)

    @property
    def tensor(self) -> QuantizedTensor:
        return QuantizedTensor(self.raw, T(int(self.qtype)), (self.raw.shape[0], int(self.width)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        return self.tensor.lookup(ids.cpu()).to(device=self.device, dtype=self.dtype)
