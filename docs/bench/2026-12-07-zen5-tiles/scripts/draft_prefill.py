"""The 0.5B draft on w4a8 and on its own GGUF blocks: a 512-token prefill and one token after it.
Run from the repository root: `.venv/bin/python docs/bench/2026-12-07-zen5-tiles/scripts/draft_prefill.py`."""

import time
import torch
from specdecode.models.loading import load_model

torch.set_num_threads(2)
for quant in ["w4a8", "gguf-int8"]:
    d = load_model(
        "qwen2.5-coder-0.5b-instruct", dtype="bfloat16", quant=quant, head_quant=quant, with_tokenizer=False
    ).model
    cache = d.new_cache(1, 2048)
    toks = torch.randint(0, 150000, (1, 512))
    d(toks, torch.tensor([0]), cache, num_logits=1)
    t0 = time.perf_counter()
    d(toks, torch.tensor([0]), cache, num_logits=1)
    pre = time.perf_counter() - t0
    best = 1e9
    for r in range(20):
        t0 = time.perf_counter()
        d(toks[:, :1], torch.tensor([512]), cache)
        best = min(best, time.perf_counter() - t0)
    print(f"{quant}: prefill 512 {pre * 1000:.0f} ms ({pre * 1000 / 512:.2f} ms/token), one token {best * 1000:.2f} ms")
