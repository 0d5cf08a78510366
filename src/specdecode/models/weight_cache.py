"""Packed weights on disk, so that only the first load of a model pays for dequantizing and packing.

A GGUF file is dequantized in Python (about 40 s for the 1.5B), its tokenizer is converted by transformers
(about 10 s) and int4 packing takes another 13 s; every load gives the same tensors. So the first load saves
the built model (safetensors) and the tokenizer, and later loads read them back. An entry is keyed by the
source's sha256 and by everything that shapes the packed tensors: dtype, quant, reduced vocabulary, torch
version, CPU capability (packed layouts are torch's) and a fingerprint of our loading and packing code. A
changed file has another hash, so a stale entry is not read. A new entry replaces the entries of the same
model and settings left by older torch or code; entries of files that changed are only deleted by hand.

Where: `$SPECDECODE_PACKED_CACHE`, else `<cache dir>/packed`; `SPECDECODE_PACKED_CACHE=off` disables it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specdecode.paths import cache_dir, file_sha256, write_atomic
from specdecode.models.config import ModelConfig
from specdecode.models.decoder import Transformer
from specdecode.models.gguf_blocks import BlockEmbedding
from specdecode.models.gguf_loader import embedding_blocks
from specdecode.models.linear import DenseLinear, Linear

FORMAT = 1  # bump when what is stored changes: older entries are then not read
# the code that decides the stored tensors: a change to dequantizing, quantizing or packing is a new entry
_CODE = ("gguf_loader.py", "gguf_blocks.py", "block_linear.py", "hf_loader.py", "decoder.py", "linear.py",
         "../kernels/w4a8.py", "../kernels/int4_amx.py", "../kernels/int4_amx.cpp", "../kernels/torch_int.py",
         "../kernels/gguf_int8.py", "../kernels/gguf_q4.py", "../kernels/gguf_amx.py")


def packed_dir() -> Path | None:
    configured = os.environ.get("SPECDECODE_PACKED_CACHE")
    if configured and configured.lower() in ("off", "0", "no", "false"):
        return None
    if configured:
        return Path(configured).expanduser()
    return cache_dir() / "packed"


class WeightCache:
    """The cache entries of one source file or folder (one sub-folder per source hash)."""

    def __init__(self, root: Path, source: Path) -> None:
        self.source = source
        self.folder = root / source_digest(source, root / "hashes.json")[:20]

    @classmethod
    def for_source(cls, source: Path) -> "WeightCache | None":
        root = packed_dir()
        return cls(root, source) if root is not None else None

    def weights_file(self, dtype: torch.dtype, quant: str, head_rows: int | None) -> Path:
        capability = torch.backends.cpu.get_cpu_capability()
        name = f"v{FORMAT}-{str(dtype).removeprefix('torch.')}-{quant}-vocab{head_rows or 'all'}" \
               f"-torch{torch.__version__}-{capability}-code{_code_fingerprint()}.safetensors"
        return self.folder / name

    def load_model(self, dtype: torch.dtype, quant: str, head_rows: int | None, decode_width: int | None,
                   device: torch.device) -> Transformer | None:
        path = self.weights_file(dtype, quant, head_rows)
        if not path.is_file():
            return None
        try:
            # copies, one tensor at a time: the file's tensors are mmapped at 8-byte offsets, and torch's packed
            # kernels need aligned memory (int8pack_mm segfaults on bfloat16 at an offset of 56)
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                meta = f.metadata()
                tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
            cfg = _config_from_json(meta["config"])
            head = int(meta["head_rows_of_embed"]) if meta["head_rows_of_embed"] else None
            quants = json.loads(meta["quants"])
        except (SafetensorError, OSError, KeyError, TypeError, ValueError) as exc:  # truncated or foreign: rebuild
            warnings.warn(f"ignoring unreadable packed-weight cache {path} ({type(exc).__name__}: {exc})",
                          stacklevel=2)
            path.unlink(missing_ok=True)
            return None
        if meta.get("embed_from_source"):  # a native model's embedding: the file's own blocks, read where they are
            tensors.update({f"embed.{k}": v for k, v in embedding_blocks(self.source).items()})
        return Transformer.from_saved(cfg, tensors, quants, head, decode_width)

    def store_model(self, model: Transformer, dtype: torch.dtype, quant: str, head_rows: int | None) -> None:
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        from_source = isinstance(model.embed, BlockEmbedding)
        if from_source:  # the GGUF file holds these bytes already
            tensors = {k: v for k, v in tensors.items() if not k.startswith("embed.")}
        tied = isinstance(model.lm_head, DenseLinear) and isinstance(model.embed, torch.Tensor) and \
            model.lm_head.weight.untyped_storage().data_ptr() == model.embed.untyped_storage().data_ptr()
        if tied:  # the lm_head is a view of the embedding: store it once
            del tensors["lm_head.weight"]
        quants = {name: m.quant for name, m in model.named_modules() if isinstance(m, Linear)}
        meta = {"config": json.dumps(asdict(model.config)), "quants": json.dumps(quants),
                "head_rows_of_embed": str(model.lm_head.out_features) if tied else "",
                "embed_from_source": "1" if from_source else "",
                "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()}
        path = self.weights_file(dtype, quant, head_rows)
        _write_atomic(path, lambda tmp: save_file(tensors, str(tmp), meta))
        settings = f"-{str(dtype).removeprefix('torch.')}-{quant}-vocab{head_rows or 'all'}-"
        for older in self.folder.glob(f"v*{settings}*.safetensors"):  # same model and settings, older torch or code
            if older != path:
                older.unlink(missing_ok=True)

    def load_tokenizer(self) -> Any | None:
        folder = self.folder / "tokenizer"
        if not (folder / "tokenizer_config.json").is_file():
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except Exception:  # noqa: BLE001  rebuild from the source instead
            return None

    def store_tokenizer(self, tokenizer: Any) -> None:
        tmp = self.folder / f"tokenizer.{os.getpid()}.tmp"
        try:
            tokenizer.save_pretrained(str(tmp))
            os.replace(tmp, self.folder / "tokenizer")
        except OSError as exc:  # an existing folder (another process won) or a full disk: only costs time
            if not (self.folder / "tokenizer").is_dir():
                warnings.warn(f"could not cache the tokenizer in {self.folder}: {exc}", stacklevel=2)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_atomic(path: Path, write) -> None:
    if (exc := write_atomic(path, write)) is not None:
        warnings.warn(f"could not write the packed-weight cache {path}: {exc}", stacklevel=3)


@cache
def _code_fingerprint() -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _CODE)).hexdigest()[:10]


def _config_from_json(text: str) -> ModelConfig:
    fields = json.loads(text)
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    return ModelConfig(**fields)


def source_digest(source: Path, memo_file: Path) -> str:
    """sha256 of a file, or of a folder's files (names and contents). Hashing a 1 GB file takes a second, so
    each file's hash is remembered with its size, mtime, ctime and inode and recomputed when any changes
    (a copy that keeps the mtime still gets a new inode and ctime)."""
    try:
        memo = json.loads(memo_file.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    total = hashlib.sha256()
    changed = False
    for f in files:
        st = f.stat()
        key = str(f.resolve())
        entry = memo.get(key)
        identity = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        if not (isinstance(entry, list) and entry[:4] == identity):
            entry = [*identity, file_sha256(f)]
            memo[key], changed = entry, True
        total.update(f"{f.relative_to(source) if f != source else f.name}:{entry[4]}\n".encode())
    if changed:
        _write_atomic(memo_file, lambda tmp: tmp.write_text(json.dumps(memo, indent=1)))
    return total.hexdigest() if source.is_dir() else memo[str(source.resolve())][4]
