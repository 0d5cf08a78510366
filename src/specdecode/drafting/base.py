"""The drafter interface: propose up to gamma tokens after a context, with the q they came from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.verification.sampling import SamplingParams

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel


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

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return self.propose_batch([DraftRequest(0, context, gamma, params, generator)])[0]

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """Drafts for several sequences at once (the server's engine step), in the order of `requests`."""
        return [self.propose(r.context, r.gamma, r.params, r.generator) for r in requests]

    def reset(self, row: int = 0) -> None:
        """Forget the per-request state of a row (a new request starts there)."""


@dataclass(frozen=True)
class DraftingSetup:
    """What a drafter is built from."""

    target: LoadedModel
    draft: LoadedModel | None  # loaded only for drafters that need one
    gamma: int  # the sequence's draft length: fixed, or where chosen lengths start
    chooses_lengths: bool  # whether the cost model chooses each step's length
    max_context: int
    batch: int  # sequences drafted for at once (the server's --max-batch)


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter as the command line, the library, the server and the bench know it: each drafter module defines
    one as `SPEC` (drafting/__init__.py collects them)."""

    name: str
    help: str  # one line for --help
    build: Callable[[DraftingSetup], Drafter]
    needs_draft_model: bool = False
    gamma: int = 4  # the default draft length: fixed, or where chosen lengths start
    chooses_lengths: bool = False  # by default the cost model chooses each step's length (0 included)
