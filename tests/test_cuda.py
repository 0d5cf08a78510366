"""The engine with its models on a CUDA device: greedy speculative decoding equals plain decoding bit for bit,
and sampling keeps the target's exact distribution. The models run on the GPU; drafting and verification read
their logits on the CPU. Skipped where torch sees no CUDA device (CI has none): run
`python -m pytest -q tests/test_cuda.py` on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from specdecode.builder import build_generator
from specdecode.models.loading import load_model
from tests import test_bit_exact, test_lossless
from tests.test_lossless import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_pair(request, tiny_pair):
    target, draft = tiny_pair
    return (load_model(target.source, dtype=request.param, device="cuda", decode_width=9),
            load_model(draft.source, dtype=request.param, device="cuda"))


def test_models_run_on_the_gpu_and_agree_with_the_cpu(cuda_pair, tiny_pair):
    assert cuda_pair[0].model.device.type == "cuda"
    tokens = torch.tensor([random_prompts(1, 64, seed=3)[0]])
    on_gpu = cuda_pair[0].model(tokens, torch.tensor([0]), cuda_pair[0].model.new_cache(1, 64))
    on_cpu = tiny_pair[0].model(tokens, torch.tensor([0]), tiny_pair[0].model.new_cache(1, 64))
    tol = 1e-3 if cuda_pair[0].model.dtype == torch.float32 else 0.1
    torch.testing.assert_close(on_gpu, on_cpu, atol=tol * on_cpu.abs().max().item(), rtol=0)


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_greedy_speculative_equals_plain_on_the_gpu(cuda_pair, drafter):
    prompts = random_prompts(20, 64, seed=7)
    plain = build_generator(cuda_pair[0], drafter="none")
    expected = [plain.generate(p, max_new_tokens=24, eos_ids=[]).token_ids for p in prompts]
    accepted = 0
    for gamma in [1, 3, 8, None][:4 if drafter == "model" else 3]:  # None: chosen each step
        gen = build_generator(cuda_pair[0], draft=cuda_pair[1], drafter=drafter, gamma=gamma)
        for p, want in zip(prompts, expected):
            result = gen.generate(p, max_new_tokens=24, eos_ids=[])
            assert result.token_ids == want, f"{drafter}, gamma {gamma}, prompt {p}"
            accepted += result.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_accepted_logits_equal_plain_decoding_on_the_gpu(cuda_pair, drafter, monkeypatch):
    test_bit_exact.test_accepted_logits_equal_plain_decoding_for_every_gamma(
        cuda_pair, random_prompts(6, 64, seed=11), drafter, monkeypatch)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_batched_accepted_logits_equal_plain_decoding_on_the_gpu(cuda_pair, max_batch, monkeypatch):
    test_bit_exact.test_batched_accepted_logits_equal_plain_decoding(
        cuda_pair, random_prompts(6, 64, seed=11), max_batch, monkeypatch)


@pytest.fixture(scope="module")
def small_vocab_on_gpu(tmp_path_factory):
    return test_lossless.small_vocab_models(tmp_path_factory.mktemp("small-gpu"), device="cuda")


@pytest.mark.parametrize("setting", ["temperature 1", "top-p 0.8", "far draft, top-k 5, temperature 0.5"])
def test_sampling_matches_the_target_distribution_with_gpu_logits(small_vocab_on_gpu, setting):
    params, draft = test_lossless.SETTINGS[setting]
    target = small_vocab_on_gpu["target"]
    counts = test_lossless.speculative_first_two(target, small_vocab_on_gpu[draft], params, seed=11)
    assert test_lossless.chi_square_p(counts, test_lossless.exact_first_two(target, params)) > 1e-3
