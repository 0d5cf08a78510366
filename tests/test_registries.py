"""Drafters and kernels are found by their modules: adding one is one new file, and the command line, the builder,
the bench and doctor know it from its declaration."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import specdecode.drafting
import specdecode.kernels
from specdecode import cli
from specdecode.bench.doctor import bytes_per_weight, configs
from specdecode.bench.methods import MethodSpec, our_kinds
from specdecode.builder import build_generator
from specdecode.drafting import registry
from specdecode.errors import InvalidRequestError
from specdecode.models import linear
from specdecode.models.linear import kernels, make_linear, parse_quant, restore_linear

NEW_DRAFTER = '''
from specdecode.drafting.base import Draft, Drafter, DrafterSpec


class RepeatDrafter(Drafter):
    """Proposes the last token again, gamma times."""

    def propose(self, context, gamma, params, generator):
        return Draft([context[-1]] * gamma, None)


SPEC = DrafterSpec("repeat", "the last token again", lambda setup: RepeatDrafter(), gamma=3)
'''

NEW_KERNEL = '''
import torch

from specdecode.models.linear import Linear


class RowByRowLinear(Linear):
    """One matrix-vector product per row: row-invariant by construction."""

    kind = "rowwise"
    help = "one torch.mv per row"
    row_invariant = True

    def __init__(self, weight, bias=None):
        super().__init__(weight.shape[0], weight.shape[1], bias, weight.dtype)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    @classmethod
    def quantize(cls, weight, bias=None, group=0):
        return cls(weight, bias)

    @classmethod
    def restore(cls, tensors, group, dtype):
        return cls(tensors["weight"], tensors.get("bias"))

    def _matmul(self, rows):
        return torch.stack([torch.mv(self.weight, row) for row in rows])
'''


def _add_module(monkeypatch, tmp_path, package, name: str, source: str) -> None:
    """A module `name` in a folder on `package.__path__`, as if it were a file of the package."""
    folder = tmp_path / package.__name__.replace(".", "_")
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    monkeypatch.delitem(sys.modules, f"{package.__name__}.{name}", raising=False)


@pytest.fixture
def fresh_registries(monkeypatch):
    """Registries rebuilt for this test and restored after it."""
    monkeypatch.setattr(linear, "_REGISTERED", dict(linear._REGISTERED))
    registry.cache_clear()
    kernels.cache_clear()
    yield
    registry.cache_clear()
    kernels.cache_clear()


def test_the_drafters_and_kernels_are_the_modules_declarations():
    assert set(registry()) == {"eagle3", "hybrid", "lookahead", "medusa", "model", "model-tree", "ngram",
                               "ngram-tree", "none", "suffix", "suffix-chain"}
    assert [name for name, spec in registry().items() if spec.needs_draft_model] == ["hybrid", "model", "model-tree"]
    assert {name: spec.head_kind for name, spec in registry().items() if spec.head_kind} == \
        {"eagle3": "eagle3", "medusa": "medusa"}
    assert {name for name, spec in registry().items() if spec.chooses_lengths} == {
        "eagle3", "medusa", "model", "model-tree", "ngram", "ngram-tree", "suffix", "suffix-chain"}
    assert list(kernels())[0] == "none"
    assert set(kernels()) == {"none", "int8", "int4", "int4-amx", "int8-amx", "w4a8", "w6a8", "w8a8", "gguf",
                              "gguf-int8", "gguf-q4"}
    for kind, cls in kernels().items():
        assert cls.kind == kind and cls.head in kernels()
        assert parse_quant(kind)[0] == kind
        for group in cls.group_sizes:
            assert parse_quant(f"{kind}-g{group}") == (kind, group)
    with pytest.raises(InvalidRequestError, match="int4\\[-g32\\|-g64\\|-g128\\]"):
        parse_quant("int5")
    assert {q for _, q in configs()} == set(kernels())
    assert bytes_per_weight("none") is None and 0.5 < bytes_per_weight("int4") < bytes_per_weight("int8") < 1.1


@pytest.mark.parametrize("kind", ["none", "int8", "int4", "int4-amx", "int8-amx", "w4a8", "w6a8", "w8a8"])
def test_every_kernel_rebuilds_from_its_state_dict(kind):
    cls = kernels()[kind]
    if not cls.available() and kind.endswith("-amx"):
        pytest.skip(f"{kind} needs {cls.requires}")
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    layer = make_linear(weight.to(torch.bfloat16), None, kind)
    again = restore_linear(layer.quant, dict(layer.state_dict()), torch.bfloat16)
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert type(again) is cls and again.quant == layer.quant and torch.equal(again(x), layer(x))


def test_a_new_drafter_is_one_new_module(fresh_registries, monkeypatch, tmp_path, tiny_pair):
    _add_module(monkeypatch, tmp_path, specdecode.drafting, "repeat", NEW_DRAFTER)
    assert "repeat" in registry() and "repeat" in our_kinds()
    args = cli.build_parser().parse_args(["generate", "--drafter", "repeat", "--prompt", "x"])
    assert args.drafter == "repeat"
    assert MethodSpec.parse("repeat:g2", "float32") == MethodSpec("repeat", "float32", gamma=2)
    target, _ = tiny_pair
    plain, repeat = (build_generator(target, drafter=name) for name in ("none", "repeat"))
    assert repeat.gamma.initial == 3 and not repeat.gamma.adaptive
    prompt = [5, 5, 5, 7, 7, 7, 7]
    result = repeat.generate(prompt, max_new_tokens=30, eos_ids=[])
    assert result.token_ids == plain.generate(prompt, max_new_tokens=30, eos_ids=[]).token_ids
    assert result.stats.drafted_tokens > 0


def test_a_new_kernel_is_one_new_module(fresh_registries, monkeypatch, tmp_path, tiny_pair):
    _add_module(monkeypatch, tmp_path, specdecode.kernels, "rowwise", NEW_KERNEL)
    assert "rowwise" in kernels() and ("bfloat16", "rowwise") in configs()
    assert "rowwise (one torch.mv per row)" in " ".join(_generate_help().split())
    layer = make_linear(torch.randn(8, 16), None, "rowwise")
    assert type(layer).__name__ == "RowByRowLinear" and layer.quant == "rowwise"
    x = torch.randn(5, 16)
    assert all(torch.equal(layer(x)[i], layer(x[i:i + 1])[0]) for i in range(5))  # what it declares


def _generate_help() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["generate"].format_help()
