"""The runtime's linear layers: one interface, so quantized kernels replace the dense one without the model knowing.

The model code only calls `layer(x)`; which kernel runs is decided when the weights are loaded (`make_linear`).
A kernel is a `Linear` subclass that declares its `kind` (the `--quant` name) and what it needs; each lives in a
module of `specdecode.kernels` and registers itself by being defined (`kernels()` imports them all), so adding
one is one new module plus its tests. Subclasses implement `_matmul(rows) -> [n, out]`; the base adds the bias.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import ClassVar

import torch
from torch import nn

import specdecode.kernels
from specdecode.errors import InvalidRequestError
from specdecode.models.gguf_blocks import QuantizedTensor

_REGISTERED: dict[str, type[Linear]] = {}


class Linear(nn.Module):
    # what a kernel declares (the command line's choices and help, doctor, bench and the loader read these)
    kind: ClassVar[str]  # the --quant name; defining a subclass with its own `kind` registers it
    help: ClassVar[str] = ""  # one phrase for --help
    bits: ClassVar[int] = 16  # per weight, scales aside
    group_sizes: ClassVar[tuple[int, ...]] = ()  # the `-gG` choices, the first the default; () for none
    requires: ClassVar[str] = "any CPU"  # what it needs to run at its speed
    head: ClassVar[str] = "none"  # a target's lm_head beside blocks of this kind: wider, as llama.cpp's Q4_K_M
    native: ClassVar[bool] = False  # runs a GGUF file's blocks as stored (`from_blocks`) instead of quantizing
    native_dtypes: ClassVar[tuple[str, ...]] = ()  # a native kernel's activation dtypes
    group = 0  # inputs per scale, for kinds with group sizes

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype  # dtype: of activations
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            _REGISTERED[cls.kind] = cls

    @property
    def row_invariant(self) -> bool:  # True: each output row is computed the same way whatever the number of rows
        return False  # a kernel that always is says `row_invariant = True`; one that depends, a property

    @property
    def quant(self) -> str:
        """What `make_linear` was given, e.g. "int4-g64": enough to rebuild the layer from its state_dict."""
        return f"{self.kind}-g{self.group}" if self.group_sizes else self.kind

    @classmethod
    def available(cls) -> bool:
        """Whether its fast kernel runs here (a kernel of ours may not have built, or need a CPU feature)."""
        return True

    @classmethod
    def bytes_per_weight(cls) -> float | None:
        """What a decode step reads per weight, scales included (None: the activations' dtype's size)."""
        return None

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: int) -> Linear:
        raise NotImplementedError

    @classmethod
    def from_blocks(cls, tensors: list[QuantizedTensor], bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
        """A native kernel's layer from a GGUF file's tensors, stacked along their outputs."""
        raise NotImplementedError

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> Linear:
        """Rebuild from a layer's `state_dict()` without quantizing again (weight cache)."""
        raise NotImplementedError

    def kernel_name(self) -> str:
        return type(self).__name__

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class DenseLinear(Linear):
    """y = x W^T + b, computed as (W @ x^T)^T.

    `W @ x.T` keeps the cost of k <= 8 rows close to that of one row on the CPUs measured (docs/kernels.md), while
    `F.linear` grows with k; for a single row `torch.mv` reads bf16 weights faster than either.
    """

    kind = "none"
    help = "the model's own dtype"
    COLUMN_BLOCK = 8  # float32 GEMMs compute a last, partial block of columns (rows of x) by other code

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[0], weight.shape[1], bias, weight.dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 0) -> DenseLinear:
        return cls(weight, bias)

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> DenseLinear:
        return cls(tensors["weight"], tensors.get("bias"))

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        if n == 1:  # draft steps; never in bit-exact mode, which pads
            return torch.mv(self.weight, rows[0]).unsqueeze(0)
        if self.weight.dtype == torch.float32 and n > self.COLUMN_BLOCK and n % self.COLUMN_BLOCK:
            # on AVX2 CPUs (torch 2.13) row 8 of a 9-row float32 matmul can differ from the same row at position 0:
            # whole blocks keep a bit-exact step's rows independent of their position
            rows = torch.cat([rows, rows.new_zeros(self.COLUMN_BLOCK - n % self.COLUMN_BLOCK, rows.shape[1])])
        return (self.weight @ rows.T).T[:n]


@functools.cache
def kernels() -> dict[str, type[Linear]]:
    """Every kind of linear by its --quant name, "none" first."""
    for module in pkgutil.iter_modules(specdecode.kernels.__path__):
        importlib.import_module(f"{specdecode.kernels.__name__}.{module.name}")
    return {"none": DenseLinear, **{k: v for k, v in _REGISTERED.items() if k != "none"}}


def quant_choices() -> str:
    """The --quant values, for help and errors: 'none, int8, int4[-g32|-g64|-g128], ...'."""
    return ", ".join(kind + (f"[-g{'|-g'.join(map(str, cls.group_sizes))}]" if cls.group_sizes else "")
                     for kind, cls in kernels().items())


def parse_quant(quant: str) -> tuple[str, int]:
    """'int4-g64' -> ('int4', 64); a kind without group sizes gets group 0, one with them its default."""
    kind, sep, group = quant.partition("-g")
    cls = kernels().get(kind)
    if cls is None or (sep and (not cls.group_sizes or not group.isdigit())):
        raise InvalidRequestError(f"unknown quantization {quant!r}; choose file, auto or {quant_choices()}")
    if sep and int(group) not in cls.group_sizes:
        raise InvalidRequestError(f"{kind} group size must be one of {cls.group_sizes}, got {group}")
    return kind, int(group) if sep else (cls.group_sizes[0] if cls.group_sizes else 0)


def kernel(quant: str) -> type[Linear]:
    return kernels()[parse_quant(quant)[0]]


def kernel_available(quant: str) -> bool:
    """False where `quant` runs one of our C++ kernels and it did not build or this CPU cannot run it
    (w4a8 would then run its pure-torch reference, which is never fast)."""
    return kernel(quant).available()


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quant: str = "none") -> Linear:
    kind, group = parse_quant(quant)
    return kernels()[kind].quantize(weight, bias, group)


def restore_linear(quant: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Linear:
    """Rebuild a layer from its `state_dict()` and its `quant`, without quantizing again (weight cache)."""
    kind, group = parse_quant(quant)
    return kernels()[kind].restore(tensors, group, dtype)


def invariant_rows(layer: Linear, width: int, max_multiple: int, seed: int = 0) -> int:
    """The largest m <= max_multiple such that every matmul of n * width rows (n <= m) gives each row
    exactly what a matmul of `width` rows gives it. Measured, since it depends on the CPU's kernels.

    A matmul kernel's reduction order depends on the shapes, not on the values, so random rows of the
    layer's own shape and dtype answer for every input.
    """
    x = torch.randn(width * max_multiple, layer.in_features, generator=torch.Generator().manual_seed(seed))
    x = x.to(device=next(iter(layer.state_dict().values())).device, dtype=layer.dtype)
    alone = torch.cat([layer._matmul(chunk) for chunk in x.split(width)])
    for n in range(2, max_multiple + 1):
        if not torch.equal(layer._matmul(x[:n * width]), alone[:n * width]):
            return n - 1
    return max_multiple
