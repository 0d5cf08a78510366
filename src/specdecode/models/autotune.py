"""Choose the dtype and the kernels for this CPU: by its capabilities first, by measurement only where they do not
decide, and a measurement is cached only when its repeats agree.

The CPU classes (`cpu_class`): AMX (bf16 matmuls on tiles: bfloat16, and the GGUF blocks run natively), AVX-512
(with or without BF16 / VNNI: measured), AVX2 only (bf16 matmuls are emulated there: float32). Which quantized
kernel is fastest (`--quant auto`) is always measured (docs/kernels.md): on an AMX Xeon bf16 `W @ x.T` is flat up to
16 rows while torch's int4 kernel costs half as much for one row and three times as much for nine; on an AVX2-only
CPU torch's int8 kernel is slower than fp32. A measurement takes the fastest of ROUNDS rounds per candidate, and is
trusted when every pairing of rounds gives the same answer (the winner's slowest round beats every other
candidate's fastest); otherwise the machine was busy: the default (float32, no quantization) is used, so a busy
machine always gets the same answer, and nothing is cached (`specdecode doctor --retune` measures again).
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from specdecode.cpu import cpu_info
from specdecode.models.gguf_blocks import random_tensor
from specdecode.paths import cache_dir, write_atomic
from specdecode.models.linear import Linear, kernel, kernel_available, kernels, make_linear

SCHEMA = 3  # bump when what is measured changes: older cached answers are then ignored (3: trusted rounds)
MARGIN = 1.1  # a quantized kernel is chosen only if it is this much faster than the dense one
ROUNDS = 3  # measurements of every candidate; the fastest counts
STREAM_BYTES = 256 * 2**20  # each candidate cycles through this many bytes of weights: no cache can hold them
PROBE_SHAPE = (4864, 896)  # the 0.5B draft's MLP projection


def _cpu_key() -> str:
    name, flags = cpu_info()
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return f"{name}|{digest}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def _cache_file() -> Path:
    return cache_dir() / "autotune.json"


def streamed_layers(dtype: torch.dtype, quant: str, shape: tuple[int, int] = PROBE_SHAPE) -> list[Linear]:
    """Copies of one random `shape` projection, together STREAM_BYTES: cycling through them reads from memory.
    A native kind (`Linear.native`) gets random Q4_K blocks, the type of most of a Q4_K_M file's weights."""
    if kernel(quant).native:
        layer = kernel(quant).from_blocks([random_tensor(GGMLQuantizationType.Q4_K, *shape)], None, dtype)
    else:
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul(0.02).to(dtype)
        layer = make_linear(weight, None, quant)
    size = sum(b.numel() * b.element_size() for b in list(layer.buffers()) + list(layer.parameters()))
    return [layer] + [copy.deepcopy(layer) for _ in range(max(1, STREAM_BYTES // size) - 1)]


def time_rows(layers: list[Linear], rows: int, repeats: int = 5) -> float:
    """Median ms of one `rows`-row matmul, cycling through `layers` (one round of `_cached_choice`)."""
    x = torch.randn(rows, layers[0].in_features).to(layers[0].dtype)
    for lin in layers:  # warm-up
        lin._matmul(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for lin in layers:
            lin._matmul(x)
        times.append((time.perf_counter() - t) / len(layers))
    return statistics.median(times) * 1e3


def fastest_quant(dtype: torch.dtype, rows: int, candidates: tuple[str, ...] | None = None,
                  changes_outputs: bool = True) -> str:
    """The quantization whose kernel is fastest for `rows`-row matmuls here (measured once, then cached).

    A quantized kernel must beat the dense one by MARGIN: it costs acceptance (for a draft) or quality.
    Anything going wrong (a kernel this CPU lacks, an unreadable cache) falls back to measuring or to "none".
    changes_outputs: for a target, a busy machine's measurement gives "none" (the same answer every time); for a
    draft, whose kernel never changes the output, the fastest it saw.
    """
    usable = [q for q in candidates or kernels() if kernel_available(q) and not kernel(q).native]
    return _cached_choice(f"{dtype}|{rows} rows|{','.join(usable)}", {q: _timer(dtype, q, rows) for q in usable},
                          "none", stable=changes_outputs)


def cpu_class(flags: frozenset[str] | None = None) -> str:
    """'amx', 'avx512' or 'avx2' (or 'other') from the CPU's flags."""
    flags = cpu_info()[1] if flags is None else flags
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


def dtype_choice(rows: int) -> tuple[str, str]:
    """(dtype, why): the activations' dtype for matmuls of `rows` rows on this CPU."""
    cls = cpu_class()
    if cls == "amx":
        return "bfloat16", "AMX-BF16: bf16 matmuls run on the tiles"
    if cls in ("avx2", "other"):
        return "float32", "no AVX-512: bf16 matmuls would be emulated"
    return fastest_dtype(rows), f"measured on this AVX-512 CPU for {rows}-row matmuls"


def draft_quant_choice(dtype: torch.dtype, rows: int, native: str | None = None) -> tuple[str, str]:
    """(quant, why): the draft's kernels (`--draft-quant auto`). With AMX, int4-amx: as fast as any for one row and,
    on the tiles, for the prompt the draft must prefill too (w4a8 is faster for one row there, and many times slower
    for a prompt). Elsewhere a GGUF draft's blocks where `native` (its file's native kernel here) is given: faster
    for the prompt than a re-quantized kernel; on gguf-int8 those wider than 4 bits as Q4_0 (`gguf-q4`: fewer bytes
    per drafted token, docs/kernels.md). Else the fastest measured for `rows` rows."""
    if cpu_class() == "amx" and kernel_available("int4-amx"):
        return "int4-amx", "AMX: int4 tiles, fast for one row and for the prompt"
    if native == "gguf-int8":
        return "gguf-q4", ("its GGUF file's blocks, the wider ones as Q4_0: faster for the prompt it prefills than "
                           "a re-quantized kernel, and fewer bytes per drafted token")
    if native is not None:
        return native, "its GGUF file's own blocks: faster for the prompt it prefills, about as fast for one row"
    return fastest_quant(dtype, rows, changes_outputs=False), f"measured for {rows}-row matmuls"


def fastest_dtype(rows: int) -> str:
    """'bfloat16' where a dense bf16 matmul of `rows` rows is faster by MARGIN than a float32 one, else 'float32'
    (the tie-breaker of `dtype_choice`: AVX-512 CPUs with or without BF16 differ, docs/kernels.md)."""
    return _cached_choice(f"dtype|{rows} rows",
                          {d: _timer(getattr(torch, d), "none", rows) for d in ("float32", "bfloat16")}, "float32")


def forget() -> int:
    """Drop this CPU's cached measurements (`doctor --retune`); returns how many were dropped."""
    cached = _read_cache()
    mine = [k for k in cached if f"|{_cpu_key()}|" in k]
    for k in mine:
        del cached[k]
    write_atomic(_cache_file(), lambda tmp: tmp.write_text(json.dumps(cached, indent=1)))
    return len(mine)


def _timer(dtype: torch.dtype, quant: str, rows: int) -> Callable[[], list[float]]:
    """ROUNDS `time_rows` of `quant` layers in `dtype`, made when called (only a cache miss builds layers)."""

    def rounds() -> list[float]:
        layers = streamed_layers(dtype, quant)
        return [time_rows(layers, rows) for _ in range(ROUNDS)]

    return rounds


def _read_cache() -> dict:
    try:
        cached = json.loads(_cache_file().read_text())
        return cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        return {}


def _cached_choice(question: str, timers: dict[str, Callable[[], list[float]]], default: str,
                   stable: bool = True) -> str:
    """The fastest of `timers` (ms), `default` unless another wins by MARGIN; measured once per CPU and torch, and
    cached only when the rounds agree on the answer (otherwise `default` where the answer must be `stable`, the
    fastest seen where not)."""
    key = f"v{SCHEMA}|{_cpu_key()}|{question}"
    cached = _read_cache()
    entry = cached.get(key)
    if isinstance(entry, dict) and entry.get("choice") in timers:
        return entry["choice"]
    rounds: dict[str, list[float]] = {}
    for name, timer in timers.items():
        try:
            rounds[name] = timer()
        except Exception:  # noqa: BLE001  a kernel this CPU or torch build lacks is simply not a candidate
            continue
    weight = {name: 1.0 if name == default else MARGIN for name in rounds}  # another must win by MARGIN
    best = {name: min(v) * weight[name] for name, v in rounds.items() if v}
    worst = {name: max(v) * weight[name] for name, v in rounds.items() if v}
    choice = min(best, key=lambda n: best[n], default=default)
    # trusted when no pairing of rounds changes the answer: the choice's slowest beats every other's fastest
    contested = [n for n in best if n != choice and best[n] <= worst[choice]]
    if contested:  # the same answer every time until a quiet measurement
        warnings.warn(f"the machine was busy while timing {question!r} ({choice}'s rounds ran "
                      f"{worst[choice] / weight[choice]:.3g}-{best[choice] / weight[choice]:.3g} ms, overlapping "
                      f"{contested[0]}'s): {default if stable else choice} is used, nothing is remembered; run "
                      "`specdecode doctor --retune` on a quiet machine", stacklevel=3)
        return default if stable else choice
    ms = {name: min(v) for name, v in rounds.items() if v}
    cached[key] = {"choice": choice, "ms": {n: round(v, 4) for n, v in ms.items()}}
    write_atomic(_cache_file(), lambda tmp: tmp.write_text(json.dumps(cached, indent=1)))  # unwritable: measured again
    return choice
