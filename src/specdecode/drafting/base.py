"""The drafter interface: propose up to gamma tokens after a context, with the q they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.verification.sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # [g], g <= gamma (may be 0: nothing worth proposing)
    probs: torch.Tensor | None  # [g, V_target] q each token was sampled from; None = deterministic (point mass)


@dataclass
class DraftRequest:
    """One sequence's turn in a batched drafting call."""

    row: int  # the sequence's row in the batch (the server's slot; 0 for a lone sequence): per-row state lives here
    context: list[int]  # every committed token
    gamma: int
    params: SamplingParams
    generator: torch.Generator


class Drafter:
    """Drafters see the whole committed context on every call and keep whatever per-row state they like.

    A drafter with a KV cache rolls it back itself by comparing the context with what it cached
    (the context only ever diverges from its last proposal after the accepted prefix). Stateless
    drafters implement `propose`; drafters that gain from batching implement `propose_batch`.
    """

    name: str

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return self.propose_batch([DraftRequest(0, context, gamma, params, generator)])[0]

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """Drafts for several sequences at once (the server's engine step), in the order of `requests`."""
        return [self.propose(r.context, r.gamma, r.params, r.generator) for r in requests]

    def reset(self, row: int = 0) -> None:
        """Forget the per-request state of a row (a new request starts there)."""
