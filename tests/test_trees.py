"""Token trees: a tree forward gives every node the logits of its path run as a chain (torch.equal, every kernel
path, in a server batch); tree verification keeps greedy output the target's own and sampled output the target's
distribution (chi-square, with planted bugs that fail it); Gumbel-coupled output equals plain's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdecode.builder import build_generator
from specdecode.draft_lengths import GammaSchedule
from specdecode.drafting.base import Draft, DraftRequest
from specdecode.drafting.lookahead import LookaheadDrafter
from specdecode.drafting.ngram import NgramDrafter
from specdecode.drafting.none import NoDrafter
from specdecode.drafting.suffix import SuffixCache, SuffixDrafter
from specdecode.drafting.trie import tree_draft
from specdecode.engine import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.serving.scheduler import build_scheduler
from specdecode.verification.sampling import SamplingParams, processed_probs
from specdecode.verification import tree
from specdecode.verification.tree import verify_tree
from tests.test_bit_exact import pair  # noqa: F401 (a fixture: the tiny pair in each dtype and quantization)
from tests.test_lossless import NEW_TOKENS, chi_square_p, random_prompts
from tests.test_scheduler import _run_batched


def random_parents(n: int, shape: str, rnd: random.Random) -> list[int]:
    """Parents of n nodes (each before its children): a chain, a star on the root, a binary tree, or random."""
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "star":
        return [-1] * n
    if shape == "binary":
        return [(i - 1) // 2 for i in range(n)]
    return [rnd.randrange(-1, i) for i in range(n)]


def path_of(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def assert_tree_rows_equal_chains(model, prefix: list[int], root: int, tokens: list[int], parents: list[int]) -> None:
    """One tree forward after `prefix`, then each node's path as a chain on another cache: equal logits."""
    draft = Draft(tokens, None, parents)
    tree_cache, chain_cache = model.new_cache(1, 512), model.new_cache(1, 512)
    for c in (tree_cache, chain_cache):
        model(torch.tensor([prefix]), torch.tensor([0]), c, num_logits=0)
    start = torch.tensor([len(prefix)])
    tree = model(torch.tensor([[root] + tokens]), start, tree_cache, tree_mask=draft.ancestor_mask().unsqueeze(0))
    for i in range(len(tokens)):
        path = path_of(parents, i)
        chain = model(torch.tensor([[root] + [tokens[j] for j in path]]), start, chain_cache)
        assert torch.equal(tree[0, i + 1], chain[0, -1]), f"node {i} of {parents}"
        if i == 0:
            assert torch.equal(tree[0, 0], chain[0, 0])


@pytest.mark.parametrize("shape", ["chain", "star", "binary", "random"])
def test_every_tree_node_gets_its_paths_logits(pair, shape):  # noqa: F811
    """Trees of 1..8 nodes (a bit-exact target's decode forwards are 9 rows) on every kernel the pair fixture runs."""
    target = pair[0].model
    rnd = random.Random(shape)
    for n in (1, 2, 3, 5, 8):
        prefix = [rnd.randrange(64) for _ in range(rnd.randint(1, 300))]  # across attention blocks
        assert_tree_rows_equal_chains(target, prefix, rnd.randrange(64), [rnd.randrange(64) for _ in range(n)],
                                      random_parents(n, shape, rnd))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trees_of_up_to_16_nodes(tiny_pair, dtype):
    target = load_model(tiny_pair[0].source, dtype=dtype, decode_width=17).model
    rnd = random.Random(7)
    for n in (12, 16):
        for shape in ("star", "binary", "random"):
            assert_tree_rows_equal_chains(target, [rnd.randrange(64) for _ in range(40)], 3,
                                          [rnd.randrange(64) for _ in range(n)], random_parents(n, shape, rnd))


def test_without_the_cpp_decode_ops_trees_are_cut_to_their_first_path(tiny_pair, monkeypatch):
    """PyTorch's attention sums a block's keys in an order that depends on where they sit: a bit-exact target without
    the C++ decode ops verifies each tree's first path only, and stays bit-exact."""
    target, _ = tiny_pair
    monkeypatch.setattr(target.model, "fused_ops", False)
    assert not target.model.exact_trees
    plain = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    gen = SpeculativeGenerator(target.model, NgramDrafter(tree=True), target.tokenizer, GammaSchedule(6))
    accepted = 0
    for prompt in random_prompts(8, 64, seed=3):
        result = gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == plain.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids
        assert result.stats.tree_drafts == 0
        accepted += result.stats.accepted_tokens
    assert accepted > 0
    tree = Draft([1, 2, 3, 4], torch.eye(8)[[1, 2, 3, 4]], [-1, -1, 0, 2])
    assert tree.first_path().tokens == [1, 3, 4] and torch.equal(tree.first_path().probs, torch.eye(8)[[1, 3, 4]])


