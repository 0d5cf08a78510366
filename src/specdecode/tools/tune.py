"""`specdecode tune`: which drafter, draft length and target format pay on this CPU and these prompts.

Three measurements, then a prediction and its check:
  1. this CPU's verify curve: ms of one target forward of k tokens (k = 1 .. 1 + a tree's nodes) at the prompts'
     context length, for each target format;
  2. each drafter on the prompts, traced at its longest draft: per step, the tokens drafted and accepted and the
     seconds drafting took (a draft model's: per drafted token, its first step of a request, which reads the prompt,
     apart; the other drafters': per step);
  3. from those, each configuration's decode tokens/s: a chain drafter's trace cut to each shorter length g (a
     step keeps min(accepted, g) tokens and runs a forward of 1 + min(drafted, g)), a tree drafter at the size it
     was traced with;
     then the likeliest configurations are run for real (`confirm`), and the fastest measured one is chosen.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from specdecode.builder import build_generator
from specdecode.draft_lengths import MAX_GAMMA
from specdecode.drafting import drafter_spec
from specdecode.engine import SpeculativeGenerator
from specdecode.models.loading import LoadedModel
from specdecode.trace import StepTrace

TREE_WIDTH = 17  # the widest verify forward measured: the last token and a tree of up to 16 nodes


@dataclass(frozen=True)
class Config:
    quant: str  # the target's format (--quant)
    drafter: str
    gamma: int | None = None  # a fixed draft length; None: the drafter's own

    @property
    def label(self) -> str:
        name = "plain" if self.drafter == "none" else self.drafter + (f" g{self.gamma}" if self.gamma else "")
        return f"{name} [{self.quant}]"


@dataclass
class Profile:
    """One drafter's traced run on the prompts."""

    steps: list[StepTrace]  # every request's steps but its first drafting one
    tokens: int  # generated, over the prompts
    requests: int
    draft_seconds: float  # per drafted token (a draft model), else per step
    per_token: bool
    catch_up_seconds: float  # per request: what its first drafting step's drafting took beyond a usual one's
    tree: bool  # it drafted trees: predicted at the size it ran with only
    gamma: int | None  # the length (a tree's size) it ran with; None: the drafter's own fixed one

    def draft_cost(self, drafted: int) -> float:
        return self.draft_seconds * drafted if self.per_token else self.draft_seconds


@dataclass
class Candidate:
    config: Config
    tokens_per_step: float
    predicted: float  # decode tokens/s
    measured: float | None = None

    def to_dict(self) -> dict:
        return {"label": self.config.label, **asdict(self.config), "tokens_per_step": round(self.tokens_per_step, 3),
                "predicted_tokens_per_second": round(self.predicted, 2),
                "measured_tokens_per_second": None if self.measured is None else round(self.measured, 2)}


@dataclass
class TuneResult:
    chosen: Candidate
    candidates: list[Candidate]  # ranked by predicted tokens/s
    verify_ms: dict[str, dict[int, float]]  # per format: ms per forward of k tokens
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def verify_curve(target: LoadedModel, context: int, widths: range = range(1, TREE_WIDTH + 1),
                 repeats: int = 5) -> dict[int, float]:
    """Median ms of one decode forward of k tokens after `context` tokens, for each k in `widths`."""
    model = target.model
    ids = torch.randint(0, model.config.vocab_size, (1, context + widths[-1]))
    cache = model.new_cache(1, context + widths[-1])
    model(ids[:, :context], torch.tensor([0]), cache, num_logits=0)
    start = torch.tensor([context])
    out = {}
    for k in widths:
        model(ids[:, context:context + k], start, cache)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            model(ids[:, context:context + k], start, cache)
            times.append((time.perf_counter() - t) * 1e3)
        out[k] = statistics.median(times)
    return out


def profile(gen_for: Callable[[int | None], SpeculativeGenerator], drafter: str, prompts: list[list[int]],
            max_new_tokens: int) -> Profile:
    """Trace `drafter` on the prompts at its longest draft (a chain's MAX_GAMMA, a tree's own size)."""
    spec = drafter_spec(drafter)
    gamma = MAX_GAMMA if spec.chooses_lengths else None
    gen = gen_for(gamma)
    steps, firsts = [], []
    tokens, tree = 0, False
    for ids in prompts:
        result = gen.generate(ids, max_new_tokens=max_new_tokens, trace=True)
        assert result.trace is not None
        drafting = [s for s in result.trace.steps if s.drafted]
        firsts += drafting[:1]
        steps += [s for s in result.trace.steps if not drafting or s is not drafting[0]]
        tokens += result.stats.new_tokens
        tree = tree or result.stats.tree_drafts > 0
    seconds = sum(s.draft_seconds for s in steps)
    per_token = spec.needs_draft_model
    cost = seconds / max(sum(s.drafted for s in steps), 1) if per_token else seconds / max(len(steps), 1)
    p = Profile(steps, tokens, len(prompts), cost, per_token, 0.0, tree, gamma)
    p.catch_up_seconds = sum(max(0.0, s.draft_seconds - p.draft_cost(s.drafted)) for s in firsts) / len(prompts)
    return p


