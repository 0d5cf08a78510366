"""Weight-only int8 / int4 linears: round-trip error, kernel = dequantized reference, bit-exact greedy decoding."""

from __future__ import annotations

import pytest
import torch

from specdecode import cli
from specdecode.builder import build_generator, load_target
from specdecode.errors import InvalidRequestError
from specdecode.kernels.torch_int import Int4Linear, Int8Linear
from specdecode.models.linear import DenseLinear, make_linear, parse_quant
from specdecode.models.loading import load_model
from tests.conftest import emulated_avx512_build, save_tiny, tiny_hf_model, tiny_tokenizer, use_cpu_build
from tests.test_int4_amx import needs_amx
from tests.test_lossless import random_prompts
from tests.test_runtime import _invariance_mismatches


def _weight(out: int = 96, inp: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_round_trip_within_half_a_step():
    w = _weight()
    layer = Int8Linear.quantize(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((layer.dequantized() - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group):
    w = _weight()
    layer = Int4Linear.quantize(w, group=group)
    g = w.reshape(w.shape[0], -1, group)
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(w.shape)
    err = (layer.dequantized() - w).abs()
    # half a quantization step, plus the bf16 rounding of the stored scale and zero point
    assert (err <= step / 2 + 2**-8 * (w.abs() + step * 8) + 1e-6).all()
    assert err.mean() < step.mean() / 3  # and not systematically off


@pytest.mark.parametrize("quant", ["int8", "int4", "int4-g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_dequantized_matmul(quant, dtype):
    w = _weight().to(dtype)
    layer = make_linear(w, torch.randn(96).to(dtype), quant)
    x = torch.randn(5, 256).to(dtype)
    reference = x.float() @ layer.dequantized().T + layer.bias.float()
    tol = 1e-4 if dtype == torch.float32 and quant == "int8" else 0.02  # int4 computes in bf16
    torch.testing.assert_close(layer(x).float(), reference, atol=tol, rtol=tol)
    assert layer(x).dtype == dtype


@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_computes_our_quantization(group):
    """Independent of the kernel: q, scale and zero recomputed here from the weights give what the packed
    kernel multiplies by (its layout and its (q - 8) * scale + zero convention)."""
    w = _weight(64, 256, seed=3)
    g = w.reshape(64, -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = ((g - (zero - 8 * scale)) / scale).round().clamp(0, 15)
    expected = ((q - 8) * scale + zero).reshape(64, 256)
    torch.testing.assert_close(Int4Linear.quantize(w, group=group).dequantized(), expected, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_round_trip_in_the_model_dtype(dtype):
    w = _weight().to(getattr(torch, dtype))
    layer = Int8Linear.quantize(w)
    step = layer.scale.float()[:, None]
    assert ((layer.dequantized() - w.float()).abs() <= step / 2 + 1e-7).all()


def test_the_lm_head_and_embedding_stay_dense(tiny_pair):
    from specdecode.models.linear import DenseLinear

    model = load_model(tiny_pair[0].source, quant="int4", with_tokenizer=False, head_rows=50).model
    assert isinstance(model.lm_head, DenseLinear) and model.lm_head.out_features == 50
    assert model.embed.dtype == torch.float32 and model.embed.shape[0] == 64  # every id can still be fed
    assert all(isinstance(b.qkv, Int4Linear) and isinstance(b.down, Int4Linear) for b in model.blocks)


def test_a_quantized_draft_quantizes_its_head_too_and_caches_it(tiny_pair):
    from specdecode.builder import load_draft

    first = load_draft(str(tiny_pair[1].source), dtype="float32", quant="int8")
    second = load_draft(str(tiny_pair[1].source), dtype="float32", quant="int8")
    assert isinstance(first.model.lm_head, Int8Linear) and isinstance(second.model.lm_head, Int8Linear)
    assert (first.from_cache, second.from_cache) == (False, True)
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = [m.model(ids, torch.tensor([0]), m.model.new_cache(1, 8)) for m in (first, second)]
    assert torch.equal(*logits)
    # a reduced vocabulary that torch's int4 layout cannot hold keeps a dense head
    assert isinstance(load_draft(str(tiny_pair[1].source), dtype="float32", quant="int4", vocab=50).model.lm_head,
                      DenseLinear)
    # the same file as a target (dense head) is another cache entry
    as_target = [load_model(tiny_pair[1].source, dtype="float32", quant="int8") for _ in range(2)]
    assert [m.from_cache for m in as_target] == [False, True]
    assert isinstance(as_target[1].model.lm_head, DenseLinear)


def test_a_tied_draft_head_is_quantized_apart_from_its_embedding(tmp_path):
    from specdecode.builder import load_draft

    folder = save_tiny(tmp_path / "tied", tiny_hf_model("qwen2", seed=4, tie_word_embeddings=True), tiny_tokenizer())
    first, second = (load_draft(str(folder), dtype="float32", quant="int8") for _ in range(2))
    assert (first.from_cache, second.from_cache) == (False, True)
    assert isinstance(second.model.lm_head, Int8Linear) and second.model.embed.shape == (64, 64)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(*(m.model(ids, torch.tensor([0]), m.model.new_cache(1, 8)) for m in (first, second)))


def test_bad_quantization_arguments():
    for bad in ["int3", "int8-g32", "int4-gx", "fp8"]:
        with pytest.raises(InvalidRequestError, match="unknown quantization"):
            parse_quant(bad)
    with pytest.raises(InvalidRequestError, match="group size"):
        Int4Linear.quantize(_weight(), group=48)
    with pytest.raises(InvalidRequestError, match="multiple"):
        Int4Linear.quantize(_weight(inp=96), group=64)


def test_cli_rejects_a_bad_quant(tiny_pair, capsys):
    target, _ = tiny_pair
    assert cli.main(["generate", "--target", str(target.source), "--drafter", "ngram", "--prompt", "abc",
                     "--quant", "int3"]) == 2
    assert "unknown quantization" in capsys.readouterr().err
    # the tiny model is 64 wide: int4 in groups of 128 cannot split it
    assert cli.main(["generate", "--target", str(target.source), "--drafter", "ngram", "--prompt", "abc",
                     "--quant", "int4-g128"]) == 2
    assert "multiple" in capsys.readouterr().err


def test_cli_rejects_bad_drafting_before_loading_anything(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")  # never read: the drafting arguments fail first
    assert cli.main(["generate", "--target", missing, "--gamma", "9", "--prompt", "abc"]) == 2
    assert "gamma must be in [1, 8]" in capsys.readouterr().err


@pytest.fixture(scope="module", params=[("float32", "int8"), ("bfloat16", "int8"), ("float32", "int4"),
                                        ("bfloat16", "w4a8"), ("float32", "w8a8"), ("bfloat16", "w6a8"),
                                        ("bfloat16", "int4"), pytest.param(("bfloat16", "int4-amx"), marks=needs_amx),
                                        pytest.param(("float32", "int4-amx"), marks=needs_amx),
                                        pytest.param(("bfloat16", "int8-amx"), marks=needs_amx),
                                        ("bfloat16", "w4a8", "avx512-emulated")],
                ids=lambda p: "-".join(p))
def quantized_pair(request, tiny_pair):
    """(target, draft, build) in one dtype and quantization; the last on w4a8's and the decode ops' AVX-512 paths,
    emulated (conftest.emulated_avx512_build); build None: this CPU's."""
    dtype, quant, *emulated = request.param
    build = emulated_avx512_build() if emulated else None
    with pytest.MonkeyPatch.context() as mp:
        if build:
            use_cpu_build(mp, build)
        return (load_target(str(tiny_pair[0].source), dtype=dtype, quant=quant),
                load_model(tiny_pair[1].source, dtype=dtype, quant=quant), build)


@pytest.fixture(autouse=True)
def _models_use_their_build(request, monkeypatch):
    """A test of an emulated pair runs its kernels on that build; every other test on this CPU's."""
    build = request.getfixturevalue("quantized_pair")[2] if "quantized_pair" in request.fixturenames else None
    if build:
        use_cpu_build(monkeypatch, build)


def test_quantized_forward_is_invariant_to_the_step_width(quantized_pair):
    assert _invariance_mismatches(quantized_pair[0].model) == 0


def assert_greedy_speculative_equals_plain(target, draft, drafter: str, gammas=(1, 4, 8), prompts: int = 12) -> None:
    """Greedy output of `drafter` at each length (None: chosen per step) is plain decoding's, with drafts accepted."""
    plain = build_generator(target, drafter="none")
    cases = random_prompts(prompts, 64, seed=5)
    expected = [plain.generate(p, max_new_tokens=20, eos_ids=[]).token_ids for p in cases]
    accepted = 0
    for gamma in gammas:
        spec = build_generator(target, draft=draft, drafter=drafter, gamma=gamma)
        for p, e in zip(cases, expected):
            r = spec.generate(p, max_new_tokens=20, eos_ids=[])
            assert r.token_ids == e
            accepted += r.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_quantized_greedy_speculative_equals_plain(quantized_pair, drafter):
    assert_greedy_speculative_equals_plain(*quantized_pair[:2], drafter)


def test_a_reduced_draft_vocabulary_keeps_greedy_output(tiny_pair):
    target, _ = tiny_pair
    plain = build_generator(target, drafter="none")
    spec = build_generator(target, draft=str(tiny_pair[1].source), drafter="model", draft_quant="none", draft_vocab=40)
    assert spec.drafter.model.lm_head.out_features == 40
    accepted, beyond = 0, 0
    for p in random_prompts(8, 64, seed=6):
        r = spec.generate(p, max_new_tokens=20, eos_ids=[])
        assert r.token_ids == plain.generate(p, max_new_tokens=20, eos_ids=[]).token_ids
        accepted += r.stats.accepted_tokens
        beyond += sum(t >= 40 for t in r.token_ids)
    assert accepted > 0 and beyond > 0  # drafts were accepted, and tokens the draft cannot propose were decoded
    with pytest.raises(InvalidRequestError, match="reduced vocabulary"):
        build_generator(target, draft=str(tiny_pair[1].source), drafter="model", draft_quant="none", draft_vocab=0)


def test_quant_quality_report(tmp_path):
    from specdecode.bench.quality import mean_log_likelihood, quant_quality

    from .conftest import CHAT, save_tiny, tiny_hf_model, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    path = save_tiny(tmp_path / "m", tiny_hf_model("qwen2", seed=0), tok)
    report = quant_quality(str(path), ["int8", "int4"], dtype="float32", prompts=3, max_new_tokens=8,
                           log=lambda _: None)
    assert report["prompts"] == 3 and set(report["quants"]) == {"none", "int8", "int4"}
    assert all(len(report["quants"][q]["first_divergence"]) == 3 for q in report["quants"])
    # teacher-forced log-likelihood equals the step-by-step log-probabilities of the same tokens
    model = load_model(path, decode_width=None, with_tokenizer=False).model
    prompt, out = [5, 9, 2], [7, 1, 4]
    cache = model.new_cache(1, 32)
    logits = model(torch.tensor([prompt + out[:-1]]), torch.tensor([0]), cache)[0, len(prompt) - 1:]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out).unsqueeze(1)).mean()
    assert abs(mean_log_likelihood(model, prompt, out) - float(expected)) < 1e-5


def test_doctor_floors_are_weights_over_bandwidth():
    from specdecode.bench.doctor import floor_ms, linear_weights
    from specdecode.models.config import ModelConfig

    qwen15 = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                         num_heads=12, num_kv_heads=2, head_dim=128)
    blocks, head = linear_weights(qwen15)
    assert blocks == 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960) and head == 151936 * 1536
    assert floor_ms(qwen15, "float32", "none", 25.0) == pytest.approx((blocks + head) * 4 / 25e9 * 1e3)
    assert floor_ms(qwen15, "bfloat16", "int4", 25.0) < floor_ms(qwen15, "bfloat16", "int8", 25.0) \
        < floor_ms(qwen15, "bfloat16", "none", 25.0)


@pytest.mark.real_autotune
def test_autotune_measures_once_caches_and_survives_bad_caches(tmp_path, monkeypatch):
    from specdecode.models import autotune

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "STREAM_BYTES", 2**20)  # a quick, cache-resident measurement will do here
    calls = []
    real = autotune.time_rows

    def timed(layers, rows, repeats=5):  # the kernels run; their microseconds are noise here, so a fixed answer
        calls.append(real(layers, rows, 1))
        return 1.0 if layers[0].kind == "int8" else 2.0

    monkeypatch.setattr(autotune, "time_rows", timed)
    # our C++ kernels only where they build; the native kinds run files' blocks and are not candidates
    n = autotune.ROUNDS * sum(autotune.kernel_available(q) and not autotune.kernel(q).native
                              for q in autotune.kernels())
    choice = autotune.fastest_quant(torch.bfloat16, 1)
    assert choice == "int8" and len(calls) == n
    assert autotune.fastest_quant(torch.bfloat16, 1) == choice and len(calls) == n  # cached
    (tmp_path / "autotune.json").write_text("[1, 2")  # corrupted
    assert autotune.fastest_quant(torch.bfloat16, 1) in autotune.kernels() and len(calls) == 2 * n

    def broken(dtype, quant, shape=autotune.PROBE_SHAPE):
        if quant != "none":
            raise RuntimeError("no such kernel here")
        return real_layers(dtype, quant, shape)

    real_layers = autotune.streamed_layers
    monkeypatch.setattr(autotune, "streamed_layers", broken)
    assert autotune.fastest_quant(torch.float32, 2) == "none"  # only the dense kernel ran


FLAGS = {"amx": frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
         "avx512": frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}), "avx2": frozenset({"avx2", "fma"})}


@pytest.mark.real_autotune
@pytest.mark.parametrize("cls", ["amx", "avx512", "avx2"])
def test_the_dtype_follows_the_cpu_class_and_is_measured_only_on_avx512(tmp_path, monkeypatch, cls):
    from specdecode.builder import resolve_dtype
    from specdecode.models import autotune

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "cpu_info", lambda: ("a CPU", FLAGS[cls]))
    monkeypatch.setattr(autotune, "streamed_layers", lambda dtype, quant, shape=None: [make_linear(
        torch.zeros(8, 8, dtype=dtype), None, quant)])
    ms = {torch.float32: 2.0, torch.bfloat16: 1.0}
    calls = []
    monkeypatch.setattr(autotune, "time_rows",
                        lambda layers, rows, repeats=5: calls.append(rows) or ms[layers[0].dtype])
    assert autotune.cpu_class() == cls
    expected = {"amx": "bfloat16", "avx2": "float32", "avx512": "bfloat16"}[cls]
    assert resolve_dtype("auto", 9) == expected and resolve_dtype("auto", 9) == expected
    assert calls == ([9] * 2 * autotune.ROUNDS if cls == "avx512" else [])  # measured once, then cached
    ms[torch.bfloat16] = 1.95  # not faster by the margin: float32
    assert resolve_dtype("auto", 1) == ("float32" if cls != "amx" else "bfloat16")
    assert resolve_dtype("float32", 9) == "float32" and resolve_dtype("auto", 9, "cuda") == "bfloat16"
    assert "AMX" in autotune.dtype_choice(9)[1] if cls == "amx" else "measured" in autotune.dtype_choice(9)[1] \
        if cls == "avx512" else "AVX-512" in autotune.dtype_choice(9)[1]


