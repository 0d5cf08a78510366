"""The packed-weight cache: a second load reads the packed model back and computes exactly what a fresh build
computes; a changed file, quant, dtype or vocabulary is a miss; a broken entry is rebuilt, not fatal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.kernels import int4_amx
from specdecode.models.loading import load_model
from specdecode.models.weight_cache import WeightCache, packed_dir
from tests.conftest import save_tiny, tiny_hf_model, tiny_tokenizer
from tests.test_gguf import _hf_model, _metadata, _model_tensors, _write_gguf


def _logits(model) -> torch.Tensor:
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    return model(tokens, torch.tensor([0]), model.new_cache(1, 64))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch) -> None:
    """Entries are content-addressed: tests that build the same tiny model must not see each other's."""
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE", str(tmp_path / "packed"))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return save_tiny(tmp_path / "m", tiny_hf_model("llama", seed=3, tie_word_embeddings=False), tiny_tokenizer())


@pytest.mark.parametrize("quant", ["int8", "int4", "w4a8",
                                   pytest.param("int4-amx", marks=pytest.mark.skipif(
                                       int4_amx.extension() is None, reason="needs AMX-BF16"))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_is_a_hit_and_computes_the_same(folder: Path, quant: str, dtype: str) -> None:
    first = load_model(folder, dtype=dtype, quant=quant, decode_width=9)
    second = load_model(folder, dtype=dtype, quant=quant, decode_width=9)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.model.decode_width == 9 and second.model.dtype == getattr(torch, dtype)
    assert [type(b.down) for b in second.model.blocks] == [type(b.down) for b in first.model.blocks]
    assert torch.equal(_logits(second.model), _logits(first.model))
    # packed kernels read with aligned loads: a tensor left at the file's 8-byte offsets crashed int8 in bf16
    assert all(t.data_ptr() % 64 == 0 for t in second.model.state_dict().values())


def test_tied_head_and_reduced_vocabulary_survive_the_round_trip(tmp_path: Path) -> None:
    folder = save_tiny(tmp_path / "tied", tiny_hf_model("qwen2", seed=4, tie_word_embeddings=True), tiny_tokenizer())
    first = load_model(folder, quant="int4", head_rows=40)
    second = load_model(folder, quant="int4", head_rows=40)
    assert second.from_cache and second.model.lm_head.out_features == 40
    # the head is stored once, as the embedding's first rows
    assert second.model.lm_head.weight.untyped_storage().data_ptr() == second.model.embed.untyped_storage().data_ptr()
    assert torch.equal(_logits(second.model), _logits(first.model))


def test_a_changed_file_quant_dtype_or_vocabulary_is_a_miss(folder: Path) -> None:
    assert not load_model(folder, quant="int4").from_cache
    assert not load_model(folder, quant="int8").from_cache
    assert not load_model(folder, quant="int4", dtype="bfloat16").from_cache
    assert not load_model(folder, quant="int4", head_rows=32).from_cache
    assert load_model(folder, quant="int4").from_cache
    entry = WeightCache.for_source(folder).weights_file(torch.float32, "int4", None)
    stale = entry.with_name(entry.name.replace("-code", "-codeOLDER"))  # as left by an older version of our code
    stale.write_bytes(b"x")
    assert not load_model(folder, quant="int4", head_rows=33).from_cache and stale.exists()  # other settings
    entry.unlink()
    assert not load_model(folder, quant="int4").from_cache and not stale.exists()  # replaced

    changed = tiny_hf_model("llama", seed=5, tie_word_embeddings=False)  # same shapes, other weights
    save_tiny(folder, changed)
    fresh = load_model(folder, quant="int4")
    assert not fresh.from_cache
    assert load_model(folder, quant="int4").from_cache
    # the new weights, not the stale entry: the same logits as a build that bypasses the cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_PACKED_CACHE", "off")
        assert packed_dir() is None
        bypass = load_model(folder, quant="int4")
    assert not bypass.from_cache
    assert torch.equal(_logits(fresh.model), _logits(bypass.model))


def test_plain_hf_folders_are_not_copied(folder: Path) -> None:
    load_model(folder)
    assert not load_model(folder).from_cache
    assert not WeightCache.for_source(folder).folder.exists()


def test_gguf_is_cached_dense_too(tmp_path: Path) -> None:
    tensors, _ = _model_tensors("llama", _hf_model("llama", tied=False)[1])
    path = _write_gguf(tmp_path / "m.gguf", "llama", _metadata("llama"), tensors)
    first = load_model(path, with_tokenizer=False)
    second = load_model(path, with_tokenizer=False)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.model.config == first.model.config
    assert torch.equal(_logits(second.model), _logits(first.model))


def test_a_broken_entry_is_rebuilt(folder: Path) -> None:
    first = load_model(folder, quant="int8")
    entry = WeightCache.for_source(folder).weights_file(torch.float32, "int8", None)
    entry.write_bytes(entry.read_bytes()[:1000])  # truncated, e.g. by a full disk
    with pytest.warns(UserWarning, match="unreadable packed-weight cache"):
        again = load_model(folder, quant="int8")
    assert not again.from_cache and torch.equal(_logits(again.model), _logits(first.model))
    assert load_model(folder, quant="int8").from_cache


def test_tokenizer_round_trip(tmp_path: Path, folder: Path) -> None:
    cache = WeightCache(tmp_path / "packed", folder)
    assert cache.load_tokenizer() is None
    cache.folder.mkdir(parents=True)
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cache.store_tokenizer(tok)
    back = cache.load_tokenizer()
    assert back.encode("abc def") == tok.encode("abc def") and back.chat_template == tok.chat_template
