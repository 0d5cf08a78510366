"""Sampling parameters and the logits -> probabilities processing shared by target and draft.

Both p (target) and q (draft) go through `processed_probs` with the same parameters, so the
speculative-sampling rule compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.errors import InvalidRequestError


COUPLINGS = ("rejection", "gumbel")
GREEDY_BELOW = 1e-5  # a temperature below this is greedy decoding (as vLLM's): its softmax would over- or underflow


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW (0 included) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    coupling: str = "rejection"  # "rejection": standard speculative sampling; "gumbel": see verification/gumbel.py

    def __post_init__(self) -> None:
        if self.coupling not in COUPLINGS:
            raise InvalidRequestError(f"coupling must be one of {', '.join(COUPLINGS)}, got {self.coupling!r}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def gumbel(self) -> bool:
        return self.coupling == "gumbel" and not self.greedy

    @property
    def draws_depend_on_draft_lengths(self) -> bool:
        """A seeded sample with rejection coupling: which random numbers a token takes depends on how many tokens
        each step drafted, so a seed reproduces the output only if the lengths do not come from timings."""
        return self.seed is not None and not self.greedy and not self.gumbel

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, row by row. logits: [..., V] -> [..., V] float32."""
    if params.greedy:
        raise ValueError("greedy decoding uses argmax, not probabilities")
    x = logits.float()
    x = (x - x.amax(-1, keepdim=True)) / params.temperature  # <= 0: a tiny temperature gives -inf, never inf - inf
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        # keep the smallest set of most likely tokens whose mass reaches top_p (the first always stays)
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # also where top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
