"""Benchmark methods: one interface over our engine's configurations and the peers (transformers, llama.cpp).

A method is named `kind[:dtype]` (e.g. `plain`, `model:float32`, `hf-plain:bfloat16`); without a dtype
it runs in the bench's `--dtype`. Every method decodes the same prompt token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from specdecode.builder import WITH_DRAFT_MODEL, build_generator, load_target
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError
from specdecode.models.loading import DTYPES, LoadedModel, load_model

OURS = ("plain", "ngram", "model", "adaptive", "hybrid")
PEERS = ("hf-plain", "hf-assisted", "hf-prompt-lookup", "llama-cpp", "llama-cpp-prompt-lookup")
PLAIN_KINDS = ("plain", "hf-plain", "llama-cpp")  # no drafting: the baselines a speedup is measured against
_OUR_CONFIG = {"plain": dict(drafter="none"), "ngram": dict(drafter="ngram"), "model": dict(drafter="model"),
               "adaptive": dict(drafter="model", adaptive=True), "hybrid": dict(drafter="hybrid")}


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

    @classmethod
    def parse(cls, text: str, default_dtype: str) -> MethodSpec:
        kind, _, dtype = text.partition(":")
        if kind not in OURS + PEERS:
            raise InvalidRequestError(f"unknown method {kind!r}; choose from {', '.join(OURS + PEERS)}")
        dtype = dtype or default_dtype
        if dtype not in DTYPES:
            raise InvalidRequestError(f"unknown dtype {dtype!r} in method {text!r}; choose one of {', '.join(DTYPES)}")
        return cls(kind, dtype)

    def name(self, default_dtype: str) -> str:
        return self.kind if self.dtype == default_dtype else f"{self.kind}:{self.dtype}"


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


def parse_methods(names: list[str], default_dtype: str) -> list[MethodSpec]:
    """Specs in the order given, `plain` (our plain decoding in the default dtype) first: the reference."""
    specs = [MethodSpec.parse(n, default_dtype) for n in names]
    reference = MethodSpec("plain", default_dtype)
    specs = [reference] + [s for s in specs if s != reference]
    if len(set(specs)) != len(specs):
        raise InvalidRequestError("a method is listed twice")
    return specs


def build_methods(specs: list[MethodSpec], target: str, draft: str, default_dtype: str, *,
                  gamma: int | None, bit_exact: bool = True, coupling: str = "rejection",
                  log=print) -> list[Method]:
    """Load each (model, dtype) once; peers whose package is missing are skipped with a message."""
    from specdecode.bench import peers

    targets: dict[str, LoadedModel] = {}
    drafts: dict[str, LoadedModel] = {}
    methods: list[Method] = []
    for spec in specs:
        name = spec.name(default_dtype)
        if spec.kind in OURS:
            if spec.dtype not in targets:
                targets[spec.dtype] = load_target(target, dtype=spec.dtype, bit_exact=bit_exact)
            cfg = _OUR_CONFIG[spec.kind]
            dft = None
            if cfg["drafter"] in WITH_DRAFT_MODEL:
                if spec.dtype not in drafts:
                    drafts[spec.dtype] = load_model(draft, dtype=spec.dtype)
                dft = drafts[spec.dtype]
            gen = build_generator(targets[spec.dtype], draft=dft, gamma=gamma, **cfg)
            methods.append(EngineMethod(name, gen, coupling))
        else:
            try:
                methods.append(peers.build(spec.kind, name, target, draft, spec.dtype))
            except PeerUnavailable as e:
                log(f"skipping {name}: {e}")
    return methods
