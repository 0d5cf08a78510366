"""The 1.5B target as `generate` loads it (its GGUF blocks, bit-exact): prefill of 64, 256 and 700 tokens, best of 3.
Run from the repository root at two commits to compare: `.venv/bin/python docs/bench/2026-12-07-zen5-q4draft/scripts/target_prefill.py`."""

import time

import torch

from specdecode.builder import load_target

torch.set_num_threads(2)
target = load_target("qwen2.5-coder-1.5b-instruct").model
cache = target.new_cache(1, 1024)
for n in (64, 256, 700):
    toks = torch.randint(0, 150000, (1, n))
    best = 1e9
    for r in range(3):
        t0 = time.perf_counter()
        target(toks, torch.tensor([0]), cache, num_logits=0)
        best = min(best, time.perf_counter() - t0)
    print(f"prefill of {n} tokens: {best * 1000 / n:.2f} ms per token", flush=True)