@pytest.mark.real_autotune
def test_a_noisy_measurement_is_used_but_not_cached_and_retune_forgets(tmp_path, monkeypatch):
    from specdecode.models import autotune

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "cpu_info", lambda: ("a CPU", FLAGS["avx512"]))
    monkeypatch.setattr(autotune, "streamed_layers", lambda dtype, quant, shape=None: [make_linear(
        torch.zeros(8, 8, dtype=dtype), None, quant)])
    busy = iter([2.0, 1.05, 2.1, 1.0, 1.0, 1.0])  # one float32 round beats bfloat16 by the margin: someone was busy
    monkeypatch.setattr(autotune, "time_rows", lambda layers, rows, repeats=5: next(busy))
    with pytest.warns(UserWarning, match="busy"):
        assert autotune.fastest_dtype(9) == "float32"  # not trusted: the default, the same on every busy run
    assert not (tmp_path / "autotune.json").exists() or "dtype" not in (tmp_path / "autotune.json").read_text()
    quiet = iter([2.0, 3.05, 2.02, 1.0, 1.01, 1.3])  # rounds vary, the answer does not: trusted
    monkeypatch.setattr(autotune, "time_rows", lambda layers, rows, repeats=5: next(quiet))
    assert autotune.fastest_dtype(9) == "bfloat16"
    assert "bfloat16" in (tmp_path / "autotune.json").read_text()
    assert autotune.forget() == 1 and autotune.forget() == 0
    busy = iter([2.0, 1.2, 2.1, 1.0, 1.0, 1.2])  # int8 faster, but not in every pairing of rounds
    monkeypatch.setattr(autotune, "time_rows", lambda layers, rows, repeats=5: next(busy))
    with pytest.warns(UserWarning, match="busy"):  # a draft's kernel never changes the output: the fastest seen
        assert autotune.fastest_quant(torch.float32, 1, ("none", "int8"), changes_outputs=False) == "int8"
    busy = iter([2.0, 1.2, 2.1, 1.0, 1.0, 1.2])
    with pytest.warns(UserWarning, match="busy"):  # a target's would: none
        assert autotune.fastest_quant(torch.float32, 1, ("none", "int8")) == "none"
    assert autotune.forget() == 0


