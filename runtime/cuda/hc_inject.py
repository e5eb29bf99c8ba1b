"""CUDA hc_inject: the contract of runtime/ops/hc_inject.py (hc_inject.cu; elementwise, out may be x)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    x, y, g, out = bufs[op["x"]], bufs[op["y"]], bufs[op["w"]], bufs[op["out"]]
    n, D = int(op["n"]), int(y.shape[-1])
    if y.ndim != 2 or x.shape != (y.shape[0], n * D) or out.shape != x.shape or g.shape != (y.shape[0], n):
        raise PlanMismatch(f"hc_inject {op['out']}: x {x.shape}, y {y.shape}, w {g.shape}, out {out.shape}, n {n} "
                           f"(x, out [rows, n*D], y [rows, D], w [rows, n] expected)")
    kern = cu.kernel("hc_inject", "hc_inject_k")
    args = (x, y, g, out, np.int32(rows), np.int32(n), np.int32(D))
    grid = grid1d(rows * n * D)
    return [lambda: kern(grid, (256,), args)]
