"""A request's trace (what each step did, token by token) agrees with its statistics and changes no token."""

from __future__ import annotations

from collections import Counter

import pytest

from specdecode.builder import build_generator


@pytest.mark.parametrize("drafter", ["model", "ngram-tree", "none"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trace_matches_the_statistics(tiny_pair, drafter, temperature):
    target, draft = tiny_pair
    gen = build_generator(target, draft=draft, drafter=drafter)
    request = dict(max_new_tokens=40, temperature=temperature, seed=3)
    result = gen.generate("hello world hello world", trace=True, **request)
    assert result.token_ids == gen.generate("hello world hello world", **request).token_ids
    trace, stats = result.trace, result.stats
    assert trace is not None and [t.token for t in trace.tokens] == result.token_ids
    kinds = Counter(t.kind for t in trace.tokens)
    assert kinds["accepted"] == stats.accepted_tokens == sum(s.accepted for s in trace.steps)
    assert len(trace.steps) == stats.target_forward_passes == kinds["corrected"] + kinds["bonus"] + kinds["target"]
    assert sum(s.drafted for s in trace.steps) == stats.drafted_tokens
    assert (kinds["target"] == len(trace.steps)) == (drafter == "none")
    for t in trace.tokens:
        assert 0 < t.p <= 1
        assert (t.rejected is not None) == (t.kind == "corrected")
        step = trace.steps[t.step]
        if drafter == "model":  # a chain's bonus token follows the whole draft (a tree's, a leaf)
            assert (t.kind == "bonus") == (step.accepted == step.depth > 0 and t.kind != "accepted")
    assert all(s.verify_seconds > 0 for s in trace.steps)
    if temperature and drafter == "model":  # sampled drafts carry q
        assert all(t.q is not None for t in trace.tokens if t.kind == "accepted")
