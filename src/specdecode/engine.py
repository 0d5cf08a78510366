"""The speculative decoding loop: draft, verify in one target forward, keep the accepted prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from specdecode.drafting.base import Drafter
from specdecode.errors import InvalidRequestError
from specdecode.models.decoder import Transformer
from specdecode.stats import GenerationStats
from specdecode.verification.sampling import SamplingParams
from specdecode.verification.verify import verify


DEFAULT_MAX_CONTEXT = 8192  # tokens; caps the preallocated KV cache of long-context models


@dataclass(frozen=True)
class GammaSchedule:
    """Draft length: fixed, or adaptive (grow after a fully accepted draft, shrink after an early rejection)."""

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

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead")
            if chat:
                ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                return list(ids)
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.target.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               eos_ids: Sequence[int] | None = None, chat: bool = False, coupling: str = "rejection") -> Stream:
        """Validate the request now (errors raise here), decode lazily as the stream is iterated."""
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
        return Stream(self._decode(ids, max_new_tokens, params, tuple(stop), eos))

    def _decode(self, ids: list[int], max_new: int, params: SamplingParams, stop: tuple[str, ...],
                eos: frozenset[int]) -> Iterator[TokenEvent | GenerationResult]:
        t_start = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(ids))
        generator = params.generator()
        self.drafter.reset()
        if self.cache is None:
            self.cache = self.target.new_cache(1, self.max_context + self.gamma.maximum + 1)
        cache = self.cache
        # the cache holds all but the last context token; each step feeds [last, draft...]
        if len(ids) > 1:
            self.target(torch.tensor([ids[:-1]]), torch.tensor([0]), cache, num_logits=0)
        stats.prefill_seconds = time.perf_counter() - t_start
        out: list[int] = []
        text, finish, gamma, hit = "", None, self.gamma.initial, False
        while finish is None:
            t0 = time.perf_counter()
            draft = self.drafter.propose(ids, min(gamma, max_new - len(out) - 1), params, generator)
            t1 = time.perf_counter()
            logits = self.target(torch.tensor([[ids[-1]] + draft.tokens]), torch.tensor([len(ids) - 1]), cache)
            tokens = torch.tensor([draft.tokens], dtype=torch.int64)  # [1, g]
            accepted, nxt = verify(logits, tokens, draft.probs, params, generator, position=len(ids))
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += time.perf_counter() - t1
            stats.record_step(len(draft.tokens), accepted)
            gamma = self.gamma.next(gamma, len(draft.tokens), accepted)
            new = draft.tokens[:accepted] + [nxt]
            for i, tok in enumerate(new):
                if tok in eos:
                    finish = "stop"
                    break
                ids.append(tok)
                out.append(tok)
                piece, text, hit = self._detokenize(out, text, stop)
                yield TokenEvent(tok, piece, drafted=i < accepted)
                if hit:
                    finish = "stop"
                    break
                if len(out) >= max_new:
                    finish = "length"
                    break
        if not hit:  # emit text held back as a possible stop string
            full = self._decode_text(out)
            if len(full) > len(text):
                yield TokenEvent(None, full[len(text):], drafted=False)
                text = full
        stats.new_tokens = len(out)
        stats.total_seconds = time.perf_counter() - t_start
        yield GenerationResult(text, out, stats, finish)

    def _decode_text(self, out: list[int]) -> str:
        return self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _detokenize(self, out: list[int], text: str, stop: tuple[str, ...]) -> tuple[str, str, bool]:
        """The new piece of text, the text emitted so far, and whether a stop string appeared.

        Text that could be the start of a stop string, or an incomplete UTF-8 character, is held
        back until the next token decides it.
        """
        full = self._decode_text(out)
        if full.endswith("\ufffd"):
            return "", text, False
        for s in stop:
            at = full.find(s, max(0, len(text) - len(s)))
            if s and at >= 0:
                return full[len(text):at], full[:at], True
        held = max((k for s in stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
        safe = max(len(text), len(full) - held)
        return full[len(text):safe], full[:safe], False
