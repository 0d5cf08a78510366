"""A GGUF file's blocks run as stored (`--quant gguf`, `--quant gguf-int8`): exact codes and scales, the AMX and int8
kernels, whole models."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from specdecode.errors import InvalidRequestError
from specdecode.kernels import gguf_amx, gguf_int8
from specdecode.kernels.gguf_amx import GgufLinear
from specdecode.kernels.gguf_int8 import GgufInt8Linear
from specdecode.models.gguf_blocks import FORMATS, BlockEmbedding, QuantizedTensor, concat_rows
from specdecode.models.linear import make_linear
from specdecode.models.loading import load_model
from tests.gguf_files import BLOCK_TYPES, Q4_K_M, Q5_0_MIX, random_blocks, write_model
from tests.test_decode_ops import assert_one_call_layers_give_the_per_op_bits
from tests.test_quant import assert_greedy_speculative_equals_plain

needs_amx = pytest.mark.skipif(gguf_amx.extension() is None, reason="needs a CPU with AMX-BF16 and g++")
needs_avx2 = pytest.mark.skipif(gguf_int8.extension() is None, reason="needs a CPU with AVX2 and g++")
SCALAR = ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")  # gguf_int8.cpp's scalar path
EMULATED_AVX512 = ("-mno-avx512f", "-DSPECDECODE_EMULATE_AVX512")  # its AVX-512 path through SIMDe
# each native kernel: its module, layer, and the activation dtype the whole-model tests give it
KERNELS = {"gguf": (gguf_amx, GgufLinear, torch.bfloat16), "gguf-int8": (gguf_int8, GgufInt8Linear, torch.float32)}
kernel_params = [pytest.param("gguf", marks=needs_amx), pytest.param("gguf-int8", marks=needs_avx2)]


def _tensor(qtype: Q, rows: int = 40, cols: int = 512, seed: int = 0) -> QuantizedTensor:
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return QuantizedTensor(torch.from_numpy(raw), qtype, (rows, cols))


def _gguf(t: QuantizedTensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(t.raw.numpy(), t.qtype)).reshape(t.shape)


def test_every_format_is_listed() -> None:
    assert set(FORMATS) == set(BLOCK_TYPES)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_codes_give_gguf_numbers_bit_for_bit(qtype: Q) -> None:
    for seed in range(3):  # random bytes: every code, sub-scale and min
        t = _tensor(qtype, seed=seed)
        assert torch.equal(t.dequantize(), _gguf(t))


@pytest.mark.parametrize("qtype", [q for q in BLOCK_TYPES if q not in (Q.Q4_K, Q.Q5_K, Q.Q6_K)],
                         ids=lambda q: q.name)
def test_codes_of_gguf_quantized_weights(qtype: Q) -> None:
    """Blocks as gguf's own quantizer writes them (not only random bytes)."""
    w = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    t = QuantizedTensor(torch.from_numpy(quantize(w, qtype)), qtype, (16, 256))
    assert torch.equal(t.dequantize(), _gguf(t))


@pytest.mark.parametrize("quant", KERNELS)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_packing_keeps_every_code_and_scale(qtype: Q, quant: str) -> None:
    module = KERNELS[quant][0]
    t = _tensor(qtype, rows=37)  # not a multiple of 16
    codes = t.codes()
    back = module.unpack(codes.fmt, module.pack(codes), 37)
    assert torch.equal(back.dequantize(), _gguf(t))
    for name in ("q", "d", "sc", "dm", "m"):
        a, b = getattr(codes, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_rows_concat_and_lookup() -> None:
    a, b = _tensor(Q.Q4_K, rows=20, seed=1), _tensor(Q.Q4_K, rows=12, seed=2)
    both = concat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([_gguf(a), _gguf(b)]))
    assert torch.equal(both.rows(25).dequantize(), both.dequantize()[:25])
    ids = torch.tensor([[3, 0, 31], [7, 7, 30]])
    emb = BlockEmbedding(both, torch.bfloat16)
    assert torch.equal(emb(ids), both.dequantize()[ids].to(torch.bfloat16))
    with pytest.raises(ValueError, match="one block type"):
        concat_rows([a, _tensor(Q.Q6_K)])


@pytest.mark.parametrize("quant", KERNELS)
def test_quantizing_dense_weights_is_refused(quant: str) -> None:
    with pytest.raises(InvalidRequestError, match="own blocks"):
        make_linear(torch.randn(32, 64), None, quant)


