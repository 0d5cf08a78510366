"""Verification of a token tree: which path of drafted nodes the target keeps, and its next token.

A tree draft is nodes 0..n-1, each with a parent (-1: the context's last token, the root) that comes before it. The
target's logits come from one forward over [root, node 0, ..., node n-1] with the tree's ancestor mask (row 0 the
root's, row i + 1 node i's), so row i + 1 is what the target predicts after node i's path.

- Greedy: from the root, step to the child whose token is the target's argmax; the first node without one gives the
  argmax as the next token.
- Gumbel coupling: the same with the target's noisy argmax at each depth's position (the noise a plain step there
  would draw), so the output equals plain sampling's with the same seed, token for token.
- Sampling: recursive rejection over siblings (SpecInfer, Miao et al. 2024; the EAGLE-2 and vLLM tree samplers):
  at a node, child c (drafted from q_c, a point mass for deterministic drafters) is kept with probability
  min(1, p(x_c) / q_c(x_c)); if rejected, p becomes normalize(max(0, p - q_c)) for the next sibling; if every child is
  rejected, the next token is sampled from what p has become. Children of one node must be drawn independently of
  each other (i.i.d. draws keep their duplicates as separate nodes). The kept tokens are distributed exactly as the
  target's p, whatever the tree.
"""

from __future__ import annotations

import torch

from specdecode.verification.gumbel import gumbel_noise, noisy_scores
from specdecode.verification.sampling import SamplingParams, processed_probs, sample


def verify_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], probs: torch.Tensor | None,
                params: SamplingParams, generator: torch.Generator, position: int) -> tuple[list[int], int]:
    """(the kept path's node indices, root first, the next token) for one sequence.

    logits: [n + 1, V], the target's after [root, nodes...]; tokens, parents: [n]; probs: [n, V] the q each node was
    drawn from, or None (point masses); position: the sequence index of the token after the root (Gumbel noise key).
    """
    children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]  # by node index + 1 (0: the root)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}'s parent {parent} does not come before it")
        children[parent + 1].append(i)
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        kids = children[node + 1]
        if params.greedy or params.gumbel:
            scores = row
            if params.gumbel:
                if params.seed is None:
                    raise ValueError("Gumbel coupling needs a seed (SpeculativeGenerator.prepare fixes one)")
                scores = noisy_scores(processed_probs(row, params),
                                      gumbel_noise(params.seed, [position + len(path)], row.shape[-1])[0])
            best = int(scores.argmax())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = processed_probs(row, params)
            nxt = None
            for c in kids:
                x = tokens[c]
                q = probs[c] if probs is not None else None
                q_x = 1.0 if q is None else float(q[x])
                if float(torch.rand((), generator=generator)) * q_x < float(p[x]):  # accept iff u < p / q
                    nxt = c
                    break
                p = residual(p, q, x)
            if nxt is None:
                return path, sample(p, generator)
        path.append(nxt)
        node = nxt


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """normalize(max(0, p - q)) [V] after a rejected draft x drawn from q (None: a point mass on x)."""
    r = p.clone() if q is None else (p - q).clamp_min(0.0)
    if q is None:
        r[x] = 0.0
    total = float(r.sum())
    return r / total if total > 0 else p  # 0 only where p == q, where rejection has probability 0