def test_a_trie_of_continuations_is_drafted_heaviest_first():
    d = tree_draft([([5, 6, 7], 1.0), ([5, 8], 2.0), ([9], 1.0)], budget=4)
    assert d.tokens == [5, 8, 6, 7] and d.parents == [-1, 0, 0, 2]  # 5 (3.0), 8 (2.0), then 6 before 9 by order
    assert d.depths() == [1, 2, 2, 3] and d.is_tree
    chain = tree_draft([([1, 2, 3], 1.0)], budget=2)
    assert chain.tokens == [1, 2] and not chain.is_tree


def test_greedy_tree_verification_walks_the_argmax_path():
    V = 8
    logits = torch.full((6, V), -5.0)
    # nodes: 0 (tok 1) and 1 (tok 2) under the root; 2 (tok 3), 3 (tok 4) under node 1; 4 (tok 5) under node 3
    tokens, parents = [1, 2, 3, 4, 5], [-1, -1, 1, 1, 3]
    for row, best in ((0, 2), (2, 4), (4, 5), (5, 7)):  # rows: root, node 1, node 3, node 4
        logits[row, best] = 5.0
    kept, nxt = verify_tree(logits, tokens, parents, None, SamplingParams(), torch.Generator(), position=10)
    assert kept == [1, 3, 4] and nxt == 7
    logits[2, 4], logits[2, 6] = -5.0, 5.0  # node 1's argmax is now no child's token
    assert verify_tree(logits, tokens, parents, None, SamplingParams(), torch.Generator(), 10) == ([1], 6)
    with pytest.raises(ValueError, match="parent"):
        verify_tree(logits, tokens, [-1, 2, 1, 1, 3], None, SamplingParams(), torch.Generator(), 10)


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_with_trees_equals_plain_greedy(tiny_pair, gamma):
    target, _ = tiny_pair
    plain = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    gen = SpeculativeGenerator(target.model, NgramDrafter(tree=True), target.tokenizer, GammaSchedule(gamma))
    trees = accepted = 0
    for prompt in random_prompts(20, 64, seed=3):
        expected = plain.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids
        result = gen.generate(prompt, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == expected, f"prompt {prompt}"
        trees, accepted = trees + result.stats.tree_drafts, accepted + result.stats.accepted_tokens
    assert accepted > 0 and (trees > 0 or gamma == 1)  # branching trees were verified and kept from


@pytest.mark.parametrize("temperature,top_p", [(0.8, 0.9), (1.0, 1.0)])
def test_gumbel_seeded_output_with_trees_equals_plain(tiny_pair, temperature, top_p):
    target, _ = tiny_pair
    plain = SpeculativeGenerator(target.model, NoDrafter(), target.tokenizer)
    gen = SpeculativeGenerator(target.model, NgramDrafter(tree=True), target.tokenizer, GammaSchedule(6))
    request = dict(max_new_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, eos_ids=[], coupling="gumbel")
    trees = 0
    for i, prompt in enumerate(random_prompts(12, 64, seed=4)):
        result = gen.generate(prompt, seed=i, **request)
        assert result.token_ids == plain.generate(prompt, seed=i, **request).token_ids
        trees += result.stats.tree_drafts
    assert trees > 0


def test_batched_trees_equal_each_sequence_alone(tiny_pair):
    """The server's batch with tree drafts (some sequences' drafts chains, some trees, some empty): each sequence's
    tokens equal its plain decoding alone."""
    target, _ = tiny_pair
    plain = build_generator(target, drafter="none")
    scheduler = build_scheduler(target, drafter="ngram-tree", max_batch=4, gamma=6)
    requests = [dict(prompt=p, max_new_tokens=random.Random(i).randint(1, 40)) for i, p in
                enumerate(random_prompts(10, 64, seed=5))]
    batched = _run_batched(scheduler, requests)
    for r, b in zip(requests, batched):
        assert b.token_ids == plain.generate(**r).token_ids
    assert sum(b.stats.tree_drafts for b in batched) > 0


V = 6
N_SAMPLES = 12_000


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5  # after the root; after token a


def tree_first_two(bug: str | None, seed: int, monkeypatch=None) -> tuple[np.ndarray, np.ndarray]:
    """Counts of (t1, t2) from one tree step per sample, and their exact probabilities. The tree: three children of
    the root drawn i.i.d. from q1, plus the token 0 as a deterministic child; under each sampled child, one child
    drawn from q2. A sample that keeps no node draws t2 from the target as the next step would."""
    params = SamplingParams(1.0)
    P1, P2 = _tables(1)
    Q1, Q2 = _tables(2)
    p1, p2 = processed_probs(P1, params), processed_probs(P2, params)
    q1, q2 = processed_probs(Q1, params), processed_probs(Q2, params)
    g = torch.Generator().manual_seed(seed)
    if bug == "rejected siblings leave p as it was":
        monkeypatch.setattr(tree, "residual", lambda p, q, x: p)
    counts = np.zeros((V, V))
    for _ in range(N_SAMPLES):
        firsts = [int(t) for t in torch.multinomial(q1, 3, replacement=True, generator=g)]
        seconds = [int(torch.multinomial(q2[a], 1, generator=g)) for a in firsts]
        tokens = firsts + [0] + seconds
        parents = [-1, -1, -1, -1, 0, 1, 2]
        probs: torch.Tensor | None = torch.stack([q1] * 3 + [torch.nn.functional.one_hot(torch.tensor(0), V).float()]
                                                 + [q2[a] for a in firsts])
        if bug == "point masses":
            probs = None
        if bug == "q of another temperature":
            probs = probs.clone()
            probs[:3] = processed_probs(Q1, SamplingParams(2.0))
        logits = torch.stack([P1] + [P2[t] for t in tokens[:4]] + [P1] * 3)  # depth-2 rows are not read for t2
        kept, nxt = verify_tree(logits, tokens, parents, probs, params, g, position=0)
        t1 = tokens[kept[0]] if kept else nxt
        t2 = tokens[kept[1]] if len(kept) > 1 else nxt if kept else int(torch.multinomial(p2[t1], 1, generator=g))
        counts[t1, t2] += 1
    exact = (p1.unsqueeze(1) * p2).numpy()
    return counts.ravel(), exact.ravel()


def test_tree_sampling_has_the_targets_distribution():
    counts, exact = tree_first_two(None, seed=21)
    assert chi_square_p(counts, exact) > 1e-3


def test_sampled_children_may_be_verified_as_point_masses():
    """Exact, only less often accepted: a point mass is a valid q for any drafted token."""
    counts, exact = tree_first_two("point masses", seed=22)
    assert chi_square_p(counts, exact) > 1e-3


@pytest.mark.parametrize("bug", ["rejected siblings leave p as it was", "q of another temperature"])
def test_the_tree_distribution_test_catches_a_planted_bug(bug, monkeypatch):
    counts, exact = tree_first_two(bug, seed=21, monkeypatch=monkeypatch)
    assert chi_square_p(counts, exact) < 1e-6


def test_the_suffix_cache_holds_its_bound_and_evicts_the_least_recent():
    cache = SuffixCache(max_tokens=100)
    rnd = random.Random(0)
    sids = []
    for _ in range(8):
        sids.append(cache.new())
        cache.extend(sids[-1], [rnd.randrange(20) for _ in range(30)])
        assert cache.tokens <= 100 and sum(map(len, cache.seqs.values())) == cache.tokens
    assert list(cache.seqs) == sids[-3:]  # LRU: the oldest went first; each extension stays
    indexed = {(sid, end) for at in cache.index.values() for sid, end in at}
    assert {sid for sid, _ in indexed} == set(sids[-3:])  # evicted sequences left the index
    assert len(indexed) <= cache.tokens
    cache.extend(sids[-3], [1, 2])  # extending makes a sequence the most recent
    assert list(cache.seqs) == [sids[-2], sids[-1], sids[-3]]
    cache.extend(sids[-1], [3] * 9)  # 101 tokens: the least recent goes
    assert list(cache.seqs) == [sids[-3], sids[-1]] and cache.tokens == 71


def test_requests_still_decoding_are_never_evicted():
    cache = SuffixCache(max_tokens=50)
    active = cache.new()
    cache.active.add(active)
    cache.extend(active, list(range(40)))
    past = cache.new()
    cache.extend(past, list(range(30)))  # over the bound, but nothing else to evict
    assert list(cache.seqs) == [active, past] and cache.tokens == 70
    cache.extend(active, list(range(20)))  # the past request goes, not the active one, though it alone exceeds it
    assert list(cache.seqs) == [active] and cache.tokens == 60


def test_suffix_drafts_come_from_earlier_requests():
    drafter = SuffixDrafter(batch=2)
    g, params = torch.Generator(), SamplingParams()
    answer = [5, 6, 7, 8, 9, 10, 11, 12]
    drafter.propose_batch([DraftRequest(0, [1, 2, 3] + answer, 0, params, g)])  # row 0 saw a prompt and answer
    drafter.reset(0)
    (d,) = drafter.propose_batch([DraftRequest(1, [40, 41, 5, 6], 4, params, g)])  # another row, another request
    assert d.tokens == [7, 8, 9, 10]
    drafter.forget()  # as a new process
    drafter.reset(1)
    (d,) = drafter.propose_batch([DraftRequest(1, [40, 41, 5, 6], 4, params, g)])
    assert d.tokens == []


@pytest.mark.parametrize("drafter", ["suffix", "suffix-chain"])
def test_suffix_drafting_is_lossless_alone_and_batched(tiny_pair, drafter):
    """Greedy output equals plain decoding's, request after request (the cache grows across them), alone and in the
    server's batch; a repeated request drafts its earlier answer."""
    target, _ = tiny_pair
    plain = build_generator(target, drafter="none")
    gen = build_generator(target, drafter=drafter, gamma=8)
    prompts = random_prompts(8, 64, seed=6)
    for p in prompts + prompts[:2]:
        result = gen.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[])
        assert result.token_ids == plain.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[]).token_ids
    assert result.stats.accepted_tokens >= NEW_TOKENS // 2  # the second time, it drafts its own earlier answer
    scheduler = build_scheduler(target, drafter=drafter, max_batch=3, gamma=8)
    requests = [dict(prompt=p, max_new_tokens=30) for p in prompts]
    batched = _run_batched(scheduler, requests + requests)
    for r, b in zip(requests + requests, batched):
        assert b.token_ids == plain.generate(**r).token_ids
    assert sum(b.stats.accepted_tokens for b in batched[len(requests):]) > \
        sum(b.stats.accepted_tokens for b in batched[:len(requests)])  # the repeats draft the earlier answers


