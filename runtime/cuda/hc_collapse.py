"""CUDA hc_collapse: the contract of runtime/ops/hc_collapse.py (hc_collapse.cu; bit for bit)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    x, wt, out = bufs[op["x"]], bufs[op["w"]], bufs[op["out"]]
    n, D = int(op["n"]), int(out.shape[-1])
    if x.shape[-1] != n * D or wt.shape[-1] != n or not x.shape[0] == wt.shape[0] == out.shape[0] >= rows:
        raise PlanMismatch(f"hc_collapse {op['x']}: n {n} streams against x {x.shape}, w {wt.shape}, out {out.shape}")
    kern = cu.kernel("hc_collapse", "hc_collapse_k")
    args = (x, wt, out, np.int32(rows), np.int32(n), np.int32(D))
    grid = grid1d(rows * D)
    return [lambda: kern(grid, (256,), args)]
