"""Gumbel coupling: seeded sampling that gives the same tokens whatever the drafter, gamma or batch.

The token at sequence position t is argmax(log p_t + G_t), with G_t Gumbel noise drawn from (seed, t)
only. That is an exact sample from p_t (the Gumbel-max trick), and G_t is independent of everything
before t, so a whole sequence is an exact sample from the target. The drafter proposes with the same
noise, and the target keeps a draft token iff its own noisy argmax equals it: verification is greedy
verification on noisy logits, and a seeded request reproduces plain seeded decoding token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions give unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """[len(positions), vocab] Gumbel(0, 1) noise, a function of (seed, position) only."""
    out = torch.empty(len(positions), vocab, dtype=torch.float64)
    g = torch.Generator()
    for i, pos in enumerate(positions):
        g.manual_seed(_mix(seed, pos))
        out[i].exponential_(generator=g)  # E ~ Exp(1): -log E ~ Gumbel(0, 1)
    return -out.log()


def noisy_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log p + G; its argmax is the coupled sample. probs: [..., n, V] after temperature / top-k / top-p
    (`processed_probs`: excluded tokens are 0, so -inf here); noise: [n, V]."""
    return probs.double().log() + noise
