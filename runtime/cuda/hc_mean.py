"""CUDA hc_mean: the contract of runtime/ops/hc_mean.py (hc_mean.cu; bit for bit)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    x, out = bufs[op["x"]], bufs[op["out"]]
    n, D = int(op["n"]), int(out.shape[-1])
    if x.shape[-1] != n * D or not x.shape[0] == out.shape[0] >= rows:
        raise PlanMismatch(f"hc_mean {op['x']}: n {n} streams against x {x.shape}, out {out.shape}")
    kern = cu.kernel("hc_mean", "hc_mean_k")
    args = (x, out, np.int32(rows), np.int32(n), np.int32(D))
    grid = grid1d(rows * D)
    return [lambda: kern(grid, (256,), args)]
