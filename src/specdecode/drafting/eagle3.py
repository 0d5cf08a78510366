"""An EAGLE-3 head drafts from the target's own hidden states (heads/eagle3.py; `specdecode train-draft` trains one).

Each step it first reads the pairs the last verify forward confirmed (the target's states at each accepted position
and the token after it) into its own one-layer KV cache, then drafts autoregressively on its own outputs. It needs no
target pass of its own and no prefill of its own beyond one layer over the prompt's states.
"""

from __future__ import annotations

import torch

from specdecode.draft_lengths import MAX_GAMMA
from specdecode.drafting.base import Draft, DrafterSpec, DraftingSetup, DraftRequest, StatesDrafter, \
    choose_among, common_prefix
from specdecode.errors import InvalidRequestError
from specdecode.heads.eagle3 import Eagle3Head
from specdecode.models.decoder import Transformer

MIN_CONFIDENCE = 0.3  # with chosen lengths, drafting stops after a token the head gives less than this


class Eagle3Drafter(StatesDrafter):
    def __init__(self, head: Eagle3Head, target: Transformer, max_len: int, batch: int = 1,
                 min_confidence: float = 0.0) -> None:
        super().__init__(head.cfg.aux_layers, batch)
        self.rt = head.runtime()
        self.target, self.vocab, self.min_confidence = target, target.config.vocab_size, min_confidence
        self.capacity = max_len + MAX_GAMMA + 1
        self.cache = self.rt.new_cache(batch, self.capacity)
        self.read: list[list[int]] = [[] for _ in range(batch)]  # per row: x_0..x_c, the context its c pairs read
        self.last: list[torch.Tensor | None] = [None] * batch  # per row: the layer's output at pair c - 1 [1, D]

    def reset(self, row: int = 0) -> None:
        super().reset(row)
        self.read[row], self.last[row] = [], None

    def propose_one(self, r: DraftRequest) -> Draft:
        ctx, row = r.context, r.row
        n = len(ctx) - 1  # pairs 0..n-1 exist: pair t is (the target's states at t, token t + 1)
        if r.gamma == 0 or n == 0:
            return Draft([], None)  # a plain step reads nothing: the next draft catches up
        c = max(min(common_prefix(self.read[row], ctx), n + 1) - 1, 0)  # pairs still valid in the head's cache
        if c < n:
            feats = self.seen.take(row, ctx, c, n)
            if feats is None:  # states the engine did not hand over (cannot happen through decode_step)
                return Draft([], None)
            out = self.rt.step(self.rt.fuse(feats), self._embed(ctx[c + 1:n + 1]), c, self.cache, row)
            self.read[row], self.last[row] = ctx[:n + 1], out[-1:]
        o = self.last[row]
        assert o is not None  # set whenever pairs were read
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        pos = n  # the head's next cache slot: drafted pairs are written past the confirmed ones, then forgotten
        while True:
            tok, q, confidence = choose_among(self.rt.draft_ids, self.rt.logits(o)[0], self.vocab, r,
                                              len(ctx) + len(tokens), bool(self.min_confidence))
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            if len(tokens) >= r.gamma or confidence < self.min_confidence or pos + 1 >= self.capacity:
                break
            o = self.rt.step(o, self._embed([tok]), pos, self.cache, row)
            pos += 1
        return Draft(tokens, torch.stack(qs) if qs else None)

    def _embed(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.target.embed_tokens(torch.tensor(ids)).float()


def build(setup: DraftingSetup) -> Eagle3Drafter:
    if not isinstance(setup.head, Eagle3Head):
        raise InvalidRequestError("drafter 'eagle3' needs an EAGLE-3 head (--draft DIR, written by "
                                  "`specdecode train-draft --kind eagle3`)")
    return Eagle3Drafter(setup.head, setup.target.model, setup.max_context, setup.batch,
                         MIN_CONFIDENCE if setup.chooses_lengths else 0.0)


SPEC = DrafterSpec("eagle3", "a trained EAGLE-3 head drafts from the target's own hidden states (--draft DIR)",
                   build, head_kind="eagle3", gamma=4, chooses_lengths=True)
