"""Runtime benchmark: load time, peak RSS and ms per forward of k new tokens after a context, beside transformers.

Each (model, dtype, engine) runs in a fresh process so peak RSS and load time are its own.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time

import torch

from specdecode.cpu import cpu_info


def cpu_name() -> str:
    return cpu_info()[0]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _ours(model: str, dtype: str, context: int, ks: list[int], repeats: int, width: int | None) -> dict:
    from specdecode.models.loading import load_model

    t = time.perf_counter()
    m = load_model(model, dtype=dtype, decode_width=width, with_tokenizer=False).model
    load_s = time.perf_counter() - t
    ids = torch.randint(0, m.config.vocab_size, (1, context + max(ks)))
    cache = m.new_cache(1, context + max(ks))
    m(ids[:, :context], torch.tensor([0]), cache, num_logits=0)
    start = torch.tensor([context])
    ms = {k: _median_ms(lambda k=k: m(ids[:, context:context + k], start, cache), repeats) for k in ks}
    return {"load_s": load_s, "ms": ms}


def _hf(model: str, dtype: str, context: int, ks: list[int], repeats: int) -> dict:
    from transformers import DynamicCache

    from specdecode.bench.peers import hf_model

    t = time.perf_counter()
    hf = hf_model(model, dtype)
    load_s = time.perf_counter() - t
    ids = torch.randint(0, hf.config.vocab_size, (1, context + max(ks)))
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(ids[:, :context], past_key_values=cache, use_cache=True)

        def step(k: int) -> None:
            hf(ids[:, context:context + k], past_key_values=cache, use_cache=True)
            cache.crop(-k)  # back to the context

        ms = {k: _median_ms(lambda k=k: step(k), repeats) for k in ks}
    return {"load_s": load_s, "ms": ms}


def _child(queue, engine: str, *args) -> None:
    result = _hf(*args[:-1]) if engine == "transformers" else _ours(*args)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    queue.put(result)


def measure(engine: str, model: str, dtype: str, context: int, ks: list[int], repeats: int,
            width: int | None) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, engine, model, dtype, context, ks, repeats, width))
    p.start()
    p.join()
    if p.exitcode != 0 or q.empty():
        raise RuntimeError(f"{engine} measurement of {model} ({dtype}) failed (exit code {p.exitcode})")
    return q.get()


def run_runtime_bench(models: list[str], dtypes: list[str], *, context: int = 500, ks: list[int] | None = None,
                      repeats: int = 20, with_hf: bool = True, bit_exact: bool = True) -> list[dict]:
    from specdecode.builder import VERIFY_WIDTH

    ks = ks or [1, 2, 4, 8, 16]
    print(f"CPU: {cpu_name()} | torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{torch.get_num_threads()} threads | context {context} | median of {repeats}")
    engines = [("specdecode bit-exact", VERIFY_WIDTH)] if bit_exact else []
    engines.append(("specdecode", None))
    if with_hf:
        engines.append(("transformers", None))
    header = "| model | dtype | engine | load s | peak RSS GB | " + " | ".join(f"k={k} ms" for k in ks) + \
             " | " + " | ".join(f"ms({k})/ms(1)" for k in ks if k > 1) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for model in models:
        for dtype in dtypes:
            for name, width in engines:
                r = measure("transformers" if name == "transformers" else "ours", model, dtype, context, ks,
                            repeats, width)
                ms = r["ms"]
                print(f"| {model} | {dtype} | {name} | {r['load_s']:.1f} | {r['peak_rss_gb']:.2f} | "
                      + " | ".join(f"{ms[k]:.1f}" for k in ks) + " | "
                      + " | ".join(f"{ms[k] / ms[1]:.2f}" for k in ks if k > 1) + " |", flush=True)
                rows.append({"model": model, "dtype": dtype, "engine": name, **r})
    return rows
