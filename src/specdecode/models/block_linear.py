"""What every kernel that runs a GGUF file's blocks as stored (`Linear.native`) shares: the layer is one part per run
of equal block types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k), each packed for the kernel, their
outputs side by side; the layer rebuilds from its state_dict and dequantizes to gguf's own numbers.

A kernel subclasses `BlockLinear` and says how it packs a tensor's `Codes` (`pack`), unpacks them (`unpack`) and
multiplies (`mm`), and how wide a packed tensor is (`inputs`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from gguf import GGMLQuantizationType
from torch import nn

from specdecode.errors import InvalidRequestError
from specdecode.models.gguf_blocks import FORMATS, BlockFormat, Codes, QuantizedTensor, concat_rows
from specdecode.models.linear import Linear

PACK_ROWS = 4096  # rows packed at a time (a multiple of 16): the temporaries of a 151936-row lm_head stay small


class Part(nn.Module):
    """One run of equal block types: its buffers, its format and its real width (outputs)."""

    def __init__(self, qtype: GGMLQuantizationType, buffers: dict[str, torch.Tensor], width: int) -> None:
        super().__init__()
        self.fmt = FORMATS[qtype]
        self.names = tuple(buffers)
        for name, t in buffers.items():
            self.register_buffer(name, t)
        self.register_buffer("qtype", torch.tensor(int(qtype)))  # kept to rebuild the layer (weight cache)
        self.register_buffer("width", torch.tensor(width))
        self.out_features = width

    def buffers_by_name(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}


class BlockLinear(Linear):
    """A GGUF file's blocks as stored, on one of our kernels; the file's dense tensors stay dense."""

    bits = 4
    head: ClassVar[str]  # the kernel's own kind: a target's lm_head runs the file's blocks too
    native = True
    row_invariant = True

    def __init__(self, parts: list[Part], in_features: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(sum(p.out_features for p in parts), in_features, bias, dtype)
        self.parts = nn.ModuleList(parts)  # their buffers in the state_dict
        self.part_list = parts

    # what a kernel defines
    @staticmethod
    def pack(codes: Codes) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def unpack(fmt: BlockFormat, buffers: dict[str, torch.Tensor], rows: int) -> Codes:
        raise NotImplementedError

    @staticmethod
    def mm(x: torch.Tensor, fmt: BlockFormat, buffers: dict[str, torch.Tensor],
           out_dtype: torch.dtype) -> torch.Tensor:  # [k, K] -> [k, N or more] in out_dtype
        raise NotImplementedError

    @staticmethod
    def inputs(fmt: BlockFormat, buffers: dict[str, torch.Tensor]) -> int:  # K, the packed tensor's width
        raise NotImplementedError

    @classmethod
    def bytes_per_weight(cls) -> float:
        return 0.5 + 4 / 256 + 2 / 32  # Q4_K: the codes, d and dm per 256, sc and m per 32

    @classmethod
    def _require(cls) -> None:
        if not cls.available():
            raise InvalidRequestError(f"--quant {cls.kind} needs {cls.requires}; use --quant none here")

    @classmethod
    def from_blocks(cls, tensors: list[QuantizedTensor], bias: torch.Tensor | None,
                    dtype: torch.dtype) -> BlockLinear:
        """Tensors stacked along their outputs (q, k, v), each of a supported block type."""
        cls._require()
        runs: list[list[QuantizedTensor]] = []
        for t in tensors:
            if runs and runs[-1][0].qtype == t.qtype:
                runs[-1].append(t)
            else:
                runs.append([t])
        parts = []
        for run in runs:
            stacked = concat_rows(run) if len(run) > 1 else run[0]
            chunks = [cls.pack(stacked.rows_between(r, r + PACK_ROWS).codes())  # bounded temporaries
                      for r in range(0, stacked.shape[0], PACK_ROWS)]
            buffers = {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}
            parts.append(Part(stacked.qtype, buffers, stacked.shape[0]))
        return cls(parts, tensors[0].shape[1], bias, dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 0) -> Linear:
        raise InvalidRequestError(f"--quant {cls.kind} runs a GGUF file's own blocks: it cannot quantize other "
                                  "weights")

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], group: int, dtype: torch.dtype) -> BlockLinear:
        cls._require()  # a cache written on another CPU, or a kernel that no longer builds
        count = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("parts."))
        parts = []
        for i in range(count):
            own = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"parts.{i}.")}
            qtype, width = GGMLQuantizationType(int(own.pop("qtype"))), int(own.pop("width"))
            parts.append(Part(qtype, own, width))
        return cls(parts, cls.inputs(parts[0].fmt, parts[0].buffers_by_name()), tensors.get("bias"), dtype)

    def kernel_name(self) -> str:
        return f"{type(self).__name__}(" + "+".join(p.fmt.name for p in self.part_list) + ")"

    def dequantized(self) -> torch.Tensor:
        return torch.cat([self.unpack(p.fmt, p.buffers_by_name(), p.out_features).dequantize()
                          for p in self.part_list])

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        outs = [self.mm(rows, p.fmt, p.buffers_by_name(), out_dtype)[:, :p.out_features] for p in self.part_list]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.contiguous().to(rows.dtype)
