"""GGUF loading: metadata -> ModelConfig, tensor names/orientation/permutation, dequantization, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdecode.errors import ModelLoadError
from specdecode.models.config import ModelConfig, UnsupportedArchitectureError
from specdecode.models.gguf_loader import load_gguf, load_gguf_tokenizer, read_tensor

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN = 2, 64, 4, 2, 96, 128

# HF module path inside a layer -> llama.cpp name (written independently of the loader's table)
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _hf_model(arch: str, *, tied: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny seeded HF model with every parameter random (norms too, so mixed-up names show)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        del state["lm_head.weight"]
    return model.config, state


def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: what llama.cpp does to q/k rows when converting."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(arch: str) -> dict[str, Any]:
    return {
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def _write_gguf(
    path: Path,
    arch: str,
    meta: dict[str, Any],
    tensors: dict[str, np.ndarray],
    raw_dtypes: dict[str, Q] | None = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=(raw_dtypes or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _model_tensors(arch: str, state: dict[str, torch.Tensor], qtype: Q | None = None) -> tuple[dict, dict]:
    """GGUF tensors for an HF state dict the way llama.cpp writes them (permuted q/k for llama)."""
    tensors: dict[str, np.ndarray] = {}
    raw: dict[str, Q] = {}
    for hf_name, value in state.items():
        name = _gguf_name(hf_name)
        array = value.numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            array = _llama_cpp_permute(array, HEADS if ".attn_q." in name else KV_HEADS)
        if qtype is not None and array.ndim == 2:
            array, raw[name] = gguf.quants.quantize(array, qtype), qtype
        tensors[name] = array
    return tensors, raw


@pytest.fixture(scope="module")
def llama() -> tuple[Any, dict[str, torch.Tensor]]:
    return _hf_model("llama", tied=False)


@pytest.fixture
def llama_gguf(tmp_path: Path, llama: tuple[Any, dict[str, torch.Tensor]]) -> Path:
    tensors, _ = _model_tensors("llama", llama[1])
    return _write_gguf(tmp_path / "llama.gguf", "llama", _metadata("llama"), tensors)


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


def test_llama_f32_round_trip_undoes_qk_permutation(tmp_path: Path, llama: tuple[Any, dict]) -> None:
    _, state = llama
    tensors, _ = _model_tensors("llama", state)
    meta = _metadata("llama") | {
        "llama.attention.key_length": HIDDEN // HEADS,
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 2.0,
    }
    config, loaded = load_gguf(_write_gguf(tmp_path / "m.gguf", "llama", meta, tensors))
    _assert_same_state(loaded, state)
    assert all(t.dtype == torch.float32 for t in loaded.values())
    assert config == ModelConfig(
        arch="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_qwen2_tied_round_trip_is_not_permuted_and_matches_hf_config(tmp_path: Path) -> None:
    hf_config, state = _hf_model("qwen2", tied=True)
    tensors, _ = _model_tensors("qwen2", state)
    assert "output.weight" not in tensors and "blk.0.attn_q.bias" in tensors
    config, loaded = load_gguf(_write_gguf(tmp_path / "q.gguf", "qwen2", _metadata("qwen2"), tensors))
    _assert_same_state(loaded, state)
    assert config.tie_word_embeddings and config.attention_bias
    assert config == ModelConfig.from_hf(hf_config.to_dict())


def test_dtype_conversion(llama_gguf: Path, llama: tuple[Any, dict]) -> None:
    _, loaded = load_gguf(llama_gguf, dtype=torch.bfloat16)
    _assert_same_state(loaded, {k: v.to(torch.bfloat16) for k, v in llama[1].items()})


def test_quantized_llama_weights_are_unpermuted_after_dequantizing(tmp_path: Path, llama: tuple[Any, dict]) -> None:
    _, state = llama
    tensors, raw = _model_tensors("llama", state, qtype=Q.Q8_0)
    _, loaded = load_gguf(_write_gguf(tmp_path / "q8.gguf", "llama", _metadata("llama"), tensors, raw))
    for name, value in state.items():
        # Q8_0 rounding error is <= half a step of max|block|/127; a wrong row order is off by O(1)
        torch.testing.assert_close(loaded[name], value, atol=0.03, rtol=0, msg=name)


# Byte offsets of the fp16 super-block scales in K-quant blocks (ggml-common.h block layouts).
_K_QUANT_FP16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _raw_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Quantized bytes for a (rows, cols) tensor: real quantization where gguf-py has it, else random blocks."""
    if qtype in _QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    for offset in _K_QUANT_FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", _QUANTIZABLE + list(_K_QUANT_FP16_FIELDS), ids=lambda q: q.name)
