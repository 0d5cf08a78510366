"""Verification: decide how many drafted tokens each sequence keeps and which token comes next.

Kept apart from drafting: these functions only see the target's logits, the draft tokens and the
distribution q each draft token was sampled from (None for a deterministic drafter: a point mass).
Batched over sequences; draft lengths may differ per sequence (`num_drafted`).
"""

from __future__ import annotations

import torch

from specdecode.verification.sampling import SamplingParams, processed_probs


def _prefix_len(ok: torch.Tensor, num_drafted: torch.Tensor | None) -> torch.Tensor:
    """Length of the leading run of True per row. ok: [B, g] -> [B]."""
    if num_drafted is not None:
        ok = ok & (torch.arange(ok.shape[1]) < num_drafted.unsqueeze(1))
    return ok.to(torch.int64).cumprod(-1).sum(-1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep draft tokens while each equals the target's argmax.

    target_logits: [B, g + 1, V]; draft_tokens: [B, g]. Returns (num_accepted [B], next_token [B]).
    """
    best = target_logits.argmax(-1)  # [B, g + 1]
    n = _prefix_len(draft_tokens == best[:, :-1], num_drafted)
    return n, best.gather(1, n.unsqueeze(1)).squeeze(1)


def verify_sampling(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                    params: SamplingParams, generator: torch.Generator,
                    num_drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    target_logits: [B, g + 1, V]; draft_tokens: [B, g]; draft_probs: [B, g, V], the q each draft token
    was sampled from (processed with the same `params`), or None for point masses.
    Accept x_i with probability min(1, p(x_i) / q(x_i)); at the first rejection sample from
    normalize(max(0, p - q)); if all are kept, sample a bonus token from p at position g + 1.
    The returned tokens are distributed exactly as the target's p.
    """
    B, g = draft_tokens.shape
    p = processed_probs(target_logits, params)  # [B, g + 1, V]
    x = draft_tokens.unsqueeze(-1)
    p_x = p[:, :g].gather(-1, x).squeeze(-1)  # [B, g]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, x).squeeze(-1)
    u = torch.rand(B, g, generator=generator)
    n = _prefix_len(u * q_x < p_x, num_drafted)  # accept iff u < p/q, without dividing
    drafted = torch.full((B,), g) if num_drafted is None else num_drafted
    rows = torch.arange(B)
    p_n = p[rows, n]  # [B, V]: where the next token is sampled
    rejected = (n < drafted).unsqueeze(1)
    if draft_probs is None:  # q is a point mass on x_n: max(0, p - q) is p without x_n
        residual = p_n.scatter(1, draft_tokens.gather(1, n.clamp(max=g - 1).unsqueeze(1)), 0.0) if g else p_n
    else:
        residual = (p_n - draft_probs[rows, n.clamp(max=g - 1)]).clamp_min(0.0) if g else p_n
    dist = torch.where(rejected, residual, p_n)
    # the residual sums to 0 only where p == q, where rejection has probability 0; guard rounding
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p_n)
    return n, torch.multinomial(dist, 1, generator=generator).squeeze(1)