def test_file_precision_runs_native_kernels_by_capability(tmp_path, monkeypatch):
    from specdecode import builder
    from specdecode.kernels.gguf_amx import GgufLinear
    from specdecode.kernels.gguf_int8 import GgufInt8Linear
    from tests.gguf_files import Q4_K_M, write_model

    gguf_file = str(write_model(tmp_path / "m.gguf", Q4_K_M))
    for amx, avx2 in ((True, True), (False, True), (False, False)):  # AMX; AVX2 or AVX-512 without AMX; neither
        monkeypatch.setattr(GgufLinear, "available", classmethod(lambda cls, a=amx: a))
        monkeypatch.setattr(GgufInt8Linear, "available", classmethod(lambda cls, a=avx2: a))
        int8 = "gguf-int8" if avx2 else "none"
        assert builder.resolve_quant("file", "bfloat16", 9, source=gguf_file) == ("gguf" if amx else int8)
        assert builder.resolve_quant("file", "float32", 9, source=gguf_file) == int8  # AMX's activations are bf16
        assert builder.resolve_quant("file", "bfloat16", 9, source=gguf_file, device="cuda") == "none"
        assert builder.resolve_quant("int8", "bfloat16", 9, source=gguf_file) == "int8"
        assert builder.resolve_quant("file", "float32", 9) == "none"  # not a GGUF file
    assert builder.resolve_quant("file", "bfloat16", 1, source=gguf_file, fallback="auto") == "none"  # measured


