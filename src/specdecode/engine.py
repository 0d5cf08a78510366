"""The speculative decoding loop for one request: validate it, prefill, then decode steps until it finishes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from jinja2 import TemplateError

from specdecode.draft_lengths import CostModel, DraftLengths, GammaSchedule
from specdecode.drafting.base import Drafter
from specdecode.errors import InvalidRequestError
from specdecode.models.decoder import KVCache, Transformer
from specdecode.sequence import GenerationResult, SequenceState, TokenEvent
from specdecode.step import decode_step
from specdecode.verification.sampling import SamplingParams


DEFAULT_MAX_CONTEXT = 8192  # tokens; caps the preallocated KV cache of long-context models
# A text this many times longer than the context is judged on a prefix of that length first: if the prefix alone has
# more tokens than the context holds (less a slack for the tokens its cut end may split differently), it is refused
# without tokenizing the rest.
PREFIX_CHARACTERS_PER_TOKEN = 16
PREFIX_SLACK_TOKENS = 64


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
        # allocated once, reused by every request (rollback makes stale slots harmless)
        self.cache: KVCache | None = None
        self.costs = CostModel()  # measured by every request: what chosen draft lengths are chosen by

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
        ids = [int(t) for t in cast("Sequence[int]", prompt)]  # a list of messages returned above
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
                coupling: str = "rejection", trace: bool = False) -> SequenceState:
        """Validate a request and build its SequenceState (InvalidRequestError on bad input; nothing runs yet).
        trace: record what each step did, token by token (the result's `trace`)."""
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
        # timings vary between runs: a sample whose draws depend on the lengths takes the grow/shrink rule
        lengths = DraftLengths(self.gamma, self.costs, by_costs=not params.draws_depend_on_draft_lengths)
        return SequenceState(ids, max_new_tokens, params, tuple(stop), eos, lengths, self.tokenizer, trace)

    def stream(self, prompt: str | Sequence[int], **request) -> Stream:
        """Validate the request now (errors raise here), decode lazily as the stream is iterated."""
        return Stream(self._decode(self.prepare(prompt, **request)))

    def _decode(self, seq: SequenceState) -> Iterator[TokenEvent | GenerationResult]:
        self.drafter.reset()
        if self.cache is None:
            self.cache = self.target.new_cache(1, self.max_context + self.gamma.maximum + 1)
        seq.prefill(self.target, self.cache, self.drafter)
        while seq.finish is None:
            [(_, events)] = decode_step(self.target, self.cache, self.drafter, [seq])
            yield from events
        yield from seq.close()
