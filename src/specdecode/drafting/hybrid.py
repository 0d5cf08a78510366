"""Prompt lookup when the context repeats itself (free to draft), the draft model otherwise."""

from __future__ import annotations

from dataclasses import replace

from specdecode.drafting import model
from specdecode.drafting.base import Draft, Drafter, DrafterSpec, DraftingSetup, DraftRequest
from specdecode.drafting.model import ModelDrafter
from specdecode.drafting.ngram import NgramDrafter

MODEL_GAMMA = 4  # at most this many draft model tokens per step


class HybridDrafter(Drafter):
    """Each step: a lookup hit of at least `min_ngram` tokens proposes up to gamma copied tokens; otherwise
    the draft model proposes up to `model_gamma` (fewer once it doubts its chain), unless the request's prompt is
    longer than the draft model's window (the draft would read only its end, prompt lookup reads all of it: lookup
    alone then). The choice depends only on the context, so it is lossless."""

    def __init__(self, model: ModelDrafter, model_gamma: int, min_ngram: int = 2) -> None:
        self.lookup = NgramDrafter(max_ngram=3, min_ngram=min_ngram)
        self.model, self.model_gamma = model, model_gamma
        self.lookup_only: dict[int, bool] = {}  # per row: its request's prompt is longer than the draft's window

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        for r in requests:
            self.lookup_only.setdefault(r.row, len(r.context) > self.model.window)
        drafts = {r.row: self.lookup.propose(r.context, r.gamma, r.params, r.generator) for r in requests}
        misses = [replace(r, gamma=min(r.gamma, self.model_gamma)) for r in requests
                  if not drafts[r.row].tokens and not self.lookup_only[r.row]]
        drafts.update(zip((r.row for r in misses), self.model.propose_batch(misses)))
        return [drafts[r.row] for r in requests]

    def reset(self, row: int = 0) -> None:
        self.model.reset(row)
        self.lookup_only.pop(row, None)

    def forget(self) -> None:
        self.model.forget()


def build(setup: DraftingSetup) -> HybridDrafter:
    return HybridDrafter(model.build(setup, min_path=model.MIN_PATH), min(setup.gamma, MODEL_GAMMA))


SPEC = DrafterSpec("hybrid", f"prompt lookup where the context repeats (up to gamma copied tokens), else the draft "
                   f"model (up to {MODEL_GAMMA}); lookup alone after a prompt longer than the draft's window", build,
                   needs_draft_model=True, gamma=4)
