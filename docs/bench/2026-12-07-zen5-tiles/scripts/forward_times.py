"""The 1.5B forward of a 512-token prefill and of k = 1, 4, 8, 16 tokens after it, with the time in gguf-int8 calls.
Run from the repository root: `.venv/bin/python docs/bench/2026-12-07-zen5-tiles/scripts/forward_times.py`; for the
kernel before the tiles, with PYTHONPATH pointing at a checkout of 16aadbf's src."""

import time
import torch
from collections import defaultdict
from specdecode.builder import load_target
import specdecode.kernels.gguf_int8 as gi

torch.set_num_threads(2)
t = load_target("qwen2.5-coder-1.5b-instruct")
m = t.model
ext = gi.extension()
orig = ext.gguf_int8_mm
acc = defaultdict(float)


class Wrap:
    def __getattr__(self, n):
        return getattr(ext, n)

    def gguf_int8_mm(self, x, *a):
        t0 = time.perf_counter()
        y = orig(x, *a)
        acc[(x.shape[0], x.shape[1], a[0].shape[0])] += time.perf_counter() - t0
        return y


w = Wrap()
gi.extension = lambda *a, **k: w
cache = m.new_cache(1, 2048)
for T in [512]:
    acc.clear()
    toks = torch.randint(0, 150000, (1, T))
    t0 = time.perf_counter()
    m(toks, torch.tensor([0]), cache, num_logits=1)
    el = time.perf_counter() - t0
    lin = sum(acc.values())
    print(f"prefill {T}: {el * 1000:.0f} ms = {el * 1000 / T:.2f} ms/token; linears {lin * 1000:.0f} ms")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:8]:
        print("  ", k, f"{v * 1000:.0f} ms")
for T in [1, 4, 8, 16]:
    acc.clear()
    toks = torch.randint(0, 150000, (1, T))
    best = 1e9
    for r in range(5):
        t0 = time.perf_counter()
        m(toks, torch.tensor([512]), cache)
        el = time.perf_counter() - t0
        best = min(best, el)
    lin = sum(acc.values()) / 5
    print(f"decode k={T}: {best * 1000:.1f} ms; linears (mean) {lin * 1000:.1f} ms")
