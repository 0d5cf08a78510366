"""The target's (1.5B, the file's blocks) and the draft's (0.5B, gguf-q4) forward of T new tokens after 300 of
context, median of 15, three interleaved rounds, with the one-call layers and with the per-op path (`Block.one_call`
off): what a verify step of T - 1 drafted tokens costs.

    .venv/bin/python docs/bench/2026-12-07-zen5-one-call/scripts/forward_widths.py
"""

import time

import torch

from specdecode.builder import load_draft, load_target

torch.set_num_threads(2)
models = {"target": load_target("qwen2.5-coder-1.5b-instruct").model,
          "draft": load_draft("qwen2.5-coder-0.5b-instruct").model}
widths = {"target": (1, 2, 3, 5, 7, 8, 9), "draft": (1,)}
results: dict[tuple[str, str, int], list[float]] = {}
caches = {}
for name, model in models.items():
    caches[name] = model.new_cache(1, 1024)
    model(torch.randint(0, 1000, (1, 300)), torch.tensor([0]), caches[name], num_logits=1)
for _ in range(3):
    for mode in ("gguf", ""):
        for name, model in models.items():
            for block in model.blocks:
                block.one_call = mode
            for T in widths[name]:
                times = []
                for _ in range(15):
                    start = time.perf_counter()
                    model(torch.randint(0, 1000, (1, T)), torch.tensor([300]), caches[name])
                    times.append(time.perf_counter() - start)
                results.setdefault((name, mode or "off", T), []).append(sorted(times)[7] * 1e3)
for (name, mode, T), ms in results.items():
    print(f"{name} one-call {mode} T={T}: " + " / ".join(f"{m:.2f}" for m in ms) + " ms")
