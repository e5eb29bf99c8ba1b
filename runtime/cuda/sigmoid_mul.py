"""CUDA sigmoid_mul: the contract of runtime/ops/sigmoid_mul.py (sigmoid_mul.cu; gate [rows, n] or [rows, 1])."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    x, gate, out = bufs[op["x"]], bufs[op["gate"]], bufs[op["out"]]
    n, gc = int(x.shape[-1]), int(gate.shape[-1])
    if out.shape != x.shape or gc not in (1, n) or gate.size != x.shape[0] * gc:
        raise PlanMismatch(f"sigmoid_mul {op['x']}: x {x.shape}, gate {gate.shape}, out {out.shape}")
    kern = cu.kernel("sigmoid_mul", "sigmoid_mul_k")
    args = (x, gate, out, np.int32(rows), np.int32(n), np.int32(gc))
    grid = grid1d(rows * n)
    return [lambda: kern(grid, (256,), args)]
