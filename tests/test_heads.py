"""Learned drafting heads: training (loss, resume, acceptance), lossless drafting with EAGLE-3 and Medusa heads, the
speculators format, and heads that do not fit the target."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.builder import build_generator, make_drafter
from specdecode.draft_lengths import GammaSchedule
from specdecode.drafting.base import ObservedFeatures
from specdecode.drafting.eagle3 import Eagle3Drafter
from specdecode.drafting.none import NoDrafter
from specdecode.engine import SpeculativeGenerator
from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.heads import data
from specdecode.heads import train as training
from specdecode.heads.eagle3 import Eagle3Head
from specdecode.heads.data import greedy_continued
from specdecode.heads.format import load_head, save_head
from specdecode.heads.medusa import MedusaHeads
from specdecode.heads.train import TrainOptions, new_head, train_draft
from specdecode.models.loading import load_model
from specdecode.verification.sampling import SamplingParams, processed_probs
from specdecode.serving.scheduler import build_scheduler
from tests.conftest import save_tiny, tiny_hf_model, tiny_tokenizer
from tests.test_lossless import NEW_TOKENS, V, chi_square_p, logit_tables, random_prompts
from tests.test_scheduler import _prompts, _run_batched

TINY = dict(seq_len=64, draft_vocab=48, conversations=8, eval_every=4, checkpoint_minutes=100.0, vocab_tokens=20_000)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A folder of seeded text in the tiny tokenizer's alphabet (the training text: the same on every machine)."""
    import random

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(60)]
    for i in range(12):
        (root / "sub").mkdir(exist_ok=True)
        (root / ("sub" if i % 2 else ".") / f"f{i}.txt").write_text(
            ". ".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(60)))
    (root / "skipped.bin").write_bytes(bytes(range(256)))
    return str(root)


@pytest.fixture(scope="module")
def trained(tiny_pair, corpus, tmp_path_factory):
    """An EAGLE-3 head and Medusa heads trained briefly on the tiny target (the same runs the training tests read)."""
    target, _ = tiny_pair
    out = {}
    for kind in ("eagle3", "medusa"):
        d = tmp_path_factory.mktemp(kind)
        train_draft(target, d, TrainOptions(kind=kind, tokens=64 * 48, text=(corpus,), **TINY), progress=False)
        out[kind] = d
    return out


def test_training_lowers_the_loss_and_beats_an_untrained_head(tiny_pair, corpus, trained):
    target, _ = tiny_pair
    for kind, d in trained.items():
        curve = json.loads((d / "curve.json").read_text())
        assert curve[0]["tokens"] == 0 and curve[-1]["tokens"] >= 64 * 24  # a learning curve from the start
        # the loss on chunks it trained on, against the same head untrained (this random target's distributions are
        # near uniform: the cross-entropy's floor, their entropy, is close to where training starts)
        head = load_head(d, target.model)
        opts = TrainOptions(kind=kind, text=(corpus,), **TINY)
        torch.manual_seed(opts.seed)
        untrained = new_head(opts, target.model, head.draft_ids)
        convs = json.loads((d / "conversations.json").read_text())["conversations"]
        feats = training.Features(target.model, training.feature_layers(head), head.draft_ids, opts.seq_len)
        seen = [feats(c) for c in islice(data.chunks(convs, target.tokenizer, opts.seed, opts.seq_len,
                                                     (Path(corpus),)), training.HELD_OUT, training.HELD_OUT + 12)]
        steps = opts.ttt_steps if kind == "eagle3" else opts.medusa_heads
        with torch.no_grad():
            losses = [sum(float(training.loss_of(h, target.model, r, steps)) for r in seen)
                      for h in (head, untrained)]
        assert losses[0] < 0.995 * losses[1], (kind, losses)  # untrained, they are equal
    # acceptance of greedy chains the target continues itself, against the same head untrained. (An untrained Medusa
    # head is the target's own next-token prediction, zero blocks, which this tiny target's looping continuations
    # already favour: Medusa is held to its loss.)
    chains = greedy_continued(target.model, target.tokenizer, [(p * 64)[:64] for p in random_prompts(16, 64, seed=9)])
    head = load_head(trained["eagle3"], target.model)
    untrained = new_head(TrainOptions(kind="eagle3", **TINY), target.model, head.draft_ids)
    feats = training.Features(target.model, training.feature_layers(head), head.draft_ids, 64)
    recs = [feats(c) for c in chains]
    trained_acc, untrained_acc = training.acceptance(head, target.model, recs), \
        training.acceptance(untrained, target.model, recs)
    assert trained_acc[0] > untrained_acc[0] + 0.1, (trained_acc, untrained_acc)


