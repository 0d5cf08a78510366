"""Bit-exact speculative decoding: the target's logits at every accepted position equal plain decoding's,
compared with torch.equal, for each dtype and quantization, drafter, gamma and batch size."""

from __future__ import annotations

import pytest
import torch

import specdecode.sequence
from specdecode.builder import build_generator, target_head_quant
from specdecode.serving.scheduler import build_scheduler
from specdecode.sequence import GenerationResult
from specdecode.models.loading import load_model
from tests.test_int4_amx import needs_amx
from tests.test_lossless import random_prompts

NEW_TOKENS = 24


def record_decided_logits(monkeypatch, module) -> dict[int, dict[int, torch.Tensor]]:
    """Wrap `module.verify`: per request (keyed by its generator), the logits row that decided each position."""
    log: dict[int, dict[int, torch.Tensor]] = {}
    real = module.verify

    def recording(logits, tokens, probs, params, generator, position):
        n, nxt = real(logits, tokens, probs, params, generator, position)
        rows = log.setdefault(id(generator), {})
        for i in range(n + 1):  # the accepted draft tokens and the token after them
            assert position + i not in rows
            rows[position + i] = logits[0, i].clone()
        return n, nxt

    monkeypatch.setattr(module, "verify", recording)
    return log


def assert_same_logits(got: dict[int, torch.Tensor], expected: dict[int, torch.Tensor], where: str) -> None:
    assert got.keys() == expected.keys(), where
    bad = [p for p in got if not torch.equal(got[p], expected[p])]
    assert not bad, f"{where}: logits differ at positions {bad}"


@pytest.fixture(scope="module", params=[("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"),
                                        ("bfloat16", "int4"), ("bfloat16", "w4a8"),
                                        pytest.param(("bfloat16", "int4-amx"), marks=needs_amx)],
                ids=lambda p: "-".join(p))
def pair(request, tiny_pair):
    target, draft = tiny_pair
    dtype, quant = request.param
    return (load_model(target.source, dtype=dtype, decode_width=9, quant=quant, head_quant=target_head_quant(quant)),
            load_model(draft.source, dtype=dtype, quant=quant))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 64, seed=11)


def plain_logits(pair, prompts, monkeypatch) -> list[dict[int, torch.Tensor]]:
    with monkeypatch.context() as patch:
        log = record_decided_logits(patch, specdecode.sequence)
        plain = build_generator(pair[0], drafter="none")
        out = []
        for p in prompts:
            log.clear()
            plain.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[])
            (rows,) = log.values()
            out.append(rows)
    return out


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_accepted_logits_equal_plain_decoding_for_every_gamma(pair, prompts, drafter, monkeypatch):
    expected = plain_logits(pair, prompts, monkeypatch)
    log = record_decided_logits(monkeypatch, specdecode.sequence)
    accepted = 0
    for gamma in range(1, 9):
        gen = build_generator(pair[0], draft=pair[1], drafter=drafter, gamma=gamma)
        for i, p in enumerate(prompts):
            log.clear()
            accepted += gen.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[]).stats.accepted_tokens
            (rows,) = log.values()
            assert_same_logits(rows, expected[i], f"{drafter}, gamma {gamma}, prompt {i}")
    assert accepted > 0  # drafts were accepted: verify steps of several rows were compared


@pytest.mark.parametrize("max_batch", [1, 2, 5, 8])
def test_batched_accepted_logits_equal_plain_decoding(pair, prompts, max_batch, monkeypatch):
    expected = plain_logits(pair, prompts, monkeypatch)
    log = record_decided_logits(monkeypatch, specdecode.sequence)  # the scheduler verifies through SequenceState.accept
    for drafter in ("model", "ngram"):
        scheduler = build_scheduler(pair[0], draft=pair[1], drafter=drafter, max_batch=max_batch)
        log.clear()
        seqs = [scheduler.gen.prepare(p, max_new_tokens=NEW_TOKENS, eos_ids=[]) for p in prompts]
        results = []
        for seq in seqs:
            scheduler.submit(seq, lambda e: results.append(e) if isinstance(e, GenerationResult) else None)
        while scheduler.active or scheduler.waiting:
            scheduler.step()
        assert len(results) == len(prompts)
        for i, seq in enumerate(seqs):
            assert_same_logits(log[id(seq.generator)], expected[i], f"{drafter}, batch {max_batch}, prompt {i}")
