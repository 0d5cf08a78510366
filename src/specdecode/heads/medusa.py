"""Medusa heads (Cai et al. 2024): K residual blocks on the target's last hidden state, head k predicting the token
k + 1 positions ahead, all at once (no KV cache, no dependence on each other's tokens). A shared lm_head over the draft
vocabulary, started from the target's own rows; the target's final norm is applied first, as the target does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdecode.heads.eagle3 import rms
from specdecode.models.linear import DenseLinear, Linear, kernel_available, make_linear


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int  # K: draft tokens per step at most
    rms_norm_eps: float
    target_vocab: int
    layer: int  # the target block whose output the heads read (num_layers: the last)


class MedusaHeads(nn.Module):
    draft_ids: torch.Tensor  # buffers
    final_norm: torch.Tensor

    def __init__(self, cfg: MedusaConfig, draft_ids: torch.Tensor, final_norm: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.register_buffer("draft_ids", draft_ids.to(torch.int64))  # [Vd] target token ids
        self.register_buffer("final_norm", final_norm.detach().float().clone())  # the target's, frozen
        self.heads = [nn.Linear(D, D) for _ in range(cfg.num_heads)]
        self.blocks = nn.ModuleList(self.heads)
        for b in self.heads:  # each head starts as the target's own next-token prediction
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        self.lm_head = nn.Linear(D, len(draft_ids), bias=False)

    @property
    def draft_vocab(self) -> int:
        return len(self.draft_ids)

    def outputs(self, last: torch.Tensor) -> list[torch.Tensor]:
        """The target's last hidden states [..., D] -> each head's features [..., D]."""
        h = rms(last, self.final_norm, self.cfg.rms_norm_eps)
        return [h + nn.functional.silu(b(h)) for b in self.heads]

    def runtime(self, quant: str = "w4a8") -> MedusaRuntime:
        return MedusaRuntime(self, quant)


class MedusaRuntime:
    """The heads for drafting: every block in one call on this CPU's fast kernel, then the shared lm_head."""

    def __init__(self, heads: MedusaHeads, quant: str) -> None:
        self.cfg = heads.cfg
        quant = quant if kernel_available(quant) else "none"

        def lin(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
            return DenseLinear(w, b) if quant == "none" else make_linear(w, b, quant)

        self.blocks = lin(torch.cat([b.weight.detach() for b in heads.heads]),
                          torch.cat([b.bias.detach() for b in heads.heads]))
        self.lm_head = lin(heads.lm_head.weight.detach().float(), None)
        self.final_norm: torch.Tensor = heads.final_norm
        self.draft_ids: torch.Tensor = heads.draft_ids

    @torch.inference_mode()
    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """One position's last hidden state [D] -> each head's draft-vocabulary logits [K, Vd]."""
        h = rms(last.view(1, -1), self.final_norm, self.cfg.rms_norm_eps)  # [1, D]
        res = nn.functional.silu(self.blocks(h)).view(self.cfg.num_heads, -1)  # [K, D]
        return self.lm_head(h + res)
