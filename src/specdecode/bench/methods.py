"""Benchmark methods: one interface over our engine's configurations and the peers (transformers, llama.cpp).

A method is named `kind[:gG][:dtype][:quant]`: `plain` (our plain decoding), a drafter's name (drafting.registry():
`model`, `ngram`, `hybrid`, ...; with `:gG` a fixed draft length G, else the drafter's default, chosen each step
where it can) or a peer (`hf-plain:bfloat16`). Without a dtype it runs in the bench's `--dtype`, without a quant
in the bench's `--quant` (default `file`, as `generate`; quant applies to our target; the draft is always the fastest
here, as `--draft-quant auto`). Every
method decodes the same prompt token ids.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from specdecode.bench.runs import Method, PeerUnavailable, RunOutput
from specdecode.builder import build_generator, check_drafting, load_draft, load_target
from specdecode.drafting import registry
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError
from specdecode.models.linear import parse_quant, quant_choices
from specdecode.models.loading import DTYPES, LoadedModel

PEERS = ("hf-plain", "hf-assisted", "hf-prompt-lookup", "llama-cpp", "llama-cpp-prompt-lookup")
PLAIN_KINDS = ("plain", "hf-plain", "llama-cpp")  # no drafting: the baselines a speedup is measured against
_FIXED_GAMMA = re.compile(r"g(\d+)")


def our_kinds() -> tuple[str, ...]:
    """`plain` and every drafter but `none` (which is `plain`)."""
    return ("plain", *(name for name in registry() if name != "none"))


def _drafter(kind: str) -> str:
    return "none" if kind == "plain" else kind


@dataclass(frozen=True)
class MethodSpec:
    kind: str
    dtype: str
    quant: str = "file"  # the target's kernels (builder.load_target); peers always "none": they run their own
    gamma: int | None = None  # a fixed draft length (our drafting methods only)

    @classmethod
    def parse(cls, text: str, default_dtype: str, default_quant: str = "file") -> MethodSpec:
        kind, *options = text.split(":")
        ours = our_kinds()
        if kind not in ours + PEERS:
            raise InvalidRequestError(f"unknown method {kind!r}; choose from {', '.join(ours + PEERS)}")
        dtype, quant, gamma = default_dtype, default_quant if kind in ours else "none", None
        for option in options:
            if option in DTYPES:
                dtype = option
            elif fixed := _FIXED_GAMMA.fullmatch(option):
                if kind not in ours or kind == "plain":
                    raise InvalidRequestError(f"{text!r}: a draft length applies to our drafting methods")
                gamma = int(fixed.group(1))
                check_drafting(kind, gamma)
            else:
                try:
                    if option not in ("file", "auto"):
                        parse_quant(option)
                except InvalidRequestError:
                    raise InvalidRequestError(f"{option!r} in method {text!r} is neither a dtype "
                                              f"({', '.join(DTYPES)}) nor the target's kernels (file, auto, "
                                              f"{quant_choices()})") from None
                quant = option
        if quant != "none" and kind not in ours:
            raise InvalidRequestError(f"{text!r}: peers run their own weights; quantization applies to our methods")
        return cls(kind, dtype, quant, gamma)

    def name(self, default_dtype: str, default_quant: str = "file") -> str:
        quant = self.quant != (default_quant if self.kind in our_kinds() else "none")
        return ":".join([self.kind] + [f"g{self.gamma}"] * (self.gamma is not None)
                        + [self.dtype] * (self.dtype != default_dtype) + [self.quant] * quant)


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

    def forget(self) -> None:
        """Start over as a new process: drafters that learn across requests (suffix) forget them."""
        self.generator.drafter.forget()


def parse_methods(names: list[str], default_dtype: str, default_quant: str = "file") -> list[MethodSpec]:
    """`plain` (our plain decoding in the default dtype and quant) first: the reference; then the other plain methods
    (each method's output is checked against its own plain one, which must have run, and is added if missing), then
    the rest as given."""
    specs = [MethodSpec.parse(n, default_dtype, default_quant) for n in names]
    for s in list(specs):  # every method of ours is checked against our plain decoding of the same weights
        baseline = MethodSpec("plain", s.dtype, s.quant)
        if s.kind in our_kinds() and baseline not in specs:
            specs.append(baseline)
    reference = MethodSpec("plain", default_dtype, default_quant)
    specs = [reference] + sorted((s for s in specs if s != reference), key=lambda s: s.kind not in PLAIN_KINDS)
    if len(set(specs)) != len(specs):
        raise InvalidRequestError("a method is listed twice")
    return specs


def build_methods(specs: list[MethodSpec], target: str, draft: str, default_dtype: str, default_quant: str = "file", *,
                  gamma: int | None, bit_exact: bool = True, coupling: str = "rejection",
                  draft_vocab: int | None = None, log=print) -> list[Method]:
    """Load each (model, dtype) once; peers whose package is missing are skipped with a message.
    gamma: the fixed draft length of our drafting methods that name none (None: each drafter's default).
    draft_vocab: our draft model proposes only the first N token ids (see `builder.load_draft`)."""
    from specdecode.bench import peers

    targets: dict[tuple[str, str], LoadedModel] = {}  # (dtype, quant) -> model
    drafts: dict[str, LoadedModel] = {}
    methods: list[Method] = []
    for spec in specs:
        name = spec.name(default_dtype, default_quant)
        if spec.kind in our_kinds():
            key = (spec.dtype, spec.quant)
            if key not in targets:
                targets[key] = load_target(target, dtype=spec.dtype, bit_exact=bit_exact, quant=spec.quant)
            drafter = _drafter(spec.kind)
            dft = None
            if registry()[drafter].needs_draft_model:
                if spec.dtype not in drafts:  # the fastest draft here, as our default: it never changes the output
                    drafts[spec.dtype] = load_draft(draft, dtype=spec.dtype, vocab=draft_vocab)
                dft = drafts[spec.dtype]
            fixed = spec.gamma or (gamma if drafter != "none" else None)
            gen = build_generator(targets[key], draft=dft, drafter=drafter, gamma=fixed)
            methods.append(EngineMethod(name, gen, coupling))
        else:
            try:
                methods.append(peers.build(spec.kind, name, target, draft, spec.dtype))
            except PeerUnavailable as e:
                log(f"skipping {name}: {e}")
    return methods
