"""One request's decoding state and what it yields: token events, then a result."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdecode.detokenize import IncrementalText
from specdecode.draft_lengths import DraftLengths
from specdecode.drafting.base import Draft, Drafter
from specdecode.models.decoder import Transformer
from specdecode.stats import GenerationStats
from specdecode.stop_strings import StopStrings
from specdecode.trace import Trace
from specdecode.verification.sampling import SamplingParams
from specdecode.verification.tree import verify_tree
from specdecode.verification.verify import verify


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None  # None: a last piece of held-back text, no new token
    text: str  # the text this token adds ("" while a character or a possible stop string is incomplete)
    drafted: bool  # True: proposed by the drafter and accepted; False: sampled by the target


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (eos or stop string) | "length"
    trace: Trace | None = None  # what each step did, where the request asked for it

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


class SequenceState:
    """One request's decoding state, whether it decodes alone or in the server's batch: the context, what was
    generated, the text emitted so far, its cache row, its draft lengths and its stats.

    `accept` verifies one step's draft against the target's logits and commits the result, returning the events it
    produces; stop conditions (eos, stop strings, max tokens) are decided here, once.
    """

    def __init__(self, ids: list[int], max_new: int, params: SamplingParams, stop: tuple[str, ...],
                 eos: frozenset[int], lengths: DraftLengths, tokenizer=None, trace: bool = False) -> None:
        self.ids, self.max_new, self.params, self.eos = ids, max_new, params, eos
        self.lengths = lengths
        self.row = 0  # of the KV cache and of the drafter's state (the server's slot)
        self.generator = params.generator()
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.trace = Trace() if trace else None
        self.out: list[int] = []
        self.kept: list[int] = []  # the draft nodes the last step kept, in order
        self.text = ""  # emitted so far: `decoded`'s text less what is held back as a possible stop string
        self.stops = StopStrings(stop)
        self.decoded = IncrementalText(tokenizer)
        self.finish: str | None = None  # "stop" (eos or stop string) | "length"
        self._hit_stop = False
        self.t_start = time.perf_counter()

    def prefill(self, target: Transformer, cache, drafter: Drafter | None = None) -> None:
        """The cache row gets all but the last context token; each step then feeds [last, draft...]. A drafter that
        reads the target's hidden states observes the prompt's."""
        layers = drafter.feature_layers if drafter is not None else ()
        if len(self.ids) > 1:
            hidden = dict.fromkeys(layers, torch.empty(0)) if layers else None
            target(torch.tensor([self.ids[:-1]]), torch.tensor([0]), cache, num_logits=0,
                   rows=torch.tensor([self.row]), hidden=hidden)
            if drafter is not None and hidden is not None:
                drafter.observe(self.row, 0, self.ids[:-1], torch.cat([hidden[n][0] for n in layers], -1))
        self.stats.prefill_seconds = time.perf_counter() - self.t_start
        self.lengths.costs.start_sequence()

    def draft_len(self) -> int:
        """Draft tokens worth proposing now: the bonus token always comes from the target."""
        return self.lengths.next(room=self.max_new - len(self.out) - 1)

    def accept(self, logits: torch.Tensor, draft: Draft) -> list[TokenEvent]:
        """Verify `draft` against the target's logits [1, g + 1, V] after [last, draft...], then commit; `kept`
        names the nodes kept."""
        if draft.is_tree:
            assert draft.parents is not None
            self.kept, nxt = verify_tree(logits[0], draft.tokens, draft.parents, draft.probs, self.params,
                                         self.generator, position=len(self.ids))
        else:
            tokens = torch.tensor([draft.tokens], dtype=torch.int64)  # [1, g]
            accepted, nxt = verify(logits, tokens, draft.probs, self.params, self.generator, position=len(self.ids))
            self.kept = list(range(accepted))
        self.stats.record_step(len(draft.tokens), len(self.kept), max(draft.depths(), default=0))
        before = len(self.out)
        events = self.commit([draft.tokens[i] for i in self.kept], nxt)
        if self.trace is not None:
            self.trace.record(logits[0], draft, self.kept, nxt, len(self.out) - before, self.params)
        return events

    def commit(self, kept: list[int], nxt: int) -> list[TokenEvent]:
        """Append the kept draft tokens and the next token (up to a stop)."""
        accepted = len(kept)
        events = []
        for i, tok in enumerate(kept + [nxt]):
            if tok in self.eos:
                self.finish = "stop"
                break
            self.ids.append(tok)
            self.out.append(tok)
            self.decoded.update(self.out)
            piece = self._new_text()
            events.append(TokenEvent(tok, piece, drafted=i < accepted))
            if self._hit_stop:
                self.finish = "stop"
                break
            if len(self.out) >= self.max_new:
                self.finish = "length"
                break
        return events

    def _new_text(self) -> str:
        """The text the last token adds to `text`, less what could be the start of a stop string (held back until
        later tokens decide it); up to the first stop string if one appeared (`_hit_stop`)."""
        full = self.decoded.text  # grows at its end only (IncrementalText holds back incomplete characters)
        at = self.stops.feed(full[self.stops.fed:])
        self._hit_stop = at is not None
        end = at if at is not None else max(len(self.text), len(full) - self.stops.held)
        piece = full[len(self.text):end]
        self.text += piece
        return piece

    def close(self) -> list[TokenEvent | GenerationResult]:
        """The last events of a finished sequence: text held back as a possible stop string, then the result."""
        events: list[TokenEvent | GenerationResult] = []
        if not self._hit_stop:
            self.decoded.update(self.out, final=True)
            full = self.decoded.text
            if len(full) > len(self.text):
                events.append(TokenEvent(None, full[len(self.text):], drafted=False))
                self.text = full
        self.stats.new_tokens = len(self.out)
        self.stats.total_seconds = time.perf_counter() - self.t_start
        events.append(GenerationResult(self.text, self.out, self.stats, self.finish or "length", self.trace))
        return events
