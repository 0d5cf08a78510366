"""The drafter interface: propose up to gamma tokens after a context, with the q they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.verification.sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # [g], g <= gamma (may be 0: nothing worth proposing)
    probs: torch.Tensor | None  # [g, V_target] q each token was sampled from; None = deterministic (point mass)


class Drafter(Protocol):
    """Drafters see the whole committed context on every call and keep whatever state they like.

    A drafter with a KV cache rolls it back itself by comparing the context with what it cached
    (the context only ever diverges from its last proposal after the accepted prefix).
    """

    name: str

    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator) -> Draft: ...

    def reset(self) -> None:
        """Forget all per-request state (a new request starts)."""