@pytest.mark.real_autotune
@pytest.mark.parametrize("cls", ["amx", "avx512", "avx2"])
def test_the_drafts_kernel_is_int4_amx_on_amx_else_its_blocks_or_measured(monkeypatch, cls):
    from specdecode.models import autotune

    monkeypatch.setattr(autotune, "cpu_info", lambda: ("a CPU", FLAGS[cls]))
    monkeypatch.setattr(autotune, "kernel_available", lambda quant: True)
    monkeypatch.setattr(autotune, "fastest_quant", lambda dtype, rows, candidates=None, changes_outputs=True:
                        "w4a8" if not changes_outputs else "none")
    expected = "int4-amx" if cls == "amx" else "w4a8"  # a draft's measurement may use the fastest seen
    assert autotune.draft_quant_choice(torch.bfloat16, 1)[0] == expected
    # a GGUF draft runs its blocks where a native int8 kernel does (faster for the prompt it prefills), in 4 bits
    expected = "int4-amx" if cls == "amx" else "gguf-q4"
    assert autotune.draft_quant_choice(torch.bfloat16, 1, "gguf-int8")[0] == expected


def test_an_empty_draft_vocabulary_is_refused_even_with_a_cached_model(tiny_pair):
    from specdecode.builder import load_draft

    load_draft(str(tiny_pair[1].source), dtype="float32", quant="int8")  # a cache entry for the full vocabulary
    for bad in (0, -5):
        with pytest.raises(InvalidRequestError, match="at least 1 token"):
            load_draft(str(tiny_pair[1].source), dtype="float32", quant="int8", vocab=bad)
