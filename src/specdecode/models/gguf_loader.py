"""Read GGUF checkpoints (llama.cpp's format) into a ModelConfig and a Hugging Face-named state dict.

Quantized tensors are dequantized on load, so the same model code serves safetensors and GGUF checkpoints, or,
with `blocks=True`, kept as the file's blocks (models/gguf_blocks.py) for kernels that run them as stored.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from specdecode.errors import ModelLoadError
from specdecode.models.config import ModelConfig, UnsupportedArchitectureError
from specdecode.models.gguf_blocks import QuantizedTensor, supported

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# GGUF `general.architecture` -> ModelConfig.arch. Mistral GGUFs are written as "llama".
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_REQUIRED = object()

# GGUF tensor name suffix -> Hugging Face module path, per decoder layer.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Only the config (the file is memory-mapped, no tensor is read)."""
    path = Path(path)
    reader = _open(path)
    return _config(reader, {t.name: t for t in reader.tensors}, path)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, blocks: bool = False
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    """Load a llama/mistral/qwen2 GGUF file as (config, state dict with Hugging Face parameter names).

    Each tensor is converted to ``dtype`` right after it is dequantized, so peak memory stays at
    roughly the result plus one float32 copy of the largest tensor (plus the file's mapped pages).
    blocks: keep the matrices of block types that gguf_blocks reads as QuantizedTensor (the file's bytes).
    """
    path = Path(path)
    reader = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, tensors, path)
    state: dict[str, torch.Tensor | QuantizedTensor] = {}
    for gguf_name, hf_name, rope_heads in _tensor_names(config):
        if gguf_name not in tensors:
            raise ModelLoadError(
                f"{path}: tensor {gguf_name!r} (for {hf_name}) is missing; "
                "the file is incomplete or not a supported llama/qwen2 model"
            )
        tensor = tensors[gguf_name]
        if blocks and len(tensor.shape) == 2 and supported(tensor.tensor_type):
            raw = _unpermute_rope(read_raw(tensor), rope_heads) if rope_heads else read_raw(tensor)
            state[hf_name] = QuantizedTensor(raw, tensor.tensor_type, (int(tensor.shape[1]), int(tensor.shape[0])))
            continue
        weight = read_tensor(tensor, dtype)
        state[hf_name] = weight if rope_heads is None else _unpermute_rope(weight, rope_heads)
    return config, state


def read_tensor(tensor: ReaderTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one GGUF tensor into a dense tensor of its logical shape (GGUF lists dims reversed)."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which cannot be dequantized "
            "(the installed gguf package has no dequantizer for it); use a file quantized differently, "
            "e.g. Q4_K_M, Q8_0 or F16"
        ) from None
    if not values.flags.writeable:  # F32 data is a view of the read-only memory map
        values = np.array(values)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(values).reshape(shape).to(dtype)


def read_raw(tensor: ReaderTensor) -> torch.Tensor:
    """A quantized matrix's bytes, [rows, bytes per row] uint8: a view of the file's read-only map, not a copy (a
    model's load packs them layer by layer; the pages are the file's, and go when the last view does). Only read."""
    with warnings.catch_warnings():  # torch warns that the memory is not writable: nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(tensor.data).view(torch.uint8).reshape(int(tensor.shape[1]), -1)


