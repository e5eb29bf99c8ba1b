"""CUDA hc_gate_mix: the contract of runtime/ops/hc_gate_mix.py (hc_gate_mix.cu: the gated mean of the
n streams, one thread per output value)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def launches(op, bufs, rows: int, w) -> list:
    xn, g, out = bufs[op["xn"]], bufs[op["w"]], bufs[op["out"]]
    n, D = int(op["n"]), int(out.shape[-1])
    if out.ndim != 2 or xn.shape != (out.shape[0], n * D) or g.shape != xn.shape:
        raise PlanMismatch(f"hc_gate_mix {op['out']}: xn {xn.shape}, w {g.shape}, out {out.shape}, n {n} "
                           f"(xn, w [rows, n*D], out [rows, D] expected)")
    kern = cu.kernel("hc_gate_mix", "hc_gate_mix_k")
    args = (xn, g, out, np.int32(rows), np.int32(n), np.int32(D))
    grid = grid1d(rows * D)
    return [lambda: kern(grid, (256,), args)]