def test_read_tensor_matches_gguf_dequantize(tmp_path: Path, qtype: Q) -> None:
    rows, cols = 3, 2 * max(gguf.GGML_QUANT_SIZES[qtype][0], 32)  # non-square, so orientation matters
    raw = _raw_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
    path = _write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": raw}, {"w": raw_dtype} if raw_dtype else None)
    tensor = gguf.GGUFReader(path).tensors[0]
    assert tensor.tensor_type == qtype
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    got = read_tensor(tensor)
    assert got.shape == (rows, cols) == want.shape
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_read_tensor_rejects_types_without_dequantizer(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "i.gguf", "llama", {}, {"blk.0.odd.weight": np.zeros((2, 4), np.int32)})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.odd\.weight'.*I32"):
        read_tensor(gguf.GGUFReader(path).tensors[0])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf_tokenizer(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0.5, -100, 10], ids=["half", "tail", "header"])
def test_truncated_file(tmp_path: Path, llama_gguf: Path, keep: float) -> None:
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep % len(data)])
    with pytest.raises(ModelLoadError, match=r"truncated or not a valid GGUF.*re-pull"):
        load_gguf(cut)


@pytest.mark.parametrize("content", [b"", b"this is a text file, not a model\n" * 64], ids=["empty", "text"])
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        load_gguf(path)


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unsupported_architecture(tmp_path: Path, arch: str) -> None:
    path = _write_gguf(tmp_path / "a.gguf", arch, _metadata(arch), {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(UnsupportedArchitectureError, match=rf"'{arch}'.*llama, qwen2"):
        load_gguf(path)


def test_unsupported_rope_scaling(tmp_path: Path, llama: tuple[Any, dict]) -> None:
    tensors, _ = _model_tensors("llama", llama[1])
    meta = _metadata("llama") | {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    with pytest.raises(UnsupportedArchitectureError, match="'yarn'"):
        load_gguf(_write_gguf(tmp_path / "y.gguf", "llama", meta, tensors))


def test_missing_tensor(tmp_path: Path, llama: tuple[Any, dict]) -> None:
    tensors, _ = _model_tensors("llama", llama[1])
    del tensors["blk.1.ffn_down.weight"]
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_down\.weight'.*model\.layers\.1\.mlp\.down_proj"):
        load_gguf(_write_gguf(tmp_path / "m.gguf", "llama", _metadata("llama"), tensors))


def test_missing_metadata_key(tmp_path: Path, llama: tuple[Any, dict]) -> None:
    tensors, _ = _model_tensors("llama", llama[1])
    meta = _metadata("llama")
    del meta["llama.feed_forward_length"]
    with pytest.raises(ModelLoadError, match=r"'llama\.feed_forward_length' is missing"):
        load_gguf(_write_gguf(tmp_path / "m.gguf", "llama", meta, tensors))


@pytest.mark.slow
def test_real_smollm2() -> None:
    from specdecode.models.catalog import resolve

    path = resolve("smollm2-135m-instruct")
    config, state = load_gguf(path)
    assert (config.arch, config.num_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    assert config.tie_word_embeddings and "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    tokenizer = load_gguf_tokenizer(path)
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
