"""W4A8: int4 weights x int8 activations, the arithmetic of llama.cpp's Q4_K x Q8_K, as a C++ extension.

torch's int4 kernel dequantizes to bf16 and grows with k (`specdecode doctor` times both), so a 9-row verify step
costs several plain steps. Integer dot
products (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`) are cheap enough that k <= 8 rows cost little more
than streaming the weights once. The layout and the exact arithmetic are in `w4a8.cpp`; `reference_mm`
computes the same float operations in the same order with torch, which the tests compare with
`torch.equal`, and which runs where the extension cannot be built.

Weights: int4 in blocks of 32 whose scales are int8 sub-scales of a float per super-block of 256 (as Q4_K), so
the AVX2 kernel applies the sub-scales in its integer sums and converts to float once per 256 inputs, against
activations quantized per super-block (as Q8_K). On AVX512-VNNI CPUs the same weights meet activations
quantized per block of 32 (as Q4_0 x Q8_0), with the blocks' scales as floats.

W8A8 (`w8a8_mm`) is the same kernel with one signed byte per weight (Q8_0-like), and W6A8 (`w6a8_mm`) the same
arithmetic on 6-bit weights (7 bits each with the scales): a w4a8 target's lm_head, which stays wider than its
blocks as llama.cpp's output layer does, and is row-invariant like them.

The extension (with the decode ops: `build.cpu_extension`) is compiled on first use with the machine's g++.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from types import ModuleType
from typing import NamedTuple, Union

import torch

from specdecode.kernels.build import cpu_extension
from specdecode.models.linear import Linear

BLOCK = 32  # inputs per weight scale (and per activation scale on the per-block arithmetic)
PAIR = 64  # two blocks: the unit the kernel packs and multiplies
PAIR6 = 48  # bytes of a pair of 6-bit weights
SUPER = 256  # inputs per super-block: one float scale D, and an int8 sub-scale per block of 32
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads and writes; others go through float32
# register position j of a pair holds element ELEMENT_OF[j]: lane j // 4 holds block (j // 4) % 2 (see w4a8.cpp)
ELEMENT_OF = torch.tensor([(j // 4 % 2) * BLOCK + (j // 8) * 4 + j % 4 for j in range(PAIR)])
POSITION_OF = torch.argsort(ELEMENT_OF)  # the inverse


class Int4Weights(NamedTuple):
    """int4 weights as the kernel takes them (S = super-blocks per row, Kp = width padded to 64)."""

    packed: torch.Tensor  # [N, Kp / 2] uint8: u = q + 8, two per byte in register order
    scale: torch.Tensor  # [N, Kp / 32] float32: each block's scale, d * sub; [N, 0] where nothing reads it
    d: torch.Tensor  # [N, S] float32
    sub: torch.Tensor  # [N, 8 S] int8
    corr: torch.Tensor  # [N, S] int32: 128 * sum over the super-block of sub * the block's sum of q

    def block_scales(self) -> torch.Tensor:
        """[N, Kp / 32] float32: `scale`, or the same products d * sub computed again where it is not kept."""
        if self.scale.shape[1]:
            return self.scale
        N, nb = self.packed.shape[0], self.packed.shape[1] * 2 // BLOCK
        return (self.d.unsqueeze(-1) * self.sub.float().view(N, -1, 8)).view(N, -1)[:, :nb].contiguous()


class Int8Weights(NamedTuple):
    packed: torch.Tensor  # [N, Kp] int8 in register order
    scale: torch.Tensor  # [N, Kp / 32] float32

    def block_scales(self) -> torch.Tensor:
        return self.scale


class Int6Weights(NamedTuple):
    """6-bit weights (q in -31..31) with a float32 scale per block of 32: the W8A8 arithmetic on 7 bits per weight
    instead of 9 (a w4a8 target's lm_head)."""

    packed: torch.Tensor  # [N, Kp * 3 / 4] uint8: per pair, 32 bytes of low nibbles of u = q + 32, 16 of high bits
    scale: torch.Tensor  # [N, Kp / 32] float32

    def block_scales(self) -> torch.Tensor:
        return self.scale

    def as_int8(self) -> Int8Weights:
        """The same q as int8 weights: what the kernel multiplies, for the reference and for dequantizing."""
        N = self.packed.shape[0]
        pairs = self.packed.view(N, -1, PAIR6)
        lo, hi = pairs[..., :32], pairs[..., 32:]
        nibbles = torch.cat([lo & 0x0F, lo >> 4], dim=-1)  # [N, pairs, 64] positions 0..63
        high = torch.cat([(hi >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)  # positions b + 16 i
        q = (nibbles | (high << 4)).to(torch.int8) - 32
        return Int8Weights(q.reshape(N, -1).contiguous(), self.scale)


Weights = Union[Int4Weights, Int6Weights, Int8Weights]
AnyWeights = Weights  # the name `Weights` means a layer's own class inside W4A8Linear
QUANTIZE_ROWS = 4096
KERNEL_OF = {Int4Weights: "w4a8_mm", Int6Weights: "w6a8_mm", Int8Weights: "w8a8_mm"}  # the extension's function


def extension(isa_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled kernel, or None (with a warning) where it cannot be built: `w4a8_mm` then runs the reference.
    isa_flags: extra compiler flags, e.g. ("-mno-avx512f",) builds the AVX2 path on an AVX-512 CPU (tests)."""
    return cpu_extension(isa_flags)


def padded_width(in_features: int) -> int:
    return -(-in_features // PAIR) * PAIR


def _super_blocks(width: int) -> int:
    return -(-width // SUPER)


def uses_super_blocks() -> bool:
    """Whether int4 weights meet the super-block arithmetic here (AVX2, scalar, or the reference where the kernel
    cannot be built), which reads d, sub and corr; the AVX512-VNNI path reads the float block scales instead."""
    ext = extension()
    return ext is None or ext.lanes(4) == 8


def for_this_kernel(weights: Int4Weights) -> Int4Weights:
    """Keep the float block scales only where the kernel reads them: elsewhere they are 0.125 bytes per weight of
    memory (160 MB for the 1.5B) that nothing reads."""
    if uses_super_blocks():
        return weights._replace(scale=weights.scale.new_empty(weights.scale.shape[0], 0))
    return weights._replace(scale=weights.block_scales())


def quantize_by_rows(pack: Callable[[torch.Tensor], AnyWeights], weight: torch.Tensor) -> AnyWeights:
    """`pack` on QUANTIZE_ROWS rows at a time (every field of the weights is per row): the float32 temporaries of a
    151936-row lm_head stay a few MiB, not gigabytes."""
    parts = [pack(weight[r:r + QUANTIZE_ROWS]) for r in range(0, weight.shape[0], QUANTIZE_ROWS)]
    if len(parts) == 1:
        return parts[0]
    joined: list[torch.Tensor] = [torch.cat(fields) for fields in zip(*parts)]
    return type(parts[0])(*joined)


def quantize_weight(weight: torch.Tensor) -> Int4Weights:
    """[N, K] -> Int4Weights; K is padded to 64 with zeros.

    Per block of 32, the ideal scale maps the element of largest magnitude to -8 (as Q4_0, so the whole range
    -8..7 is used). Per super-block of 256, d = the largest |ideal scale| / 127, and each block's scale is
    d * sub with sub an int8: of round(ideal / d) and its two neighbours, the one whose q = round(w / scale),
    clamped to -8..7, is closest to the weights (as Q4_K's integer sub-scales, so the AVX2 kernel sums 8 blocks
    in integers).
    """
    N, K = weight.shape
    Kp = padded_width(K)
    S = _super_blocks(Kp)
    w = torch.nn.functional.pad(weight.float(), (0, S * SUPER - K)).view(N, S, 8, BLOCK)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)  # [N, S, 8], signed
    ideal = extreme / -8
    d = ideal.abs().amax(-1) / 127  # [N, S]
    d_ = d.unsqueeze(-1)
    near = torch.where(d_ > 0, torch.round(ideal / d_), 0)
    best_q = best_sub = best_err = None
    for sub in (near, near - 1, near + 1):
        sub = sub.clamp(-127, 127)
        scale = (d_ * sub).unsqueeze(-1)  # float32, as the kernel's per-block scale
        q = torch.where(scale != 0, torch.round(w / scale), 0).clamp(-8, 7)
        err = ((q * scale - w) ** 2).sum(-1)  # [N, S, 8]
        if best_q is None or best_sub is None or best_err is None:  # the first candidate
            best_q, best_sub, best_err = q, sub, err
        else:
            better = err < best_err
            best_q = torch.where(better.unsqueeze(-1), q, best_q)
            best_sub, best_err = torch.where(better, sub, best_sub), torch.minimum(err, best_err)
    assert best_q is not None and best_sub is not None  # set by the loop's first candidate
    corr = 128 * (best_sub.long() * best_q.sum(-1).long()).sum(-1)  # [N, S], exact (|.| < 2^26)
    q = best_q.view(N, -1)[:, :Kp]
    u = (q + 8).to(torch.uint8).view(N, -1, PAIR)[..., ELEMENT_OF]  # [N, pairs, 64] in register order
    packed = (u[..., :32] | (u[..., 32:] << 4)).reshape(N, -1).contiguous()
    sub = best_sub.view(N, -1).to(torch.int8).contiguous()
    weights = Int4Weights(packed, d.new_empty(N, 0), d.contiguous(), sub, corr.to(torch.int32).contiguous())
    return weights._replace(scale=weights.block_scales())


def quantize_weight8(weight: torch.Tensor) -> Int8Weights:
    """[N, K] -> Int8Weights: per block of 32, scale = amax / 127, q = round(w / scale) in -127..127, stored in
    register order per pair of blocks."""
    N, K = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, padded_width(K) - K)).view(N, -1, BLOCK)
    scale = w.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale != 0, torch.round(w / scale), 0).clamp(-127, 127)
    packed = q.to(torch.int8).view(N, -1, PAIR)[..., ELEMENT_OF].reshape(N, -1).contiguous()
    return Int8Weights(packed, scale.view(N, -1).contiguous())


def quantize_weight6(weight: torch.Tensor) -> Int6Weights:
    """[N, K] -> Int6Weights: per block of 32, scale = amax / 31, q = round(w / scale) in -31..31, in register order
    per pair of blocks, u = q + 32 split into the low nibbles (as the int4 layout) and the two high bits."""
    N, K = weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, padded_width(K) - K)).view(N, -1, BLOCK)
    scale = w.abs().amax(-1, keepdim=True) / 31
    q = torch.where(scale != 0, torch.round(w / scale), 0).clamp(-31, 31)
    u = (q + 32).to(torch.uint8).view(N, -1, PAIR)[..., ELEMENT_OF]  # [N, pairs, 64] in register order
    lo = (u[..., :32] & 0x0F) | ((u[..., 32:] & 0x0F) << 4)
    h = (u >> 4).view(N, -1, 4, 16)  # positions 16 i + b
    hi = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
    return Int6Weights(torch.cat([lo, hi], dim=-1).reshape(N, -1).contiguous(), scale.view(N, -1).contiguous())


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


def dequantize(weights: Weights, in_features: int) -> torch.Tensor:
    """int4, 6-bit or int8 packed weights -> [N, in_features] float32."""
    if isinstance(weights, Int6Weights):
        weights = weights.as_int8()
    packed = weights.packed
    q = unpack(packed).float().view(packed.shape[0], -1, BLOCK) - _offset(packed)
    return (q * weights.block_scales().unsqueeze(-1)).reshape(packed.shape[0], -1)[:, :in_features]


def reference_quantize_activations(x: torch.Tensor, padded: int, span: int = BLOCK
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, K] float32 -> (q [k, Kp] int8, scale [k, ceil(Kp / span)] float32): per span of inputs (32: a block,
    256: a super-block; the last may be shorter), scale = amax / 127, q = round(x / scale)."""
    k = x.shape[0]
    spans = -(-padded // span)
    xb = torch.nn.functional.pad(x.float(), (0, spans * span - x.shape[1])).view(k, spans, span)
    scale = xb.abs().amax(-1) / 127
    q = torch.where(scale.unsqueeze(-1) > 0, torch.round(xb / scale.unsqueeze(-1)), 0)
    q = q.nan_to_num(0.0, 0.0, 0.0).clamp(-127, 127)  # inf / inf; a denormal scale
    return q.to(torch.int8).view(k, spans * span)[:, :padded].contiguous(), scale


def reference_mm(x: torch.Tensor, weights: Weights, lanes: int = 8, rows_per_chunk: int = 256) -> torch.Tensor:
    """What the C++ kernel computes, operation for operation (see w4a8.cpp), for int4 or int8 weights, in `lanes`
    float lanes (the extension's `lanes(bits)`: 16 for int4 on its AVX512-VNNI path, where int4 takes the
    per-block arithmetic; 8 otherwise, where int4 takes the super-block one): [k, K] float32 -> [k, N] float32.
    Output rows are computed `rows_per_chunk` at a time to bound the integer products' memory. 6-bit weights are
    int8 ones to the arithmetic."""
    if isinstance(weights, Int6Weights):
        weights = weights.as_int8()
    _check_width(x, weights.packed)
    super_blocks = isinstance(weights, Int4Weights) and lanes == 8
    Kp = _padded(weights.packed)
    activations = reference_quantize_activations(x, Kp, SUPER if super_blocks else BLOCK)  # once for all rows
    out = []
    for rows in range(0, weights.packed.shape[0], rows_per_chunk):
        part = type(weights)(*(t[rows:rows + rows_per_chunk] for t in weights))
        acc = (_super_block_lanes(*activations, part, lanes) if super_blocks and isinstance(part, Int4Weights)
               else _block_lanes(*activations, part, lanes))
        total = acc[..., 0]
        for i in range(1, lanes):
            total = total + acc[..., i]
        out.append(total)
    return torch.cat(out, dim=1)


def _block_lanes(q: torch.Tensor, ascale: torch.Tensor, weights: Weights, lanes: int) -> torch.Tensor:
    """The per-block arithmetic's float lanes [k, n, lanes] after the last pair, for activations q [k, Kp] with
    a scale per block of 32."""
    k, n, Kp = q.shape[0], weights.packed.shape[0], _padded(weights.packed)
    pairs = Kp // PAIR
    qa = q.view(k, pairs, PAIR)[..., ELEMENT_OF].to(torch.int32).view(k, 1, pairs, 16, 4)
    block_of_lane = torch.arange(lanes) % 2
    a_s = ascale.view(k, 1, pairs, 2)[..., block_of_lane]  # [k, 1, pairs, lanes]
    u = _registers(weights.packed).to(torch.int32).view(1, n, pairs, 16, 4)
    lanes16 = (u * qa).sum(-1) - _offset(weights.packed) * qa.sum(-1)  # [k, n, pairs, 16], exact integers
    lane = (lanes16 if lanes == 16 else lanes16[..., :8] + lanes16[..., 8:]).float()  # 8: positions j, j + 32
    ws = weights.block_scales().view(1, n, pairs, 2)[..., block_of_lane]  # [1, n, pairs, lanes]
    acc = torch.zeros(k, n, lanes, dtype=torch.float32)
    for p in range(pairs):
        acc = acc + lane[:, :, p] * (ws[:, :, p] * a_s[:, :, p])
    return acc


def _super_block_lanes(q: torch.Tensor, ascale: torch.Tensor, weights: Int4Weights, lanes: int) -> torch.Tensor:
    """The super-block arithmetic's 8 float lanes [k, n, 8] after the last super-block, for activations q [k, Kp]
    with a scale per super-block (ascale [k, S])."""
    k, n, Kp = q.shape[0], weights.packed.shape[0], _padded(weights.packed)
    pairs, S = Kp // PAIR, _super_blocks(Kp)
    qa = (q.view(k, pairs, PAIR)[..., ELEMENT_OF].to(torch.int32) + 128).view(k, 1, pairs, 16, 4)
    qw = _registers(weights.packed).to(torch.int32).view(1, n, pairs, 16, 4) - 8
    lanes16 = (qw * qa).sum(-1)  # [k, n, pairs, 16]
    per_pair = lanes16[..., :8] + lanes16[..., 8:]  # lane l: positions 4l..4l+3 and 32+4l..32+4l+3
    sub = weights.sub.to(torch.int32).view(1, n, -1, 2)[:, :, :pairs, torch.arange(8) % 2]  # [1, n, pairs, 8]
    scaled = torch.nn.functional.pad(per_pair * sub, (0, 0, 0, S * 4 - pairs))  # [k, n, 4 S, 8]
    lane = scaled.view(k, n, S, 4, 8).sum(3)  # [k, n, S, 8], exact integers
    lane[..., 0] -= weights.corr.view(1, n, S)
    lane = lane.float()
    acc = torch.zeros(k, n, lanes, dtype=torch.float32)
    for s in range(S):
        acc = acc + lane[:, :, s] * (weights.d[:, s].view(1, n, 1) * ascale[:, s].view(k, 1, 1))
    return acc


def _padded(packed: torch.Tensor) -> int:
    return packed.shape[1] * (1 if packed.dtype == torch.int8 else 2)


def _check_width(x: torch.Tensor, packed: torch.Tensor) -> None:
    Kp = _padded(packed)
    if not Kp - PAIR < x.shape[1] <= Kp:
        raise ValueError(f"inputs of width {x.shape[1]} do not fit weights packed for width {Kp}")


def w4a8_mm(x: torch.Tensor, weights: Weights, bias: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [..., K] times the packed int4 or int8 weights, plus bias [N], -> [..., N] in dtype: the float32 sum rounded
    once. The kernel takes float32 or bfloat16 in and out, the bias and any leading shape, so a layer is one call
    from Python."""
    ext = extension()
    if ext is None:
        y = reference_mm(x.reshape(-1, x.shape[-1]).float(), weights)
        return (y if bias is None else y + bias.float()).to(dtype).view(*x.shape[:-1], y.shape[-1])
    kernel = getattr(ext, KERNEL_OF[type(weights)])
    if x.dtype in KERNEL_DTYPES and dtype in KERNEL_DTYPES:
        return kernel(x, *weights, bias, dtype)
    return kernel(x.float(), *weights, bias).to(dtype)  # e.g. float16: the float32 sum plus bias, cast here


class W4A8Linear(Linear):
    """int4 weights (symmetric, blocks of 32 with int8 sub-scales of a float per 256) x int8 activations (per
    token): integer dot products in our C++ kernel, so that a verify step of k <= 8 rows costs about what one row
    does."""

    kind = "w4a8"
    help = "our C++ int4 x int8 kernel, row-invariant on AVX2 and AVX-512; the lm_head then w6a8"
    bits = 4
    requires = "a CPU with AVX2 and FMA (AVX-512 VNNI faster) and a C++ compiler"
    head = "w6a8"
    pack: staticmethod[[torch.Tensor], AnyWeights] = staticmethod(quantize_weight)
    Weights: type[AnyWeights] = Int4Weights
    _take = staticmethod(itemgetter(*Weights._fields))  # the buffers (or saved tensors) that make its Weights

    @property
    def row_invariant(self) -> bool:  # the C++ kernel is; its pure-torch stand-in is not promised to be
        return extension() is not None

    def __init__(self, weights: AnyWeights, in_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(weights.packed.shape[0], in_features, bias, dtype)
        if isinstance(weights, Int4Weights):  # the float block scales only where this CPU's kernel reads them
            weights = for_this_kernel(weights)
        for name, tensor in weights._asdict().items():  # see Int4Weights / Int8Weights
            self.register_buffer(name, tensor)
        self.register_buffer("width", torch.tensor(in_features))  # the padding hides it: kept to rebuild the layer

    @property
    def weights(self) -> AnyWeights:  # read at every call: a few hundred times per step
        return self.Weights._make(self._take(self._buffers))

    @classmethod
    def available(cls) -> bool:
        return extension() is not None

    @classmethod
    def bytes_per_weight(cls) -> float:
        if cls.Weights is Int4Weights and uses_super_blocks():
            return 0.5 + 16 / 256  # a float, an int32 and 8 int8 sub-scales per 256
        return cls.bits / 8 + 4 / BLOCK  # + a float scale per block

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 0) -> W4A8Linear:
        return cls(quantize_by_rows(cls.pack, weight), weight.shape[1], bias, weight.dtype)

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> W4A8Linear:
        return cls(cls.Weights._make(cls._take(tensors)), int(tensors["width"]), tensors.get("bias"), dtype)

    def kernel_name(self) -> str:
        ext = extension()
        return f"{type(self).__name__}({ext.simd_path()})" if ext is not None else type(self).__name__

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.weights, self.in_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return w4a8_mm(rows, self.weights, dtype=rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the shape, bias and cast in the kernel: one call per layer
        return w4a8_mm(x, self.weights, self.bias, x.dtype)


class W8A8Linear(W4A8Linear):
    """int8 weights (symmetric, blocks of 32, as llama.cpp's Q8_0) x int8 activations in the same kernel: wider than
    w4a8 blocks and row-invariant like them."""

    kind = "w8a8"
    help = "int8 weights x int8, same kernel"
    bits = 8
    pack = staticmethod(quantize_weight8)
    Weights = Int8Weights
    _take = staticmethod(itemgetter(*Weights._fields))


class W6A8Linear(W4A8Linear):
    """6-bit weights (symmetric, blocks of 32) x int8 activations, W8A8's arithmetic on 7 bits per weight instead of
    9: a w4a8 target's lm_head, wider than its blocks (as llama.cpp's Q4_K_M keeps a 6-bit output layer)."""

    kind = "w6a8"
    help = "6-bit weights x int8, same kernel"
    bits = 6
    pack = staticmethod(quantize_weight6)
    Weights = Int6Weights
    _take = staticmethod(itemgetter(*Weights._fields))
