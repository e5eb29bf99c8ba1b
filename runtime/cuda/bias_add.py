"""CUDA bias_add: the contract of runtime/ops/bias_add.py (bias_add.cu)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    x, out = bufs[op["x"]], bufs[op["out"]]
    bias = w.vector(op["bias"])
    n = int(x.shape[-1])
    if out.shape != x.shape or bias.size != n:
        raise PlanMismatch(f"bias_add {op['bias']}: {bias.size} values, x {x.shape}, out {out.shape}")
    kern = cu.kernel("bias_add", "bias_add_k")
    args = (x, bias, out, np.int32(rows), np.int32(n))
    grid = grid1d(rows * n)
    return [lambda: kern(grid, (256,), args)]
