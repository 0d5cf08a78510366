"""Continuous batching: each step drafts for every active sequence and verifies them all in one target forward.

Sequences occupy rows ("slots") of one preallocated KV cache. A step:
  1. drops cancelled requests and admits waiting ones into free slots (prefill, one at a time);
  2. drafts up to each sequence's gamma tokens, for all sequences in shared draft forwards (ragged lengths);
  3. runs one target forward over [B, 1 + max draft] tokens (shorter drafts padded; padding rows
     write cache slots past their sequence, which no real token ever sees);
  4. verifies each sequence on its own rows, commits, and frees the slots of finished sequences.

Bit-exact mode stays bit-exact here: every sequence gets the decode width's rows, and each linear
splits the batch's rows into chunks this CPU computes row-invariantly (`Transformer.enable_batching`),
so a sequence's logits do not depend on which others share the step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specdecode.drafting.base import Draft, DraftRequest
from specdecode.engine import GenerationResult, SequenceState, SpeculativeGenerator, TokenEvent
from specdecode.errors import SpecDecodeError

log = logging.getLogger(__name__)

T = TypeVar("T")
Event = TokenEvent | GenerationResult | Exception  # an Exception ends the request with an error


class QueueFullError(SpecDecodeError):
    """Every slot is busy and the waiting queue is at its limit: the client should retry later."""


@dataclass(eq=False)
class Request:
    seq: SequenceState
    emit: Callable[[Event], None]  # called from the scheduler's thread; must be quick
    id: int = field(default_factory=itertools.count().__next__)
    slot: int | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


class Scheduler:
    """Serves concurrent requests from one background thread; `submit` and `cancel` are thread-safe."""

    def __init__(self, generator: SpeculativeGenerator, max_batch: int = 8, max_queue: int = 64,
                 on_step: Callable[[int], None] | None = None) -> None:
        """generator.drafter must keep state for `max_batch` rows (builder.build_scheduler makes it so)."""
        self.gen, self.target, self.drafter = generator, generator.target, generator.drafter
        self.max_batch, self.max_queue, self.on_step = max_batch, max_queue, on_step
        # fewest sequences a linear takes per matmul while staying bit-exact on this CPU
        self.invariant_batch = self.target.enable_batching(self.max_batch)
        self.cache = self.target.new_cache(self.max_batch, generator.max_context + generator.gamma.maximum + 1)
        self.free = list(range(self.max_batch))
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}  # slot -> request
        self.steps = 0
        self.sequence_steps = 0  # sum over steps of the sequences in each: mean batch = sequence_steps / steps
        self.cancelled = 0  # requests dropped before they finished (their client went away)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- thread-safe API -------------------------------------------------------------------------
    def submit(self, seq: SequenceState, emit: Callable[[Event], None]) -> Request:
        with self._cond:
            if len(self.waiting) >= self.max_queue + len(self.free):  # free slots take waiting ones next step
                raise QueueFullError(f"the server is busy ({self.max_batch} running, {len(self.waiting)} "
                                     "waiting); retry later")
            req = Request(seq, emit)
            self.waiting.append(req)
            self._cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (its client went away); its slot is freed before the next step."""
        with self._cond:
            req.cancelled = True
            self._cond.notify()

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specdecode-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    # --- the loop ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self.waiting or self.active)
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # a bug or an out-of-memory must not take the server down
                log.exception("scheduler step failed")
                for req in list(self.active.values()):
                    self._finish(req, [exc])

    def step(self) -> None:
        """One engine step over every active sequence (admitting waiting ones first)."""
        self._admit()
        batch = list(self.active.values())
        if not batch:
            return
        t0 = time.perf_counter()
        batch, proposed = self._each_alone_on_error(batch, self._draft, "drafting")
        drafts = dict(zip(batch, proposed))
        t1 = time.perf_counter()
        batch, logits = self._each_alone_on_error(batch, lambda reqs: self._forward(reqs, drafts), "the target forward")
        forward_seconds = time.perf_counter() - t1
        if not batch:
            return
        self.steps += 1
        self.sequence_steps += len(batch)
        if self.on_step is not None:
            self.on_step(len(batch))
        for req, seq_logits in zip(batch, logits):
            seq, draft = req.seq, drafts[req]
            try:  # one sequence's failure (e.g. a degenerate distribution) must not fail the others
                events = seq.accept(seq_logits.unsqueeze(0), draft)
            except Exception as exc:
                log.exception("verification failed for one sequence")
                self._finish(req, [exc])
                continue
            seq.stats.draft_seconds += t1 - t0  # each sequence waited for the whole batch's drafting
            seq.stats.verify_seconds += forward_seconds
            for event in events:
                req.emit(event)
            if seq.finish is not None:
                self._finish(req, seq.close())

    def _draft(self, batch: list[Request]) -> list[Draft]:
        return self.drafter.propose_batch([DraftRequest(r.slot, r.seq.ids, r.seq.draft_len(), r.seq.params,
                                                        r.seq.generator) for r in batch])

    def _forward(self, batch: list[Request], drafts: dict[Request, Draft]) -> list[torch.Tensor]:
        """The target's logits [1 + g, V] of each sequence after [last, draft...], from one forward."""
        width = 1 + max(len(drafts[r].tokens) for r in batch)
        tokens = torch.tensor([[r.seq.ids[-1]] + drafts[r].tokens + [0] * (width - 1 - len(drafts[r].tokens))
                               for r in batch])  # [B, width]
        start = torch.tensor([len(r.seq.ids) - 1 for r in batch])
        rows = torch.tensor([r.slot for r in batch])
        logits = self.target(tokens, start, self.cache, rows=rows)  # [B, width, V]
        return [logits[b, :len(drafts[r].tokens) + 1] for b, r in enumerate(batch)]

    def _each_alone_on_error(self, batch: list[Request], run: Callable[[list[Request]], list[T]],
                             what: str) -> tuple[list[Request], list[T]]:
        """`run(batch)` (one result per request); if it raises, `run([req])` for each request alone, so that an
        error one sequence causes fails that sequence only. Returns the requests that went through and their
        results. A sequence gives the same bits alone or batched (`Transformer.enable_batching`)."""
        try:
            return batch, run(batch)
        except Exception as exc:
            if len(batch) == 1:  # already alone: running it again would repeat the failing work
                log.exception("%s failed for one sequence", what)
                self._finish(batch[0], [exc])
                return [], []
            log.warning("%s failed for a batch of %d; running each sequence alone", what, len(batch))
        kept: list[Request] = []
        results: list[T] = []
        for req in batch:
            try:
                results += run([req])
            except Exception as exc:
                log.exception("%s failed for one sequence", what)
                self._finish(req, [exc])
                continue
            kept.append(req)
        return kept, results

    def _admit(self) -> None:
        with self._cond:
            dropped = [r for r in self.active.values() if r.cancelled] + [r for r in self.waiting if r.cancelled]
            for req in dropped:
                self._release(req)
            self.cancelled += len(dropped)
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
            admitted = []
            while self.free and self.waiting:
                req = self.waiting.popleft()
                req.slot = self.free.pop(0)
                self.active[req.slot] = req
                admitted.append(req)
        for req in admitted:  # prefill outside the lock: submit/cancel stay responsive
            try:
                self._prefill(req)
            except Exception as exc:
                log.exception("prefill failed")
                self._finish(req, [exc])

    def _prefill(self, req: Request) -> None:
        """The cache row gets all but the last context token; each step feeds [last, draft...]."""
        self.drafter.reset(req.slot)
        req.seq.prefill(self.target, self.cache, req.slot)

    def _finish(self, req: Request, events: list[Event]) -> None:
        """Free the slot first (a client that resubmits at once finds it free), then deliver the last events."""
        with self._cond:
            self._release(req)
        for event in events:
            req.emit(event)

    def _release(self, req: Request) -> None:
        """Free the request's slot (caller holds the lock). Its cache row needs no clearing: the next
        sequence in the slot writes its own keys before any query can see them."""
        if req.slot is not None and self.active.get(req.slot) is req:
            del self.active[req.slot]
            self.free.append(req.slot)
            self.free.sort()
        req.slot = None
