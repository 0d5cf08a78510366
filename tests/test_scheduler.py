"""The batching scheduler: batched greedy output equals unbatched output, bit for bit, and slots are freed."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from specdecode.builder import build_generator
from specdecode.errors import InvalidRequestError
from specdecode.models.loading import load_model
from specdecode.sequence import GenerationResult
from specdecode.serving.scheduler import QueueFullError, build_scheduler


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(64) for _ in range(rnd.randint(1, 300))] for _ in range(n)]


def _run_batched(scheduler, requests: list[dict]) -> list[GenerationResult]:
    """Submit all requests at once, step until every one has its result."""
    results: list[GenerationResult | None] = [None] * len(requests)

    def emit_to(i):
        def emit(event):
            if isinstance(event, Exception):
                raise event
            if isinstance(event, GenerationResult):
                results[i] = event
        return emit

    for i, r in enumerate(requests):
        scheduler.submit(scheduler.gen.prepare(**r), emit_to(i))
    while scheduler.active or scheduler.waiting:
        scheduler.step()
    return results


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid", "none"])
def test_batched_greedy_equals_unbatched_bit_for_bit(tiny_pair, drafter):
    target, draft = tiny_pair
    single = build_generator(target, draft=draft, drafter=drafter)
    scheduler = build_scheduler(target, draft=draft, drafter=drafter, max_batch=5)
    # 12 requests through 5 slots: ragged lengths, cache lengths across attention blocks, slots reused
    requests = [dict(prompt=p, max_new_tokens=random.Random(i).randint(1, 60)) for i, p in enumerate(_prompts(12))]
    batched = _run_batched(scheduler, requests)
    for r, b in zip(requests, batched):
        alone = single.generate(**r)
        assert b.token_ids == alone.token_ids
        assert b.finish_reason == alone.finish_reason
    assert scheduler.steps < sum(b.stats.target_forward_passes for b in batched)  # it did batch
    assert not scheduler.active and sorted(scheduler.free) == list(range(5))


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_batched_gumbel_sampling_equals_plain_seeded_decoding(tiny_pair, drafter):
    """Seeded Gumbel-coupled requests give the same tokens batched, with any drafter, as plain decoding alone."""
    target, draft = tiny_pair
    plain = build_generator(target, drafter="none")
    scheduler = build_scheduler(target, draft=draft, drafter=drafter, max_batch=4)
    requests = [dict(prompt=p, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=i, coupling="gumbel")
                for i, p in enumerate(_prompts(10, seed=2))]
    batched = _run_batched(scheduler, requests)
    assert [b.token_ids for b in batched] == [plain.generate(**r).token_ids for r in requests]
    assert sum(b.stats.accepted_tokens for b in batched) > 0


def test_each_served_sequence_chooses_its_own_draft_lengths(tiny_pair):
    """The server runs the decode step a lone request runs: lengths chosen per sequence, from its own acceptance and
    the timings the server's steps share."""
    target, draft = tiny_pair
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=3)
    assert scheduler.gen.gamma.adaptive
    seqs = []
    submit = scheduler.submit
    scheduler.submit = lambda seq, emit: (seqs.append(seq), submit(seq, emit))[1]
    _run_batched(scheduler, [dict(prompt=p, max_new_tokens=40) for p in _prompts(4, seed=6)])
    costs = [seq.lengths.costs for seq in seqs]
    assert all(seq.lengths.by_costs for seq in seqs)
    assert len({id(c) for c in costs}) == 4 and len({id(c.timings) for c in costs}) == 1
    assert all(c.drafted_tokens == seq.stats.drafted_tokens for c, seq in zip(costs, seqs))
    assert costs[0].timings.forward and costs[0].timings.draft is not None  # measured by the shared steps


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_seeded_sample_served_alone_equals_generate(tiny_pair, drafter):
    """Rejection-coupled seeded samples take the same draft lengths (the grow/shrink rule) in the server as in
    `generate`, so the same seed gives the same tokens."""
    target, draft = tiny_pair
    single = build_generator(target, draft=draft, drafter=drafter)
    scheduler = build_scheduler(target, draft=draft, drafter=drafter, max_batch=2)
    for i, prompt in enumerate(_prompts(4, seed=8)):
        request = dict(prompt=prompt, max_new_tokens=30, temperature=1.0, seed=i)
        [served] = _run_batched(scheduler, [request])
        assert served.token_ids == single.generate(**request).token_ids


