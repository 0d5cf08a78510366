"""W4A8: int4 weights x int8 activations, the arithmetic of llama.cpp's Q4_0 x Q8_0, as a C++ extension.

torch's int4 kernel dequantizes to bf16 and grows with k (0.69 ms for 1 row of the 1.5B's 8960x1536
projection, 2.27 ms for 9 on our Xeon), so a 9-row verify step costs three plain steps. Integer dot
products (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`) are cheap enough that k <= 8 rows cost little more
than streaming the weights once. The layout and the exact arithmetic are in `w4a8.cpp`; `reference_mm`
computes the same float operations in the same order with torch, which the tests compare with
`torch.equal`, and which runs where the extension cannot be built.

W8A8 (`w8a8_mm`) is the same kernel with one signed byte per weight (Q8_0-like): a w4a8 target's lm_head, which
stays wider than its blocks as llama.cpp's output layer does, and is row-invariant like them.

The extension is compiled on first use with the machine's g++ (kernels/build.py, about 25 s on our Xeon).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from specdecode.kernels.build import build

BLOCK = 32  # inputs per weight scale and per activation scale
PAIR = 64  # two blocks: the unit the kernel packs and multiplies
SOURCE = Path(__file__).with_name("w4a8.cpp")
# register position j of a pair holds element ELEMENT_OF[j]: lane j // 4 holds block (j // 4) % 2 (see w4a8.cpp)
ELEMENT_OF = torch.tensor([(j // 4 % 2) * BLOCK + (j // 8) * 4 + j % 4 for j in range(PAIR)])
POSITION_OF = torch.argsort(ELEMENT_OF)  # the inverse


@cache
def extension(isa_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled kernel, or None (with a warning) where it cannot be built: `w4a8_mm` then runs the reference.
    isa_flags: extra compiler flags, e.g. ("-mno-avx512f",) builds the AVX2 path on an AVX-512 CPU (tests)."""
    return build(SOURCE, isa_flags)


def padded_width(in_features: int) -> int:
    return -(-in_features // PAIR) * PAIR


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed [N, Kp / 2] uint8, scale [N, Kp / 32] float32), Kp = K padded to 64 with zeros.

    Per block of 32: the element of largest magnitude m maps to -8 (scale = m / -8), as in Q4_0, so
    the whole range -8..7 is used; q = round(w / scale), stored as q + 8, two per byte in register order.
    """
    N, K = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, padded_width(K) - K)).view(N, -1, BLOCK)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # [N, nb, 1], signed
    scale = extreme / -8
    q = torch.where(scale != 0, torch.round(w / scale), 0).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).view(N, -1, PAIR)[..., ELEMENT_OF]  # [N, pairs, 64] in register order
    packed = (u[..., :32] | (u[..., 32:] << 4)).reshape(N, -1).contiguous()
    return packed, scale.view(N, -1).contiguous()


def quantize_weight8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed [N, Kp] int8, scale [N, Kp / 32] float32): per block of 32, scale = amax / 127,
    q = round(w / scale) in -127..127, stored in register order per pair of blocks."""
    N, K = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, padded_width(K) - K)).view(N, -1, BLOCK)
    scale = w.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale != 0, torch.round(w / scale), 0).clamp(-127, 127)
    packed = q.to(torch.int8).view(N, -1, PAIR)[..., ELEMENT_OF].reshape(N, -1).contiguous()
    return packed, scale.view(N, -1).contiguous()


def _registers(packed: torch.Tensor) -> torch.Tensor:
    """Packed weights in register order, as the integers the kernel multiplies: [N, pairs, 64].
    int4 ([N, Kp / 2] uint8): u = q + 8; int8 ([N, Kp] int8): q."""
    if packed.dtype == torch.int8:
        return packed.view(packed.shape[0], -1, PAIR)
    p = packed.view(packed.shape[0], -1, 32)
    return torch.cat([p & 0x0F, p >> 4], dim=-1)