@needs_amx
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_kernel_is_the_reference_arithmetic_and_row_invariant(qtype: Q) -> None:
    t = _tensor(qtype, rows=40, cols=512)
    layer = GgufLinear.from_blocks([t], None, torch.bfloat16)
    assert torch.equal(layer.dequantized(), _gguf(t))
    part = layer.part_list[0]
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = gguf_amx.gguf_amx_mm(x, part.fmt, part.buffers_by_name())
    reference = gguf_amx.reference_mm(x, part.fmt, part.buffers_by_name())
    # inside a tile multiply the hardware orders and rounds the additions: a few ulps of the products' size
    products = (x.float().abs() @ _gguf(t).abs().T)
    assert ((y[:, :40] - reference[:, :40]).abs() <= 2**-20 * products + 1e-30).all()
    for k in range(1, 17):
        assert torch.equal(gguf_amx.gguf_amx_mm(x[:k], part.fmt, part.buffers_by_name()), y[:k]), k
    assert torch.equal(layer(x.float()), y[:, :40])  # the layer: the kernel's float32 outputs


@needs_amx
@pytest.mark.parametrize("qtype,cols", [(Q.Q4_0, 96), (Q.Q8_0, 160), (Q.Q5_0, 576), (Q.Q4_1, 64)],
                         ids=["q4_0-3groups", "q8_0-5groups", "q5_0-18groups", "q4_1-2groups"])
def test_widths_whose_groups_are_not_a_multiple_of_four(qtype: Q, cols: int) -> None:
    t = _tensor(qtype, rows=24, cols=cols)
    part = GgufLinear.from_blocks([t], None, torch.bfloat16).part_list[0]
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = gguf_amx.gguf_amx_mm(x, part.fmt, part.buffers_by_name())
    reference = gguf_amx.reference_mm(x, part.fmt, part.buffers_by_name())
    products = x.float().abs() @ _gguf(t).abs().T
    assert ((y[:, :24] - reference[:, :24]).abs() <= 2**-20 * products + 1e-30).all()
    assert torch.equal(gguf_amx.gguf_amx_mm(x[:1], part.fmt, part.buffers_by_name()), y[:1])


@needs_avx2
@pytest.mark.parametrize("qtype,cols", [(q, 768) for q in BLOCK_TYPES] + [(Q.Q4_0, 96), (Q.Q5_1, 896)],
                         ids=[q.name for q in BLOCK_TYPES] + ["q4_0-96", "q5_1-896"])
def test_int8_kernel_is_the_reference_arithmetic_and_row_invariant(qtype: Q, cols: int) -> None:
    """The int8 kernel against its arithmetic done in torch (exact integers per block, then the same float32 steps;
    the reference's fused multiply-add rounds twice): within an ulp or so of the sum of the products' magnitudes;
    spans of activations shorter than 256 (96, 896 inputs) and a tile of 8 real rows of 16 included."""
    t = _tensor(qtype, rows=40, cols=cols)
    layer = GgufInt8Linear.from_blocks([t], None, torch.float32)
    assert torch.equal(layer.dequantized(), _gguf(t))
    part = layer.part_list[0]
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(0))
    x[3] = 0  # a zero row: scale 0
    x[5, :40] *= 1e4  # one outlier span
    y = gguf_int8.gguf_int8_mm(x, part.fmt, part.buffers_by_name())[:, :40]
    reference = gguf_int8.reference_mm(x, part.fmt, part.buffers_by_name())[:, :40]
    products = x.abs() @ _gguf(t).abs().T
    assert ((y - reference).abs() <= 2**-22 * products + 1e-30).all()
    assert (y - x @ _gguf(t).T).abs().max() < 0.05 * products.max()  # the int8 activations' rounding, no worse
    for k in range(1, 17):
        assert torch.equal(gguf_int8.gguf_int8_mm(x[:k], part.fmt, part.buffers_by_name())[:, :40], y[:k]), k
    assert torch.equal(layer(x), y)
    assert torch.equal(layer(x.to(torch.bfloat16)), gguf_int8.gguf_int8_mm(
        x.to(torch.bfloat16), part.fmt, part.buffers_by_name())[:, :40].to(torch.bfloat16))


AVX2 = ("-mno-avx512f",)  # gguf_int8.cpp's AVX2 path on an AVX-512 CPU


