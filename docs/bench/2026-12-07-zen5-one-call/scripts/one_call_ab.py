"""Plain and speculative (model drafter) decoding of four chat prompts, 128 new tokens each, with the one-call GGUF
layers and with the per-op path (`Block.one_call` off), interleaved in one process; prints tokens per second.

    .venv/bin/python docs/bench/2026-12-07-zen5-one-call/scripts/one_call_ab.py
"""

import time

import torch

from specdecode.builder import build_generator, load_draft, load_target

torch.set_num_threads(2)
target, draft = load_target("qwen2.5-coder-1.5b-instruct"), load_draft("qwen2.5-coder-0.5b-instruct")
spec = build_generator(target, draft=draft, drafter="model")
plain = build_generator(target, drafter="none")
prompts = ["Write a Python function that checks whether a number is prime.", "Explain how a hash map works.",
           "Write a short story about a robot learning to paint.",
           "What are the main causes of inflation? Answer in a few paragraphs."]
encoded = [spec.encode([{"role": "user", "content": p}], chat=True) for p in prompts]


def tokens_per_second(generator) -> float:
    start, tokens = time.perf_counter(), 0
    for ids in encoded:
        tokens += generator.generate(ids, max_new_tokens=128).stats.new_tokens
    return tokens / (time.perf_counter() - start)


tokens_per_second(spec)  # warm-up
for round_ in range(3):
    for mode in ("gguf", ""):
        for model in (target.model, draft.model):
            for block in model.blocks:
                block.one_call = mode
        p, s = tokens_per_second(plain), tokens_per_second(spec)
        print(f"round {round_} one-call {'on ' if mode else 'off'}: plain {p:.2f} tok/s, speculative {s:.2f} tok/s, "
              f"{s / p:.3f}x", flush=True)
