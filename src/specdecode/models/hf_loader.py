"""Load a Hugging Face folder: config.json, *.safetensors (sharded too) and its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdecode.errors import ModelLoadError
from specdecode.models.config import ModelConfig


def read_hf_config(folder: Path) -> ModelConfig:
    """A checkpoint folder's config (config.json), without its weights."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        return ModelConfig.from_hf(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"{config_path} is not a valid model config: {e!r}") from e


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (Hugging Face parameter names) of a checkpoint folder."""
    cfg = read_hf_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (pytorch_model.bin is not supported; "
                             "convert it with transformers' save_pretrained(safe_serialization=True))")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"shard {f.name} listed in the index is missing from {folder}")
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {f}: {e} (truncated or corrupt file?)") from e
    return cfg, state


# a tokenizer's vocabulary in one of the forms transformers reads (with tokenizer_config.json beside it, or not)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "tekken.json")


def load_hf_tokenizer(folder: Path):
    """The folder's tokenizer (with its chat template) through transformers."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):  # transformers would build an empty one
        raise ModelLoadError(f"{folder} has no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} there "
                             "(copy the tokenizer files from the model's original folder)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {folder}: {e}") from e
