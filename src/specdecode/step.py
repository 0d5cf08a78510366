"""One decode step over a batch of sequences, for a lone request (a batch of one) and for the server's batch alike:

  1. each sequence's draft length (draft_lengths.py), then drafts for all of them in shared draft forwards;
  2. one target forward over [B, 1 + max draft] tokens, each sequence on its own cache row (shorter drafts padded:
     padding rows write cache slots past their sequence, which no real token ever sees); a tree draft's nodes see
     their ancestors only (its ancestor mask);
  3. each sequence verifies its draft on its own rows and commits (a tree's kept path moves to the cache slots right
     after the context); its draft lengths observe the step's costs.

Bit-exact stays bit-exact in a batch: each linear splits the batch's rows into chunks this CPU computes
row-invariantly (`Transformer.enable_batching`), so a sequence's logits do not depend on which others share the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from specdecode.drafting.base import Draft, Drafter, DraftRequest
from specdecode.models.decoder import Transformer
from specdecode.sequence import SequenceState, TokenEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
OnError = Callable[[SequenceState, Exception], None]


def decode_step(target: Transformer, cache, drafter: Drafter, batch: list[SequenceState],
                on_error: OnError | None = None) -> list[tuple[SequenceState, list[TokenEvent]]]:
    """Advance every sequence of `batch` by one step; returns each sequence that went through with its events.

    on_error: None raises whatever a phase raises. Otherwise a phase that raises for the batch runs again for each
    sequence alone, and `on_error(seq, exc)` ends the sequences that fail alone: one sequence's bad input or
    degenerate distribution never fails the others (a sequence gives the same bits alone or batched)."""
    t0 = time.perf_counter()
    batch, proposed = _each_alone_on_error(batch, lambda seqs: _draft(drafter, seqs), "drafting", on_error)
    if any(d.is_tree for d in proposed) and not target.exact_trees:  # a node would not get its path's bits here
        proposed = [d.first_path() for d in proposed]
    drafts = dict(zip(batch, proposed))
    t1 = time.perf_counter()
    batch, outputs = _each_alone_on_error(batch, lambda seqs: _forward(target, cache, seqs, drafts, drafter),
                                          "the target forward", on_error)
    t2 = time.perf_counter()
    # the draft model runs one shared forward per drafted position: the batch's seconds per token are its draft's,
    # unless a sequence that skipped drafting last step (a new one, or after a plain step) caught up on its context
    longest = max((len(drafts[seq].tokens) for seq in batch), default=0)
    steady = all(seq.lengths.costs.drafted_last for seq in batch if drafts[seq].tokens)
    width = 1 + longest
    done = []
    for seq, (seq_logits, features) in zip(batch, outputs):
        draft, accepted_before, start = drafts[seq], seq.stats.accepted_tokens, len(seq.ids) - 1
        try:
            events = seq.accept(seq_logits.unsqueeze(0), draft)
            if draft.is_tree:  # the kept path's keys and values move to the slots right after the context
                cache.move(seq.row, [start + 1 + i for i in seq.kept], range(start + 1, start + 1 + len(seq.kept)))
            if drafter.reads_verify:
                drafter.verified(seq.row, draft, seq_logits.argmax(-1).tolist(), seq.kept)
            if features is not None:  # the states of the last token and the kept path
                drafter.observe(seq.row, start, [seq.ids[start]] + [draft.tokens[i] for i in seq.kept],
                                features[[0] + [1 + i for i in seq.kept]])
        except Exception as exc:
            if on_error is None:
                raise
            log.exception("verification failed for one sequence")
            on_error(seq, exc)
            continue
        seq.stats.draft_seconds += t1 - t0  # each sequence waits for the whole batch's drafting
        seq.stats.verify_seconds += t2 - t1
        if seq.trace is not None:
            seq.trace.timed(t1 - t0, t2 - t1)
        drafted = len(draft.tokens)
        seq.lengths.observe(width, t2 - t1, drafted, seq.stats.accepted_tokens - accepted_before,
                            (t1 - t0) * drafted / longest if steady and longest else None, max(draft.depths(),
                                                                                                default=0))
        done.append((seq, events))
    return done


def _draft(drafter: Drafter, batch: list[SequenceState]) -> list[Draft]:
    return drafter.propose_batch([DraftRequest(seq.row, seq.ids, seq.draft_len(), seq.params, seq.generator)
                                  for seq in batch])


def _forward(target: Transformer, cache, batch: list[SequenceState], drafts: dict[SequenceState, Draft],
             drafter: Drafter) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each sequence's target logits [1 + g, V] after [last, draft...] (a tree's nodes see their ancestors only),
    and the hidden states [1 + g, F] a drafter that reads them asked for (else None), from one forward."""
    width = 1 + max(len(drafts[s].tokens) for s in batch)
    tokens = torch.tensor([[s.ids[-1]] + drafts[s].tokens + [0] * (width - 1 - len(drafts[s].tokens))
                           for s in batch])  # [B, width]
    tree_mask = None
    if any(drafts[s].is_tree for s in batch):  # [B, width, width]: padding rows see themselves only
        tree_mask = torch.eye(width, dtype=torch.bool).repeat(len(batch), 1, 1)
        for b, s in enumerate(batch):
            g = len(drafts[s].tokens)
            tree_mask[b, :1 + g, :1 + g] = drafts[s].ancestor_mask()
    start = torch.tensor([len(s.ids) - 1 for s in batch])
    rows = torch.tensor([s.row for s in batch])
    hidden = dict.fromkeys(drafter.feature_layers, torch.empty(0)) if drafter.feature_layers else None
    logits = target(tokens, start, cache, tree_mask=tree_mask, rows=rows, hidden=hidden)  # [B, width, V]
    features = None if hidden is None else torch.cat([hidden[n] for n in drafter.feature_layers], -1)
    return [(logits[b, :len(drafts[s].tokens) + 1], None if features is None else features[b])
            for b, s in enumerate(batch)]


def _each_alone_on_error(batch: list[SequenceState], run: Callable[[list[SequenceState]], list[T]], what: str,
                         on_error: OnError | None) -> tuple[list[SequenceState], list[T]]:
    """`run(batch)` (one result per sequence); if it raises, `run([seq])` for each sequence alone. Returns the
    sequences that went through and their results."""
    try:
        return batch, run(batch)
    except Exception as exc:
        if on_error is None:
            raise
        if len(batch) == 1:  # already alone: running it again would repeat the failing work
            log.exception("%s failed for one sequence", what)
            on_error(batch[0], exc)
            return [], []
        log.warning("%s failed for a batch of %d; running each sequence alone", what, len(batch))
    kept: list[SequenceState] = []
    results: list[T] = []
    for seq in batch:
        try:
            results += run([seq])
        except Exception as exc:
            log.exception("%s failed for one sequence", what)
            on_error(seq, exc)
            continue
        kept.append(seq)
    return kept, results
