"""The AVX2 build of gguf-int8 (-mno-avx512f) on an AVX-512 CPU: the 1.5B's prefill of 512 tokens and k = 1, 4, 8
tokens after it (median of 10). Run from the repository root: `.venv/bin/python
docs/bench/2026-12-07-zen5-tiles/scripts/avx2_forward.py`; for the kernel before the tiles, with PYTHONPATH pointing
at a checkout of 16aadbf's src."""

import time
import torch
import specdecode.kernels.gguf_int8 as gi

native = gi.extension
gi.extension = lambda isa_flags=(): native(isa_flags or ("-mno-avx512f",))
print(gi.extension().simd_path())
from specdecode.models.loading import load_model  # noqa: E402  after the patch above

torch.set_num_threads(2)
m = load_model(
    "qwen2.5-coder-1.5b-instruct",
    dtype="float32",
    quant="gguf-int8",
    head_quant="gguf-int8",
    with_tokenizer=False,
    decode_width=9,
).model
cache = m.new_cache(1, 2048)
toks = torch.randint(0, 150000, (1, 512))
t0 = time.perf_counter()
m(toks, torch.tensor([0]), cache, num_logits=1)
pre = time.perf_counter() - t0
res = []
for k in (1, 4, 8):
    ts = []
    for r in range(10):
        t0 = time.perf_counter()
        m(toks[:, :k], torch.tensor([512]), cache)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    res.append(f"k={k} {ts[len(ts) // 2] * 1000:.1f}")
print(f"prefill {pre * 1000 / 512:.2f} ms/tok", *res, flush=True)
