"""Proofs of losslessness: greedy identity, exact sampling distribution, rollback, bad input."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdecode.builder import build_generator, make_drafter
from specdecode.drafting.hybrid import HybridDrafter
from specdecode.drafting.model import ModelDrafter
from specdecode.drafting.ngram import NgramDrafter
from specdecode.drafting.none import NoDrafter
from specdecode.draft_lengths import CostModel, GammaSchedule, Timings
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.models.loading import load_model
from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.rejection import verify_sampling
from specdecode.verification.sampling import COUPLINGS, SamplingParams, processed_probs
from tests.conftest import perturbed, save_tiny, tiny_hf_model, tiny_tokenizer

N_PROMPTS = 50
NEW_TOKENS = 24


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    prompts = []
    for _ in range(n):
        base = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 12))]
        prompts.append((base * rnd.randint(1, 3))[:40])  # repetitions give the n-gram drafter matches
    return prompts


@pytest.fixture(scope="module")
def plain_outputs(tiny_pair):
    target, _ = tiny_pair
    gen = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    return [gen.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids
            for p in random_prompts(N_PROMPTS, 64)]


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("gamma,adaptive", [(1, False), (2, False), (3, False), (5, False), (8, False), (3, True)])
def test_greedy_speculative_equals_plain_greedy(tiny_pair, plain_outputs, drafter_kind, gamma, adaptive):
    target, draft = tiny_pair
    drafter = make_drafter(drafter_kind, target, draft, gamma=min(gamma, 3), chooses_lengths=adaptive)
    gen = SpeculativeGenerator(target.model, drafter, target.tokenizer, GammaSchedule(gamma, adaptive))
    accepted = 0
    for prompt, expected in zip(random_prompts(N_PROMPTS, 64), plain_outputs):
        result = gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == expected, f"prompt {prompt}"
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # the drafts were really used, not all rejected


def _costs(forward: dict[int, float], draft: float, accepted: float, rejected: float) -> CostModel:
    return CostModel(Timings(forward=dict(forward), draft=draft), accepted=accepted, rejected=rejected,
                     drafted_tokens=CostModel.WARM_UP)


def test_the_cost_model_waits_for_two_widths_and_a_draft():
    costs = CostModel(drafted_tokens=CostModel.WARM_UP)  # past the warm-up (its own test)
    assert costs.best_gamma(8) is None
    costs.observe(5, 0.1, 4, 3, 2.0)  # a request's first draft also fills the draft model's cache: not its cost
    assert costs.best_gamma(8) is None and costs.timings.draft is None
    costs.observe(5, 0.1, 4, 3, 0.04)
    assert costs.best_gamma(8) is None and costs.timings.draft == pytest.approx(0.01)  # one width: no slope yet
    costs.observe(9, 0.2, 8, 8, 0.08)
    assert costs.best_gamma(8) is not None
    assert costs.timings.forward_seconds(1) == pytest.approx(0.025)  # extrapolated to 0, bounded below by a quarter
    assert costs.timings.forward_seconds(7) == pytest.approx(0.15)


def test_the_cost_model_trusts_the_acceptance_after_a_warm_up():
    costs = CostModel()
    for width, accepted in ((5, 1), (3, 0), (2, 0)):  # two timed widths, a steady draft, 3 of 7 accepted
        costs.observe(width, 0.05 * width, width - 1, accepted, 0.01 * (width - 1))
    assert costs.best_gamma(8) is None  # 7 drafted tokens say little: the grow/shrink rule goes on
    for _ in range(3):
        costs.observe(4, 0.2, 3, 1, 0.03)
    assert costs.best_gamma(8) is not None


def test_the_acceptance_is_averaged_slowly_but_probes_count_fully():
    costs = CostModel()
    costs.observe(5, 0.1, 4, 4, 0.04)
    assert (costs.accepted, costs.rejected) == pytest.approx((0.97 + 4, 0.97))
    costs.probe_step = True  # set by best_gamma when it chooses a probe
    costs.observe(2, 0.05, 1, 0, 0.01)
    assert (costs.accepted, costs.rejected) == pytest.approx((0.9 * 4.97, 0.9 * 0.97 + 1))


def test_the_cost_model_takes_plain_steps_where_drafting_does_not_pay_and_probes():
    # an AVX2 CPU: a verify of 5 tokens costs 2.2 plain steps and a draft token half of one; 60% acceptance
    costs = _costs({1: 0.048, 5: 0.103, 9: 0.19}, draft=0.023, accepted=6, rejected=4)
    costs.observe(2, 0.062, 1, 1, 5.0)  # a probe after plain steps catches the draft model up: not its cost
    assert costs.timings.draft == 0.023
    costs.accepted, costs.rejected = 6, 4
    choices = [costs.best_gamma(8) for _ in range(CostModel.PROBE_AFTER + 4)]
    probe = [1, 1, 0]  # two drafting steps in a row: the second measures the draft's cost again
    assert choices == [0] * CostModel.PROBE_AFTER + probe + [0]
    # each probe that ends in plain steps doubles the wait for the next: it makes the draft read the context
    choices += [costs.best_gamma(8) for _ in range(5000)]
    probes = [i for i in range(1, len(choices)) if choices[i] and not choices[i - 1]]
    waits = [b - a for a, b in zip(probes, probes[1:])]
    assert waits[:4] == [m * CostModel.PROBE_AFTER + 1 for m in (2, 4, 8, 16)]  # + the first probe step
    assert max(waits) == CostModel.MAX_PROBE_AFTER + 1
    # once drafting pays again, probes come at the first pace
    costs.timings.draft = 0.001
    assert costs.best_gamma(8) > 0 and costs.probe_after == CostModel.PROBE_AFTER


def test_the_cost_model_drafts_long_where_verifying_is_flat():
    costs = _costs({1: 0.056, 9: 0.082}, draft=0.002, accepted=18, rejected=1)  # AMX int4 target, n-gram drafts
    assert costs.best_gamma(8) == 8
    costs = _costs({1: 0.056, 9: 0.082}, draft=0.021, accepted=9, rejected=1)  # a 0.5B draft model: dearer
    assert 2 <= costs.best_gamma(8) < 8


def test_the_cost_model_keeps_lookups_short_where_verifying_is_steep():
    steep = {1: 0.042, 2: 0.054, 5: 0.082, 9: 0.135}  # w4a8 on an AVX2 Zen 3 (runtime-bench, 1.5B)
    assert costs_pick(steep, accepted=1, rejected=1) <= 2  # copied tokens are free, but verifying them is not
    assert costs_pick(steep, accepted=1, rejected=4) == 0  # mostly wrong lookups: plain steps
    assert costs_pick(steep, accepted=30, rejected=1) >= 6  # long copies: worth a wide verify


def costs_pick(forward: dict[int, float], accepted: float, rejected: float) -> int:
    return _costs(forward, draft=1e-5, accepted=accepted, rejected=rejected).best_gamma(8)


def test_draft_lengths_are_chosen_each_step_unless_a_gamma_is_given(tiny_pair, plain_outputs):
    target, draft = tiny_pair
    gen = build_generator(target, drafter="ngram")
    assert gen.gamma.adaptive and gen.gamma.initial == 8  # lookups start long; the cost model shortens them
    for prompt, expected in zip(random_prompts(N_PROMPTS, 64)[:10], plain_outputs):
        assert gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids == expected
    model = build_generator(target, draft=draft, drafter="model")
    assert model.gamma.adaptive and model.gamma.initial == 4 and model.drafter.min_path > 0
    for kind in ("model", "ngram", "hybrid"):
        fixed = build_generator(target, draft=draft, drafter=kind, gamma=3)
        assert not fixed.gamma.adaptive and fixed.gamma.initial == 3
    hybrid = build_generator(target, draft=draft)  # the default drafter
    assert isinstance(hybrid.drafter, HybridDrafter)
    assert not hybrid.gamma.adaptive and hybrid.gamma.initial == 4  # its fixed lengths: 4 copied, 4 model tokens


def test_hybrid_drafts_by_lookup_alone_after_a_prompt_longer_than_the_drafts_window(tiny_pair, plain_outputs):
    target, draft = tiny_pair
    hybrid = HybridDrafter(ModelDrafter(draft.model, 64, 256, window=8), model_gamma=3)
    asked: list[int] = []
    propose = hybrid.model.propose_batch
    hybrid.model.propose_batch = lambda requests: asked.extend(len(r.context) for r in requests) or propose(requests)
    gen = SpeculativeGenerator(target.model, hybrid, target.tokenizer, GammaSchedule(3))
    short_asked = 0
    for prompt, expected in list(zip(random_prompts(N_PROMPTS, 64), plain_outputs))[:20]:
        asked.clear()
        assert gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids == expected
        if len(prompt) > 8:
            assert not asked, f"a prompt of {len(prompt)} tokens asked the draft model"
        short_asked += len(asked)
    assert short_asked > 0  # shorter prompts did (beyond 8 tokens of context too)


def test_greedy_output_is_plain_decodings_whatever_the_cost_model_chooses(tiny_pair, plain_outputs):
    target, draft = tiny_pair
    drafter = make_drafter("model", target, draft, chooses_lengths=True)
    gen = SpeculativeGenerator(target.model, drafter, target.tokenizer,
                               GammaSchedule(3, adaptive=True))
    gen.costs = _costs({1: 1.0, 2: 3.0}, draft=1.0, accepted=1, rejected=1)  # drafting looks hopeless: mostly plain
    gen.costs.timings.decay = 1.0  # keep these numbers whatever is measured
    steps = drafted_steps = 0
    for prompt, expected in zip(random_prompts(N_PROMPTS, 64)[:20], plain_outputs):
        result = gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == expected, f"prompt {prompt}"
        steps += result.stats.target_forward_passes
        drafted_steps += result.stats.drafts
    assert 0 < drafted_steps < steps / 4  # mostly plain steps, and the probes drafted


# ---- exact distribution of the first two tokens, by enumeration, against 120k speculative samples ----

V = 12
PROMPT = [3, 7, 1, 7]
N_SAMPLES = 120_000


def small_vocab_models(root, device: str = "cpu") -> dict:
    """A 12-token target, a draft near it, one far from it, and the near one with a reduced vocabulary."""
    shape = dict(vocab=V, hidden=32, heads=2, kv_heads=1, layers=1, sharpen=12.0)
    target_hf = tiny_hf_model("llama", seed=5, **shape)
    near = perturbed(target_hf, 0.5, seed=6)
    far = tiny_hf_model("llama", seed=7, **shape)

    def load(name, m, **kw):
        return load_model(save_tiny(root / name, m), with_tokenizer=False, device=device, **kw).model

    return {"target": load("t", target_hf), "near": load("near", near), "far": load("far", far),
            "near-reduced": load("near-reduced", near, head_rows=7)}  # proposes only ids 0..6 of 12


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return small_vocab_models(tmp_path_factory.mktemp("small"))


def logit_tables(model, prompt: list[int] = PROMPT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits after prompt, prompt+a and prompt+a+b for every a, b: [V], [V, V], [V, V, V]."""
    rows = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # [V*V, len+2]
    cache = model.new_cache(V * V, 16)
    logits = model(rows, torch.zeros(V * V, dtype=torch.long), cache)[:, -3:]  # [V*V, 3, V]
    logits = logits.view(V, V, 3, V)
    return logits[0, 0, 0], logits[:, 0, 1], logits[:, :, 2]


