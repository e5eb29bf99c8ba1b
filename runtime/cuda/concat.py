"""CUDA concat: the contract of runtime/ops/concat.py (concat.cu; a [rows, na], b [rows, nb] -> out [rows, na + nb])."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    a, b, out = bufs[op["a"]], bufs[op["b"]], bufs[op["out"]]
    na, nb = int(a.shape[-1]), int(b.shape[-1])
    if out.shape[-1] != na + nb or min(a.shape[0], b.shape[0], out.shape[0]) < rows:
        raise PlanMismatch(f"concat {op['a']} | {op['b']}: a {a.shape}, b {b.shape}, out {out.shape}")
    kern = cu.kernel("concat", "concat_k")
    args = (a, b, out, np.int32(rows), np.int32(na), np.int32(nb))
    grid = grid1d(rows * (na + nb))
    return [lambda: kern(grid, (256,), args)]
