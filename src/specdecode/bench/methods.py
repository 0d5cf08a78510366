"""Benchmark methods: one interface over our engine's configurations and the peers (transformers, llama.cpp).

A method is named `kind[:dtype][:quant]` (e.g. `plain`, `model:float32`, `plain:int4`, `hf-plain:bfloat16`);
without a dtype it runs in the bench's `--dtype`, without a quant unquantized (quant applies to our target;
the draft is always the fastest here, as `--draft-quant auto`). Every method decodes the same prompt token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from specdecode.builder import DEFAULT_GAMMA, MAX_GAMMA, WITH_DRAFT_MODEL, build_generator, load_draft, load_target
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError
from specdecode.models.linear import parse_quant
from specdecode.models.loading import DTYPES, LoadedModel

OURS = ("plain", "ngram", "ngram-adaptive", "model", "adaptive", "hybrid")
PEERS = ("hf-plain", "hf-assisted", "hf-prompt-lookup", "llama-cpp", "llama-cpp-prompt-lookup")
PLAIN_KINDS = ("plain", "hf-plain", "llama-cpp")  # no drafting: the baselines a speedup is measured against
# the fixed-length methods carry their default gamma (bench --gamma replaces it); without one, the length is chosen
# each step (builder.build_generator)
_OUR_CONFIG = {"plain": dict(drafter="none"), "ngram": dict(drafter="ngram", gamma=MAX_GAMMA),
               "ngram-adaptive": dict(drafter="ngram"), "model": dict(drafter="model", gamma=DEFAULT_GAMMA),
               "adaptive": dict(drafter="model"), "hybrid": dict(drafter="hybrid", gamma=None)}


@dataclass
class RunOutput:
    token_ids: list[int]
    seconds: float  # prefill + decode, end to end
    target_forward_passes: int  # target forwards that yielded tokens (a prefill that yields none is not one)
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0


class Method(Protocol):
    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos_ids: list[int]) -> RunOutput: ...


class PeerUnavailable(Exception):
    """A peer's optional package is not installed (or cannot run these weights): the bench skips it."""


@dataclass(frozen=True)
class MethodSpec:
    kind: str
    dtype: str
    quant: str = "none"

    @classmethod
    def parse(cls, text: str, default_dtype: str, default_quant: str = "none") -> MethodSpec:
        kind, *options = text.split(":")
        if kind not in OURS + PEERS:
            raise InvalidRequestError(f"unknown method {kind!r}; choose from {', '.join(OURS + PEERS)}")
        dtype, quant = default_dtype, default_quant if kind in OURS else "none"
        for option in options:
            if option in DTYPES:
                dtype = option
            else:
                try:
                    parse_quant(option)
                except InvalidRequestError:
                    raise InvalidRequestError(f"{option!r} in method {text!r} is neither a dtype "
                                              f"({', '.join(DTYPES)}) nor a quantization (none, int8, int4[-gG], "
                                              "int4-amx[-gG], int8-amx, w4a8, w6a8, w8a8)") from None
                quant = option
        if quant != "none" and kind not in OURS:
            raise InvalidRequestError(f"{text!r}: peers run their own weights; quantization applies to our methods")
        return cls(kind, dtype, quant)

    def name(self, default_dtype: str, default_quant: str = "none") -> str:
        quant = self.quant != (default_quant if self.kind in OURS else "none")
        return ":".join([self.kind] + [self.dtype] * (self.dtype != default_dtype) + [self.quant] * quant)


@dataclass
class EngineMethod:
    """One configuration of our engine (drafter, γ schedule, dtype)."""

    name: str
    generator: SpeculativeGenerator
    coupling: str = "rejection"  # how sampled drafts are verified (see verification/)

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos_ids: list[int]) -> RunOutput:
        t = time.perf_counter()
        r = self.generator.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    eos_ids=eos_ids, coupling=self.coupling)
        s = r.stats
        return RunOutput(r.token_ids, time.perf_counter() - t, s.target_forward_passes, s.drafted_by_position,
                         s.accepted_by_position, s.draft_seconds)


def parse_methods(names: list[str], default_dtype: str, default_quant: str = "none") -> list[MethodSpec]:
    """`plain` (our plain decoding in the default dtype and quant) first: the reference; then the other plain methods
    (each method's output is checked against its own plain one, which must have run, and is added if missing), then
    the rest as given."""
    specs = [MethodSpec.parse(n, default_dtype, default_quant) for n in names]
    for s in list(specs):  # every method of ours is checked against our plain decoding of the same weights
        baseline = MethodSpec("plain", s.dtype, s.quant)
        if s.kind in OURS and baseline not in specs:
            specs.append(baseline)
    reference = MethodSpec("plain", default_dtype, default_quant)
    specs = [reference] + sorted((s for s in specs if s != reference), key=lambda s: s.kind not in PLAIN_KINDS)
    if len(set(specs)) != len(specs):
        raise InvalidRequestError("a method is listed twice")
    return specs


def build_methods(specs: list[MethodSpec], target: str, draft: str, default_dtype: str, default_quant: str = "none", *,
                  gamma: int | None, bit_exact: bool = True, coupling: str = "rejection",
                  draft_vocab: int | None = None, log=print) -> list[Method]:
    """Load each (model, dtype) once; peers whose package is missing are skipped with a message.
    draft_vocab: our draft model proposes only the first N token ids (see `builder.load_draft`)."""
    from specdecode.bench import peers

    targets: dict[tuple[str, str], LoadedModel] = {}  # (dtype, quant) -> model
    drafts: dict[str, LoadedModel] = {}
    methods: list[Method] = []
    for spec in specs:
        name = spec.name(default_dtype, default_quant)
        if spec.kind in OURS:
            key = (spec.dtype, spec.quant)
            if key not in targets:
                targets[key] = load_target(target, dtype=spec.dtype, bit_exact=bit_exact, quant=spec.quant)
            cfg = dict(_OUR_CONFIG[spec.kind])
            if gamma is not None and "gamma" in cfg:  # bench --gamma: the length of the fixed-length methods
                cfg["gamma"] = gamma
            dft = None
            if cfg["drafter"] in WITH_DRAFT_MODEL:
                if spec.dtype not in drafts:  # the fastest draft here, as our default: it never changes the output
                    drafts[spec.dtype] = load_draft(draft, dtype=spec.dtype, vocab=draft_vocab)
                dft = drafts[spec.dtype]
            gen = build_generator(targets[key], draft=dft, **cfg)
            methods.append(EngineMethod(name, gen, coupling))
        else:
            try:
                methods.append(peers.build(spec.kind, name, target, draft, spec.dtype))
            except PeerUnavailable as e:
                log(f"skipping {name}: {e}")
    return methods
