"""An EAGLE-3 drafting head (Li et al. 2025): one decoder layer on the target's own hidden states.

Pair t of a sequence is (the target's hidden states at position t, fused by `fc`, and the token at t + 1); the layer's
output at pair t predicts the token at t + 2. Drafting further, the layer's own output takes the place of the target's
features (training-time test unrolls the same on its own outputs). The layer's q, k and v read [embedding, hidden]
(2 D wide); its vocabulary is the draft vocabulary `draft_ids` (target ids, most frequent first), a few percent of the
target's lm_head.

Weight names follow vLLM's `speculators` format (heads/format.py): fc, layers.0.{input_layernorm, hidden_norm,
self_attn.*, post_attention_layernorm, mlp.*}, norm, lm_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from specdecode.models.linear import DenseLinear, Linear, kernel_available, make_linear


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # the target's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab: int
    aux_layers: tuple[int, ...]  # the target blocks whose inputs are fused (low, middle, high)
    max_position_embeddings: int
    fc_norm: bool = True  # an RMSNorm per feature before `fc` (the target's states differ by 100x in size between
    # depths and tokens: Qwen2's first token is 3000-6500 wide against 20-140 for the others)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high features, as EAGLE-3 and vLLM pick them (the inputs of these blocks)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [..., T, hd] at `positions` [T] (or broadcastable to x's leading dims)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # [..., T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Eagle3Head(nn.Module):
    """The head in float32 for training; `runtime()` gives the drafting copy on this CPU's fast kernels."""

    draft_ids: torch.Tensor  # a buffer

    def __init__(self, cfg: Eagle3Config, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        D, H, KVH, hd, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.register_buffer("draft_ids", draft_ids.to(torch.int64))  # [Vd] target token ids
        self.fc = nn.Linear(len(cfg.aux_layers) * D, D, bias=False)
        self.fc_norm = nn.ParameterList([nn.Parameter(torch.ones(D)) for _ in cfg.aux_layers] if cfg.fc_norm else [])
        self.input_layernorm = nn.Parameter(torch.ones(D))
        self.hidden_norm = nn.Parameter(torch.ones(D))
        self.q_proj = nn.Linear(2 * D, H * hd, bias=False)
        self.k_proj = nn.Linear(2 * D, KVH * hd, bias=False)
        self.v_proj = nn.Linear(2 * D, KVH * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(D))
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)
        self.norm = nn.Parameter(torch.ones(D))
        self.lm_head = nn.Linear(D, len(draft_ids), bias=False)
        for lin in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                    self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)
        nn.init.zeros_(self.o_proj.weight)  # the layer starts as the identity on its hidden input
        nn.init.zeros_(self.down_proj.weight)

    @property
    def draft_vocab(self) -> int:
        return len(self.draft_ids)

    def _qkv(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B, T, D] each -> q [B, H, T, hd], k, v [B, KVH, T, hd] before rotary, and the residual."""
        c = self.cfg
        x = torch.cat([rms(embeds, self.input_layernorm, c.rms_norm_eps), rms(hidden, self.hidden_norm,
                                                                                c.rms_norm_eps)], -1)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def _mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual after attention, then the SwiGLU: the layer's output [B, T, D]."""
        B, T = attn.shape[0], attn.shape[2]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        h = rms(x, self.post_attention_layernorm, self.cfg.rms_norm_eps)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features [..., A*D] -> the layer's hidden input [..., D]."""
        if len(self.fc_norm):
            aux = torch.cat([rms(a, w, self.cfg.rms_norm_eps) for a, w in zip(aux.chunk(len(self.fc_norm), -1),
                                                                               self.fc_norm)], -1)
        return self.fc(aux)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of layer outputs [..., D] -> [..., Vd]."""
        return self.lm_head(rms(out, self.norm, self.cfg.rms_norm_eps))

    def unrolled(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the layer's outputs for `steps` unrolled drafting steps over whole sequences.

        aux: [B, T, A*D] the target's features of pairs 0..T-1; embeds: [B, T + steps - 1, D] the embeddings of
        tokens 1..T+steps-1 (pair t's token first). Step k's output at t ([B, T, D] per step) predicts the token
        at t + 2 + k; its query sits at position t + k and sees the step-0 keys of pairs 0..t and its own earlier
        steps' keys at t (exactly what drafting k tokens ahead of pair t sees).
        """
        c = self.cfg
        B, T, _ = aux.shape
        G = c.num_heads // c.num_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        hidden = self.fuse(aux)
        pos = torch.arange(T)
        causal = pos.view(-1, 1) >= pos.view(1, -1)  # [T, T]
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        for k in range(steps):
            q, kk, vv = self._qkv(embeds[:, k:k + T], hidden)
            q, kk = rope(q, pos + k, c.rope_theta), rope(kk, pos + k, c.rope_theta)
            kk, vv = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)  # [B, H, T, hd]
            keys.append((kk, vv))
            k0, v0 = keys[0]
            s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, H, T, T]
            diag = [(q * km).sum(-1, keepdim=True) * scale for km, _ in keys[1:]]  # each [B, H, T, 1]
            p = torch.softmax(torch.cat([s0, *diag], -1), -1)
            attn = p[..., :T] @ v0
            for m, (_, vm) in enumerate(keys[1:]):
                attn = attn + p[..., T + m:T + m + 1] * vm
            hidden = self._mlp(hidden, attn)
            outs.append(hidden)
        return outs

    def runtime(self, quant: str = "w4a8") -> Eagle3Runtime:
        return Eagle3Runtime(self, quant)


