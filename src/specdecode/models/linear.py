"""The runtime's linear layer: one interface, so quantized kernels can replace the dense one.

The model code only calls `layer(x)`; which kernel runs is decided when the weights are loaded.
"""

from __future__ import annotations

import torch
from torch import nn


class DenseLinear(nn.Module):
    """y = x W^T + b, computed as (W @ x^T)^T.

    On the CPUs we measured (see shared/CPU.md), `W @ x.T` keeps the cost of k <= 8 rows close to
    that of one row, while `F.linear` grows with k; for a single row `torch.mv` reads bf16 weights
    at 1.5x the speed of either (Xeon with AMX, torch 2.13). For a fixed number of rows, each row's result
    does not depend on the other rows, which bit-exact decoding relies on.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        # one row (draft steps; never in bit-exact mode, which pads): matrix-vector is 1.5x faster in bf16
        y = torch.mv(self.weight, rows[0]).unsqueeze(0) if rows.shape[0] == 1 else (self.weight @ rows.T).T
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)
