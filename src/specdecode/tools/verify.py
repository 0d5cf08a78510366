"""`specdecode verify`: is speculative decoding lossless for this target, these drafters and these prompts?

Greedy: every drafter's tokens must equal plain decoding's, alone and in the server's batched step; a difference is
reported at its first token with the context, both tokens and the target's logit margin between them there.
Sampled: the seeded Gumbel-coupled output must equal plain seeded decoding's (the same per-position noise makes
any lossless drafter reproduce it), and with rejection coupling the first two tokens' frequencies over many seeds
are tested against the target's exact distribution there (chi-square, Pearson's, on the tokens expected at least
5 times, the rest pooled; a sampled token the target gives probability 0 fails at once).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specdecode.bench.spec_bench import first_mismatch
from specdecode.builder import build_generator
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError
from specdecode.models.loading import LoadedModel
from specdecode.sequence import GenerationResult
from specdecode.serving.scheduler import build_scheduler
from specdecode.tools.prompts import Prompt
from specdecode.verification.sampling import SamplingParams, processed_probs

MIN_EXPECTED = 5.0  # a chi-square bin's least expected count; rarer tokens share one bin
MIN_CONDITIONAL = 20  # samples behind the second token's test (those whose first token was the likeliest)


@dataclass(frozen=True)
class Difference:
    position: int  # of the generated tokens
    context: str  # the text just before it
    expected: int | None  # plain decoding's token (None: it had ended)
    got: int | None  # the speculative one's
    expected_text: str
    got_text: str
    margin: float | None  # the target's logit of `expected` less that of `got` there (None where one had ended)


@dataclass(frozen=True)
class Check:
    prompt: str
    drafter: str
    path: str  # "alone" (one request) | "batched" (the server's step, several requests)
    tokens: int
    difference: Difference | None = None


@dataclass(frozen=True)
class DistributionTest:
    prompt: str
    drafter: str
    position: int  # 1: the first generated token; 2: the second, after the likeliest first
    samples: int
    statistic: float
    dof: int
    p_value: float
    impossible: int | None = None  # a token sampled where the target gives it probability 0
    alpha: float = 1e-3  # the test fails below this p-value

    @property
    def passed(self) -> bool:
        return self.impossible is None and self.p_value >= self.alpha


@dataclass
class VerifyReport:
    settings: dict
    checks: list[Check] = field(default_factory=list)
    tests: list[DistributionTest] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # per drafter

    @property
    def ok(self) -> bool:
        return all(c.difference is None for c in self.checks) and all(t.passed for t in self.tests)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "settings": self.settings, "seconds": self.seconds,
                "checks": [asdict(c) for c in self.checks],
                "tests": [asdict(t) | {"passed": t.passed} for t in self.tests]}


def verify(target: LoadedModel, prompts: list[Prompt], drafters: list[str], *, draft: LoadedModel | None = None,
           gamma: int | None = None, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, batch: int = 4, samples: int = 200, distribution_prompts: int = 1,
           alpha: float = 1e-3, progress: Callable[[str], None] = lambda line: None) -> VerifyReport:
    """Check each drafter against plain decoding on `prompts` (see the module's docstring). batch: requests per
    server step for the batched check (0: none); samples: seeds per distribution test, on the first
    `distribution_prompts` prompts (sampled settings only)."""
    check_settings(max_new_tokens, temperature, top_k, top_p, seed, batch, samples, distribution_prompts, alpha)
    if not prompts:
        raise InvalidRequestError("no prompts to verify")
    greedy = temperature == 0
    request: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   coupling="rejection" if greedy else "gumbel")
    report = VerifyReport(dict(request, gamma=gamma, seed=seed, batch=batch, prompts=len(prompts),
                               samples=samples if not greedy else 0, alpha=alpha))

    def generator(drafter: str) -> SpeculativeGenerator:
        return build_generator(target, draft=draft, drafter=drafter, gamma=None if drafter == "none" else gamma)

    plain = generator("none")
    encoded = [plain.prepare(p.content, chat=p.chat, **request).ids for p in prompts]  # bad prompts fail first
    t0 = time.perf_counter()
    reference = [plain.generate(ids, seed=seed + i, **request).token_ids for i, ids in enumerate(encoded)]
    report.seconds["none"] = round(time.perf_counter() - t0, 2)
    progress(f"plain decoding: {sum(map(len, reference))} tokens of {len(prompts)} prompts")

    def compare(prompt: int, drafter: str, path: str, got: list[int]) -> Check:
        pos = first_mismatch(reference[prompt], got)
        diff = None if pos is None else _difference(plain, encoded[prompt], reference[prompt], got, pos)
        check = Check(prompts[prompt].name, drafter, path, len(got), diff)
        progress(describe(check))
        return check

    for drafter in (["none"] if batch else []) + [d for d in drafters if d != "none"]:  # batched plain first
        t0 = time.perf_counter()
        if drafter != "none":
            gen = generator(drafter)
            for i, ids in enumerate(encoded):
                got = gen.generate(ids, seed=seed + i, **request).token_ids
                report.checks.append(compare(i, drafter, "alone", got))
        if batch:
            for i, got in enumerate(_batched(target, draft, drafter, gamma, batch, encoded, seed, request)):
                report.checks.append(compare(i, drafter, "batched", got))
        if not greedy and drafter != "none":
            for i in range(min(distribution_prompts, len(prompts))):
                for test in _distribution(generator(drafter), encoded[i], prompts[i].name, drafter, samples, seed,
                                          SamplingParams(temperature, top_k, top_p), alpha):
                    report.tests.append(test)
                    progress(describe(test))
        report.seconds[drafter] = round(report.seconds.get(drafter, 0) + time.perf_counter() - t0, 2)
    return report


def check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int, batch: int,
                   samples: int, distribution_prompts: int, alpha: float) -> None:
    """verify's settings' errors, named as its options, before anything loads."""
    SamplingParams(temperature, top_k, top_p, seed)
    if max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch < 0:
        raise InvalidRequestError(f"--batch must be >= 0 (0: no batched check), got {batch}")
    if temperature > 0 and samples < MIN_CONDITIONAL:
        raise InvalidRequestError(f"--samples must be >= {MIN_CONDITIONAL}, got {samples}")
    if temperature > 0 and distribution_prompts < 0:
        raise InvalidRequestError(f"--distribution-prompts must be >= 0, got {distribution_prompts}")
    if temperature > 0 and not 0 < alpha < 1:
        raise InvalidRequestError(f"--alpha must be between 0 and 1, got {alpha}")


def _batched(target: LoadedModel, draft: LoadedModel | None, drafter: str, gamma: int | None, batch: int,
             encoded: list[list[int]], seed: int, request: dict[str, Any]) -> list[list[int]]:
    """Every prompt through the server's scheduler, `batch` at a time, stepped here."""
    scheduler = build_scheduler(target, draft=draft, drafter=drafter, gamma=None if drafter == "none" else gamma,
                                max_batch=batch, max_queue=len(encoded))
    done: dict[int, GenerationResult | Exception] = {}

    def keep_last(i: int) -> Callable[[object], None]:
        def emit(event: object) -> None:
            if isinstance(event, (GenerationResult, Exception)):
                done[i] = event
        return emit

    for i, ids in enumerate(encoded):
        scheduler.submit(scheduler.gen.prepare(ids, seed=seed + i, **request), keep_last(i))
    while len(done) < len(encoded):
        scheduler.step()
    out = []
    for i in range(len(encoded)):
        result = done[i]
        if isinstance(result, Exception):
            raise result
        out.append(result.token_ids)
    return out


def _difference(plain: SpeculativeGenerator, prompt: list[int], expected: list[int], got: list[int],
                position: int) -> Difference:
    """Both tokens at the first difference, and the target's logits there (one forward of the common prefix)."""
    tok = plain.tokenizer
    context = prompt + expected[:position]
    a = expected[position] if position < len(expected) else None
    b = got[position] if position < len(got) else None
    margin = None
    if a is not None and b is not None:
        cache = plain.target.new_cache(1, len(context) + 1)
        logits = plain.target(torch.tensor([context]), torch.tensor([0]), cache, num_logits=1)[0, -1]
        margin = float(logits[a] - logits[b])

    def text(ids: list[int]) -> str:
        return tok.decode(ids) if tok is not None else " ".join(map(str, ids))

    return Difference(position, text(expected[:position])[-80:], a, b,
                      "(end)" if a is None else text([a]), "(end)" if b is None else text([b]), margin)


def _distribution(gen: SpeculativeGenerator, ids: list[int], name: str, drafter: str, samples: int, seed: int,
                  params: SamplingParams, alpha: float) -> list[DistributionTest]:
    """The first two tokens of `samples` seeded speculative samples (rejection coupling, a draft of 2 or more in
    the first step) against the target's exact distributions there."""
    firsts: list[tuple[int, int]] = []
    for s in range(samples):
        out = gen.generate(ids, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, seed=seed + 1_000_003 + s, coupling="rejection").token_ids
        if len(out) >= 2:  # an eos first ends the sample: its first token still counts
            firsts.append((out[0], out[1]))
        elif out:
            firsts.append((out[0], -1))
    first = Counter(a for a, _ in firsts)
    tests = [_chi_square(first, _target_probs(gen, ids, params), name, drafter, 1, alpha)]
    likeliest = first.most_common(1)[0][0]
    second = Counter(b for a, b in firsts if a == likeliest and b >= 0)
    if sum(second.values()) >= MIN_CONDITIONAL:
        tests.append(_chi_square(second, _target_probs(gen, ids + [likeliest], params), name, drafter, 2, alpha))
    return tests


def _target_probs(gen: SpeculativeGenerator, ids: list[int], params: SamplingParams) -> torch.Tensor:
    cache = gen.target.new_cache(1, len(ids) + 1)
    logits = gen.target(torch.tensor([ids]), torch.tensor([0]), cache, num_logits=1)[0, -1]
    return processed_probs(logits, params).double()


def _chi_square(counts: Counter, p: torch.Tensor, name: str, drafter: str, position: int,
                alpha: float) -> DistributionTest:
    """Pearson's chi-square of observed token counts against probabilities p [V]."""
    n = sum(counts.values())
    impossible = next((t for t in counts if p[t] == 0), None)
    expected = p * n
    common = (expected >= MIN_EXPECTED).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in common]
    wanted = [float(expected[t]) for t in common]
    rest = n - sum(observed), n - sum(wanted)
    if rest[1] >= 1e-9:  # the pooled bin of the rarer tokens
        observed.append(rest[0])
        wanted.append(rest[1])
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    dof = max(len(wanted) - 1, 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return DistributionTest(name, drafter, position, n, round(stat, 3), dof, p_value, impossible, alpha)


def describe(item: Check | DistributionTest) -> str:
    """One line for the terminal."""
    if isinstance(item, DistributionTest):
        head = f"{item.drafter:14s} {item.prompt}: token {item.position} of {item.samples} seeded samples"
        if item.impossible is not None:
            return f"{head}: FAILS, sampled token {item.impossible}, which the target gives probability 0"
        verdict = "matches" if item.passed else "FAILS"
        return (f"{head} {verdict} the target's distribution (chi-square {item.statistic:.1f}, {item.dof} dof, "
                f"p = {item.p_value:.3g}, threshold {item.alpha:g})")
    head = f"{'plain' if item.drafter == 'none' else item.drafter:14s} {item.path:7s} {item.prompt}"
    d = item.difference
    if d is None:
        return f"{head}: identical ({item.tokens} tokens)"
    margin = "" if d.margin is None else f"; the target's logit margin there {d.margin:.4g}"
    return (f"{head}: DIFFERS at token {d.position}, after {d.context!r}: plain {d.expected_text!r} ({d.expected}), "
            f"speculative {d.got_text!r} ({d.got}){margin}")
