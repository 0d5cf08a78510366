"""`model-tree` sized by this CPU's verify costs (the default: `CostModel.tree_size`) against the same drafter
filling the budget the cost model gives it, registered here as `model-tree-budget`, in one Spec-Bench run.

    .venv/bin/python docs/bench/2026-12-07-zen5-path-stop/scripts/tree_size_ab.py OUT_DIR \
        plain,model,model-tree,model-tree-budget
"""

import sys
from dataclasses import replace

from specdecode.bench.spec_bench import benchmark
from specdecode.drafting import model_tree, registry
from specdecode.drafting.base import Draft, DrafterSpec, DraftRequest
from specdecode.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


class Budget(model_tree.ModelTreeDrafter):
    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        return super().propose_batch([replace(r, costs=None) for r in requests])


registry()["model-tree-budget"] = DrafterSpec(
    "model-tree-budget", "model-tree filling its budget", lambda setup: model_tree.build_chain(setup, kind=Budget),
    needs_draft_model=True, gamma=6, chooses_lengths=True)
benchmark(target=DEFAULT_TARGET, draft=DEFAULT_DRAFT, methods=sys.argv[2].split(","), per_category=2,
          max_new_tokens=128, out=sys.argv[1], progress=False)