def test_a_resumed_run_equals_an_uninterrupted_one(tiny_pair, corpus, tmp_path):
    target, _ = tiny_pair
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    opts = dict(kind="eagle3", text=(corpus,), **TINY | {"checkpoint_minutes": 0.0})
    train_draft(target, straight, TrainOptions(tokens=64 * 8, **opts), progress=False)
    train_draft(target, resumed, TrainOptions(tokens=64 * 4, **opts), progress=False)
    train_draft(target, resumed, TrainOptions(tokens=64 * 8, **opts), progress=False, resume=True)
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(resumed / "checkpoint.pt", weights_only=False)
    assert a["tokens"] == b["tokens"] and a["steps"] == b["steps"]
    for k in a["head"]:
        assert torch.equal(a["head"][k], b["head"][k]), k
    with pytest.raises(InvalidRequestError, match="other options"):
        train_draft(target, resumed, TrainOptions(tokens=64 * 9, **opts | {"seed": 1}), progress=False,
                    resume=True)


def test_bad_training_options_are_refused(tiny_pair, tmp_path):
    target, _ = tiny_pair
    for bad in (dict(kind="lookahead"), dict(minutes=0), dict(draft_vocab=3), dict(text=(str(tmp_path / "no"),))):
        with pytest.raises(InvalidRequestError):
            train_draft(target, tmp_path, TrainOptions(**TINY | bad), progress=False)


@pytest.fixture(scope="module")
def plain_outputs(tiny_pair):
    target, _ = tiny_pair
    gen = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    return [gen.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids for p in random_prompts(20, 64)]


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
@pytest.mark.parametrize("gamma,adaptive", [(1, False), (3, False), (8, False), (4, True)])
def test_greedy_with_a_head_equals_plain_greedy(tiny_pair, trained, plain_outputs, kind, gamma, adaptive):
    target, _ = tiny_pair
    head = load_head(trained[kind], target.model)
    drafter = make_drafter(kind, target, None, head=head, gamma=gamma, chooses_lengths=adaptive)
    gen = SpeculativeGenerator(target.model, drafter, target.tokenizer, GammaSchedule(gamma, adaptive))
    accepted = 0
    for prompt, expected in zip(random_prompts(20, 64), plain_outputs):
        result = gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == expected, f"prompt {prompt}"
        accepted += result.stats.accepted_tokens
    # the head's drafts were really used (chosen lengths follow measured timings, which may choose not to draft)
    assert accepted > 0 or adaptive


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_gumbel_seeded_output_with_a_head_equals_plain(tiny_pair, trained, kind):
    target, _ = tiny_pair
    plain = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    request = dict(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, eos_ids=[], coupling="gumbel")
    prompts = random_prompts(12, 64)
    expected = [plain.generate(p, seed=i, **request).token_ids for i, p in enumerate(prompts)]
    drafter = make_drafter(kind, target, None, head=load_head(trained[kind], target.model), gamma=4)
    gen = SpeculativeGenerator(target.model, drafter, target.tokenizer, GammaSchedule(4))
    accepted = 0
    for i, (p, exp) in enumerate(zip(prompts, expected)):
        r = gen.generate(p, seed=i, **request)
        assert r.token_ids == exp, f"prompt {i}"
        accepted += r.stats.accepted_tokens
    assert accepted > 0


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """A 12-token target (tests/test_lossless.py's) with an untrained head: its drafts are far from the target's."""
    root = tmp_path_factory.mktemp("small-head")
    hf = tiny_hf_model("llama", seed=5, vocab=V, hidden=32, heads=2, kv_heads=1, layers=1, sharpen=12.0)
    return load_model(save_tiny(root / "t", hf), with_tokenizer=False)


class LyingDrafter(Eagle3Drafter):
    """A planted bug: the q it reports is not the one it sampled from (a hotter one)."""

    def propose_batch(self, requests):
        drafts = super().propose_batch(requests)
        for d in drafts:
            if d.probs is not None:
                d.probs = torch.softmax(torch.log(d.probs.clamp_min(1e-30)) / 3, -1)
        return drafts


@pytest.mark.parametrize("drafter_cls,passes", [(Eagle3Drafter, True), (LyingDrafter, False)])
def test_sampling_with_a_head_keeps_the_target_distribution(small_target, drafter_cls, passes):
    """First-token frequencies through the engine (gamma 3) against p; the lying drafter must fail the same test."""
    torch.manual_seed(0)
    head = new_head(TrainOptions(kind="eagle3", draft_vocab=8), small_target.model, torch.arange(8))
    with torch.no_grad():  # a head whose drafts vary with its input: random weights everywhere
        for p in head.parameters():
            p.normal_(0, 0.5)
    drafter = drafter_cls(head, small_target.model, 64)
    gen = SpeculativeGenerator(small_target.model, drafter, None, GammaSchedule(3), max_context=64)
    prompt = [3, 7, 1, 7]
    first = [gen.generate(prompt, max_new_tokens=2, temperature=1.0, seed=s, eos_ids=[]).token_ids[0]
             for s in range(1500)]  # the head drafts the first token: pair (states at 2, token 3) predicts it
    p1 = processed_probs(logit_tables(small_target.model, prompt)[0], SamplingParams(1.0)).double().numpy()
    p = chi_square_p(np.bincount(first, minlength=V), p1)
    assert (p > 1e-3) == passes, p