@needs_avx2
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("path", ["scalar", "avx2", "emulated-avx512"])
def test_int8_kernel_paths_give_the_same_bits(qtype: Q, path: str) -> None:
    """One arithmetic on every path: a CPU without AVX2 runs the scalar code, an AVX2 CPU its own, and the AVX-512
    code (built through SIMDe where the CPU lacks it) gets the same numbers as this CPU's path."""
    flags = {"scalar": SCALAR, "avx2": AVX2, "emulated-avx512": EMULATED_AVX512}[path]
    if path == "emulated-avx512":
        pytest.importorskip("simde_py")
        flags = (*flags, "-I" + __import__("simde_py").get_include())
    if gguf_int8.extension(flags) is None:
        pytest.skip(f"the {path} build failed")
    assert gguf_int8.extension(flags).gguf_simd_path() == {"emulated-avx512": "avx512-vnni"}.get(path, path)
    t = _tensor(qtype, rows=24, cols=768, seed=4)
    part = GgufInt8Linear.from_blocks([t], None, torch.float32).part_list[0]
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(2))
    assert torch.equal(gguf_int8.gguf_int8_mm(x, part.fmt, part.buffers_by_name()),
                       gguf_int8.gguf_int8_mm(x, part.fmt, part.buffers_by_name(), isa_flags=flags))


@pytest.mark.parametrize("quant", kernel_params)
def test_a_layer_of_mixed_types_is_its_parts_side_by_side(quant: str) -> None:
    cls = KERNELS[quant][1]
    q, k, v = _tensor(Q.Q4_K, rows=32, seed=1), _tensor(Q.Q4_K, rows=16, seed=2), _tensor(Q.Q6_K, rows=16, seed=3)
    bias = torch.randn(64)
    layer = cls.from_blocks([q, k, v], bias, torch.float32)
    assert layer.kernel_name() == f"{cls.__name__}(Q4_K+Q6_K)" and layer.out_features == 64
    x = torch.randn(3, 512)
    expected = torch.cat([cls.from_blocks([t], None, torch.float32)(x) for t in (q, k, v)], dim=1) + bias
    assert torch.equal(layer(x), expected)
    restored = cls.restore(layer.state_dict(), 0, torch.float32)
    assert restored.in_features == 512 and torch.equal(restored(x), layer(x))


@pytest.fixture(scope="module", params=[(q, mix) for q in KERNELS for mix in (Q4_K_M, Q5_0_MIX)],
                ids=[f"{q}-{mix}" for q in KERNELS for mix in ("q4_k_m", "q5_0")])
def native_pair(request, tmp_path_factory):
    quant, mix = request.param
    module, _, dtype = KERNELS[quant]
    if module.extension() is None:
        pytest.skip(f"{quant} does not run on this CPU")
    root = tmp_path_factory.mktemp("gguf")
    target, draft = write_model(root / "t.gguf", mix), write_model(root / "d.gguf", mix, perturb=0.05)
    dtype_name = str(dtype).removeprefix("torch.")
    return (load_model(target, dtype=dtype_name, quant=quant, head_quant=quant, decode_width=9, with_tokenizer=False),
            load_model(draft, dtype=dtype_name, quant=quant, head_quant=quant, with_tokenizer=False), target, quant)


def test_a_native_model_runs_the_files_numbers(native_pair) -> None:
    target, _, path, quant = native_pair
    model = target.model
    assert isinstance(model.embed, BlockEmbedding)
    assert all(isinstance(m, KERNELS[quant][1]) for m in (model.lm_head, *model.blocks[0].children()))
    reference = load_model(path, dtype="float32", quant="none", with_tokenizer=False).model
    tokens = torch.tensor([[1, 5, 9, 13, 40, 41, 50, 2]])
    got = model(tokens, torch.tensor([0]), model.new_cache())
    want = reference(tokens, torch.tensor([0]), reference.new_cache())
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # bf16 or int8 activations against float32


def test_native_forward_is_invariant_to_the_step_width(native_pair) -> None:
    from tests.test_runtime import _invariance_mismatches

    assert _invariance_mismatches(native_pair[0].model) == 0


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_native_greedy_speculative_equals_plain(native_pair, drafter) -> None:
    assert_greedy_speculative_equals_plain(*native_pair[:2], drafter, gammas=(1, 4, None), prompts=8)


def test_native_tree_nodes_get_their_paths_logits(native_pair) -> None:
    from tests.test_trees import assert_tree_rows_equal_chains, random_parents

    rnd = random.Random(1)
    for n, shape in ((3, "star"), (5, "binary"), (8, "random")):
        assert_tree_rows_equal_chains(native_pair[0].model, [rnd.randrange(64) for _ in range(rnd.randint(1, 300))],
                                      7, [rnd.randrange(64) for _ in range(n)], random_parents(n, shape, rnd))


def test_the_packed_cache_gives_the_same_model(native_pair) -> None:
    target, _, path, quant = native_pair
    dtype = str(target.model.dtype).removeprefix("torch.")
    again = load_model(path, dtype=dtype, quant=quant, head_quant=quant, decode_width=9, with_tokenizer=False)
    assert again.from_cache
    tokens = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(again.model(tokens, torch.tensor([0]), again.model.new_cache()),
                       target.model(tokens, torch.tensor([0]), target.model.new_cache()))


