"""Tiny GGUF files of quantized blocks, written by the tests: random codes with float16 scales, any block type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from specdecode.models.gguf_blocks import random_tensor

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 64, 2
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_TYPES)
# Q4_K_M's mix (as in the catalog's Qwen2.5-Coder files) and the 0.5B's (Q5_0 blocks, a Q8_0 output)
Q4_K_M = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
          "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q4_K, "output": Q.Q6_K}
Q5_0_MIX = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_0,
            "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_1, "token_embd": Q.Q4_0, "output": Q.Q8_0}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8 of random blocks (gguf_blocks.random_tensor), seeded from `rng`."""
    return random_tensor(qtype, rows, cols, seed=int(rng.integers(2**31))).raw.numpy()


def write_model(path: Path, types: dict[str, Q], seed: int = 0, perturb: float = 0.0, tied: bool = False) -> Path:
    """A qwen2 GGUF (2 layers, hidden 256, head_dim 64) with each weight matrix in `types[part]`; perturb: the share
    of rows redrawn (a draft that mostly agrees with the model of the same seed); tied: no output.weight."""
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1000)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in {"block_count": LAYERS, "context_length": 512, "embedding_length": HIDDEN,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen2.rope.freq_base", 10000.0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}

    def matrix(name: str, part: str, rows: int, cols: int) -> None:
        raw = random_blocks(types[part], rows, cols, rng)
        if perturb:  # some rows redrawn
            redraw = noise.random(rows) < perturb
            raw[redraw] = random_blocks(types[part], rows, cols, noise)[redraw]
        writer.add_tensor(name, raw, raw_dtype=types[part])

    matrix("token_embd.weight", "token_embd", VOCAB, HIDDEN)
    for i in range(LAYERS):
        for part, (rows, cols) in shapes.items():
            matrix(f"blk.{i}.{part}.weight", part, rows, cols)
        for part, n in (("attn_q", HIDDEN), ("attn_k", KV_HEADS * head_dim), ("attn_v", KV_HEADS * head_dim)):
            writer.add_tensor(f"blk.{i}.{part}.bias", (rng.standard_normal(n) * 0.1).astype(np.float32))
        for part in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{part}.weight", (1 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32))
    if not tied:
        matrix("output.weight", "output", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