def test_the_speculators_format_round_trips_and_validates(tiny_pair, trained, tmp_path):
    speculators = pytest.importorskip("speculators.models.eagle3")
    target, _ = tiny_pair
    head = load_head(trained["eagle3"], target.model)
    save_head(head, tmp_path, target=target.model, target_name="tiny")
    config = speculators.Eagle3SpeculatorConfig.from_pretrained(tmp_path)  # the package's own validation
    assert config.draft_vocab_size == head.draft_vocab
    assert config.speculators_config.algorithm == "eagle3"
    assert config.transformer_layer_config.hidden_size == target.model.config.hidden_size
    assert list(config.eagle_aux_hidden_state_layer_ids) == list(head.cfg.aux_layers)
    again = load_head(tmp_path, target.model)
    assert isinstance(again, Eagle3Head) and torch.equal(again.draft_ids, head.draft_ids)
    for (name, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float() if a.is_floating_point() else a, b), name
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["d2t"] + torch.arange(head.draft_vocab), head.draft_ids)
    assert int(tensors["t2d"].sum()) == head.draft_vocab and tensors["t2d"].shape[0] == target.model.config.vocab_size


def test_a_head_for_another_target_is_refused_naming_both(trained, tmp_path):
    other = load_model(save_tiny(tmp_path / "other", tiny_hf_model("qwen2", seed=3, vocab=64, hidden=32, heads=2,
                                                                   kv_heads=1), tiny_tokenizer()))
    for d in trained.values():
        with pytest.raises(ModelLoadError, match="hidden size 64 .* hidden size 32"):
            load_head(d, other.model)
    with pytest.raises(ModelLoadError, match="holds no drafting head"):
        load_head(tmp_path, other.model)


def test_drafters_say_which_head_they_need(tiny_pair, trained, tmp_path, monkeypatch):
    target, _ = tiny_pair
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    with pytest.raises(InvalidRequestError, match="train-draft --kind eagle3"):
        build_generator(target, drafter="eagle3")
    with pytest.raises(InvalidRequestError, match="holds a medusa head"):
        build_generator(target, drafter="eagle3", draft=str(trained["medusa"]))
    assert isinstance(load_head(trained["medusa"], target.model), MedusaHeads)
    gen = build_generator(target, drafter="medusa", draft=str(trained["medusa"]))
    assert gen.generate([1, 2, 3], max_new_tokens=4, eos_ids=[]).token_ids


def test_observed_features_keep_what_the_context_confirms():
    f = ObservedFeatures(1)
    f.observe(0, 0, [1, 2, 3], torch.arange(3.).view(3, 1))
    f.observe(0, 2, [3, 9, 9], torch.tensor([[30.], [40.], [50.]]))  # a verify from position 2, 2 drafts
    assert f.take(0, [1, 2, 3, 8], 0, 4) is None  # position 3 was computed for 9, not 8
    got = f.take(0, [1, 2, 3, 9, 5], 1, 4)
    assert got is not None and got.flatten().tolist() == [1., 30., 40.]
    assert f.take(0, [1, 2, 3, 9, 5], 1, 4) is None  # used: dropped


def test_capturing_hidden_states_changes_no_logit(tiny_pair):
    target, _ = tiny_pair
    m = target.model
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    plain = m(tokens, torch.tensor([0]), m.new_cache(1, 64))
    hidden = {0: torch.empty(0), 1: torch.empty(0), m.config.num_layers: torch.empty(0)}
    captured = m(tokens, torch.tensor([0]), m.new_cache(1, 64), hidden=hidden)
    assert torch.equal(plain, captured)
    assert hidden[0].shape == (1, 5, m.config.hidden_size)
    assert torch.equal(hidden[0], m.embed_tokens(tokens).float())


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_served_batches_with_a_head_equal_plain_decoding(tiny_pair, trained, kind):
    """The server's continuous batching with a head: ragged prompts through 4 slots (rows reused, each row's head
    cache and observed states its own), greedy and Gumbel-sampled, equal plain decoding alone."""
    target, _ = tiny_pair
    plain = build_generator(target, drafter="none")
    scheduler = build_scheduler(target, draft=str(trained[kind]), drafter=kind, max_batch=4)
    requests = [dict(prompt=p, max_new_tokens=24 + i, eos_ids=[]) for i, p in enumerate(_prompts(8))] + \
        [dict(prompt=p, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=i, coupling="gumbel", eos_ids=[])
         for i, p in enumerate(_prompts(4, seed=2))]
    batched = _run_batched(scheduler, requests)
    assert [b.token_ids for b in batched] == [plain.generate(**r).token_ids for r in requests]
    assert sum(b.stats.accepted_tokens for b in batched) > 0
    assert scheduler.steps < sum(b.stats.target_forward_passes for b in batched)  # it did batch