def test_llama_q_and_k_rows_are_unpermuted_in_their_blocks(tmp_path) -> None:
    """llama.cpp permutes a llama model's q/k rows; the blocks are whole rows, so the loader moves them back."""
    from specdecode.models.gguf_loader import load_gguf
    from tests.test_gguf import _hf_model, _metadata, _model_tensors, _write_gguf

    _, state = _hf_model("llama", tied=False)
    tensors, raw = _model_tensors("llama", state, Q.Q8_0)
    path = _write_gguf(tmp_path / "l.gguf", "llama", _metadata("llama"), tensors, raw)
    _, blocks = load_gguf(path, blocks=True)
    _, dense = load_gguf(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        q = blocks[name]
        assert isinstance(q, QuantizedTensor) and torch.equal(q.dequantize(), dense[name])


@needs_amx
def test_a_tied_embedding_is_also_a_native_head_and_a_reduced_one(tmp_path) -> None:
    path = write_model(tmp_path / "tied.gguf", Q4_K_M, tied=True)
    full = load_model(path, dtype="bfloat16", quant="gguf", head_quant="gguf", with_tokenizer=False).model
    assert isinstance(full.embed, BlockEmbedding) and isinstance(full.lm_head, GgufLinear)
    assert torch.equal(full.lm_head.dequantized(), full.embed.tensor.dequantize())
    reduced = load_model(path, dtype="bfloat16", quant="gguf", head_quant="gguf", head_rows=32,
                         with_tokenizer=False).model
    assert reduced.lm_head.out_features == 32
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(reduced(tokens, torch.tensor([0]), reduced.new_cache())[..., :32],
                       full(tokens, torch.tensor([0]), full.new_cache())[..., :32])
    dense_head = load_model(path, dtype="bfloat16", quant="gguf", head_quant="none", with_tokenizer=False).model
    assert isinstance(dense_head.embed, torch.Tensor)  # a tied dense head is a view of one dense embedding
    assert dense_head.lm_head.weight.untyped_storage().data_ptr() == dense_head.embed.untyped_storage().data_ptr()


@needs_avx2
def test_a_tied_embedding_stays_blocks_beside_a_requantized_head(tmp_path) -> None:
    """A draft's w4a8 head is quantized from the dense embedding; the embedding itself stays the file's blocks (the
    dense copy is only a temporary), and the cache gives the same model back."""
    from specdecode.kernels.w4a8 import W4A8Linear

    path = write_model(tmp_path / "tied.gguf", Q4_K_M, tied=True)
    draft = load_model(path, quant="w4a8", head_quant="w4a8", head_rows=48, with_tokenizer=False)
    model = draft.model
    assert isinstance(model.embed, BlockEmbedding) and isinstance(model.lm_head, W4A8Linear)
    assert model.lm_head.out_features == 48
    dense = load_model(path, quant="none", with_tokenizer=False).model
    ids = torch.tensor([[0, 7, 63]])
    assert torch.equal(model.embed(ids), dense.embed[ids])  # the file's numbers, read from the blocks
    again = load_model(path, quant="w4a8", head_quant="w4a8", head_rows=48, with_tokenizer=False)
    assert again.from_cache
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(again.model(tokens, torch.tensor([0]), again.model.new_cache()),
                       model(tokens, torch.tensor([0]), model.new_cache()))


def test_gguf_on_a_safetensors_model_is_refused(tiny_pair) -> None:
    with pytest.raises(InvalidRequestError, match="not a GGUF file"):
        load_model(tiny_pair[0].source, quant="gguf", with_tokenizer=False)


@needs_avx2
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", ["gguf-int8", "gguf-q4"])
def test_the_one_call_gguf_layer_gives_the_bits_of_the_per_op_path(cpu_build, tmp_path, monkeypatch, quant, dtype):
    """kernels/layer.cpp runs a layer of GGUF blocks in one call (parts of two block types side by side, a qkv bias):
    the same logits and cache writes as the layer's ops called one by one from Python, for batches in any cache rows
    and steps of 1..16 tokens."""
    path = write_model(tmp_path / "m.gguf", Q4_K_M if quant == "gguf-int8" else Q5_0_MIX)
    model = load_model(path, dtype=dtype, quant=quant, head_quant=quant, decode_width=9, with_tokenizer=False).model
    assert any(len(block.qkv.part_list) > 1 for block in model.blocks) or quant == "gguf-q4"
    assert_one_call_layers_give_the_per_op_bits(model, "gguf", monkeypatch)
