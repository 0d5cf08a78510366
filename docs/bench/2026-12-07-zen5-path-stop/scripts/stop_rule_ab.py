"""The draft model's stop rule inside `hybrid`, side by side in one Spec-Bench run: the default (stop once the draft
gives its chain less than `model.MIN_PATH`) against the rule it replaced (stop after a token the draft gives less
than 0.3), registered here as the method `hybrid-token-0.3`.

    .venv/bin/python docs/bench/2026-12-07-zen5-path-stop/scripts/stop_rule_ab.py OUT_DIR
"""

import sys

import torch

from specdecode.bench.spec_bench import benchmark
from specdecode.drafting import hybrid, model, registry
from specdecode.drafting.base import Draft, DrafterSpec, DraftRequest, choose
from specdecode.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


class TokenRule(model.ModelDrafter):
    """The draft model stopping after a token it gives less than 0.3."""

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        drafting = [r for r in requests if r.gamma > 0]
        feeds = self._catch_up(drafting)
        tokens: dict[int, list[int]] = {r.row: [] for r in requests}
        qs: dict[int, list[torch.Tensor]] = {r.row: [] for r in requests}
        live = drafting
        while live := [r for r in live if len(self.cached[r.row]) + len(feeds[r.row]) < self.max_len]:
            logits = self._forward([r.row for r in live], [feeds[r.row] for r in live])
            assert logits is not None
            still = []
            for r, row_logits in zip(live, logits):
                tok, q, confidence = choose(row_logits, r, len(r.context) + len(tokens[r.row]), True)
                tokens[r.row].append(tok)
                if q is not None:
                    qs[r.row].append(q)
                feeds[r.row] = [tok]
                if len(tokens[r.row]) < r.gamma and confidence >= 0.3:
                    still.append(r)
            live = still
        return [Draft(tokens[r.row], torch.stack(qs[r.row]) if qs[r.row] else None) for r in requests]


registry()["hybrid-token-0.3"] = DrafterSpec(
    "hybrid-token-0.3", "hybrid with the draft model stopping after a token it gives less than 0.3",
    lambda setup: hybrid.HybridDrafter(model.build(setup, min_path=1.0, kind=TokenRule), hybrid.MODEL_GAMMA),
    needs_draft_model=True, gamma=4)
benchmark(target=DEFAULT_TARGET, draft=DEFAULT_DRAFT, methods=["plain", "hybrid", "hybrid-token-0.3"],
          per_category=2, max_new_tokens=128, out=sys.argv[1], progress=False)
