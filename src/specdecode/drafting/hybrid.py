"""Prompt lookup when the context repeats itself (free to draft), the draft model otherwise."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft
from specdecode.drafting.model import ModelDrafter
from specdecode.drafting.ngram import NgramDrafter
from specdecode.verification.sampling import SamplingParams


class HybridDrafter:
    """Each step: a lookup hit of at least `min_ngram` tokens proposes up to gamma copied tokens; otherwise
    the draft model proposes up to `model_gamma`. The choice depends only on the context, so it is lossless."""

    name = "hybrid"

    def __init__(self, model: ModelDrafter, model_gamma: int, min_ngram: int = 2) -> None:
        self.lookup = NgramDrafter(max_ngram=3, min_ngram=min_ngram)
        self.model, self.model_gamma = model, model_gamma

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        draft = self.lookup.propose(context, gamma, params, generator)
        if draft.tokens:
            return draft
        return self.model.propose(context, min(gamma, self.model_gamma), params, generator)

    def reset(self) -> None:
        self.model.reset()