@pytest.mark.parametrize("gamma", [2, 6])
def test_the_draft_models_trees_keep_greedy_and_gumbel_output(tiny_pair, gamma):
    target, draft = tiny_pair
    plain = build_generator(target, drafter="none")
    gen = build_generator(target, draft=draft, drafter="model-tree", gamma=gamma)
    trees = accepted = 0
    for i, p in enumerate(random_prompts(10, 64, seed=8)):
        for request in (dict(), dict(temperature=0.8, top_p=0.9, seed=i, coupling="gumbel")):
            result = gen.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[], **request)
            assert result.token_ids == plain.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[], **request).token_ids
            trees, accepted = trees + result.stats.tree_drafts, accepted + result.stats.accepted_tokens
    assert trees > 0 and accepted > 0


def test_lookahead_is_lossless_and_drafts_from_its_pool(tiny_pair):
    """Greedy and Gumbel-coupled output equal plain decoding's, alone and in the server's batch; the pool's n-grams
    (from the target's iterates on the window) get accepted."""
    target, _ = tiny_pair
    plain = build_generator(target, drafter="none")
    gen = build_generator(target, drafter="lookahead", gamma=8)
    accepted = 0
    for i, p in enumerate(random_prompts(10, 64, seed=10)):
        for request in (dict(), dict(temperature=0.8, top_p=0.9, seed=i, coupling="gumbel")):
            result = gen.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[], **request)
            assert result.token_ids == plain.generate(p, max_new_tokens=NEW_TOKENS, eos_ids=[], **request).token_ids
            accepted += result.stats.accepted_tokens
    assert accepted > 0
    scheduler = build_scheduler(target, drafter="lookahead", max_batch=3, gamma=8)
    requests = [dict(prompt=p, max_new_tokens=30) for p in random_prompts(6, 64, seed=12)]
    for r, b in zip(requests, _run_batched(scheduler, requests)):
        assert b.token_ids == plain.generate(**r).token_ids


