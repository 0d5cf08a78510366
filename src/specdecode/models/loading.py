"""One entry point to load a model by catalog name, Hugging Face folder or GGUF file."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.heap import temporaries_returned
from specdecode.models.catalog import resolve
from specdecode.models.config import ModelConfig
from specdecode.models.decoder import Transformer
from specdecode.models.gguf_blocks import BlockEmbedding, QuantizedTensor
from specdecode.models.gguf_loader import embedding_blocks, load_gguf, load_gguf_tokenizer, read_gguf_config
from specdecode.models.hf_loader import load_hf_folder, load_hf_tokenizer
from specdecode.models.linear import kernel, parse_quant
from specdecode.models.weight_cache import WeightCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    source: Path
    load_seconds: float
    from_cache: bool = False  # the weights came from the packed-weight cache (models/weight_cache.py)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"dtype {dtype} is not supported; choose one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"device {device!r} is not supported; choose cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but this torch build sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r} is not supported; choose cpu or cuda")
    return dev


def load_model(name_or_path: str | Path, *, dtype: str | torch.dtype = "float32", device: str = "cpu",
               decode_width: int | None = None, pull_missing: bool = True,
               with_tokenizer: bool = True, quant: str = "none", head_rows: int | None = None,
               head_quant: str = "none") -> LoadedModel:
    """Load weights and tokenizer. `decode_width` turns on bit-exact fixed-width forwards; `quant` quantizes
    the blocks' linears at load, `head_quant` the lm_head (see decoder and models/linear.py). GGUF and quantized
    models go through the packed
    weight cache (models/weight_cache.py), so only their first load dequantizes and packs."""
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    if head_rows is not None and head_rows < 1:
        raise InvalidRequestError(f"a reduced vocabulary needs at least 1 token, got {head_rows}")
    for q in (quant, head_quant):
        parse_quant(q)  # a bad value fails before the slow part
        if q != "none" and dev.type != "cpu":
            raise InvalidRequestError(f"--quant {q} uses CPU kernels; on {dev.type} use --quant none")
    t0 = time.perf_counter()
    path = resolve(str(name_or_path), pull_missing=pull_missing)
    gguf_file = _is_gguf_file(path)
    if not (path.is_dir() or gguf_file):
        raise ModelLoadError(f"{path} is neither a Hugging Face folder nor a GGUF file")
    if not gguf_file and any(kernel(q).native for q in (quant, head_quant)):
        raise InvalidRequestError(f"--quant {quant} runs a GGUF file's own blocks; {path.name} is not a GGUF file "
                                  "(--quant file, the default, runs it in its own dtype)")
    # a HF folder in the model dtype loads as fast as the cache would: only GGUF and quantized models are cached
    cache = WeightCache.for_source(path) if gguf_file or quant != "none" or head_quant != "none" else None
    settings = quant if head_quant == "none" else f"{quant}-head{head_quant}"  # what the cache files are keyed by
    model = cache.load_model(torch_dtype, settings, head_rows, decode_width, dev) if cache else None
    from_cache = model is not None
    if model is None:
        if gguf_file:
            read_gguf_config(path)  # a broken file fails here, before the message below promises minutes of work
        if cache:
            head = "" if head_quant == "none" else f", {head_quant} lm_head"
            linears = "dense" if quant == "none" else quant
            print(f"specdecode: first load of {path.name} ({str(torch_dtype).removeprefix('torch.')}, {linears} linears"
                  f"{head}): packing (one to two minutes for the 1.5B on 2 cores), then cached in "
                  f"{cache.folder}", file=sys.stderr, flush=True)
        with temporaries_returned():  # packing's temporaries would otherwise stay in the heap: gigabytes of RSS
            # a GGUF file's blocks stay blocks: native kernels run them, the embedding reads its rows from them
            cfg, state = load_gguf(path, dtype=torch_dtype, blocks=True) if gguf_file \
                else _as_state(load_hf_folder(path))
            try:
                model = Transformer.from_state_dict(cfg, state, dtype=torch_dtype, device=dev,
                                                    decode_width=decode_width, quant=quant, head_rows=head_rows,
                                                    head_quant=head_quant)
            except KeyError as e:
                raise ModelLoadError(f"{path}: {e.args[0]}") from e
            except ValueError as e:
                raise InvalidRequestError(str(e)) from e
            del state  # views of the file's map: with the last of them the map, and the pages packing read, go
        if isinstance(model.embed, BlockEmbedding):  # a fresh map of the embedding alone: pages of its rows only
            model.embed = BlockEmbedding.restore(embedding_blocks(path), torch_dtype, model.embed.device)
        if cache:
            cache.store_model(model, torch_dtype, settings, head_rows)
    tokenizer = None
    if with_tokenizer and not gguf_file:
        tokenizer = load_hf_tokenizer(path)
    elif with_tokenizer:  # converting a GGUF's tokenizer takes seconds: cache it beside the weights
        tokenizer = cache.load_tokenizer() if cache else None
        if tokenizer is None:
            tokenizer = load_gguf_tokenizer(path)
            if cache:
                cache.store_tokenizer(tokenizer)
    return LoadedModel(model.eval(), tokenizer, path, time.perf_counter() - t0, from_cache)


def _as_state(loaded: tuple[ModelConfig, dict[str, torch.Tensor]]
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    return loaded[0], dict(loaded[1])


def is_gguf(name_or_path: str | Path) -> bool:
    """Whether a model name or path (resolve: catalog names are pulled) is a GGUF file."""
    return _is_gguf_file(resolve(str(name_or_path)))


def _is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return path.suffix.lower() == ".gguf" or f.read(4) == b"GGUF"
