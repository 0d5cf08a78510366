"""Row-invariant RMSNorm, rotary attention with the KV-cache write, and SiLU * up, in C++ (`decode_ops.cpp`).

For decode and verify steps: one call per op instead of ~40 small PyTorch ops per layer, and every output row
computed by the same fixed sequence of operations whatever the number of rows, so these ops are bit-exact across
k by construction (PyTorch's attention matmuls are not: their reduction order depends on the row count).
CPUs with AVX-512 or AVX2 + FMA run it; elsewhere, or where the build fails, the decoder keeps its PyTorch ops.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from specdecode.kernels.build import build_for_cpu, cpu_extension


@cache
def extension() -> ModuleType | None:
    """The compiled ops where this CPU runs them (AVX-512, or AVX2 + FMA), else None: then the decoder uses PyTorch's
    ops."""
    return build_for_cpu({"avx2", "fma"}, cpu_extension)


HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)  # what rope_attention takes


def _ops() -> ModuleType:
    ext = extension()
    if ext is None:
        raise RuntimeError("the C++ decode ops do not run on this CPU; the decoder uses PyTorch's ops there")
    return ext


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] float32 or bfloat16 -> the same shape and dtype."""
    return _ops().rms_norm(x.contiguous(), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate then up) -> SiLU(gate) * up [..., I]."""
    return _ops().silu_mul(gate_up.contiguous())


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                   heads: int, kv_heads: int) -> torch.Tensor:
    """Rotary embedding of the new queries and keys, the new keys and values written to the cache at
    (rows[b], slots[b, t]), and each query's attention over the cache slots mask[b, t] marks.

    qkv: [B, T, (heads + 2 kv_heads) * hd]; cos, sin: [B, T, hd] float32; k_cache, v_cache: [batch, kv_heads,
    capacity, hd] (one layer's, written in place); rows: [B]; slots: [B, T]; mask: [B, T, K <= capacity] bool.
    Returns [B, T, heads * hd] in qkv's dtype."""
    return _ops().rope_attention(qkv.contiguous(), cos.contiguous(), sin.contiguous(), k_cache, v_cache,
                                      rows.contiguous(), slots.contiguous(), mask.contiguous(), heads, kv_heads)


def w4a8_layer(x: torch.Tensor, attn_norm: torch.Tensor, mlp_norm: torch.Tensor, eps: float, qkv: tuple,
               qkv_bias: torch.Tensor | None, o: tuple, gate_up: tuple, down: tuple, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """A decoder layer whose four linears are W4A8 (their `w4a8.Int4Weights`), in one C++ call (`layer.cpp`): the
    ops above and the linears in the order `decoder.Block` runs them, so the same bits without the interpreter
    between them. x [B, T, D] and the step's tensors must be contiguous (the C++ checks; nothing is copied here);
    the other arguments as `rms_norm` and `rope_attention` take them."""
    return _ops().w4a8_layer(x, attn_norm, mlp_norm, eps, qkv, qkv_bias, o, gate_up, down, cos, sin, k_cache,
                                  v_cache, rows, slots, mask, heads, kv_heads)


def gguf_layer(x: torch.Tensor, attn_norm: torch.Tensor, mlp_norm: torch.Tensor, eps: float, qkv: list,
               qkv_bias: torch.Tensor | None, o: list, gate_up: list, down: list, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The same layer, its four linears a GGUF file's blocks on gguf_int8's kernel (each its
    `GgufInt8Linear.layer_parts`)."""
    return _ops().gguf_layer(x, attn_norm, mlp_norm, eps, qkv, qkv_bias, o, gate_up, down, cos, sin, k_cache, v_cache,
                             rows, slots, mask, heads, kv_heads)