def _offset(packed: torch.Tensor) -> int:
    """What the register values hold above q: 8 for int4 (u = q + 8), 0 for int8."""
    return 0 if packed.dtype == torch.int8 else 8


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The register values of `_registers` with the elements in order: [N, Kp]."""
    return _registers(packed)[..., POSITION_OF].reshape(packed.shape[0], -1)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """int4 or int8 packed weights -> [N, in_features] float32."""
    q = unpack(packed).float().view(packed.shape[0], -1, BLOCK) - _offset(packed)
    return (q * scale.unsqueeze(-1)).reshape(packed.shape[0], -1)[:, :in_features]


def reference_quantize_activations(x: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, K] float32 -> (q [k, Kp] int8, scale [k, Kp / 32] float32): scale = amax / 127, q = round(x / scale)."""
    k = x.shape[0]
    xb = torch.nn.functional.pad(x.float(), (0, padded - x.shape[1])).view(k, -1, BLOCK)
    scale = xb.abs().amax(-1) / 127
    q = torch.where(scale.unsqueeze(-1) > 0, torch.round(xb / scale.unsqueeze(-1)), 0)
    q = q.nan_to_num(0.0, 0.0, 0.0).clamp(-127, 127)  # inf / inf; a denormal scale
    return q.to(torch.int8).view(k, padded), scale


def reference_mm(x: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor, lanes: int = 8,
                 rows_per_chunk: int = 256) -> torch.Tensor:
    """What the C++ kernel computes, operation for operation (see w4a8.cpp), for int4 (uint8 `packed`) or int8
    weights, in `lanes` float lanes (the extension's `lanes(bits)`: 16 on its AVX512-VNNI int4 path, else 8):
    [k, K] float32 -> [k, N] float32. Output rows are computed `rows_per_chunk` at a time to bound the integer
    products' memory."""
    _check_width(x, packed)
    k, N, Kp = x.shape[0], packed.shape[0], _padded(packed)
    pairs = Kp // PAIR
    q, ascale = reference_quantize_activations(x, Kp)
    qa = q.view(k, pairs, PAIR)[..., ELEMENT_OF].to(torch.int32).view(k, 1, pairs, 16, 4)
    block_of_lane = torch.arange(lanes) % 2
    a_s = ascale.view(k, 1, pairs, 2)[..., block_of_lane]  # [k, 1, pairs, lanes]
    out = []
    for rows in range(0, N, rows_per_chunk):
        n = min(rows_per_chunk, N - rows)
        u = _registers(packed[rows:rows + n]).to(torch.int32).view(1, n, pairs, 16, 4)
        lanes16 = (u * qa).sum(-1) - _offset(packed) * qa.sum(-1)  # [k, n, pairs, 16], exact integers
        lane = (lanes16 if lanes == 16 else lanes16[..., :8] + lanes16[..., 8:]).float()  # 8: positions j, j + 32
        ws = wscale[rows:rows + n].view(1, n, pairs, 2)[..., block_of_lane]  # [1, n, pairs, lanes]
        acc = torch.zeros(k, n, lanes, dtype=torch.float32)
        for p in range(pairs):
            acc = acc + lane[:, :, p] * (ws[:, :, p] * a_s[:, :, p])
        total = acc[..., 0]
        for i in range(1, lanes):
            total = total + acc[..., i]
        out.append(total)
    return torch.cat(out, dim=1)


def _padded(packed: torch.Tensor) -> int:
    return packed.shape[1] * (1 if packed.dtype == torch.int8 else 2)


def _check_width(x: torch.Tensor, packed: torch.Tensor) -> None:
    Kp = _padded(packed)
    if not Kp - PAIR < x.shape[1] <= Kp:
        raise ValueError(f"inputs of width {x.shape[1]} do not fit weights packed for width {Kp}")


def w4a8_mm(x: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """x [k, K] (any float dtype) times the packed int4 (uint8) or int8 weights -> [k, N] float32."""
    ext = extension()
    x = x.float().contiguous()
    if ext is None:
        return reference_mm(x, packed, wscale)
    return (ext.w8a8_mm if packed.dtype == torch.int8 else ext.w4a8_mm)(x, packed, wscale)
