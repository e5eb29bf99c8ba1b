"""CUDA hc_expand: the contract of runtime/ops/hc_expand.py (hc_expand.cu: n copies of each row)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    x, out = bufs[op["x"]], bufs[op["out"]]
    n, D = int(op["n"]), int(x.shape[-1])
    if x.ndim != 2 or out.shape != (x.shape[0], n * D):
        raise PlanMismatch(f"hc_expand {op['out']}: x {x.shape}, out {out.shape}, n {n} (out [rows, n*D] expected)")
    kern = cu.kernel("hc_expand", "hc_expand_k")
    args = (x, out, np.int32(rows), np.int32(n), np.int32(D))
    grid = grid1d(rows * n * D)
    return [lambda: kern(grid, (256,), args)]
