"""Suffix drafting (SuffixDecoding, Oliaro et al. 2025): drafts from every token sequence the process has seen, the
prompts and answers of earlier requests included, shared by all the server's sequences. Agentic and multi-turn work
repeats itself across requests; prompt lookup only sees the current one.

The cache holds whole sequences (each request's context as it grows), an LRU bounded in tokens (requests still
decoding are never evicted: the bound holds unless they alone exceed it), and an index from
each KEY-token window to where it occurs (the most recent MAX_PER_KEY per window). To draft, it finds the windows
equal to the context's last KEY tokens, measures how far back each match goes (up to MAX_MATCH tokens) and merges
what followed them into a token tree: a continuation weighs the sum of its matches' lengths (frequent continuations
of long matches first).
"""

from __future__ import annotations

from collections import OrderedDict

from specdecode.drafting.base import Draft, Drafter, DraftRequest, DrafterSpec, common_prefix
from specdecode.drafting.trie import tree_draft
from specdecode.errors import InvalidRequestError

KEY = 2  # tokens of the indexed windows
MAX_PER_KEY = 64  # occurrences kept per window, the most recent
MAX_MATCH = 32  # tokens a match is measured back to
MAX_TOKENS = 1 << 18  # tokens the cache holds by default (262144: tens of MB with its index)


class SuffixCache:
    """Token sequences and an index of their KEY-token windows, least recently extended evicted first once more
    than `max_tokens` are held; `active` sequences (requests still decoding) are never evicted."""

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise InvalidRequestError(f"the suffix cache needs a positive size, got {max_tokens}")
        self.max_tokens = max_tokens
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()  # least recently extended first
        self.index: dict[tuple[int, ...], dict[tuple[int, int], None]] = {}  # window -> {(sequence, end): None}
        self.tokens = 0
        self.active: set[int] = set()
        self._next = 0

    def new(self) -> int:
        sid, self._next = self._next, self._next + 1
        self.seqs[sid] = []
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        seq = self.seqs[sid]
        self.seqs.move_to_end(sid)
        for t in tokens:
            seq.append(t)
            if len(seq) >= KEY:
                at = self.index.setdefault(tuple(seq[-KEY:]), {})
                at[(sid, len(seq))] = None
                if len(at) > MAX_PER_KEY:
                    del at[next(iter(at))]
        self.tokens += len(tokens)
        if self.tokens > self.max_tokens:
            for old in [s for s in self.seqs if s not in self.active and s != sid]:  # least recent first
                self.evict(old)
                if self.tokens <= self.max_tokens:
                    break

    def evict(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        self.tokens -= len(seq)
        for end in range(KEY, len(seq) + 1):
            key = tuple(seq[end - KEY:end])
            at = self.index.get(key)
            if at is not None:
                at.pop((sid, end), None)
                if not at:
                    del self.index[key]

    def continuations(self, context: list[int], length: int) -> list[tuple[list[int], float]]:
        """What followed each match of the context's end, the most recent first, weighted by the match's length."""
        if len(context) < KEY or length <= 0:
            return []
        found: list[tuple[list[int], float]] = []
        tail = context[-MAX_MATCH:][::-1]
        for sid, end in reversed(self.index.get(tuple(context[-KEY:]), {})):
            seq = self.seqs[sid]
            if end < len(seq):  # not the context's own end
                before = seq[max(end - MAX_MATCH, 0):end][::-1]
                found.append((seq[end:end + length], float(common_prefix(before, tail))))
        return found


class SuffixDrafter(Drafter):
    """Drafts trees (or chains: tree=False, the most recent longest match) from a SuffixCache shared by every row;
    each row's context goes into the cache as it grows (prompt, then each committed token)."""

    def __init__(self, batch: int = 1, cache: SuffixCache | None = None, tree: bool = True) -> None:
        self.cache = cache or SuffixCache()
        self.tree = tree
        self.rows: list[int | None] = [None] * batch  # each row's sequence in the cache

    def reset(self, row: int = 0) -> None:
        sid = self.rows[row]
        self.cache.active.discard(sid)  # what it held stays in the cache: the next requests draft from it
        self.rows[row] = None

    def forget(self) -> None:
        self.cache = SuffixCache(self.cache.max_tokens)
        self.rows = [None] * len(self.rows)

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose(r) for r in requests]

    def _propose(self, r: DraftRequest) -> Draft:
        self._sync(r.row, r.context)
        if r.gamma <= 0:
            return Draft([], None)
        found = self.cache.continuations(r.context, r.gamma)
        if not found:
            return Draft([], None)
        return tree_draft(found, r.gamma) if self.tree else Draft(max(found, key=lambda f: f[1])[0], None)

    def _sync(self, row: int, context: list[int]) -> None:
        sid = self.rows[row]
        seq = self.cache.seqs.get(sid) if sid is not None else None
        if sid is None or seq is None or context[:len(seq)] != seq:  # new, evicted or not its prefix
            self.cache.active.discard(sid)
            sid = self.rows[row] = self.cache.new()
            self.cache.active.add(sid)
            seq = []
        if len(context) > len(seq):
            self.cache.extend(sid, context[len(seq):])


SPEC = DrafterSpec("suffix", "a token tree from every earlier prompt and answer of the process (a suffix cache "
                   "shared by the server's requests, LRU-bounded) and the current context",
                   lambda setup: SuffixDrafter(setup.batch), gamma=8, chooses_lengths=True)
CHAIN_SPEC = DrafterSpec("suffix-chain", "suffix drafting as a chain: what followed the longest match among every "
                         "earlier prompt and answer of the process",
                         lambda setup: SuffixDrafter(setup.batch, tree=False), gamma=8, chooses_lengths=True)
