"""Model hyper-parameters, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` -> our family name
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedArchitectureError(ModelLoadError):
    """Raised for a checkpoint whose architecture the runtime does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if archs:
            arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        else:  # no architectures: the model type names the family
            arch = cfg.get("model_type") if cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values() else None
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "<missing>")
            raise UnsupportedArchitectureError(
                f"architecture {name!r} is not supported; supported: "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 nests theta and scaling under "rope_parameters"
    return cfg.get("rope_parameters") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or _rope_params(cfg)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedArchitectureError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    return {k: v for k, v in scaling.items() if k != "rope_theta"}
