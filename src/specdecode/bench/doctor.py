"""`specdecode doctor`: what this CPU offers, how fast each linear kernel is here, and whether it is bit-exact.

The CPUs we run on differ (AVX2-only Zen 3, AVX-512 Zen 5, AMX Xeons) and so does the fastest kernel
(docs/kernels.md). The doctor measures: ms for k = 1..16 rows through one projection per (dtype, quant), the
invariance of each kernel, memory bandwidth and the resulting floor per model; and it says what the defaults
choose on this CPU and why (models/autotune.py).
"""

from __future__ import annotations

import time

import torch

from specdecode.bench.runtime import cpu_name
from specdecode.builder import VERIFY_WIDTH, native_kind
from specdecode.cpu import cpu_info
from specdecode.kernels import decode_ops
from specdecode.models.config import ModelConfig
from specdecode.models.autotune import cpu_class, draft_quant_choice, dtype_choice, fastest_quant, streamed_layers, \
    time_rows
from specdecode.models.linear import Linear, invariant_rows, kernel, kernel_available, kernels

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
KS = tuple(range(1, 17))


def configs() -> list[tuple[str, str]]:
    """(dtype, quant) pairs to time: dense in both dtypes, then every kernel (kernels()) in bf16, int8 in float32."""
    return [("float32", "none")] + [("bfloat16", kind) for kind in kernels()] + [("float32", "int8")]


def bytes_per_weight(quant: str) -> float | None:
    """What a decode step reads per weight of this quant (None: the dtype's size)."""
    return kernel(quant).bytes_per_weight()


def cpu_flags() -> list[str]:
    have = cpu_info()[1]
    return [f for f in FLAGS_OF_INTEREST if f in have]


def memory_bandwidth_gbs(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth of a sum over a buffer far larger than any cache (best of `repeats`)."""
    a = torch.ones(int(gigabytes * 2**30) // 4)
    a.sum()
    best = min(_timed(a.sum) for _ in range(repeats))
    return a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def kernel_curve(layers: list[Linear], ks=KS, repeats: int = 5) -> dict[int, float]:
    """Median ms of one matmul of k rows, for each k, with the weights streaming from memory as in decoding."""
    return {k: round(time_rows(layers, k, repeats), 3) for k in ks}


def row_invariant(layer: Linear, ks=KS) -> bool:
    """Row t of a k-row matmul equals the 1-row result, for every k and t (torch.equal)."""
    x = torch.randn(max(ks), layer.in_features, generator=torch.Generator().manual_seed(0)).to(layer.dtype)
    one = [layer._matmul(x[t:t + 1])[0] for t in range(max(ks))]
    return all(torch.equal(layer._matmul(x[:k])[t], one[t]) for k in ks for t in range(k))


def linear_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(weights of the blocks' linears, weights of the lm_head): what one decode step reads."""
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * (cfg.num_heads * cfg.head_dim) + 2 * d * kv + cfg.num_heads * cfg.head_dim * d \
        + 3 * d * cfg.intermediate_size
    return cfg.num_layers * per_layer, cfg.vocab_size * d


def floor_ms(cfg: ModelConfig, dtype: str, quant: str, bandwidth_gbs: float) -> float:
    """ms per token if decoding only streamed the weights at the measured bandwidth (the lm_head as a target's:
    dense, or int8 beside int4-amx blocks)."""
    from specdecode.builder import target_head_quant

    blocks, head = linear_weights(cfg)
    dense = 4.0 if dtype == "float32" else 2.0
    head_bytes = bytes_per_weight(target_head_quant(quant)) or dense
    return (blocks * (bytes_per_weight(quant) or dense) + head * head_bytes) / (bandwidth_gbs * 1e9) * 1e3


def diagnose(shape: tuple[int, int] = (8960, 1536), models: dict[str, ModelConfig] | None = None,
             repeats: int = 5) -> dict:
    """Everything `specdecode doctor` prints, as one JSON-able dict."""
    timed: list[dict] = []
    for dtype, quant in configs():
        if not kernel_available(quant):  # timing w4a8's pure-torch fallback would say nothing
            timed.append({"name": quant, "dtype": dtype, "quant": quant,
                          "error": f"unavailable here: it needs {kernel(quant).requires}"})
            continue
        try:
            layers = streamed_layers(getattr(torch, dtype), quant, shape)
            curve = kernel_curve(layers, repeats=repeats)
        except Exception as exc:  # noqa: BLE001  a kernel this torch build or CPU lacks, or a shape it refuses
            timed.append({"name": f"{quant}/{dtype}", "dtype": dtype, "quant": quant, "error": str(exc)[:200]})
            continue
        timed.append({"name": f"{layers[0].kernel_name()}/{dtype}", "dtype": dtype, "quant": quant,
                        "ms_by_k": curve, "flatness_8_over_1": round(curve[8] / curve[1], 2),
                        "bit_exact": row_invariant(layers[0]),
                        "by_construction": layers[0].row_invariant,  # then bit-exact mode need not pad
                        # sequences of 9 rows one matmul may hold and stay bit-exact (a server batch's group)
                        "invariant_sequences": invariant_rows(layers[0], 9, 8)})
        del layers
    bandwidth = memory_bandwidth_gbs()
    floors = {name: {f"{d}/{q}": round(floor_ms(cfg, d, q, bandwidth), 1) for d, q in configs()}
              for name, cfg in (models or {}).items()}
    # what the defaults pick: a bit-exact verify step has 9 rows, a draft step 1
    (target_dtype, dtype_why), (draft_dtype, _) = dtype_choice(VERIFY_WIDTH), dtype_choice(1)
    native = native_kind(target_dtype)
    # the default draft is a GGUF file: its own blocks where a native kernel runs them
    draft_quant, draft_why = draft_quant_choice(getattr(torch, draft_dtype), 1, native_kind(draft_dtype))
    return {"cpu": cpu_name(), "flags": cpu_flags(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "projection": list(shape), "kernels": timed, "bandwidth_gbs": round(bandwidth, 1),
            "floor_ms_per_token": floors, "decode_ops": decode_ops.extension() is not None,
            "cpu_class": cpu_class(),
            "chosen": {"why_dtype": dtype_why, "native": native,
                       "target": {"dtype": target_dtype, "quant": native or "none",
                                  "quant_auto": fastest_quant(getattr(torch, target_dtype), VERIFY_WIDTH)},
                       "draft": {"dtype": draft_dtype, "quant": draft_quant, "why_quant": draft_why}}}
