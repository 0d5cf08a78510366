"""Where specdecode keeps files (models, packed weights, built kernels, measurements) and how it writes them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

_CHUNK = 4 << 20  # bytes per read when hashing


def cache_dir() -> Path:
    """``$SPECDECODE_CACHE``, else ``~/.cache/specdecode``: pulled models, packed weights, kernels, autotune."""
    configured = os.environ.get("SPECDECODE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdecode"


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def write_atomic(path: Path, write: Callable[[Path], object]) -> OSError | None:
    """`write(tmp)`, then rename tmp to `path`: concurrent readers never see half a file. Returns the error (and
    leaves nothing behind) if the folder is not writable or the disk is full: a cache write only costs time later."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
        return None
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return exc
