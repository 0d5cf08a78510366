"""Choose the fastest linear kernel on this CPU by measuring it once; the answer is cached per CPU and torch.

Which kernel wins depends on the CPU (docs/kernels.md): on an AMX Xeon bf16 `W @ x.T` is flat up to 16 rows
while torch's int4 kernel costs half as much for one row and three times as much for nine; on an
AVX2-only CPU torch's int8 kernel is slower than fp32. So `--quant auto` (and the draft's default) asks.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdecode.cpu import cpu_info
from specdecode.paths import cache_dir, write_atomic
from specdecode.models.linear import Linear, kernel_available, kernels, make_linear

SCHEMA = 2  # bump when what is measured changes: older cached answers are then ignored (2: kernels on all threads)
MARGIN = 1.1  # a quantized kernel is chosen only if it is this much faster than the dense one
STREAM_BYTES = 256 * 2**20  # each candidate cycles through this many bytes of weights: no cache can hold them
PROBE_SHAPE = (4864, 896)  # the 0.5B draft's MLP projection


def _cpu_key() -> str:
    name, flags = cpu_info()
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return f"{name}|{digest}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def _cache_file() -> Path:
    return cache_dir() / "autotune.json"


def streamed_layers(dtype: torch.dtype, quant: str, shape: tuple[int, int] = PROBE_SHAPE) -> list[Linear]:
    """Copies of one random `shape` projection, together STREAM_BYTES: cycling through them reads from memory."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul(0.02).to(dtype)
    layer = make_linear(weight, None, quant)
    size = sum(b.numel() * b.element_size() for b in list(layer.buffers()) + list(layer.parameters()))
    return [layer] + [copy.deepcopy(layer) for _ in range(max(1, STREAM_BYTES // size) - 1)]


def time_rows(layers: list[Linear], rows: int, repeats: int = 5) -> float:
    """Median ms of one `rows`-row matmul, cycling through `layers`."""
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


def fastest_quant(dtype: torch.dtype, rows: int, candidates: tuple[str, ...] | None = None) -> str:
    """The quantization whose kernel is fastest for `rows`-row matmuls here (measured once, then cached).

    A quantized kernel must beat the dense one by MARGIN: it costs acceptance (for a draft) or quality.
    Anything going wrong (a kernel this CPU lacks, an unreadable cache) falls back to measuring or to "none".
    """
    usable = [q for q in candidates or kernels() if kernel_available(q)]
    return _cached_choice(f"{dtype}|{rows} rows|{','.join(usable)}", {q: _timer(dtype, q, rows) for q in usable},
                          "none")


def fastest_dtype(rows: int) -> str:
    """'bfloat16' where a dense bf16 matmul of `rows` rows is faster by MARGIN than a float32 one, else 'float32'.

    Measured, not guessed from flags: on AMX Xeons bf16 is flat in k and 2-4x faster than float32; on
    AVX2-only CPUs bf16 is emulated, faster for 1 row but slower for 8 (docs/kernels.md).
    """
    return _cached_choice(f"dtype|{rows} rows",
                          {d: _timer(getattr(torch, d), "none", rows) for d in ("float32", "bfloat16")}, "float32")


def _timer(dtype: torch.dtype, quant: str, rows: int) -> Callable[[], float]:
    """`time_rows` of `quant` layers in `dtype`, made when called (only the timers a cache miss runs build layers)."""
    return lambda: time_rows(streamed_layers(dtype, quant), rows)


def _cached_choice(question: str, timers: dict[str, Callable[[], float]], default: str) -> str:
    """The fastest of `timers` (ms), `default` unless another wins by MARGIN; measured once per CPU and torch."""
    key = f"v{SCHEMA}|{_cpu_key()}|{question}"
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, dict) and entry.get("choice") in timers:
        return entry["choice"]
    ms = {}
    for name, timer in timers.items():
        try:
            ms[name] = timer()
        except Exception:  # noqa: BLE001  a kernel this CPU or torch build lacks is simply not a candidate
            continue
    choice = min(ms, key=lambda n: ms[n] if n == default else ms[n] * MARGIN, default=default)
    cached[key] = {"choice": choice, "ms": {n: round(v, 4) for n, v in ms.items()}}
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(cached, indent=1)))  # unwritable: measured next time
    return choice