def test_lookahead_pools_the_targets_iterate():
    drafter = LookaheadDrafter()
    g, params = torch.Generator(), SamplingParams()
    (d,) = drafter.propose_batch([DraftRequest(0, [1, 2, 3, 4], 8, params, g)])
    assert d.tokens[:4] == [1, 2, 3, 4]  # the first window: the context's tokens, as guesses
    # the target: 9 after the context, then 8, 7, 6 after the guesses; it kept nothing
    drafter.verified(0, d, [9, 8, 7, 6, 5] + [0] * (len(d.tokens) - 4), kept=[])
    (d,) = drafter.propose_batch([DraftRequest(0, [1, 2, 3, 4, 9], 8, params, g)])
    assert d.tokens[:4] == [8, 7, 6, 5]  # the window moved on: the target's iterate after position 4
    assert set(drafter.pools[0]) == {4, 1, 2, 3}  # keyed by the token each iterate's n-gram followed
    assert drafter.pools[0][4] == {(9, 8, 7): None}  # after the context's last token: 9, then 8 and 7
    assert drafter.pools[0][1] == {(8, 7, 6): None}  # the guess 1 at position 4 was followed by 8 (then 7, 6)
    assert drafter.pools[0][3] == {(6, 5): None}


class _Scripted:
    """A stand-in draft model whose next-token probabilities depend only on the last token fed at each row."""

    def __init__(self, table: dict[int, list[float]], vocab: int) -> None:
        self.table, self.vocab = table, vocab

    def __call__(self, tokens, start, cache, tree_mask=None, rows=None, num_logits=None):
        out = torch.full((*tokens.shape, self.vocab), -30.0)
        for b in range(tokens.shape[0]):
            for t in range(tokens.shape[1]):
                probs = self.table.get(int(tokens[b, t]), [1.0 / self.vocab] * self.vocab)
                out[b, t] = torch.tensor(probs).clamp_min(1e-12).log()
        return out if num_logits is None else out[:, tokens.shape[1] - num_logits:]


