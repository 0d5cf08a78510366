"""One entry point for the engine: greedy, Gumbel-coupled or speculative-sampling verification."""

from __future__ import annotations

import torch

from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.rejection import verify_greedy, verify_sampling
from specdecode.verification.sampling import SamplingParams, processed_probs


def verify(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator, position: int) -> tuple[int, int]:
    """(accepted draft tokens, next token) for one sequence.

    logits: [1, g + 1, V], the target's after [last, draft...]; draft_tokens: [1, g]; draft_probs: [g, V]
    or None (point mass); position: the sequence index of the first token to decide (Gumbel noise key).
    """
    if params.greedy:
        n, nxt = verify_greedy(logits, draft_tokens)
    elif params.gumbel:  # the target's noisy argmax at positions position .. position + g
        if params.seed is None:
            raise ValueError("Gumbel coupling needs a seed (SpeculativeGenerator.prepare fixes one)")
        noise = gumbel_noise(params.seed, range(position, position + logits.shape[1]), logits.shape[-1])
        n, nxt = verify_greedy(noisy_scores(processed_probs(logits, params), noise), draft_tokens)
    else:  # q: draft probs; p: target probs
        q = None if draft_probs is None else draft_probs.unsqueeze(0)
        n, nxt = verify_sampling(logits, draft_tokens, q, params, generator)
    return int(n), int(nxt)
