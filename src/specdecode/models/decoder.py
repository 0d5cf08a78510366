"""A Llama-family decoder (Llama, Mistral, SmolLM2, Qwen2) with a preallocated, rollback-able KV cache.

One forward takes T new tokens per sequence, writes their keys/values at cache slots
`start .. start+T-1` and returns logits for all T. Rolling back is free: a sequence's length is
just the `start` of its next forward, and stale slots beyond it are never visible (a query at
position p sees cache slots j <= p, or the slots its tree mask allows).

Bit-exact mode (`decode_width=W`): a token's logits must not depend on how many tokens share its
forward. Two ways, chosen per model:
- Row-invariant by construction: forwards of up to FUSED_MAX_ROWS tokens (decode forwards up to
  W <= FUSED_MAX_WIDTH) run RMSNorm, rotary attention and SiLU * up as C++ ops that compute every row by the
  same fixed operations (kernels/decode_ops.py, AVX-512 or AVX2 + FMA CPUs); with linears that do the same
  (int4-amx, int8-amx, w4a8, w6a8, w8a8) no row is padded. A dense lm_head still gets its fixed shape of W rows
  (its kernel's order depends on the row count).
- Padding: otherwise every forward of T <= W tokens is padded to exactly W rows, so a plain 1-token
  step and a (1 + gamma)-token verify step run the same kernels on the same shapes. The PyTorch
  attention walks the cache in fixed blocks of `ATTN_BLOCK` keys in a fixed order (online softmax), so
  a query's reductions do not depend on the cache length or on masked keys.
Other forwards (prefills longer than the C++ ops take, every forward of a model without the promise where the C++ ops
do not run) use the PyTorch ops, attention PyTorch's fused kernel; plain and speculative decoding prefill the same
way, in one forward of the same shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from specdecode.kernels import decode_ops
from specdecode.kernels.gguf_int8 import GgufInt8Linear
from specdecode.kernels.w4a8 import W4A8Linear, Weights
from specdecode.models.config import ModelConfig
from specdecode.models.gguf_blocks import BlockEmbedding, QuantizedTensor, supported
from specdecode.models.linear import DenseLinear, Linear, invariant_rows, kernel, make_linear, parse_quant, \
    restore_linear

ATTN_BLOCK = 256  # keys per attention block; cache capacity is a multiple of it
FUSED_MAX_ROWS = 16  # forwards of up to this many tokens per sequence use the C++ decode ops where they run
FUSED_MAX_WIDTH = 32  # and a bit-exact target's decode forwards (up to its width: a token tree's nodes) up to this
ROPE_CHUNK = 1024  # positions per chunk of the cos / sin tables


@dataclass
class StepInputs:
    """What every layer of one forward needs besides x: where the new tokens go and what they see.

    rows: [B] cache rows (None: 0..B-1; fused: never None); slots: [B, T] cache slots written; fused: run the
    C++ decode ops.
    Fused: cos, sin [B, T, hd] float32, mask [B, T, K] bool. PyTorch ops: cos, sin [B, 1, T, hd] in the
    model dtype; mask a list of [B, 1, T, ATTN_BLOCK] per cache block (bit-exact: see `blocked_attention`), or
    [B, T, K] bool (not bit-exact: PyTorch's fused attention, see `cached_attention`).
    """

    rows: torch.Tensor | None
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | list[torch.Tensor]
    fused: bool


@dataclass
class KVCache:
    """Keys and values of `batch` sequences, preallocated to `capacity` slots.

    k, v: [layers, batch, kv_heads, capacity, head_dim]. Lengths live with the caller (the
    `start` of each forward), which makes rollback O(1).
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def move(self, row: int, src: list[int], dst: range) -> None:
        """Copy the keys and values of slots `src` to slots `dst` of a row, in order (a token tree's kept path goes
        to the slots right after the context; each source lies at or after its destination). Keys are stored
        rotated at their positions, which a path keeps."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if pairs:
            s_idx = torch.tensor([s for s, _ in pairs], device=self.k.device)
            d_idx = torch.tensor([d for _, d in pairs], device=self.k.device)
            for t in (self.k, self.v):
                t[:, row, :, d_idx] = t[:, row, :, s_idx]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # same arithmetic as transformers' LlamaRMSNorm: reduce in float32, scale in the model dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the checkpoint's theta and scaling (linear, llama3)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    """One decoder layer: pre-norm attention with grouped-query heads, then pre-norm SwiGLU."""

    def __init__(self, cfg: ModelConfig, qkv: Linear, o: Linear, gate_up: Linear,
                 down: Linear, attn_norm: torch.Tensor, mlp_norm: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.attn_norm = nn.Parameter(attn_norm, requires_grad=False)
        self.mlp_norm = nn.Parameter(mlp_norm, requires_grad=False)
        # decided here, once: a layer whose linears are swapped later needs a new Block
        self.one_call = one_call_kind(qkv, o, gate_up, down)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache, step: StepInputs) -> torch.Tensor:
        # x: [B, T, D]
        cfg = self.cfg
        B, T, _ = x.shape
        H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if step.fused:  # its rows and mask are tensors (see StepInputs)
            rows, mask = step.rows, step.mask
            assert rows is not None and isinstance(mask, torch.Tensor)
            # the ops below and the linears in one C++ call (kernels/layer.cpp)
            if self.one_call == "w4a8":
                return decode_ops.w4a8_layer(x, self.attn_norm, self.mlp_norm, cfg.rms_norm_eps, _weights(self.qkv),
                                             self.qkv.bias, _weights(self.o), _weights(self.gate_up),
                                             _weights(self.down), step.cos, step.sin, cache.k[layer], cache.v[layer],
                                             rows, step.slots, mask, H, KVH)
            if self.one_call == "gguf":
                return decode_ops.gguf_layer(x, self.attn_norm, self.mlp_norm, cfg.rms_norm_eps,
                                             _gguf_parts(self.qkv), self.qkv.bias, _gguf_parts(self.o),
                                             _gguf_parts(self.gate_up), _gguf_parts(self.down), step.cos, step.sin,
                                             cache.k[layer], cache.v[layer], rows, step.slots, mask, H, KVH)
            # the same layer in three row-invariant C++ ops (kernels/decode_ops.cpp)
            attn = decode_ops.rope_attention(self.qkv(decode_ops.rms_norm(x, self.attn_norm, cfg.rms_norm_eps)),
                                             step.cos, step.sin, cache.k[layer], cache.v[layer], rows,
                                             step.slots, mask, H, KVH)
            x = x + self.o(attn)
            return x + self.down(decode_ops.silu_mul(self.gate_up(decode_ops.rms_norm(x, self.mlp_norm,
                                                                                        cfg.rms_norm_eps))))
        qkv = self.qkv(rms_norm(x, self.attn_norm, cfg.rms_norm_eps))
        q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, KVH, hd).transpose(1, 2)  # [B, KVH, T, hd]
        v = v.view(B, T, KVH, hd).transpose(1, 2)
        q = q * step.cos + rotate_half(q) * step.sin
        k = k * step.cos + rotate_half(k) * step.sin
        index = (torch.arange(B, device=x.device) if step.rows is None else step.rows).view(B, 1)
        cache.k[layer].permute(0, 2, 1, 3)[index, step.slots] = k.transpose(1, 2)
        cache.v[layer].permute(0, 2, 1, 3)[index, step.slots] = v.transpose(1, 2)
        if isinstance(step.mask, list):
            attn = blocked_attention(q, cache.k[layer], cache.v[layer], step.rows, step.mask)  # [B, H, T, hd]
        else:
            attn = cached_attention(q, cache.k[layer], cache.v[layer], step.rows, step.slots, step.mask)
        x = x + self.o(attn.transpose(1, 2).reshape(B, T, H * hd))
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


def one_call_kind(qkv: Linear, o: Linear, gate_up: Linear, down: Linear) -> str:
    """Which one-call layer of kernels/layer.cpp runs a layer of these linears: "w4a8" where all four are our W4A8
    kernel, "gguf" where all four run a GGUF file's blocks on gguf_int8's kernel, "" otherwise (also where o, gate_up
    or down has a bias, which the C++ layer would drop: this family has none)."""
    linears = (qkv, o, gate_up, down)
    if any(lin.bias is not None for lin in linears[1:]):
        return ""
    if all(type(lin) is W4A8Linear and lin.row_invariant for lin in linears):
        return "w4a8"
    if all(isinstance(lin, GgufInt8Linear) for lin in linears):
        return "gguf"
    return ""


def _weights(lin: Linear) -> Weights:
    assert isinstance(lin, W4A8Linear)  # Block.one_call
    return lin.weights


def _gguf_parts(lin: Linear) -> list[tuple]:
    assert isinstance(lin, GgufInt8Linear)  # Block.one_call
    return lin.layer_parts


def blocked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None,
                      visible: list[torch.Tensor]) -> torch.Tensor:
    """Attention over the cache in fixed blocks of ATTN_BLOCK keys, in order, with online softmax.

    q: [B, H, T, hd]; k_cache, v_cache: [batch, KVH, capacity, hd]; rows: [B] the cache rows of the
    B sequences (None: the first B); visible[b]: [B, 1, T, ATTN_BLOCK] bool for cache block b. Every
    block has the same shape whatever the cache length or the batch, and a fully masked block leaves
    a query's running sums bit-for-bit unchanged.
    """
    B, H, T, hd = q.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    qg = q.reshape(B, KVH, G * T, hd).float() * (1.0 / math.sqrt(hd))  # heads of a group share K/V
    m = torch.full((B, KVH, G * T, 1), float("-inf"), device=q.device)
    denom = torch.zeros(B, KVH, G * T, 1, device=q.device)
    acc = torch.zeros(B, KVH, G * T, hd, device=q.device)
    for b, vis in enumerate(visible):
        block = slice(b * ATTN_BLOCK, (b + 1) * ATTN_BLOCK)
        kb = (k_cache[:B, :, block] if rows is None else k_cache[rows, :, block]).float()  # [B, KVH, N, hd]
        vb = (v_cache[:B, :, block] if rows is None else v_cache[rows, :, block]).float()
        s = (qg @ kb.transpose(-1, -2)).view(B, KVH, G, T, ATTN_BLOCK)
        s = s.masked_fill(~vis.unsqueeze(2), float("-inf")).view(B, KVH, G * T, ATTN_BLOCK)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ vb
        m = m_new
    return (acc / denom).view(B, H, T, hd).to(q.dtype)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None,
                     slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention through PyTorch's fused kernel, a sequence at a time over its cache up to its last new slot. Its
    reductions depend on the shapes, so a bit-exact model's decode forwards use `blocked_attention`; prefills and
    models without the promise (a draft) use this.

    q: [B, H, T, hd]; k_cache, v_cache: [batch, KVH, capacity, hd]; rows: [B] (None: the first B); slots: [B, T];
    visible: [B, T, K] bool. Returns [B, H, T, hd].
    """
    out = []
    for b in range(q.shape[0]):
        row = b if rows is None else int(rows[b])
        n = int(slots[b].max()) + 1
        out.append(nn.functional.scaled_dot_product_attention(
            q[b:b + 1], k_cache[row:row + 1, :, :n], v_cache[row:row + 1, :, :n], attn_mask=visible[b, :, :n],
            enable_gqa=True))
    return torch.cat(out)


class Transformer(nn.Module):
    """The decoder stack plus embeddings and lm_head. Build it with `Transformer.from_state_dict`."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    embed: nn.Parameter | BlockEmbedding

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor | BlockEmbedding, blocks: list[Block], norm: torch.Tensor,
                 lm_head: Linear, decode_width: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed = embed if isinstance(embed, BlockEmbedding) else nn.Parameter(embed, requires_grad=False)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.decode_width = decode_width
        self.max_group = 1 << 30  # decode batches larger than this run in groups (enable_batching measures it)
        # short forwards run the C++ decode ops where this CPU has them; with row-invariant linears too, a
        # bit-exact forward then needs no padding rows (only a dense lm_head still gets them)
        self.fused_ops = (self.device.type == "cpu" and decode_ops.extension() is not None
                          and cfg.head_dim in decode_ops.HEAD_DIMS and embed.dtype in (torch.float32, torch.bfloat16))
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(embed.device), persistent=False)
        self._rope_cos = self._rope_sin = torch.zeros(0, cfg.head_dim, device=embed.device)  # see _rope_tables

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, sd: dict[str, torch.Tensor | QuantizedTensor],
                        dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", decode_width: int | None = None,
                        quant: str = "none", head_rows: int | None = None, head_quant: str = "none") -> "Transformer":
        """Build from Hugging Face parameter names (GGUF loading maps to them too).

        quant: quantization of every linear of the blocks ("none", "int8", "int4[-gG]", "int4-amx[-gG]",
        "int8-amx", "w4a8"), done layer by layer as the weights are taken. The embedding stays in `dtype` (a
        lookup reads one row per token).
        head_rows: keep only the lm_head's first rows (a draft's reduced vocabulary: logits for token ids
        below it; byte-level BPE vocabularies list their most frequent merges first).
        head_quant: the lm_head's quantization: a target's stays wider than its blocks (see
        `builder.target_head_quant`); a draft's may be as narrow, since its precision only changes how often
        its tokens are accepted (its head is a third of its weights).
        """

        def take(name: str) -> torch.Tensor:
            return dense(pop(name))

        def pop(name: str) -> torch.Tensor | QuantizedTensor:
            if name not in sd:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return sd.pop(name)

        def dense(t: torch.Tensor | QuantizedTensor) -> torch.Tensor:
            t = t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t
            return t.to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in sd else None

        def native(tensors: list[torch.Tensor | QuantizedTensor], quant: str) -> list[QuantizedTensor] | None:
            """The tensors, if a native kernel (`--quant gguf`) runs them as the file stores them."""
            blocks = [t for t in tensors if isinstance(t, QuantizedTensor) and supported(t.qtype)]
            return blocks if kernel(quant).native and len(blocks) == len(tensors) else None

        def linear(tensors: list[torch.Tensor | QuantizedTensor], bias: torch.Tensor | None = None,
                   quant: str = quant) -> Linear:
            if (blocks := native(tensors, quant)) is not None:
                return kernel(quant).from_blocks(blocks, bias, dtype)
            if kernel(quant).native:  # the file holds this one densely: its precision is its dtype
                quant = "none"
            return make_linear(torch.cat([dense(t) for t in tensors]), bias, quant)

        blocks = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = [pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            biases = [b for n in "qkv" if (b := maybe(p + f"self_attn.{n}_proj.bias")) is not None]
            qkv_b = torch.cat(biases) if len(biases) == 3 else None
            gate_up = [pop(p + "mlp.gate_proj.weight"), pop(p + "mlp.up_proj.weight")]
            blocks.append(Block(cfg, linear(qkv, qkv_b), linear([pop(p + "self_attn.o_proj.weight")]),
                                linear(gate_up), linear([pop(p + "mlp.down_proj.weight")]),
                                take(p + "input_layernorm.weight"), take(p + "post_attention_layernorm.weight")))
        embed_t = pop("model.embed_tokens.weight")
        head_t = embed_t if cfg.tie_word_embeddings or "lm_head.weight" not in sd else pop("lm_head.weight")
        rows = head_t.shape[0] if head_rows is None else head_rows
        if not 1 <= rows <= head_t.shape[0]:
            raise ValueError(f"a reduced vocabulary needs 1..{head_t.shape[0]} tokens, got {head_rows}")
        if parse_quant(head_quant)[0] == "int4" and rows % 16:
            head_quant = "none"  # torch's int4 layout needs rows in multiples of 16 (a reduced vocabulary may not)
        native_head = native([head_t], head_quant) is not None
        dense_head_quant = "none" if kernel(head_quant).native else head_quant
        shares_embedding = head_t is embed_t and not native_head and dense_head_quant == "none"
        if isinstance(embed_t, QuantizedTensor) and not shares_embedding:  # the file's blocks, read row by row
            embed: torch.Tensor | BlockEmbedding = BlockEmbedding(embed_t, dtype, torch.device(device))
        else:  # dense; a tied dense head is a view of it (one tensor)
            embed = dense(embed_t)
        if isinstance(head_t, QuantizedTensor) and (native_head or head_t is not embed_t):
            lm_head = linear([head_t if head_rows is None else head_t.rows(head_rows)], None, head_quant)
        else:
            head = embed if isinstance(embed, torch.Tensor) and head_t is embed_t else dense(head_t)
            if head_rows is not None:
                head = head[:head_rows] if head is embed else head[:head_rows].clone()  # free the untied rest
            lm_head = make_linear(head, None, dense_head_quant)
        return cls(cfg, embed, blocks, take("model.norm.weight"), lm_head, decode_width)

    @classmethod
    def from_saved(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor], quants: dict[str, str],
                   head_rows_of_embed: int | None, decode_width: int | None = None) -> "Transformer":
        """Rebuild from this class's own `state_dict()` (the packed weight cache): no dequantizing, no packing.

        quants: each linear's `quant` by module name; head_rows_of_embed: the lm_head is the embedding's first
        rows (tied weights are stored once), else None.
        """

        def linear(name: str) -> Linear:
            prefix = name + "."
            own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            return restore_linear(quants[name], own, tensors["norm"].dtype)

        blocks = [Block(cfg, linear(f"blocks.{i}.qkv"), linear(f"blocks.{i}.o"), linear(f"blocks.{i}.gate_up"),
                        linear(f"blocks.{i}.down"), tensors[f"blocks.{i}.attn_norm"], tensors[f"blocks.{i}.mlp_norm"])
                  for i in range(cfg.num_layers)]
        own = {k.removeprefix("embed."): v for k, v in tensors.items() if k.startswith("embed.")}
        embed = BlockEmbedding.restore(own, tensors["norm"].dtype, tensors["norm"].device) if own else tensors["embed"]
        head = DenseLinear(tensors["embed"][:head_rows_of_embed]) if head_rows_of_embed else linear("lm_head")
        return cls(cfg, embed, blocks, tensors["norm"], head, decode_width)

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        """A zeroed cache for `batch` sequences of up to `max_len` tokens (default: the model's context)."""
        max_len = max_len or self.config.max_position_embeddings
        slack = self.decode_width or 0  # padding rows of the last step write past the end
        capacity = -(-(max_len + slack) // ATTN_BLOCK) * ATTN_BLOCK
        shape = (self.config.num_layers, batch, self.config.num_kv_heads, capacity, self.config.head_dim)
        # zeros, not empty: masked keys are multiplied by 0 and must not be NaN
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))

    def enable_batching(self, max_batch: int) -> int:
        """Keep bit-exactness for decode batches of up to `max_batch` sequences: a batch runs in groups of as
        many sequences as every linear of this model computes row-invariantly on this CPU (measured once per
        kernel and shape, see `invariant_rows`). Returns that group size (1: no batching gain on linears)."""
        if self.decode_width is None:  # no bit-exact promise to keep
            return max_batch
        if self.device.type != "cpu":  # the GPU's batched attention matmuls pick kernels by batch size
            self.max_group = 1
            return 1
        measured: dict[tuple, int] = {}
        for lin in self.modules():
            if not isinstance(lin, Linear):
                continue
            key = (type(lin), lin.out_features, lin.in_features, lin.dtype)
            if key not in measured:
                measured[key] = invariant_rows(lin, self.decode_width, max_batch)
        self.max_group = min(measured.values(), default=max_batch)
        return self.max_group

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, num_logits: int | None = None,
                rows: torch.Tensor | None = None, hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run T new tokens per sequence and return their logits.

        tokens: [B, T] ids; start: [B] cache length of each sequence before this step (its new
        tokens go to slots start..start+T-1); rows: [B] which cache rows hold the B sequences
        (default: rows 0..B-1). tree_mask: optional [B, T, T] bool, which new tokens
        each new token sees (default causal; a token tree passes its ancestor mask, and positions
        are then start + depth). num_logits: only the last n rows get logits (prefill needs 1).
        hidden: hidden states to capture, filled in place: its keys name layers, each gets the input of that
        block ([B, T, D] float32 on the CPU, the real rows only; key num_layers: the last block's output, before
        the final norm). Learned drafting heads read them; capturing changes no logit.
        Inputs may live on the CPU whatever the model's device; the outputs are on the CPU (the engine
        drafts and verifies there).
        Returns logits [B, n, V] float32.
        """
        B, T = tokens.shape
        W = self.decode_width
        if rows is not None and torch.equal(rows.cpu(), torch.arange(B)):
            rows = None  # the first B rows: attention slices the cache instead of gathering it
        if W is not None and T <= W and B > self.max_group:  # bit-exact decode batch: groups of invariant size
            groups = [slice(i, i + self.max_group) for i in range(0, B, self.max_group)]
            parts = [{k: torch.empty(0) for k in hidden or {}} for _ in groups]
            logits = torch.cat([self.forward(tokens[g], start[g], cache, None if tree_mask is None else tree_mask[g],
                                             num_logits, torch.arange(B)[g] if rows is None else rows[g], part)
                                for g, part in zip(groups, parts)])
            if hidden is not None:
                for k in hidden:
                    hidden[k] = torch.cat([part[k] for part in parts])
            return logits
        fused = self.fused_ops and (W <= FUSED_MAX_WIDTH if W is not None and T <= W else T <= FUSED_MAX_ROWS)
        if W is not None and T < W and not (fused and self.rows_independent):  # bit-exact: pad to exactly W rows
            tokens = torch.cat([tokens, tokens.new_zeros(B, W - T)], dim=1)
            if tree_mask is not None:
                pad = torch.eye(W, dtype=torch.bool, device=tree_mask.device).expand(B, W, W).clone()
                pad[:, :T, :T] = tree_mask
                tree_mask = pad
        dev = self.device
        tokens, start = tokens.to(dev), start.to(dev)
        rows = None if rows is None else rows.to(dev)
        tree_mask = None if tree_mask is None else tree_mask.to(dev)
        Tp = tokens.shape[1]
        start = start.to(torch.long).view(B, 1)
        slots = start + torch.arange(Tp, device=dev).view(1, Tp)  # [B, Tp]
        if tree_mask is None:
            positions = slots
        else:
            depth = tree_mask.sum(-1) - 1  # a token sees itself and its ancestors
            positions = start + depth
        if int(slots.max()) >= cache.capacity:
            raise ValueError(f"sequence of {int(slots.max()) + 1} tokens exceeds the cache capacity {cache.capacity}")
        mask = self._visibility(start, slots, positions, tree_mask)  # [B, Tp, K]
        cos, sin = self._rope_tables(int(positions.max()) + 1)
        cos, sin = cos[positions], sin[positions]  # [B, Tp, hd] float32
        if fused:
            step = StepInputs(torch.arange(B) if rows is None else rows, slots, cos, sin, mask, True)
        else:
            exact = W is not None and T <= W  # a bit-exact decode forward; a prefill's shapes are the same in
            # plain and speculative decoding, whatever its attention kernel
            step = StepInputs(rows, slots, cos.unsqueeze(1).to(self.dtype), sin.unsqueeze(1).to(self.dtype),
                              list(mask.unsqueeze(1).split(ATTN_BLOCK, dim=-1)) if exact else mask, False)
        x = self.embed_tokens(tokens)
        for i, block in enumerate(self.blocks):
            if hidden is not None and i in hidden:
                hidden[i] = x[:, :T].to("cpu", torch.float32, copy=True)
            x = block(x, i, cache, step)
        if hidden is not None and len(self.blocks) in hidden:
            hidden[len(self.blocks)] = x[:, :T].to("cpu", torch.float32, copy=True)
        n = T if num_logits is None else min(num_logits, T)
        if n == 0:  # a prefill that only fills the cache: no lm_head
            return torch.zeros(B, 0, self.lm_head.out_features)
        return self._head(x, T, n, fused).cpu()

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., D] in the model's dtype."""
        return self.embed(tokens) if isinstance(self.embed, BlockEmbedding) else self.embed[tokens]

    def _head(self, x: torch.Tensor, T: int, n: int, fused: bool) -> torch.Tensor:
        """Final norm and lm_head for the last n of the T real rows of x [B, Tp, D] -> logits float32."""
        W, eps = self.decode_width, self.config.rms_norm_eps
        if fused:  # row-invariant norm; a head that is not gets its fixed shape of W rows in bit-exact mode
            h = decode_ops.rms_norm(x[:, T - n:T], self.norm, eps)
            if W is not None and T <= W and not self.lm_head.row_invariant:
                rows = torch.cat([h, h.new_zeros(h.shape[0], W - n, h.shape[-1])], dim=1)
                return self.lm_head(rows)[:, :n].float()
            return self.lm_head(h).float()
        if x.shape[1] == W:  # padded: keep the fixed shape through lm_head, then drop padding rows
            h = rms_norm(x, self.norm, eps)
            return self.lm_head(h).float()[:, T - n:T]
        return self.lm_head(rms_norm(x[:, T - n:], self.norm, eps)).float()

    def _rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position below n: [>= n, hd] float32. Built in chunks of ROPE_CHUNK positions
        of one shape, so a position's values never depend on how many positions a forward has (torch's cos may
        round an element differently in another tensor shape)."""
        while self._rope_cos.shape[0] < n:
            first = self._rope_cos.shape[0]
            freqs = torch.arange(first, first + ROPE_CHUNK, device=self.device).float().unsqueeze(-1) * self.inv_freq
            emb = torch.cat([freqs, freqs], dim=-1)  # [ROPE_CHUNK, hd]
            self._rope_cos = torch.cat([self._rope_cos, emb.cos()])
            self._rope_sin = torch.cat([self._rope_sin, emb.sin()])
        return self._rope_cos, self._rope_sin

    @property
    def exact_trees(self) -> bool:
        """Whether a token tree's nodes get their paths' bits in a decode forward: not in bit-exact mode, or with the
        C++ decode ops (their attention sums the visible keys in slot order; PyTorch's reductions depend on where a
        key sits in its block, and a tree's ancestors sit at other slots than its path's)."""
        return self.decode_width is None or (self.fused_ops and self.decode_width <= FUSED_MAX_WIDTH)

    @cached_property
    def rows_independent(self) -> bool:
        """Whether every linear of the blocks computes each row independently of the others (by construction)."""
        return all(m.row_invariant for m in self.blocks.modules() if isinstance(m, Linear))

    @staticmethod
    def _visibility(start: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    tree_mask: torch.Tensor | None) -> torch.Tensor:
        """Which cache slots each new token sees: [B, Tp, K] bool, K a multiple of ATTN_BLOCK."""
        n_blocks = -(-(int(slots.max()) + 1) // ATTN_BLOCK)
        keys = torch.arange(n_blocks * ATTN_BLOCK, device=slots.device).view(1, 1, -1)
        if tree_mask is None:
            return keys <= slots.unsqueeze(-1)  # [B, Tp, K]: causal by slot
        vis = keys < start.unsqueeze(-1)  # the committed prefix
        new = keys - start.unsqueeze(-1)  # [B, 1, K] index into the new tokens
        in_new = (new >= 0) & (new < slots.shape[1])
        tm = torch.gather(tree_mask, 2, new.clamp(0, slots.shape[1] - 1).expand(-1, slots.shape[1], -1))
        return vis | (in_new & tm)