def test_the_draft_models_tree_spends_its_budget_on_its_likeliest_paths():
    from specdecode.drafting.model_tree import ModelTreeDrafter

    V = 8
    confident = {1: [0, 0, .95, .05, 0, 0, 0, 0], 2: [0, 0, 0, .9, .1, 0, 0, 0], 3: [0, 0, 0, 0, .9, .1, 0, 0]}
    unsure = {1: [0, 0, .5, .4, .1, 0, 0, 0], 2: [0, 0, 0, 0, .6, .4, 0, 0], 3: [0, 0, 0, 0, .7, .3, 0, 0]}
    for table, expected_tokens, expected_parents in (
            (confident, [2, 3, 4], [-1, 0, 1]),  # a chain: 0.95, 0.855, 0.77 beat the siblings (0.05, 0.095)
            (unsure, [2, 3, 4], [-1, -1, 0])):  # siblings 0.5 and 0.4, then 2's child 4 (0.3) over 3's (0.28)
        drafter = ModelTreeDrafter.__new__(ModelTreeDrafter)
        model = _Scripted(table, V)
        drafter.model, drafter.target_vocab, drafter.max_len, drafter.min_path = model, V, 100, 0.0
        drafter.cache = type("C", (), {"capacity": 200})()
        drafter.cached = [[0, 1]]
        d = drafter._tree(DraftRequest(0, [0, 1], 3, SamplingParams(), torch.Generator()),
                          model(torch.tensor([[1]]), None, None)[0, 0])
        assert (d.tokens, d.parents) == (expected_tokens, expected_parents)


def test_the_draft_model_stops_once_it_doubts_its_chain():
    from specdecode.drafting.model import MIN_PATH, ModelDrafter

    V = 8
    # greedy chain 2, 3, 4, 5, ...: each token's probability 0.9, 0.8, 0.6, 0.9, ...; the chain's 0.9, 0.72, 0.43
    table = {1: [0, 0, .9, .1, 0, 0, 0, 0], 2: [0, 0, 0, .8, .2, 0, 0, 0], 3: [0, 0, 0, 0, .6, .4, 0, 0],
             4: [0, 0, 0, 0, 0, .9, .1, 0], 5: [0, 0, 0, 0, 0, 0, .9, .1], 6: [0, 0, 0, 0, 0, 0, 0, 1.]}
    assert 0.72 >= MIN_PATH > 0.9 * 0.8 * 0.6
    for min_path, expected in ((MIN_PATH, [2, 3, 4]), (0.0, [2, 3, 4, 5, 6, 7])):  # 0: fixed lengths
        drafter = ModelDrafter.__new__(ModelDrafter)
        drafter.model, drafter.target_vocab, drafter.max_len, drafter.window = _Scripted(table, V), V, 100, 100
        drafter.min_path, drafter.cache, drafter.cached, drafter.offset, drafter.new = min_path, None, [[]], [0], [True]
        d = drafter.propose_batch([DraftRequest(0, [0, 1], 6, SamplingParams(), torch.Generator())])[0]
        assert d.tokens == expected  # the token that takes the chain below MIN_PATH is drafted, then it stops
