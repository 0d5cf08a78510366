"""Prompt lookup: find earlier occurrences of the context's last n tokens and propose what followed them. The chain
drafter copies what followed the latest match; the tree drafter merges what followed every match (up to MAX_MATCHES,
longer matches weigh more) into a token tree."""

from __future__ import annotations

import torch

from specdecode.drafting.base import Draft, Drafter, DrafterSpec
from specdecode.drafting.trie import tree_draft
from specdecode.errors import InvalidRequestError
from specdecode.verification.sampling import SamplingParams

MAX_MATCHES = 32  # matches a tree is built from, the most recent first


class NgramDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree: bool = False) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidRequestError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.tree = max_ngram, min_ngram, tree

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        ctx = torch.tensor(context)
        found: list[tuple[list[int], float]] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            windows = ctx[:-1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram (not the suffix itself)
            hits = (windows == ctx[-n:]).all(-1).nonzero().flatten().tolist()
            for h in reversed(hits):  # most recent first
                follow = h + n
                if follow not in seen and len(found) < MAX_MATCHES:
                    seen.add(follow)
                    found.append((context[follow:follow + gamma], float(n)))
            if found and not self.tree:
                return Draft(found[0][0], None)  # the latest of the longest matches
        return tree_draft(found, gamma) if found else Draft([], None)


SPEC = DrafterSpec("ngram", "prompt lookup: copies what followed the latest earlier match of the last 1-3 tokens",
                   lambda setup: NgramDrafter(), gamma=8, chooses_lengths=True)
TREE_SPEC = DrafterSpec("ngram-tree", "prompt lookup as a token tree: what followed every earlier match of the last "
                        "1-3 tokens, merged (longer matches weigh more)",
                        lambda setup: NgramDrafter(tree=True), gamma=8, chooses_lengths=True)