class Eagle3Runtime:
    """The head for drafting: its linears on this CPU's fast kernel (a draft's precision changes only how often its
    tokens are accepted), its own KV cache with a row per sequence, rolled back by its caller (O(1): a row's length
    is the `start` of its next call)."""

    def __init__(self, head: Eagle3Head, quant: str) -> None:
        self.cfg, self.head = head.cfg, head
        quant = quant if kernel_available(quant) else "none"

        def lin(m: nn.Linear) -> Linear:
            w = m.weight.detach().float()
            return DenseLinear(w) if quant == "none" else make_linear(w, None, quant)

        self.fc, self.o, self.down, self.lm_head = lin(head.fc), lin(head.o_proj), lin(head.down_proj), \
            lin(head.lm_head)
        # q, k, v in one call; gate and up in another
        self.qkv = _joined(lin, head.q_proj, head.k_proj, head.v_proj)
        self.gate_up = _joined(lin, head.gate_proj, head.up_proj)
        self.norms = {n: getattr(head, n).detach().float() for n in
                      ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")}
        self.fc_norms = [w.detach().float() for w in head.fc_norm]
        self.draft_ids: torch.Tensor = head.draft_ids

    def new_cache(self, rows: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        shape = (rows, c.num_kv_heads, capacity, c.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    @torch.inference_mode()
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features [T, A*D] -> the layer's hidden input [T, D]."""
        if self.fc_norms:
            aux = torch.cat([rms(a, w, self.cfg.rms_norm_eps) for a, w in zip(aux.chunk(len(self.fc_norms), -1),
                                                                               self.fc_norms)], -1)
        return self.fc(aux)

    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, start: int, cache: tuple[torch.Tensor, torch.Tensor],
             row: int) -> torch.Tensor:
        """Pairs start..start+T-1 of one sequence (hidden, embeds: [T, D]): writes their keys and values to the
        cache row, returns the layer's outputs [T, D] (each pair sees the row's slots up to its own)."""
        c, n = self.cfg, self.norms
        T = hidden.shape[0]
        x = torch.cat([rms(embeds, n["input_layernorm"], c.rms_norm_eps), rms(hidden, n["hidden_norm"],
                                                                                c.rms_norm_eps)], -1)
        q, k, v = self.qkv(x).split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                     c.num_kv_heads * c.head_dim], -1)
        pos = torch.arange(start, start + T)
        q = rope(q.view(T, c.num_heads, c.head_dim).transpose(0, 1), pos, c.rope_theta)  # [H, T, hd]
        k = rope(k.view(T, c.num_kv_heads, c.head_dim).transpose(0, 1), pos, c.rope_theta)
        kc, vc = cache
        kc[row, :, start:start + T] = k
        vc[row, :, start:start + T] = v.view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
        keys, values = kc[row, :, :start + T], vc[row, :, :start + T]  # [KVH, L, hd]
        G = c.num_heads // c.num_kv_heads
        mask = torch.arange(start + T).view(1, -1) <= pos.view(-1, 1)  # [T, L]
        L = start + T
        attn = nn.functional.scaled_dot_product_attention(  # heads of a group share a key/value head
            q.view(c.num_kv_heads, G, T, c.head_dim), keys.unsqueeze(1).expand(-1, G, L, -1),
            values.unsqueeze(1).expand(-1, G, L, -1), attn_mask=mask)  # [KVH, G, T, hd]
        attn = attn.reshape(c.num_heads, T, c.head_dim).transpose(0, 1).reshape(T, -1)
        x = hidden + self.o(attn)
        g, u = self.gate_up(rms(x, n["post_attention_layernorm"], c.rms_norm_eps)).chunk(2, -1)
        return x + self.down(nn.functional.silu(g) * u)

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[T, D] -> draft-vocabulary logits [T, Vd]."""
        return self.lm_head(rms(out, self.norms["norm"], self.cfg.rms_norm_eps))


def _joined(lin, *mods: nn.Linear) -> Linear:
    joined = nn.Linear(mods[0].in_features, sum(m.out_features for m in mods), bias=False)
    joined.weight.data = torch.cat([m.weight.detach() for m in mods])
    return lin(joined)
