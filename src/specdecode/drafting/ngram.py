"""Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose what followed."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft, Drafter, DrafterSpec
from specdecode.errors import InvalidRequestError
from specdecode.verification.sampling import SamplingParams


class NgramDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidRequestError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        ctx = torch.tensor(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            windows = ctx[:-1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram (not the suffix itself)
            hits = (windows == ctx[-n:]).all(-1).nonzero()
            if len(hits):
                follow = int(hits[-1]) + n  # most recent match; propose what followed it
                return Draft(context[follow:follow + gamma], None)
        return Draft([], None)


SPEC = DrafterSpec("ngram", "prompt lookup: copies what followed the latest earlier match of the last 1-3 tokens",
                   lambda setup: NgramDrafter(), gamma=8, chooses_lengths=True)
