"""The draft model drafts a token tree (EAGLE-2's dynamic tree, Li et al. 2024, with a small model). Level by level it
expands the BEAM likeliest new nodes (likelihood = the draft's path probability), each into its TOP_K likeliest
children, one draft forward per level over the nodes expanded so far (their ancestor mask); then it drafts the
`budget` likeliest nodes of all it saw, a node only with its parent. A confident draft so drafts a chain, an
unsure one siblings, within the same node budget.

Every node is a point mass for verification (the target keeps a node with its own probability of it; a
deterministic choice of candidates, as the draft's top-k, is exact that way): greedy ranks by the draft's
probabilities, Gumbel coupling by the draft's noisy scores at that position (its first is the chain's choice),
sampling by the draft's processed distribution.
"""

from __future__ import annotations

import math

import torch

from specdecode.drafting.base import Draft, DrafterSpec, DraftingSetup, DraftRequest
from specdecode.drafting.model import ModelDrafter, build as build_chain
from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.sampling import processed_probs

TOP_K = 4  # children considered per expanded node
BEAM = 2  # nodes expanded per level
# with chosen lengths, paths the draft finds less likely than this are not drafted (a chain stops at model.MIN_PATH; a
# tree's siblings are for the less likely paths a chain would not reach)
MIN_PATH_PROBABILITY = 0.05


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
        start = len(self.cached[r.row])  # the context is cached: expanded nodes go to the slots after it
        budget = min(r.gamma, self.cache.capacity - start)
        floor = math.log(MIN_PATH_PROBABILITY) if self.min_path else -math.inf  # min_path set: lengths are chosen
        # every node seen: (log path probability, token, parent's index in `seen` or -1, depth)
        seen: list[tuple[float, int, int, int]] = []
        fed: list[int] = []  # indices in `seen` of the nodes fed to the draft model, in feeding order
        frontier = [(-1, root_logits)]  # (index in `seen`, its logits [V_target]) of the nodes just expanded
        while frontier:
            new = []
            for at, logits in frontier:
                logp, depth = (seen[at][0], seen[at][3]) if at >= 0 else (0.0, 0)
                probs, ranking = self._ranked(logits, r, len(r.context) + depth)
                for x in ranking.topk(min(TOP_K, len(ranking))).indices.tolist():
                    if probs[x] > 0:
                        new.append(len(seen))
                        seen.append((logp + math.log(float(probs[x])), x, at, depth + 1))
            new.sort(key=lambda i: -seen[i][0])
            expand = [i for i in new[:BEAM] if seen[i][3] < budget
                      and seen[i][0] >= floor]
            if not expand:
                break
            fed += expand
            position = {i: k for k, i in enumerate(fed)}
            draft = Draft([seen[i][1] for i in fed], None, [position.get(seen[i][2], -1) for i in fed])
            mask = draft.ancestor_mask()[1:, 1:].unsqueeze(0)  # among the fed nodes; the root is in the cache
            logits = self.model(torch.tensor([draft.tokens]), torch.tensor([start]), self.cache, tree_mask=mask,
                                rows=torch.tensor([r.row]))[0]  # [len(fed), V_draft]
            frontier = [(i, self._on_target_vocab(logits[position[i]])) for i in expand]
        # the budget's likeliest nodes, each after its parent (a child is never likelier than its parent)
        index: dict[int, int] = {-1: -1}
        tokens: list[int] = []
        parents: list[int] = []
        for i in sorted(range(len(seen)), key=lambda i: (-seen[i][0], seen[i][3])):
            if len(tokens) >= budget:
                break
            likely = seen[i][0] >= floor
            if seen[i][2] in index and (likely or not tokens):  # with chosen lengths, unlikely paths are left
                index[i] = len(tokens)
                tokens.append(seen[i][1])
                parents.append(index[seen[i][2]])
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
