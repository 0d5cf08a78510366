"""Saving and loading drafting heads.

EAGLE-3 heads use vLLM's `speculators` format: config.json (`speculators_model_type` "eagle3", the decoder layer as a
Llama `transformer_layer_config`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, `speculators_config` with
the algorithm, proposal methods and verifier) and model.safetensors (fc, layers.0.*, norm, lm_head, and the draft
vocabulary as `d2t`: target id - draft id, and `t2d`: which target ids are drafted). vLLM serves such a head beside its
target; a head trained elsewhere in this format loads here (the embedding is the target's: one saved with the head is
not read). Medusa heads have no speculators type: the same files with `specdecode_head` "medusa".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import torch
from safetensors.torch import load_file, save_file

from specdecode.errors import ModelLoadError
from specdecode.heads.eagle3 import Eagle3Config, Eagle3Head
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.models.decoder import Transformer

Head = Union[Eagle3Head, MedusaHeads]

EAGLE3_NAMES = {  # ours -> the speculators format's
    "fc.weight": "fc.weight", "input_layernorm": "layers.0.input_layernorm.weight",
    "hidden_norm": "layers.0.hidden_norm.weight", "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight", "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight", "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight", "norm": "norm.weight", "lm_head.weight": "lm_head.weight",
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def save_head(head: Head, out: Path, *, target: Transformer, target_name: str = "", trained: dict | None = None,
              speculative_tokens: int = 4) -> None:
    """config.json and model.safetensors (weights in bfloat16, as the speculators format ships them)."""
    out.mkdir(parents=True, exist_ok=True)
    tc = target.config
    verifier = {"name_or_path": target_name or None, "architectures": [ARCHITECTURES.get(tc.arch, tc.arch)]}
    ours = {"target_hidden_size": tc.hidden_size, "target_vocab_size": tc.vocab_size,
            "target_layers": tc.num_layers, "trained": trained or {}}
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()
          if k not in ("draft_ids",)}
    draft_ids = head.draft_ids
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    if isinstance(head, Eagle3Head):
        c = head.cfg
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": {
                "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.target_vocab,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
            "draft_vocab_size": head.draft_vocab, "norm_before_residual": False, "fc_norm": c.fc_norm,
            "target_hidden_size": tc.hidden_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "verifier": verifier},
            "specdecode": ours}
        sd = {EAGLE3_NAMES.get(k, f"{k}.weight"): v for k, v in sd.items()}  # fc_norm.i -> fc_norm.i.weight
    else:
        c2 = head.cfg
        config = {"specdecode_head": "medusa", "hidden_size": c2.hidden_size, "num_heads": c2.num_heads,
                  "rms_norm_eps": c2.rms_norm_eps, "target_vocab_size": c2.target_vocab, "layer": c2.layer,
                  "draft_vocab_size": head.draft_vocab, "verifier": verifier, "specdecode": ours}
        sd["final_norm"] = head.final_norm.float()
    sd["d2t"] = draft_ids - torch.arange(len(draft_ids))
    sd["t2d"] = t2d
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def load_head(path: str | Path, target: Transformer | None) -> Head:
    """A head saved by `save_head` (or an EAGLE-3 head in the speculators format), checked against `target` (None:
    unchecked, as the runtime benchmark times a head alone)."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelLoadError(f"{path} holds no drafting head (config.json and model.safetensors; "
                             "`specdecode train-draft` writes them)")
    config = json.loads((path / "config.json").read_text())
    sd = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path / "model.safetensors")).items()}
    tc = target.config if target is not None else None
    draft_ids = sd.pop("d2t").long() + torch.arange(config["draft_vocab_size"])
    sd.pop("t2d", None)
    sd.pop("embed_tokens.weight", None)  # the target's own embedding is used
    if config.get("speculators_model_type") == "eagle3":
        lc = config["transformer_layer_config"]
        hidden, vocab = config.get("target_hidden_size") or lc["hidden_size"], lc["vocab_size"]
        target_layers = tc.num_layers if tc is not None else config.get("specdecode", {}).get("target_layers")
        if tc is not None:
            _check(path, hidden, vocab, tc.hidden_size, tc.vocab_size)
        layers = config.get("eagle_aux_hidden_state_layer_ids")
        if not layers:  # vLLM's choice for heads that do not say
            if target_layers is None:
                raise ModelLoadError(f"the head at {path} names no target layers (eagle_aux_hidden_state_layer_ids)")
            layers = [2, target_layers // 2, target_layers - 3]
        if tc is not None and max(layers) > tc.num_layers:
            raise ModelLoadError(f"the head at {path} reads target layer {max(layers)}; the target has "
                                 f"{tc.num_layers}")
        rope_theta = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        cfg = Eagle3Config(lc["hidden_size"], lc["num_attention_heads"], lc["num_key_value_heads"],
                           lc.get("head_dim") or lc["hidden_size"] // lc["num_attention_heads"],
                           lc["intermediate_size"], lc["rms_norm_eps"], rope_theta, vocab, tuple(layers),
                           lc.get("max_position_embeddings", 32768), bool(config.get("fc_norm", False)))
        if config.get("norm_before_fc"):
            raise ModelLoadError(f"the head at {path} has norm_before_fc; heads without it are supported")
        if lc.get("num_hidden_layers", 1) != 1 or config.get("norm_before_residual"):
            raise ModelLoadError(f"the head at {path} has {lc.get('num_hidden_layers')} layers or "
                                 "norm_before_residual; one layer without it is supported")
        head: Head = Eagle3Head(cfg, draft_ids)
        back = {v: k for k, v in EAGLE3_NAMES.items()} | {f"fc_norm.{i}.weight": f"fc_norm.{i}"
                                                           for i in range(len(layers) if cfg.fc_norm else 0)}
        unknown = set(sd) - set(back)
        if unknown:
            raise ModelLoadError(f"the head at {path} has tensors this EAGLE-3 head does not: {sorted(unknown)[:4]}")
        head.load_state_dict({back[k]: v for k, v in sd.items()} | {"draft_ids": draft_ids})
        return head
    if config.get("specdecode_head") == "medusa":
        if tc is not None:
            _check(path, config["hidden_size"], config["target_vocab_size"], tc.hidden_size, tc.vocab_size)
        mcfg = MedusaConfig(config["hidden_size"], config["num_heads"], config["rms_norm_eps"],
                            config["target_vocab_size"], config["layer"])
        heads = MedusaHeads(mcfg, draft_ids, sd["final_norm"])
        heads.load_state_dict(sd | {"draft_ids": draft_ids})
        return heads
    raise ModelLoadError(f"{path}/config.json is neither an EAGLE-3 head (speculators_model_type 'eagle3') nor a "
                         "Medusa head of ours")


def _check(path: Path, hidden: int, vocab: int, target_hidden: int, target_vocab: int) -> None:
    if (hidden, vocab) != (target_hidden, target_vocab):
        raise ModelLoadError(f"the head at {path} was trained for a target with hidden size {hidden} and a "
                             f"vocabulary of {vocab} tokens; this target has hidden size {target_hidden} and "
                             f"{target_vocab} tokens: train a head for it with `specdecode train-draft`")
