"""The drafter interface: propose up to gamma tokens after a context, with the q they came from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.sampling import SamplingParams, processed_probs, sample

if TYPE_CHECKING:
    from specdecode.heads.format import Head
    from specdecode.models.loading import LoadedModel


@dataclass
class Draft:
    """A chain of drafted tokens, or a tree of them (`parents`): the target verifies every node in one forward."""

    tokens: list[int]  # [g], g <= gamma (may be 0: nothing worth proposing)
    probs: torch.Tensor | None  # [g, V_target] q each token was sampled from; None = deterministic (point mass)
    parents: list[int] | None = None  # tree: [g] each node's parent node, -1 the context's last token; None: a chain

    @property
    def parent_of(self) -> list[int]:
        """Each node's parent [g], a chain's too (node i - 1)."""
        return self.parents if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def first_path(self) -> Draft:
        """The chain from the root through each node's first child (a tree's drafters put their likeliest first)."""
        if not self.is_tree:
            return self
        assert self.parents is not None
        path, at = [], -1
        while (child := next((i for i, p in enumerate(self.parents) if p == at), None)) is not None:
            path.append(child)
            at = child
        return Draft([self.tokens[i] for i in path], None if self.probs is None else self.probs[path])

    def depths(self) -> list[int]:
        """Each node's depth [g]: 1 for a child of the context's last token."""
        out: list[int] = []
        for p in self.parent_of:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[1 + g, 1 + g] bool: which of [last, nodes...] each sees (itself, its ancestors and the last token)."""
        g = len(self.tokens)
        m = torch.eye(1 + g, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parent_of):
            m[i + 1] |= m[p + 1]
        return m


@dataclass
class DraftRequest:
    """One sequence's turn in a batched drafting call."""

    row: int  # the sequence's row in the batch (the server's slot; 0 for a lone sequence): per-row state lives here
    context: list[int]  # every committed token
    gamma: int
    params: SamplingParams
    generator: torch.Generator


class Drafter:
    """Drafters see the whole committed context on every call and keep whatever per-row state they like.

    A drafter with a KV cache rolls it back itself by comparing the context with what it cached
    (the context only ever diverges from its last proposal after the accepted prefix). Stateless
    drafters implement `propose`; drafters that gain from batching implement `propose_batch`.

    A drafter that reads the target's hidden states names their layers in `feature_layers` (see
    `Transformer.forward`'s `hidden`); the engine then hands it the states of the prefill and, after each verify
    forward, those of the context's last token and the kept draft tokens (`observe`). A drafter that learns from
    the target's guesses at its drafted tokens (lookahead) sets `reads_verify` and gets them through `verified`.
    """

    feature_layers: tuple[int, ...] = ()
    reads_verify: bool = False  # whether `verified` wants the target's greedy tokens at each drafted node

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return self.propose_batch([DraftRequest(0, context, gamma, params, generator)])[0]

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """Drafts for several sequences at once (the server's engine step), in the order of `requests`."""
        return [self.propose(r.context, r.gamma, r.params, r.generator) for r in requests]

    def reset(self, row: int = 0) -> None:
        """Forget the per-request state of a row (a new request starts there)."""

    def observe(self, row: int, start: int, tokens: list[int], features: torch.Tensor) -> None:
        """The target's hidden states of `tokens` at positions start.. of a row: [len(tokens), F], F the
        `feature_layers`' states side by side."""

    def forget(self) -> None:
        """Forget what was learned from earlier requests (the suffix cache), as a new process would know nothing."""

    def verified(self, row: int, draft: Draft, best: list[int], kept: list[int]) -> None:
        """After a step (for drafters that set `reads_verify`): the target's argmax after the context's last token
        and after each node of `draft` (best: [1 + g]), and the nodes it kept."""


def choose(logits: torch.Tensor, r: DraftRequest, position: int, confidence: bool = True
           ) -> tuple[int, torch.Tensor | None, float]:
    """A draft token from logits on the target's vocabulary [V] at `position`: the q it was sampled from (None where
    verification needs none: greedy, or Gumbel coupling with the noise the target will use there) and its
    probability (1.0 for greedy unless `confidence`)."""
    if r.params.greedy:
        tok = int(logits.argmax())
        return tok, None, float(torch.softmax(logits, -1)[tok]) if confidence else 1.0
    q = processed_probs(logits, r.params)
    if r.params.gumbel:
        if r.params.seed is None:
            raise ValueError("Gumbel coupling needs a seed (SpeculativeGenerator.prepare fixes one)")
        tok = int(noisy_scores(q, gumbel_noise(r.params.seed, [position], len(q))).argmax())
        return tok, None, float(q[tok])
    tok = sample(q, r.generator)
    return tok, q, float(q[tok])


