"""The speculative decoding loop: draft, verify in one target forward, keep the accepted prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from jinja2 import TemplateError

from specdecode.detokenize import IncrementalText
from specdecode.drafting.base import Draft, Drafter
from specdecode.errors import InvalidRequestError
from specdecode.models.decoder import Transformer
from specdecode.stats import GenerationStats
from specdecode.stop_strings import StopStrings
from specdecode.verification.sampling import SamplingParams
from specdecode.verification.verify import verify


DEFAULT_MAX_CONTEXT = 8192  # tokens; caps the preallocated KV cache of long-context models
# A text this many times longer than the context is judged on a prefix of that length first: if the prefix alone has
# more tokens than the context holds (less a slack for the tokens its cut end may split differently), it is refused
# without tokenizing the rest.
PREFIX_CHARACTERS_PER_TOKEN = 16
PREFIX_SLACK_TOKENS = 64


@dataclass
class CostModel:
    """What speculation costs and yields here, measured as decoding goes (exponential moving averages per step):
    seconds of a target forward of k tokens, seconds per drafted token, and how often a drafted token is accepted.

    An adaptive draft length takes the gamma that maximises expected tokens per second under these numbers
    (Leviathan et al. 2023, section 3.4: (1 - a^(g+1)) / (1 - a) tokens for g * c_draft + c_forward(g + 1)
    seconds), 0 included: a plain step, where drafting does not pay (a slow draft, a verify cost that grows fast
    with k, low acceptance). After PROBE_AFTER plain steps in a row it drafts one token in two steps to see
    whether acceptance and the draft's cost have changed; each probe that ends in plain steps again doubles the
    wait (up to MAX_PROBE_AFTER), since a probe's first step makes the draft model read the whole context it
    missed (the prompt too: on a CPU where drafting never pays, probing every 16 steps cost 40% more time per
    prompt token). The draft's cost is only taken from a drafting step that follows one within the same
    request: the first also reads the prompt or the tokens since the last draft into the draft model's cache.
    It decides nothing before WARM_UP tokens have been drafted (the grow/shrink rule runs meanwhile), and it
    averages the acceptance more slowly than the timings, except on probes: a few drafts say little about the
    acceptance, and plain steps bring no news to undo a dip, so a dip must not switch drafting off where it pays,
    while a probe is the only news there is.
    Which gamma runs never changes the output, only the speed.
    """

    PROBE_AFTER = 16
    WARM_UP = 16  # drafted tokens before the acceptance is trusted: two drafts of 4 are too few to give up drafting
    MAX_PROBE_AFTER = 1024
    decay: float = 0.9  # of the timings, and of the acceptance counts on probe steps
    acceptance_decay: float = 0.97  # of the acceptance counts on other drafting steps
    forward: dict[int, float] = field(default_factory=dict)  # width -> seconds
    draft: float | None = None  # seconds per drafted token
    accepted: float = 1.0  # decayed counts of accepted and rejected drafted tokens: a 50% prior
    rejected: float = 1.0
    plain_steps: int = 0  # plain steps in a row chosen by `best_gamma`
    probing: int = 0  # probe steps still to run
    probe_after: int = PROBE_AFTER  # plain steps in a row before the next probe
    drafted_last: bool = False  # whether this request's previous step drafted
    drafted_tokens: int = 0  # over the generator's life
    probe_step: bool = False  # whether `best_gamma` last chose a probe

    def observe(self, width: int, forward_s: float, drafted: int, accepted: int, draft_s: float) -> None:
        d = self.decay
        old = self.forward.get(width)
        self.forward[width] = forward_s if old is None else d * old + (1 - d) * forward_s
        if drafted and self.drafted_last:  # a steady drafting step: no catching up on the context
            per_token = draft_s / drafted
            self.draft = per_token if self.draft is None else d * self.draft + (1 - d) * per_token
        self.drafted_tokens += drafted
        if drafted:
            d = self.decay if self.probe_step else self.acceptance_decay
            self.accepted = d * self.accepted + accepted
            self.rejected = d * self.rejected + (accepted < drafted)
        self.drafted_last = drafted > 0

    def forward_seconds(self, width: int) -> float:
        """Measured, else linear in the width through the two nearest measured widths (at least 2 measured)."""
        if width in self.forward:
            return self.forward[width]
        near = sorted(self.forward, key=lambda w: (abs(w - width), w))[:2]
        (w0, t0), (w1, t1) = sorted((w, self.forward[w]) for w in near)
        return max(t0 + (t1 - t0) * (width - w0) / (w1 - w0), min(self.forward.values()) / 4)

    def best_gamma(self, maximum: int) -> int | None:
        """The draft length worth running now, or None until a draft and two forward widths have been timed and
        WARM_UP tokens drafted."""
        if self.draft is None or len(self.forward) < 2 or self.drafted_tokens < self.WARM_UP:
            return None
        a = self.accepted / (self.accepted + self.rejected)

        def tokens_per_second(g: int) -> float:
            tokens = (1 - a ** (g + 1)) / (1 - a) if a < 1 else g + 1.0
            return tokens / (g * self.draft + self.forward_seconds(g + 1))

        best = max(range(maximum + 1), key=tokens_per_second)
        self.plain_steps = self.plain_steps + 1 if best == 0 else 0
        if best:
            self.probe_after = self.PROBE_AFTER
        if self.plain_steps > self.probe_after:
            self.plain_steps, self.probing = 0, 2
            self.probe_after = min(2 * self.probe_after, self.MAX_PROBE_AFTER)
        self.probe_step = bool(self.probing and best == 0)
        if self.probe_step:
            self.probing -= 1
            return 1
        self.probing = 0
        return best


@dataclass(frozen=True)
class GammaSchedule:
    """Draft length: fixed, or adaptive: chosen by the generator's CostModel once it has measured enough (except
    for seeded samples with rejection coupling, whose draws depend on it), before that (and for those samples)
    grown after a fully accepted draft and shrunk after an early rejection."""

    initial: int = 4
    adaptive: bool = False
    minimum: int = 1
    maximum: int = 8

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.minimum <= 0:
            raise InvalidRequestError(f"gamma must be >= 1, got {self.initial}")
        if not self.minimum <= self.initial <= self.maximum:
            raise InvalidRequestError(f"gamma {self.initial} is outside [{self.minimum}, {self.maximum}]")

    def next(self, gamma: int, drafted: int, accepted: int) -> int:
        if not self.adaptive or drafted == 0:
            return gamma
        if accepted == drafted:
            return min(gamma + 1, self.maximum)
        if accepted < drafted // 2:
            return max(gamma - 1, self.minimum)
        return gamma


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

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


@dataclass
class Stream:
    """Iterate for TokenEvents; `result` is set once the iteration ends."""

    events: Iterator[TokenEvent | GenerationResult]
    result: GenerationResult | None = field(default=None)

    def __iter__(self) -> Iterator[TokenEvent]:
        for e in self.events:
            if isinstance(e, GenerationResult):
                self.result = e
            else:
                yield e


class SequenceState:
    """One request's decoding state, shared by the single-request loop below and the server's batching
    scheduler: the context, what was generated, the text emitted so far, the draft length and the stats.

    `commit` applies one verified step and returns the events it produces; stop conditions (eos,
    stop strings, max tokens) are decided here, once.
    """

    def __init__(self, ids: list[int], max_new: int, params: SamplingParams, stop: tuple[str, ...],
                 eos: frozenset[int], gamma: GammaSchedule, tokenizer=None) -> None:
        self.ids, self.max_new, self.params, self.eos = ids, max_new, params, eos
        self.schedule, self.gamma = gamma, gamma.initial
        self.generator = params.generator()
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.out: list[int] = []
        self.text = ""  # emitted so far: `decoded`'s text less what is held back as a possible stop string
        self.stops = StopStrings(stop)
        self.decoded = IncrementalText(tokenizer)
        self.finish: str | None = None  # "stop" (eos or stop string) | "length"
        self._hit_stop = False
        self.t_start = time.perf_counter()

    def prefill(self, target: Transformer, cache, row: int = 0) -> None:
        """Cache row `row` gets all but the last context token; each step then feeds [last, draft...]."""
        if len(self.ids) > 1:
            target(torch.tensor([self.ids[:-1]]), torch.tensor([0]), cache, num_logits=0, rows=torch.tensor([row]))
        self.stats.prefill_seconds = time.perf_counter() - self.t_start

    def accept(self, logits: torch.Tensor, draft: Draft) -> list[TokenEvent]:
        """Verify `draft` against the target's logits [1, g + 1, V] after [last, draft...], then commit."""
        tokens = torch.tensor([draft.tokens], dtype=torch.int64)  # [1, g]
        accepted, nxt = verify(logits, tokens, draft.probs, self.params, self.generator, position=len(self.ids))
        return self.commit(draft.tokens, accepted, nxt)

    def draft_len(self) -> int:
        """Draft tokens worth proposing now: the bonus token always comes from the target."""
        return min(self.gamma, self.max_new - len(self.out) - 1)

    def commit(self, draft_tokens: list[int], accepted: int, nxt: int) -> list[TokenEvent]:
        self.stats.record_step(len(draft_tokens), accepted)
        self.gamma = self.schedule.next(self.gamma, len(draft_tokens), accepted)
        events = []
        for i, tok in enumerate(draft_tokens[:accepted] + [nxt]):
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
        events.append(GenerationResult(self.text, self.out, self.stats, self.finish or "length"))
        return events