def speculative_first_two(target, draft, params: SamplingParams, *, seed: int, point_mass: bool = False) -> np.ndarray:
    """Counts of (t1, t2) over N_SAMPLES runs of one gamma = 2 speculative step (batched)."""
    g = torch.Generator().manual_seed(seed)
    P1, P2, P3 = logit_tables(target)
    Q1, Q2, _ = logit_tables(draft)
    N = N_SAMPLES
    if point_mass:  # a deterministic drafter: always propose the draft model's argmax
        d1 = torch.full((N,), int(Q1.argmax()))
        d2 = Q2.argmax(-1)[d1]
        q = None
    else:
        q1, q2 = processed_probs(Q1, params), processed_probs(Q2, params)
        d1 = torch.multinomial(q1, N, replacement=True, generator=g)
        d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(1)
        q = torch.stack([q1.expand(N, V), q2[d1]], dim=1)  # [N, 2, V]
    logits = torch.stack([P1.expand(N, V), P2[d1], P3[d1, d2]], dim=1)  # [N, 3, V]
    n, nxt = verify_sampling(logits, torch.stack([d1, d2], 1), q, params, g)
    t1 = torch.where(n == 0, nxt, d1)
    second_from_target = torch.multinomial(processed_probs(P2, params)[t1], 1, generator=g).squeeze(1)
    t2 = torch.where(n == 0, second_from_target, torch.where(n == 1, nxt, d2))
    return torch.bincount(t1 * V + t2, minlength=V * V).numpy()