def test_batched_drafting_keeps_each_rows_cache_right(tiny_pair):
    """After batched drafting with rejections and slot reuse, each draft cache row holds what a fresh
    forward of its cached ids writes."""
    target, draft = tiny_pair
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=3)
    _run_batched(scheduler, [dict(prompt=p, max_new_tokens=25) for p in _prompts(5, seed=4)])
    drafter = scheduler.drafter
    assert any(drafter.cached)
    for row, ids in enumerate(drafter.cached):
        if not ids:
            continue
        fresh = draft.model.new_cache(1, 512)
        draft.model(torch.tensor([ids]), torch.tensor([0]), fresh, num_logits=0)
        n = len(ids)
        torch.testing.assert_close(drafter.cache.k[:, row, :, :n], fresh.k[:, 0, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(drafter.cache.v[:, row, :, :n], fresh.v[:, 0, :, :n], atol=1e-5, rtol=0)


def batched_vs_alone_mismatches(model) -> int:
    """Rows whose logits differ between a batch of 8 sequences (cache lengths around the attention's block
    boundaries, steps of k = 1..W tokens, also a subset of rows in another order) and each sequence alone."""
    W = model.decode_width
    g = torch.Generator().manual_seed(3)
    lengths = [5, 255, 256, 257, 300, 511, 40, 130]
    cache = model.new_cache(8, 600)
    alone_cache = model.new_cache(1, 600)
    ids = [torch.randint(0, 64, (1, n + W), generator=g) for n in lengths]
    for b, x in enumerate(ids):
        model(x[:, :lengths[b]], torch.tensor([0]), cache, rows=torch.tensor([b]))
    bad = 0
    for k in range(1, W + 1):
        batched = model(torch.cat([x[:, n:n + k] for x, n in zip(ids, lengths)]), torch.tensor(lengths), cache)
        for b, (x, n) in enumerate(zip(ids, lengths)):
            model(x[:, :n], torch.tensor([0]), alone_cache)
            alone = model(x[:, n:n + k], torch.tensor([n]), alone_cache)
            bad += sum(not torch.equal(batched[b, t], alone[0, t]) for t in range(k))
        subset = [6, 1, 3]
        part = model(torch.cat([ids[b][:, lengths[b]:lengths[b] + k] for b in subset]),
                     torch.tensor([lengths[b] for b in subset]), cache, rows=torch.tensor(subset))
        bad += sum(not torch.equal(part[j], batched[b]) for j, b in enumerate(subset))
    return bad


@pytest.mark.parametrize("group", [None, 1, 3], ids=["measured", "1 sequence per group", "3 per group"])
def test_batched_logits_equal_a_lone_sequence(tiny_pair, group, monkeypatch):
    """Per op, end to end: a sequence's logits do not depend on the other sequences of the batch or their cache
    lengths (in groups of the size measured on this CPU, and forced smaller than the batch)."""
    model = tiny_pair[0].model
    monkeypatch.setattr(model, "max_group", model.max_group)  # restored after the test
    model.enable_batching(8)
    if group is not None:
        model.max_group = group
    assert batched_vs_alone_mismatches(model) == 0


def test_a_non_invariant_linear_breaks_the_batched_check(tiny_pair, monkeypatch):
    """Test of the test: a linear whose rows depend on how many rows share the call fails the check above."""
    from specdecode.models import linear

    model = tiny_pair[0].model
    monkeypatch.setattr(model, "max_group", 1 << 30)
    real = linear.DenseLinear._matmul
    monkeypatch.setattr(linear.DenseLinear, "_matmul", lambda self, rows: real(self, rows) + 1e-6 * rows.shape[0])
    assert batched_vs_alone_mismatches(model) > 0


def test_long_prompts_batched_equal_a_separately_loaded_model(tiny_pair, monkeypatch):
    """Prefill is never split into groups: the server's output equals that of a model loaded on its own (as
    `specdecode generate` loads it), for prompts longer than a decode group, with groups forced to 1."""
    target, draft = tiny_pair
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=4)
    monkeypatch.setattr(target.model, "max_group", 1)
    requests = [dict(prompt=p, max_new_tokens=20) for p in _prompts(6, seed=9) if len(p) > 40]
    batched = _run_batched(scheduler, requests)
    fresh = build_generator(load_model(target.source, decode_width=9), drafter="none")
    assert [b.token_ids for b in batched] == [fresh.generate(**r).token_ids for r in requests]


def test_cancelled_requests_free_their_slots(tiny_pair):
    target, draft = tiny_pair
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=2, max_queue=1)
    seen = []
    reqs = [scheduler.submit(scheduler.gen.prepare([1, 2, 3], max_new_tokens=50), seen.append) for _ in range(3)]
    with pytest.raises(QueueFullError):  # 2 free slots + 1 waiting place are taken
        scheduler.submit(scheduler.gen.prepare([1, 2, 3], max_new_tokens=5), seen.append)
    scheduler.step()
    assert scheduler.running == 2 and scheduler.queued == 1
    scheduler.cancel(reqs[0])
    scheduler.cancel(reqs[2])  # still waiting: never admitted
    scheduler.step()
    assert scheduler.running == 1 and scheduler.queued == 0
    scheduler.cancel(reqs[1])
    scheduler.step()
    assert scheduler.running == 0 and sorted(scheduler.free) == [0, 1]
    assert not any(isinstance(e, GenerationResult) for e in seen)


def test_background_thread_serves_concurrent_submissions(tiny_pair):
    target, draft = tiny_pair
    scheduler = build_scheduler(target, draft=draft, drafter="ngram", max_batch=3)
    scheduler.start()
    done = threading.Semaphore(0)
    results = {}

    def emit_to(i):
        def emit(event):
            if isinstance(event, GenerationResult):
                results[i] = event.token_ids
                done.release()
        return emit

    try:
        prompts = _prompts(6, seed=1)
        for i, p in enumerate(prompts):
            scheduler.submit(scheduler.gen.prepare(p, max_new_tokens=20), emit_to(i))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        scheduler.stop()
    single = build_generator(target, drafter="ngram")
    assert [results[i] for i in range(6)] == [single.generate(p, max_new_tokens=20).token_ids for p in prompts]


def test_bad_scheduler_arguments(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(InvalidRequestError):
        build_scheduler(target, drafter="ngram", max_batch=0)