def embedding_blocks(path: str | Path) -> dict[str, torch.Tensor]:
    """token_embd's blocks as a BlockEmbedding's buffers, mapped from the file rather than copied (a lookup reads
    the pages of its rows only)."""
    tensor = next((t for t in _open(Path(path)).tensors if t.name == "token_embd.weight"), None)
    if tensor is None:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing; the file is incomplete")
    return {"raw": read_raw(tensor), "qtype": torch.tensor(int(tensor.tensor_type)),
            "width": torch.tensor(int(tensor.shape[0]))}


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Build the Hugging Face tokenizer embedded in a GGUF file's metadata."""
    from transformers import AutoTokenizer  # slow import, only needed here

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} not found")
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for malformed tokenizer metadata
        raise ModelLoadError(f"could not build a tokenizer from {path}: {type(exc).__name__}: {exc}") from exc


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} not found")
    try:
        return GGUFReader(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    except Exception as exc:  # bad bytes give ValueError, IndexError, KeyError, ...; short tensor data fails reshape
        raise ModelLoadError(
            f"{path} is truncated or not a valid GGUF file ({type(exc).__name__}: {exc}); "
            "re-pull it (`specdecode pull NAME`) or download it again"
        ) from exc


def _config(reader: GGUFReader, tensors: dict[str, ReaderTensor], path: Path) -> ModelConfig:
    """Translate llama.cpp metadata keys into a ModelConfig."""

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        field = reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{path}: metadata key {key!r} is missing; the GGUF file is incomplete")
            return default
        return field.contents()

    gguf_arch = meta("general.architecture")
    arch = SUPPORTED_GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))} (mistral GGUFs use llama)"
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing; the file is incomplete")
    hidden = meta(f"{gguf_arch}.embedding_length")
    heads = meta(f"{gguf_arch}.attention.head_count")
    eos = meta("tokenizer.ggml.eos_token_id", None)
    return ModelConfig(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=meta(f"{gguf_arch}.feed_forward_length"),
        num_layers=meta(f"{gguf_arch}.block_count"),
        num_heads=heads,
        num_kv_heads=meta(f"{gguf_arch}.attention.head_count_kv", heads),
        head_dim=meta(f"{gguf_arch}.attention.key_length", hidden // heads),
        rms_norm_eps=_decimal(meta(f"{gguf_arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_decimal(meta(f"{gguf_arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(
            meta(f"{gguf_arch}.rope.scaling.type", "none"), _decimal(meta(f"{gguf_arch}.rope.scaling.factor", 1.0))
        ),
        max_position_embeddings=meta(f"{gguf_arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
    )


def _decimal(value: float) -> float:
    """The shortest decimal that a float32 metadata value came from (1e-06, not 9.99999997e-07), as HF configs hold."""
    return float(str(np.float32(value)))


def _rope_scaling(kind: str, factor: float) -> dict[str, Any] | None:
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise UnsupportedArchitectureError(f"GGUF rope scaling {kind!r} is not supported (supported: none, linear)")


def _tensor_names(config: ModelConfig) -> Iterator[tuple[str, str, int | None]]:
    """(GGUF name, Hugging Face name, heads to un-permute by or None) for every tensor the model needs.

    Only llama-architecture files have permuted q/k rows; llama.cpp's qwen2 converter keeps HF order.
    """
    permuted = config.arch == "llama"
    rope_heads = {
        "attn_q": config.num_heads if permuted else None,
        "attn_k": config.num_kv_heads if permuted else None,
    }
    yield "token_embd.weight", "model.embed_tokens.weight", None
    for i in range(config.num_layers):
        for gguf_part, hf_part in _LAYER_TENSORS.items():
            yield f"blk.{i}.{gguf_part}.weight", f"model.layers.{i}.{hf_part}.weight", rope_heads.get(gguf_part)
        if config.attention_bias:
            for gguf_part in ("attn_q", "attn_k", "attn_v"):
                hf_part = _LAYER_TENSORS[gguf_part]
                yield f"blk.{i}.{gguf_part}.bias", f"model.layers.{i}.{hf_part}.bias", rope_heads.get(gguf_part)
    yield "output_norm.weight", "model.norm.weight", None
    if not config.tie_word_embeddings:
        yield "output.weight", "lm_head.weight", None


def _unpermute_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf ``LlamaModel.permute``).

    llama.cpp rotates adjacent pairs of each head's dims while Hugging Face rotates the two
    halves, so the converter interleaves the halves; this restores the Hugging Face order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
