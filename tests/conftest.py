"""Tiny random models built with transformers and saved to disk, shared by the tests."""

from __future__ import annotations

import json
import platform
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from specdecode.kernels import decode_ops, gguf_int8, w4a8
from specdecode.kernels.build import cpu_extension
from specdecode.models import autotune
from specdecode.models.loading import LoadedModel, load_model

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a chat template the tiny tokenizer can encode
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_hf_model(arch: str = "qwen2", *, seed: int = 0, vocab: int = 64, hidden: int = 64, layers: int = 2,
                  heads: int = 4, kv_heads: int = 2, sharpen: float = 4.0, **extra):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                     eos_token_id=None, bos_token_id=None, **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random init is nearly uniform; sharpen it so greedy paths are non-trivial
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(sharpen)
    return model


def tiny_tokenizer(shuffle_seed: int | None = None) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer of 64 single-character tokens (space, letters, digits, '.')."""
    chars = ["\u0120"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
        [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [str(d) for d in range(10)] + ["."]
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(chars)
    return Qwen2Tokenizer(vocab={c: i for i, c in enumerate(chars)}, merges=[])


def save_tiny(path: Path, model, tokenizer=None) -> Path:
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with noise on every weight: a draft that agrees with the target often, not always."""
    import copy

    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return other


REAL_AUTOTUNE = (autotune.fastest_quant, autotune.fastest_dtype, autotune.dtype_choice, autotune.draft_quant_choice)


