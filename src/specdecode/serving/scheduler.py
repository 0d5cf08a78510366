"""Continuous batching: each step drafts for every active sequence and verifies them all in one target forward.

Sequences occupy rows ("slots") of one preallocated KV cache. A step drops cancelled requests, admits waiting ones
into free slots (prefill, one at a time), runs `step.decode_step` over every active sequence (the step a lone request
runs too), delivers each sequence's events and frees the slots of finished sequences. Each sequence chooses its own
draft lengths from its own acceptance and the timings the server's steps measure.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdecode.builder import build_generator
from specdecode.draft_lengths import CostModel
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError, SpecDecodeError
from specdecode.sequence import GenerationResult, SequenceState, TokenEvent
from specdecode.step import decode_step

log = logging.getLogger(__name__)

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

    @property
    def alive(self) -> bool:
        """False once the step loop has ended without being stopped (it survives a step's errors, not a bug of its
        own): the server can no longer answer."""
        return self._thread is None or self._thread.is_alive() or self._stopping

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
        """One decode step over every active sequence (admitting waiting ones first)."""
        self._admit()
        requests = {req.seq: req for req in self.active.values()}
        if not requests:
            return
        done = decode_step(self.target, self.cache, self.drafter, list(requests),
                           on_error=lambda seq, exc: self._finish(requests[seq], [exc]))
        if not done:
            return
        self.steps += 1
        self.sequence_steps += len(done)
        if self.on_step is not None:
            self.on_step(len(done))
        for seq, events in done:
            req = requests[seq]
            for event in events:
                req.emit(event)
            if seq.finish is not None:
                self._finish(req, seq.close())

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
        """The cache row gets all but the last context token; each step feeds [last, draft...]. The sequence's draft
        lengths learn from its own acceptance and the server's timings."""
        assert req.slot is not None  # given by _admit
        self.drafter.reset(req.slot)
        req.seq.row = req.slot
        req.seq.lengths.costs = CostModel(self.gen.costs.timings)
        req.seq.prefill(self.target, self.cache, self.drafter)

    def _finish(self, req: Request, events: Sequence[Event]) -> None:
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


def build_scheduler(target, *, max_batch: int = 8, max_queue: int = 64, on_step: Callable[[int], None] | None = None,
                    **generator_args) -> Scheduler:
    """A continuous-batching scheduler for the server (`builder.build_generator`'s arguments): its drafter keeps one
    row per batch slot."""
    if max_batch < 1 or max_queue < 0:
        raise InvalidRequestError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
    return Scheduler(build_generator(target, **generator_args, batch=max_batch), max_batch, max_queue, on_step)
