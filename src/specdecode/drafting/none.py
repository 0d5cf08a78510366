"""No drafting: plain target-only decoding through the same loop, the baseline."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft, Drafter, DrafterSpec
from specdecode.verification.sampling import SamplingParams


class NoDrafter(Drafter):
    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return Draft([], None)


SPEC = DrafterSpec("none", "no drafting: plain decoding through the same loop", lambda setup: NoDrafter(), gamma=1)
