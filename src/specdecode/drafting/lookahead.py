"""Lookahead decoding (Fu et al. 2024), with one Jacobi level: the verify forward's spare rows carry a window of
guesses for the next tokens, and the target's greedy tokens at those rows are the next Jacobi iterate; the
n-grams they form go to a pool, from which later steps draft.

Each step drafts one token tree from the context's last token: the window (WINDOW guesses, a chain) and the pool's
continuations of the last token (up to POOL_PER_KEY, merged in a trie), within the node budget. After the step,
the target's argmax after the last token and after each window guess (`Drafter.verified`) gives the new iterate:
guess j of the window (at position p + j) is replaced by what the target predicted there given the guesses before
it; n-grams along the iterate go to the pool (keyed by the token before them). Verification is that of any tree:
whatever was guessed, the output is the target's.
"""

from __future__ import annotations

from collections import OrderedDict

from specdecode.drafting.base import Draft, Drafter, DrafterSpec, DraftRequest
from specdecode.drafting.trie import tree_draft

WINDOW = 4  # guesses the Jacobi window carries
NGRAM = 4  # tokens per pool entry: the key and what followed it
POOL_PER_KEY = 8  # continuations kept per key, the most recent
WINDOW_WEIGHT = 1e6  # the window always gets its nodes first: without them the iteration stops


class LookaheadDrafter(Drafter):
    reads_verify = True

    def __init__(self, batch: int = 1) -> None:
        self.pools: list[dict[int, OrderedDict[tuple[int, ...], None]]] = [{} for _ in range(batch)]
        self.guesses: list[dict[int, int]] = [{} for _ in range(batch)]  # per row: position -> the current guess
        self.window: list[list[int]] = [[] for _ in range(batch)]  # per row: the last draft's window
        self.context: list[tuple[int, int]] = [(0, -1)] * batch  # per row: the last draft's context length, last token

    def reset(self, row: int = 0) -> None:
        self.pools[row], self.guesses[row], self.window[row] = {}, {}, []
        self.context[row] = (0, -1)

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose(r) for r in requests]

    def _propose(self, r: DraftRequest) -> Draft:
        row, n = r.row, len(r.context)
        self.window[row] = []
        if r.gamma <= 0:
            return Draft([], None)
        guesses = self.guesses[row]
        for p in [p for p in guesses if p < n]:
            del guesses[p]  # decided by now
        # the window: the current iterate's guesses for positions n.., else tokens of the context (a first guess)
        width = min(WINDOW, max(r.gamma // 2, 1))
        window = [guesses.get(n + j, r.context[(n - width + j) % n]) for j in range(width)]
        self.window[row], self.context[row] = window, (n, r.context[-1])
        pool = self.pools[row].get(r.context[-1]) or OrderedDict()
        found = [(window, WINDOW_WEIGHT)] + [(list(cont), 1.0) for cont in reversed(pool)]
        return tree_draft(found, r.gamma)

    def verified(self, row: int, draft: Draft, best: list[int], kept: list[int]) -> None:
        window = self.window[row]
        if not window:
            return
        # the window's nodes: its guesses are the first path from the root (it weighs most)
        parents = draft.parent_of
        nodes, at = [], -1
        for tok in window:
            child = next((i for i, p in enumerate(parents) if p == at and draft.tokens[i] == tok), None)
            if child is None:
                break
            nodes.append(child)
            at = child
        n, last = self.context[row]
        # the next iterate: the target's greedy token for position n + k after the guesses before it
        iterate = [best[0]] + [best[1 + i] for i in nodes]
        before = [last] + [draft.tokens[i] for i in nodes]  # the token at position n + k - 1 it followed
        pool = self.pools[row]
        for k in range(len(iterate) - 1):
            entries = pool.setdefault(before[k], OrderedDict())
            cont = tuple(iterate[k:k + NGRAM - 1])
            entries.pop(cont, None)
            entries[cont] = None
            if len(entries) > POOL_PER_KEY:
                entries.popitem(last=False)
        self.guesses[row] = {n + k: tok for k, tok in enumerate(iterate)}


SPEC = DrafterSpec("lookahead", "lookahead decoding: a Jacobi window of guesses in the verify forward's spare rows "
                   "and an n-gram pool of the target's iterates", lambda setup: LookaheadDrafter(setup.batch),
                   gamma=8)