@pytest.fixture(scope="session", autouse=True)
def _session_caches(tmp_path_factory):
    """Fast tests never time kernels nor write the user's caches: 'auto' quantization means none and 'auto'
    dtype float32 here (whatever the CPU's class), and packed weights of the tiny models go to a folder of the test
    session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_PACKED_CACHE", str(tmp_path_factory.mktemp("packed")))
        mp.setattr(autotune, "fastest_quant", lambda *args, **kwargs: "none")
        mp.setattr(autotune, "fastest_dtype", lambda *args, **kwargs: "float32")
        mp.setattr(autotune, "dtype_choice", lambda *args, **kwargs: ("float32", "tests"))
        mp.setattr(autotune, "draft_quant_choice", lambda *args, **kwargs: ("none", "tests"))
        yield


@pytest.fixture(autouse=True)
def _real_caches_for_real_tests(request, monkeypatch):
    """Slow real-model tests (and `real_autotune` ones) measure kernels and use the user's caches: the real
    models' packed weights and the kernel choices are worth keeping."""
    if "real_autotune" in request.keywords or "slow" in request.keywords:
        monkeypatch.setattr(autotune, "fastest_quant", REAL_AUTOTUNE[0])
        monkeypatch.setattr(autotune, "fastest_dtype", REAL_AUTOTUNE[1])
        monkeypatch.setattr(autotune, "dtype_choice", REAL_AUTOTUNE[2])
        monkeypatch.setattr(autotune, "draft_quant_choice", REAL_AUTOTUNE[3])
    if "slow" in request.keywords:
        monkeypatch.delenv("SPECDECODE_PACKED_CACHE")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[LoadedModel, LoadedModel]:
    """A tiny target (bit-exact width 9) and a draft that is a noisy copy of it, with a shared tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_hf_model("qwen2", seed=0, vocab=64, layers=2)
    draft = perturbed(target, 0.3, seed=1)
    tok = tiny_tokenizer()
    save_tiny(root / "target", target, tok)
    save_tiny(root / "draft", draft, tok)
    return (load_model(root / "target", decode_width=9), load_model(root / "draft"))


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory) -> tuple[str, str]:
    """The folders of a tiny target with a chat template and its noisy-copy draft, for commands that load by name."""
    root = tmp_path_factory.mktemp("pair_dirs")
    target = tiny_hf_model("qwen2", seed=0, vocab=64, layers=2)
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    return (str(save_tiny(root / "target", target, tok)),
            str(save_tiny(root / "draft", perturbed(target, 0.3, seed=1), tok)))


def emulated_avx512_build():
    """Our CPU extension with its AVX-512 paths (w4a8's VNNI arithmetic, the 16-float decode ops) compiled through
    SIMDe's portable intrinsics (kernels/simd.h), so that CPUs without AVX-512 test those paths too."""
    from specdecode.cpu import cpu_info

    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= set(cpu_info()[1]):
        pytest.skip("the emulated AVX-512 build needs AVX2 + FMA: SIMDe runs each 512-bit operation as two 256-bit "
                    "ones, and a fused multiply-add must stay fused")
    import simde_py

    ext = cpu_extension(("-DSPECDECODE_EMULATE_AVX512", "-I" + simde_py.get_include()))
    assert ext is not None and ext.simd_path() == "avx512-vnni", "the emulated AVX-512 build failed (see the warning)"
    return ext


def use_cpu_build(mp: pytest.MonkeyPatch, ext) -> None:
    """Makes `w4a8.extension()`, `gguf_int8.extension()` and `decode_ops.extension()` return `ext` (models must be
    loaded after this)."""
    for module in (w4a8, gguf_int8):
        native = module.extension
        mp.setattr(module, "extension", lambda isa_flags=(), native=native: native(isa_flags) if isa_flags else ext)
    mp.setattr(decode_ops, "extension", lambda: ext)


@pytest.fixture(params=["native", "avx2", "avx512-emulated"])
def cpu_build(request, monkeypatch):
    """Runs a test on this CPU's build of our CPU extension, on its AVX2 paths (built without AVX-512 where this CPU
    has it), then on its AVX-512 paths, emulated: every ISA's instantiation of the kernels runs on any x86 CPU."""
    if request.param == "native":
        if decode_ops.extension() is None:
            pytest.skip("needs a CPU with AVX-512 or AVX2 + FMA, and g++")
        return decode_ops.extension()
    if request.param == "avx2":
        from specdecode.cpu import cpu_info

        if "avx512f" not in cpu_info()[1]:
            pytest.skip("the native build is the AVX2 one here")
        ext = cpu_extension(("-mno-avx512f",))
        assert ext is not None and ext.simd_path() == "avx2", "the AVX2 build failed (see the warning)"
        use_cpu_build(monkeypatch, ext)
        return ext
    ext = emulated_avx512_build()
    use_cpu_build(monkeypatch, ext)
    return ext


def corrupt_json(path: Path, key: str, value) -> None:
    cfg = json.loads(path.read_text())
    cfg[key] = value
    path.write_text(json.dumps(cfg))


# --- the server of test_server*.py: the tiny pair behind the OpenAI API, with a key --------------------------

API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_CONTEXT = 256
WORDS = ["hello world", "The cat sat on the mat", "abc def ghi", "Speculative decoding is lossless",
         "x1 y2 z3", "Once upon a time", "numbers 12345", "quick brown fox"]


@pytest.fixture(scope="module")
def server(tiny_pair):
    import openai

    from specdecode.builder import build_generator
    from specdecode.serving.scheduler import build_scheduler
    from specdecode.serving.app import create_app, serve_in_thread

    target, draft = tiny_pair
    target.tokenizer.chat_template = CHAT
    scheduler = build_scheduler(target, draft=draft, drafter="model", max_batch=4, max_queue=32,
                                max_context=MAX_CONTEXT)
    app = create_app(scheduler, "tiny", api_key=API_KEY)
    reference = build_generator(target, draft=draft, drafter="model", max_context=MAX_CONTEXT)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        yield SimpleNamespace(url=url, client=client, scheduler=scheduler, reference=reference, target=target,
                              draft=draft)


def wait_idle(scheduler, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while scheduler.running or scheduler.queued:
        assert time.time() < deadline, f"{scheduler.running} running, {scheduler.queued} waiting"
        time.sleep(0.02)
