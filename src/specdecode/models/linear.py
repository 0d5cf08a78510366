"""The runtime's linear layer: one interface, so quantized kernels can replace the dense one.

The model code only calls `layer(x)`; which kernel runs is decided when the weights are loaded.
"""

from __future__ import annotations

import torch
from torch import nn


class DenseLinear(nn.Module):
    """y = x W^T + b, computed as (W @ x^T)^T, in chunks of at most `max_rows` rows.

    On the CPUs we measured (see shared/CPU.md), `W @ x.T` keeps the cost of k <= 8 rows close to
    that of one row, while `F.linear` grows with k; for a single row `torch.mv` reads bf16 weights
    at 1.5x the speed of either (Xeon with AMX, torch 2.13). Up to some number of rows (which
    depends on the CPU, the dtype and the shape), a row's result does not depend on how many rows
    share the matmul; bit-exact batched decoding sets `max_rows` below that limit
    (`invariant_rows`), so a batch of sequences computes each row exactly as a lone sequence would.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.max_rows: int | None = None  # None: one matmul whatever the row count

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] == 1:  # draft steps; never in bit-exact mode, which pads: matrix-vector is 1.5x faster in bf16
            y = torch.mv(self.weight, rows[0]).unsqueeze(0)
        elif self.max_rows is None or rows.shape[0] <= self.max_rows:
            y = (self.weight @ rows.T).T
        else:
            y = torch.cat([(self.weight @ chunk.T).T for chunk in rows.split(self.max_rows)])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def invariant_rows(weight: torch.Tensor, width: int, max_multiple: int, seed: int = 0) -> int:
    """The largest m <= max_multiple such that every matmul of n * width rows (n <= m) gives each row
    exactly what a matmul of `width` rows gives it. Measured, since it depends on the CPU's kernels.

    A matmul kernel's reduction order depends on the shapes, not on the values, so random rows of the
    layer's own shape and dtype answer for every input.
    """
    x = torch.randn(width * max_multiple, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    x = x.to(weight.dtype)
    alone = torch.cat([(weight @ chunk.T).T for chunk in x.split(width)])
    for n in range(2, max_multiple + 1):
        if not torch.equal((weight @ x[:n * width].T).T, alone[:n * width]):
            return n - 1
    return max_multiple
