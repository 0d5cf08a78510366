"""The draft model drafts a token tree (EAGLE-2's expansion, Li et al. 2024, with a small model): from the root (the
context's last token) it keeps, level by level, the BEAM most likely paths among the TOP_K best children of the
last level's nodes (likelihood = the draft's path probability), until the node budget is spent. One draft forward
per level feeds the tree so far with its ancestor mask.

Every node is a point mass for verification (the target keeps a node with its own probability of it; a
deterministic choice of candidates, as the draft's top-k, is exact that way): greedy picks the draft's top-k,
Gumbel coupling the top-k of the draft's noisy scores at that position (its first is the chain's choice), sampling
the top-k of the draft's processed distribution.
"""

from __future__ import annotations

import math

import torch

from specdecode.drafting.base import Draft, DrafterSpec, DraftingSetup, DraftRequest
from specdecode.drafting.model import ModelDrafter, build as build_chain
from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.sampling import processed_probs

TOP_K = 4  # children considered per expanded node
BEAM = 2  # nodes kept per level
MIN_PATH_PROBABILITY = 0.05  # with chosen lengths, paths the draft finds less likely than this are not drafted


class ModelTreeDrafter(ModelDrafter):
    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        drafting = [r for r in requests if r.gamma > 0 and len(r.context) < self.max_len]
        feeds = self._catch_up(drafting)
        out: dict[int, Draft] = {}
        if drafting:
            roots = self._forward([r.row for r in drafting], [feeds[r.row] for r in drafting])  # [B', V_target]
            assert roots is not None  # asked for
            for r, logits in zip(drafting, roots):
                out[r.row] = self._tree(r, logits)
        return [out.get(r.row, Draft([], None)) for r in requests]

    def _tree(self, r: DraftRequest, root_logits: torch.Tensor) -> Draft:
        start = len(self.cached[r.row])  # the context is cached: the tree goes to the slots after it
        budget = min(r.gamma, self.cache.capacity - start)
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        frontier = [(-1, root_logits, 0.0)]  # (node, its logits [V_target], log path probability)
        while frontier and len(tokens) < budget:
            candidates = []
            for node, logits, logp in frontier:
                probs, ranking = self._ranked(logits, r, len(r.context) + (depth[node] if node >= 0 else 0))
                for x in ranking.topk(min(TOP_K, len(ranking))).indices.tolist():
                    if probs[x] > 0:
                        candidates.append((logp + math.log(float(probs[x])), node, x))
            candidates.sort(key=lambda c: -c[0])
            keep = candidates[:min(BEAM, budget - len(tokens))]
            if self.min_confidence and tokens:
                keep = [c for c in keep if c[0] >= math.log(MIN_PATH_PROBABILITY)]
            first = len(tokens)
            for logp, node, x in keep:
                tokens.append(x)
                parents.append(node)
                depth.append(1 if node < 0 else depth[node] + 1)
            if not keep or len(tokens) >= budget:
                break
            draft = Draft(tokens, None, parents)
            mask = draft.ancestor_mask()[1:, 1:].unsqueeze(0)  # among the nodes; the root is in the cache
            logits = self.model(torch.tensor([tokens]), torch.tensor([start]), self.cache, tree_mask=mask,
                                rows=torch.tensor([r.row]))[0]  # [n, V_draft]
            frontier = [(first + i, self._on_target_vocab(logits[first + i]), keep[i][0]) for i in range(len(keep))]
        return Draft(tokens, None, parents)

    @staticmethod
    def _ranked(logits: torch.Tensor, r: DraftRequest, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's probabilities [V] of the next token at `position`, and the scores its candidates are
        ranked by [V]."""
        if r.params.greedy:
            return torch.softmax(logits, -1), logits
        probs = processed_probs(logits, r.params)
        if r.params.gumbel:
            assert r.params.seed is not None  # fixed by SpeculativeGenerator.prepare
            return probs, noisy_scores(probs, gumbel_noise(r.params.seed, [position], len(probs))[0])
        return probs, probs


def build(setup: DraftingSetup) -> ModelDrafter:
    return build_chain(setup, kind=ModelTreeDrafter)


SPEC = DrafterSpec("model-tree", "the draft model drafts a token tree (its most likely paths, EAGLE-2's expansion)",
                   build, needs_draft_model=True, gamma=6, chooses_lengths=True)