def exact_first_two(target, params: SamplingParams) -> np.ndarray:
    P1, P2, _ = logit_tables(target)
    p1, p2 = processed_probs(P1, params), processed_probs(P2, params)
    return (p1.unsqueeze(1) * p2).flatten().double().numpy()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square; zero-probability cells must stay empty, small cells are pooled."""
    assert counts[probs == 0].sum() == 0, "a token with probability 0 was produced"
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


SETTINGS = {
    "temperature 1": (SamplingParams(1.0), "near"),
    "temperature 0.7": (SamplingParams(0.7), "near"),
    "top-k 3": (SamplingParams(1.0, top_k=3), "near"),
    "top-p 0.8": (SamplingParams(1.0, top_p=0.8), "near"),
    "far draft": (SamplingParams(1.0), "far"),
    "far draft, top-k 5, temperature 0.5": (SamplingParams(0.5, top_k=5), "far"),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_matches_target_distribution(small_vocab, setting):
    params, draft = SETTINGS[setting]
    counts = speculative_first_two(small_vocab["target"], small_vocab[draft], params, seed=11)
    assert chi_square_p(counts, exact_first_two(small_vocab["target"], params)) > 1e-3


def test_point_mass_drafter_matches_target_distribution(small_vocab):
    params = SamplingParams(0.8, top_p=0.9)
    counts = speculative_first_two(small_vocab["target"], small_vocab["near"], params, seed=12, point_mass=True)
    assert chi_square_p(counts, exact_first_two(small_vocab["target"], params)) > 1e-3


@pytest.mark.parametrize("bug", ["correction sampled from p, not the residual", "q from another temperature"])
def test_the_distribution_test_catches_a_planted_bug(small_vocab, bug):
    params = SamplingParams(1.0)
    g = torch.Generator().manual_seed(14)
    P1, P2, P3 = logit_tables(small_vocab["target"])
    Q1, Q2, _ = logit_tables(small_vocab["far"])
    q_params = SamplingParams(2.0) if bug == "q from another temperature" else params
    q1, q2 = processed_probs(Q1, params), processed_probs(Q2, params)
    d1 = torch.multinomial(q1, N_SAMPLES, replacement=True, generator=g)
    d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(1)
    claimed_q = torch.stack([processed_probs(Q1, q_params).expand(N_SAMPLES, V), processed_probs(Q2, q_params)[d1]], 1)
    logits = torch.stack([P1.expand(N_SAMPLES, V), P2[d1], P3[d1, d2]], dim=1)
    n, nxt = verify_sampling(logits, torch.stack([d1, d2], 1), claimed_q, params, g)
    if bug == "correction sampled from p, not the residual":
        p_at_n = processed_probs(logits, params)[torch.arange(N_SAMPLES), n]
        nxt = torch.where(n < 2, torch.multinomial(p_at_n, 1, generator=g).squeeze(1), nxt)
    t1 = torch.where(n == 0, nxt, d1)
    t2 = torch.where(n == 0, torch.multinomial(processed_probs(P2, params)[t1], 1, generator=g).squeeze(1),
                     torch.where(n == 1, nxt, d2))
    counts = torch.bincount(t1 * V + t2, minlength=V * V).numpy()
    assert chi_square_p(counts, exact_first_two(small_vocab["target"], params)) < 1e-3


@pytest.mark.parametrize("kind,coupling", [("model", "rejection"), ("hybrid", "rejection"), ("model", "gumbel"),
                                           ("reduced", "rejection"), ("reduced", "gumbel")])
def test_engine_sampling_first_token_distribution_and_seeds(small_vocab, kind, coupling):
    """End to end through the engine (gamma 3): first-token frequencies match p. The hybrid's prompt repeats
    itself, so its first draft is a copied point mass and later ones come from the draft model. The reduced
    draft only knows 7 of the 12 tokens: the others can only come from the residual distribution."""
    target, near = small_vocab["target"], small_vocab["near-reduced" if kind == "reduced" else "near"]
    params = SamplingParams(1.0, top_k=6)
    model = ModelDrafter(near, V, 64)
    drafter = HybridDrafter(model, model_gamma=3) if kind == "hybrid" else model
    prompt = [1, 7, 3, 1, 7] if kind == "hybrid" else PROMPT
    gen = SpeculativeGenerator(target, drafter, None, GammaSchedule(3), max_context=64)
    first = [gen.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=6, seed=s, eos_ids=[],
                          coupling=coupling).token_ids[0] for s in range(600)]
    p1 = processed_probs(logit_tables(target, prompt)[0], params).double().numpy()
    assert chi_square_p(np.bincount(first, minlength=V), p1) > 1e-3
    a = gen.generate(prompt, max_new_tokens=20, temperature=1.0, seed=5, eos_ids=[], coupling=coupling)
    b = gen.generate(prompt, max_new_tokens=20, temperature=1.0, seed=5, eos_ids=[], coupling=coupling)
    assert a.token_ids == b.token_ids  # a seed reproduces a run


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_a_seed_reproduces_a_sample_whatever_the_costs_measured_before(tiny_pair, coupling):
    """Draft lengths chosen from timings vary between runs; a seeded sample must not: with rejection coupling its
    draws depend on the lengths, so it takes the grow/shrink rule instead."""
    target, draft = tiny_pair
    gen = build_generator(target, draft=draft, drafter="model")
    assert gen.gamma.adaptive
    runs = []
    for forward, accepted in (({1: 1.0, 2: 1.0}, 30), ({1: 1.0, 2: 3.0}, 1)):  # costs that pick 8 drafts, then 0
        gen.costs = _costs(forward, draft=1e-5, accepted=accepted, rejected=1)
        gen.costs.timings.decay = 1.0
        runs.append([gen.generate(p, max_new_tokens=24, temperature=1.0, seed=s, eos_ids=[],
                                  coupling=coupling).token_ids for s, p in enumerate(random_prompts(6, 64, seed=3))])
    assert runs[0] == runs[1]


# ---- Gumbel coupling: exact samples, and the same tokens whatever the drafter and gamma ----

def gumbel_first_two(target, params: SamplingParams, n: int, noise_fn=gumbel_noise) -> np.ndarray:
    """Counts of (t1, t2) from plain Gumbel-coupled sampling over n seeds."""
    P1, P2, _ = logit_tables(target)
    pos = len(PROMPT)
    noise = torch.stack([noise_fn(s, [pos, pos + 1], V) for s in range(n)])  # [n, 2, V]
    t1 = noisy_scores(processed_probs(P1, params), noise[:, 0]).argmax(-1)
    t2 = noisy_scores(processed_probs(P2, params)[t1], noise[:, 1]).argmax(-1)
    return torch.bincount(t1 * V + t2, minlength=V * V).numpy()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6, top_k=5), SamplingParams(1.0, top_p=0.8)],
                         ids=["temperature 1", "temperature 0.6 top-k 5", "top-p 0.8"])
def test_gumbel_coupled_samples_follow_the_target_distribution(small_vocab, params):
    counts = gumbel_first_two(small_vocab["target"], params, 30_000)
    assert chi_square_p(counts, exact_first_two(small_vocab["target"], params)) > 1e-3


def test_the_gumbel_distribution_test_catches_noise_shared_across_positions(small_vocab):
    params = SamplingParams(1.0)
    shared = lambda seed, positions, vocab: gumbel_noise(seed, [0] * len(positions), vocab)  # noqa: E731
    counts = gumbel_first_two(small_vocab["target"], params, 30_000, noise_fn=shared)
    assert chi_square_p(counts, exact_first_two(small_vocab["target"], params)) < 1e-3


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "hybrid"])
def test_gumbel_seeded_output_equals_plain_seeded_output(tiny_pair, drafter_kind):
    target, draft = tiny_pair
    plain = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    request = dict(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, eos_ids=[], coupling="gumbel")
    prompts = random_prompts(20, 64)
    expected = [plain.generate(p, seed=i, **request).token_ids for i, p in enumerate(prompts)]
    for gamma in (1, 3, 8):
        drafter = make_drafter(drafter_kind, target, draft, gamma=min(gamma, 4))
        gen = SpeculativeGenerator(target.model, drafter, target.tokenizer, GammaSchedule(gamma))
        accepted = 0
        for i, (p, exp) in enumerate(zip(prompts, expected)):
            r = gen.generate(p, seed=i, **request)
            assert r.token_ids == exp, f"gamma {gamma}, prompt {i}"
            accepted += r.stats.accepted_tokens
        assert accepted > 0
    other_seed = [plain.generate(p, seed=i + 1, **request).token_ids for i, p in enumerate(prompts)]
    assert other_seed != expected  # the seed matters: the test is not comparing constants


# ---- rollback and bad input ----

def test_caches_after_rejections_equal_a_fresh_forward(tiny_pair):
    target, draft = tiny_pair
    drafter = ModelDrafter(draft.model, 64, 256)
    gen = SpeculativeGenerator(target.model, drafter, None, GammaSchedule(5), max_context=256)
    result = gen.generate([5, 9, 13, 5, 9], max_new_tokens=60, eos_ids=[])
    assert result.stats.accepted_tokens < result.stats.drafted_tokens  # there were rejections
    ids = [5, 9, 13, 5, 9] + result.token_ids
    for model, cache, n in [(target.model, gen.cache, len(ids) - 1),
                            (draft.model, drafter.cache, len(drafter.cached[0]))]:
        fresh = model.new_cache(1, 256)
        model(torch.tensor([ids[:n]]), torch.tensor([0]), fresh, num_logits=0)
        torch.testing.assert_close(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-5, rtol=0)
    assert drafter.cached[0] == ids[:len(drafter.cached[0])]


def test_plain_steps_leave_the_draft_model_alone_and_the_next_draft_catches_up(tiny_pair):
    target, draft = tiny_pair
    params = SamplingParams()
    drafter = ModelDrafter(draft.model, 64, 256)
    context = [5, 9, 13, 5, 9, 1, 2, 3] * 4  # 32 tokens: longer than a shared feed
    assert drafter.propose(context, 0, params, None).tokens == []
    assert drafter.cached[0] == []  # no forward of the draft model for a plain step
    fresh = ModelDrafter(draft.model, 64, 256)
    later = context + [7, 7]
    assert drafter.propose(later, 3, params, None).tokens == fresh.propose(later, 3, params, None).tokens
    assert drafter.cached[0][:34] == context + [7, 7]


def test_the_draft_model_reads_the_window_of_a_new_context(tiny_pair, plain_outputs):
    target, draft = tiny_pair
    params = SamplingParams()
    drafter = ModelDrafter(draft.model, 64, 256, window=8)
    context = [5, 9, 13, 5, 9, 1, 2, 3, 11, 17] * 3  # 30 tokens
    tokens = drafter.propose(context, 3, params, None).tokens
    assert drafter.offset[0] == 22 and drafter.cached[0] == context[22:] + tokens[:-1]
    assert tokens == ModelDrafter(draft.model, 64, 256).propose(context[22:], 3, params, None).tokens  # that alone
    later = context + [tokens[0], 7]
    drafter.propose(later, 2, params, None)
    assert drafter.offset[0] == 22 and drafter.cached[0][:9] == later[22:31]  # the same window, grown
    drafter.propose([4, 4, 4], 2, params, None)  # another context: a window of its own
    assert drafter.offset[0] == 0 and drafter.cached[0][:2] == [4, 4]
    drafter.propose([4, 4, 6, 6, 6], 2, params, None)  # what it shares is kept, the rest fed
    assert drafter.offset[0] == 0 and drafter.cached[0][:4] == [4, 4, 6, 6]
    longer = [4, 4] + context  # shares a prefix, but more than a window is new: a new window
    drafter.propose(longer, 2, params, None)
    assert drafter.offset[0] == 24 and drafter.cached[0][:7] == longer[24:31]
    # and greedy decoding with it is plain decoding's
    gen = SpeculativeGenerator(target.model, ModelDrafter(draft.model, 64, 256, window=4), target.tokenizer,
                               GammaSchedule(3))
    accepted = 0
    for prompt, expected in list(zip(random_prompts(N_PROMPTS, 64), plain_outputs))[:20]:
        result = gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == expected, f"prompt {prompt}"
        accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_the_draft_model_keeps_what_a_next_request_shares(tiny_pair, plain_outputs):
    target, draft = tiny_pair
    params = SamplingParams()
    drafter = ModelDrafter(draft.model, 64, 256, window=8)
    fed: list[list[int]] = []
    forward = drafter._forward
    drafter._forward = lambda rows, feeds, logits=True: fed.append(feeds[0]) or forward(rows, feeds, logits)
    first = [5, 9, 13, 5, 9, 1, 2]
    drafter.propose(first, 2, params, None)
    drafter.reset(0)  # a next request with the same first five tokens (a system prompt): only the rest is fed
    fed.clear()
    drafter.propose(first[:5] + [7, 7, 3], 2, params, None)
    assert fed[0] == [7, 7, 3] and drafter.cached[0][:5] == first[:5]
    drafter.propose(list(range(1, 30)), 2, params, None)  # a window that starts later
    assert drafter.offset[0] == 21
    drafter.reset(0)  # is dropped at the next request: what came before it is not known
    fed.clear()
    other = [40] * 21 + list(range(22, 30))  # the same tokens in the window, others before it
    drafter.propose(other, 2, params, None)
    assert drafter.offset[0] == 21 and fed[0] == other[21:]
    # a seeded sample with rejection coupling reads its context afresh, shared or not (its output depends on q)
    drafter.propose(first, 2, params, None)
    drafter.reset(0)
    fed.clear()
    seeded = SamplingParams(temperature=1.0, seed=3)
    drafter.propose(first[:5] + [7, 7, 3], 2, seeded, seeded.generator())
    assert fed[0] == first[:5] + [7, 7, 3]
    fed.clear()
    drafter.propose(first[:5] + [7, 7, 3, 1], 2, seeded, seeded.generator())  # within its request: reused
    assert fed[0] == [1]
    drafter.forget()  # a new process: nothing cached
    assert drafter.cached[0] == [] and drafter.offset[0] == 0
    # and greedy decoding with one drafter across requests is plain decoding's
    gen = SpeculativeGenerator(target.model, ModelDrafter(draft.model, 64, 256), target.tokenizer, GammaSchedule(3))
    for prompt, expected in list(zip(random_prompts(N_PROMPTS, 64), plain_outputs))[:10]:
        assert gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids == expected, f"prompt {prompt}"


def test_bad_requests_get_clear_errors(tiny_pair):
    target, _ = tiny_pair
    gen = SpeculativeGenerator(target.model, NgramDrafter(), target.tokenizer, max_context=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        gen.generate("")
    with pytest.raises(InvalidRequestError, match="empty"):
        gen.generate([])
    with pytest.raises(InvalidRequestError, match="top_p"):
        gen.generate([1, 2], top_p=0.0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        gen.generate([1, 2], top_p=1.5)
    with pytest.raises(InvalidRequestError, match="temperature"):
        gen.generate([1, 2], temperature=-1)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        gen.generate([1, 2], max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="the context holds 64"):
        gen.generate(list(range(64)))
    with pytest.raises(InvalidRequestError, match=r"\[0, 64\)"):
        gen.generate([1, 64])
    for bad in (0, -2):
        with pytest.raises(InvalidRequestError, match="gamma"):
            GammaSchedule(bad)


def test_mismatched_tokenizers_are_refused(tiny_pair, tmp_path):
    target, _ = tiny_pair
    other = load_model(save_tiny(tmp_path / "other", tiny_hf_model("qwen2", seed=9), tiny_tokenizer(shuffle_seed=1)))
    with pytest.raises(ModelLoadError, match="same tokenizer"):
        make_drafter("model", target, other)


def test_stop_strings_and_streaming_text(tiny_pair):
    target, _ = tiny_pair
    gen = SpeculativeGenerator(target.model, NgramDrafter(), target.tokenizer)
    full = gen.generate("Hello world. ", max_new_tokens=12, eos_ids=[])
    stream = gen.stream("Hello world. ", max_new_tokens=12, eos_ids=[])
    assert "".join(e.text for e in stream) == full.text == stream.result.text
    assert len(full.text) >= 8
    stop = full.text[5:7]
    cut = gen.generate("Hello world. ", max_new_tokens=12, eos_ids=[], stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)


def test_small_vocab_distributions_are_not_flat(small_vocab):
    """The statistical tests only have power if p is far from uniform and the far draft disagrees."""
    P1, P2, _ = logit_tables(small_vocab["target"])
    Q1, _, _ = logit_tables(small_vocab["far"])
    p1, q1 = torch.softmax(P1, -1), torch.softmax(Q1, -1)
    assert p1.max() > 0.3 and (p1 - q1).abs().sum() > 0.5