class SpeculativeGenerator:
    """A target model, a drafter and a tokenizer; `generate` and `stream` run one request."""

    def __init__(self, target: Transformer, drafter: Drafter, tokenizer=None,
                 gamma: GammaSchedule | None = None, max_context: int | None = None) -> None:
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        width = target.decode_width
        self.gamma = gamma or GammaSchedule(maximum=(width - 1) if width else 8)
        if width is not None and self.gamma.maximum > width - 1:
            raise InvalidRequestError(f"gamma up to {self.gamma.maximum} needs a verify width of "
                                      f"{self.gamma.maximum + 1}, but the target runs {width} rows")
        self.max_context = max_context or min(target.config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        eos = set(target.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.cache = None  # allocated once, reused by every request (rollback makes stale slots harmless)
        self.costs = CostModel()  # measured by every request: what adaptive draft lengths are chosen by

    def encode(self, prompt: str | Sequence[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a text prompt, a list of ids, or a list of chat messages ({"role", "content"})."""
        if isinstance(prompt, str) and chat:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            self._check_text("\n".join(str(m.get("content", "")) for m in prompt))
            return self._apply_chat_template(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead")
            self._check_text(prompt)
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.target.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _check_text(self, text: str) -> None:
        """Refuse text that is not valid Unicode, and text whose first part alone overflows the context, before
        the whole of it is tokenized (megabytes take seconds and gigabytes of memory)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"the prompt holds a lone surrogate ({text[exc.start]!r} at character "
                                      f"{exc.start}); send valid Unicode") from None
        prefix = PREFIX_CHARACTERS_PER_TOKEN * self.max_context
        if self.tokenizer is not None and len(text) > prefix:
            tokens = len(self.tokenizer.encode(text[:prefix], add_special_tokens=False))
            if tokens > self.max_context + PREFIX_SLACK_TOKENS:
                raise InvalidRequestError(f"the prompt has more than {tokens - PREFIX_SLACK_TOKENS} tokens in its "
                                          f"first {prefix} characters; the context holds {self.max_context}")

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt instead")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as exc:  # e.g. a template that refuses a system message or non-alternating roles
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def prepare(self, prompt: str | Sequence[int] | list[dict], *, max_new_tokens: int = 128,
                temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                stop: Sequence[str] = (), eos_ids: Sequence[int] | None = None, chat: bool = False,
                coupling: str = "rejection") -> SequenceState:
        """Validate a request and build its SequenceState (InvalidRequestError on bad input; nothing runs yet)."""
        params = SamplingParams(temperature, top_k, top_p, seed, coupling)
        if params.gumbel and seed is None:  # the noise is a function of the seed: fix one for this request
            params = replace(params, seed=int(torch.randint(0, 2**62, ())))
        if max_new_tokens <= 0:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self.encode(prompt, chat)
        if not ids:
            raise InvalidRequestError("the prompt encodes to no tokens")
        if len(ids) >= self.max_context:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context}")
        max_new_tokens = min(max_new_tokens, self.max_context - len(ids))
        eos = self.eos_ids if eos_ids is None else frozenset(eos_ids)
        return SequenceState(ids, max_new_tokens, params, tuple(stop), eos, self.gamma, self.tokenizer)

    def stream(self, prompt: str | Sequence[int], **request) -> Stream:
        """Validate the request now (errors raise here), decode lazily as the stream is iterated."""
        return Stream(self._decode(self.prepare(prompt, **request)))

    def _decode(self, seq: SequenceState) -> Iterator[TokenEvent | GenerationResult]:
        self.drafter.reset()
        if self.cache is None:
            self.cache = self.target.new_cache(1, self.max_context + self.gamma.maximum + 1)
        ids = seq.ids
        seq.prefill(self.target, self.cache)
        self.costs.drafted_last = False
        while seq.finish is None:
            by_costs = self.gamma.adaptive and not seq.params.draws_depend_on_draft_lengths  # timings vary by run
            chosen = self.costs.best_gamma(self.gamma.maximum) if by_costs else None
            seq.gamma = seq.gamma if chosen is None else chosen
            accepted_before = seq.stats.accepted_tokens
            t0 = time.perf_counter()
            draft = self.drafter.propose(ids, seq.draft_len(), seq.params, seq.generator)
            t1 = time.perf_counter()
            logits = self.target(torch.tensor([[ids[-1]] + draft.tokens]), torch.tensor([len(ids) - 1]), self.cache)
            t2 = time.perf_counter()
            seq.stats.draft_seconds += t1 - t0
            seq.stats.verify_seconds += t2 - t1
            events = seq.accept(logits, draft)
            self.costs.observe(1 + len(draft.tokens), t2 - t1, len(draft.tokens),
                               seq.stats.accepted_tokens - accepted_before, t1 - t0)
            yield from events
        yield from seq.close()
