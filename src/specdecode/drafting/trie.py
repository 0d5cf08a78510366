"""A token tree from weighted continuations: drafters that find several candidate continuations (prompt lookup's
matches, the suffix cache's) merge them into a trie and draft its heaviest nodes, within a node budget."""

from __future__ import annotations

import heapq

from specdecode.drafting.base import Draft


def tree_draft(continuations: list[tuple[list[int], float]], budget: int) -> Draft:
    """The `budget` heaviest nodes of the trie of `continuations` (each with a weight; earlier ones win ties), a node
    only after its parent: a tree Draft with point masses (deterministic tokens), nodes in the order chosen (so each
    parent comes before its children). A single continuation gives a chain."""
    children: dict[int, dict[int, int]] = {-1: {}}  # trie node -> token -> trie node
    weight: list[float] = []
    first: list[int] = []  # the first continuation through a node (ties)
    token: list[int] = []
    for order, (cont, w) in enumerate(continuations):
        node = -1
        for tok in cont[:budget]:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(weight)
                children[node][tok] = nxt
                children[nxt] = {}
                weight.append(0.0)
                first.append(order)
                token.append(tok)
            weight[nxt] += w
            node = nxt
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[int, int] = {-1: -1}  # trie node -> draft node
    frontier = [(-weight[c], first[c], c, -1) for c in children[-1].values()]
    heapq.heapify(frontier)
    while frontier and len(tokens) < budget:
        _, _, node, parent = heapq.heappop(frontier)
        index[node] = len(tokens)
        tokens.append(token[node])
        parents.append(index[parent])
        for c in children[node].values():
            heapq.heappush(frontier, (-weight[c], first[c], c, node))
    return Draft(tokens, None, parents)