def predict(p: Profile, curve: dict[int, float], gamma: int | None) -> tuple[float, float]:
    """(tokens per step, decode tokens/s) of the profiled drafter cut to `gamma` drafted tokens (None: as run), on a
    target whose forward of k tokens takes curve[k] ms."""
    if not p.steps:
        return 1.0, 1e3 / curve[1]
    g = gamma or TREE_WIDTH
    tokens = sum(1 + min(s.accepted, g) for s in p.steps) / len(p.steps)
    seconds = sum(curve[min(1 + min(s.drafted, g), max(curve))] / 1e3 + p.draft_cost(min(s.drafted, g))
                  for s in p.steps) / len(p.steps)
    return tokens, p.tokens / (p.tokens / tokens * seconds + p.requests * p.catch_up_seconds)


def candidates(profiles: dict[str, Profile], curves: dict[str, dict[int, float]]) -> list[Candidate]:
    """Every configuration, ranked by predicted decode tokens/s: plain per format, each chain drafter at each
    length up to MAX_GAMMA and as it chooses (predicted as its best length), each tree drafter at the size it was
    profiled with, a drafter of one fixed length at that length."""
    out = []
    for quant, curve in curves.items():
        out.append(Candidate(Config(quant, "none"), 1.0, 1e3 / curve[1]))
        for drafter, p in profiles.items():
            if p.tree or not drafter_spec(drafter).chooses_lengths:
                out.append(Candidate(Config(quant, drafter, p.gamma), *predict(p, curve, None)))
                continue
            fixed = [Candidate(Config(quant, drafter, g), *predict(p, curve, g)) for g in range(1, MAX_GAMMA + 1)]
            best = max(fixed, key=lambda c: c.predicted)
            out += fixed + [Candidate(Config(quant, drafter), best.tokens_per_step, best.predicted)]
    return sorted(out, key=lambda c: -c.predicted)


def decode_speed(gen: SpeculativeGenerator, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Measured decode tokens/s over the prompts (prefill apart, a draft model's reading of the prompt in)."""
    tokens = seconds = 0.0
    for ids in prompts:
        stats = gen.generate(ids, max_new_tokens=max_new_tokens).stats
        tokens += stats.new_tokens
        seconds += stats.total_seconds - stats.prefill_seconds
    return tokens / seconds


def tune(targets: dict[str, LoadedModel], prompts: list[list[int]], drafters: list[str], *,
         draft: LoadedModel | None = None, max_new_tokens: int = 64, confirm: int = 4, minutes: float = 15.0,
         curves: dict[str, dict[int, float]] | None = None,
         progress: Callable[[str], None] = lambda line: None) -> TuneResult:
    """Profile the drafters on the first format's target, predict every configuration on each format's verify curve
    (`curves`: given, e.g. measured before, else measured here), run the `confirm` best predicted (with plain decoding
    of each format) for real while `minutes` last, and choose the fastest measured (confirm 0: the best predicted,
    nothing run)."""
    t0 = time.perf_counter()
    deadline = t0 + minutes * 60
    first = next(iter(targets.values()))
    if curves is None:
        context = int(statistics.median(len(ids) for ids in prompts)) + max_new_tokens // 2
        curves = {}
        for quant, target in targets.items():
            curves[quant] = verify_curve(target, context)
            progress(f"verify curve [{quant}], ms per forward of k tokens: "
                     + ", ".join(f"{k}: {ms:.1f}" for k, ms in curves[quant].items()))
    profiles = {}
    for drafter in drafters:
        if time.perf_counter() > t0 + 0.6 * (deadline - t0):
            progress(f"out of time: {', '.join(d for d in drafters if d not in profiles)} not profiled")
            break

        def gen_for(gamma: int | None, drafter: str = drafter) -> SpeculativeGenerator:
            return build_generator(first, draft=draft, drafter=drafter, gamma=gamma)

        profiles[drafter] = p = profile(gen_for, drafter, prompts, max_new_tokens)
        accepted = sum(s.accepted for s in p.steps) / max(len(p.steps), 1)
        progress(f"profiled {drafter}: {accepted:.2f} accepted tokens per step")
    ranked = candidates(profiles, curves)
    plain = [c for c in ranked if c.config.drafter == "none"]
    for c in (plain + [c for c in ranked if c.config.drafter != "none"][:confirm]) if confirm else []:
        if time.perf_counter() > deadline and c not in plain:
            progress("out of time: the other configurations stay unconfirmed")
            break
        gen = build_generator(targets[c.config.quant], draft=draft, drafter=c.config.drafter, gamma=c.config.gamma)
        c.measured = decode_speed(gen, prompts, max_new_tokens)
        progress(f"confirmed {c.config.label}: predicted {c.predicted:.2f}, measured {c.measured:.2f} tok/s")
    confirmed = [c for c in ranked if c.measured is not None]
    chosen = max(confirmed, key=lambda c: c.measured or 0.0) if confirmed else ranked[0]
    return TuneResult(chosen, ranked, curves, round(time.perf_counter() - t0, 1))
