"""Medusa heads draft from the target's last hidden state at the last confirmed position: head k proposes the token
k + 1 places ahead, all heads at once (heads/medusa.py; `specdecode train-draft --kind medusa` trains them)."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft, DrafterSpec, DraftingSetup, DraftRequest, StatesDrafter, choose_among
from specdecode.errors import InvalidRequestError
from specdecode.heads.medusa import MedusaHeads
from specdecode.models.decoder import Transformer

MIN_CONFIDENCE = 0.3  # with chosen lengths, drafting stops after a token its head gives less than this


class MedusaDrafter(StatesDrafter):
    def __init__(self, heads: MedusaHeads, target: Transformer, batch: int = 1, min_confidence: float = 0.0) -> None:
        super().__init__((heads.cfg.layer,), batch)
        self.rt = heads.runtime()
        self.vocab, self.min_confidence = target.config.vocab_size, min_confidence

    def propose_one(self, r: DraftRequest) -> Draft:
        n = len(r.context) - 1  # the last token (the target's own) has no state yet: the one before it drafts
        if r.gamma == 0 or n == 0 or (state := self.seen.take(r.row, r.context, n - 1, n)) is None:
            return Draft([], None)
        head_logits = self.rt.logits(state[0])  # [K, Vd]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for k in range(min(r.gamma, self.rt.cfg.num_heads)):
            tok, q, confidence = choose_among(self.rt.draft_ids, head_logits[k], self.vocab, r, len(r.context) + k,
                                              bool(self.min_confidence))
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if confidence < self.min_confidence:
                break
        return Draft(tokens, torch.stack(qs) if qs else None)


def build(setup: DraftingSetup) -> MedusaDrafter:
    if not isinstance(setup.head, MedusaHeads):
        raise InvalidRequestError("drafter 'medusa' needs Medusa heads (--draft DIR, written by "
                                  "`specdecode train-draft --kind medusa`)")
    return MedusaDrafter(setup.head, setup.target.model, setup.batch,
                         MIN_CONFIDENCE if setup.chooses_lengths else 0.0)


SPEC = DrafterSpec("medusa", "trained Medusa heads draft from the target's last hidden state (--draft DIR)",
                   build, head_kind="medusa", gamma=4, chooses_lengths=True)