def choose_among(ids: torch.Tensor, logits: torch.Tensor, vocab: int, r: DraftRequest, position: int,
                 confidence: bool = True) -> tuple[int, torch.Tensor | None, float]:
    """`choose` for logits over some target token ids only (a head's draft vocabulary, ids [Vd], logits [Vd]): the
    other tokens get probability 0. Greedy stays in the draft vocabulary; sampling puts the logits on the target's."""
    if r.params.greedy:
        i = int(logits.argmax())
        return int(ids[i]), None, float(torch.softmax(logits, -1)[i]) if confidence else 1.0
    full = torch.full((vocab,), float("-inf"))
    full[ids] = logits
    return choose(full, r, position, confidence)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class DraftingSetup:
    """What a drafter is built from."""

    target: LoadedModel
    draft: LoadedModel | None  # loaded only for drafters that need one
    head: Head | None  # a trained drafting head, for drafters that need one (heads/format.py)
    gamma: int  # the sequence's draft length: fixed, or where chosen lengths start
    chooses_lengths: bool  # whether the cost model chooses each step's length
    max_context: int
    batch: int  # sequences drafted for at once (the server's --max-batch)


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter as the command line, the library, the server and the bench know it: each drafter module defines
    one as `SPEC` (drafting/__init__.py collects them)."""

    name: str
    help: str  # one line for --help
    build: Callable[[DraftingSetup], Drafter]
    needs_draft_model: bool = False
    head_kind: str | None = None  # the kind of trained head it drafts with (--draft DIR), if any
    gamma: int = 4  # the default draft length: fixed, or where chosen lengths start
    chooses_lengths: bool = False  # by default the cost model chooses each step's length (0 included)


class ObservedFeatures:
    """Per row, the target's hidden states a drafter has been handed and not yet used: positions start.. with the
    tokens they were computed for. A new observation from position p replaces whatever was held from p on."""

    def __init__(self, rows: int) -> None:
        self.start = [0] * rows
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.features: list[torch.Tensor | None] = [None] * rows

    def clear(self, row: int) -> None:
        self.start[row], self.tokens[row], self.features[row] = 0, [], None

    def observe(self, row: int, start: int, tokens: list[int], features: torch.Tensor) -> None:
        held = self.features[row]
        keep = start - self.start[row]
        if held is None or not 0 <= keep <= len(self.tokens[row]):  # nothing held, or a gap: start over here
            self.start[row], self.tokens[row], self.features[row] = start, list(tokens), features
            return
        self.tokens[row] = self.tokens[row][:keep] + list(tokens)
        self.features[row] = torch.cat([held[:keep], features])

    def take(self, row: int, context: list[int], first: int, end: int) -> torch.Tensor | None:
        """The states of positions first..end-1 [end - first, F] if held and computed for the context's tokens there
        (None otherwise); what is held before `end` is dropped (the caller has used it)."""
        held, s = self.features[row], self.start[row]
        if held is None or first < s or end > s + len(self.tokens[row]) or \
                self.tokens[row][first - s:end - s] != context[first:end]:
            return None
        out = held[first - s:end - s]
        self.start[row], self.tokens[row], self.features[row] = end, self.tokens[row][end - s:], held[end - s:]
        return out


class StatesDrafter(Drafter):
    """A drafter that reads the target's hidden states (a trained head): it keeps each row's observed states and
    drafts for the requests of a batch in turn (`propose_one`)."""

    def __init__(self, layers: tuple[int, ...], batch: int) -> None:
        self.feature_layers = layers
        self.seen = ObservedFeatures(batch)

    def reset(self, row: int = 0) -> None:
        self.seen.clear(row)

    def observe(self, row: int, start: int, tokens: list[int], features: torch.Tensor) -> None:
        self.seen.observe(row, start, tokens, features)

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self.propose_one(r) for r in requests]

    def propose_one(self, r: DraftRequest) -> Draft:
        raise NotImplementedError
