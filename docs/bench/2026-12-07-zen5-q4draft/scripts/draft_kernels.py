"""The 0.5B draft on gguf-int8 (its file's blocks), gguf-q4 (the wider ones as Q4_0) and w4a8: one token after 300
of context (median and best of 30, three interleaved rounds) and a 256-token prefill (best of 3).
Run from the repository root: `.venv/bin/python docs/bench/2026-12-07-zen5-q4draft/scripts/draft_kernels.py`."""

import time

import torch

from specdecode.models.loading import load_model

torch.set_num_threads(2)
models = {q: load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", quant=q, head_quant=q, head_rows=65536,
                        with_tokenizer=False).model for q in ["gguf-int8", "gguf-q4", "w4a8"]}
for rep in range(3):
    for quant, d in models.items():
        cache = d.new_cache(1, 1024)
        toks = torch.randint(0, 150000, (1, 300))
        d(toks, torch.tensor([0]), cache, num_logits=1)
        ts = []
        for r in range(30):
            t0 = time.perf_counter()
            d(toks[:, :1], torch.tensor([300 + r]), cache)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"{quant}: one token median {ts[15] * 1000:.2f} ms, best {ts[0] * 1000:.2f} ms", flush=True)
for quant, d in models.items():
    cache = d.new_cache(1, 1024)
    toks = torch.randint(0, 150000, (1, 256))
    best = 1e9
    for r in range(3):
        t0 = time.perf_counter()
        d(toks, torch.tensor([0]), cache, num_logits=1)
        best = min(best, time.perf_counter() - t0)
    print(f"{quant}: prefill of 256 tokens {best * 1000 / 256:.2f} ms per token")
