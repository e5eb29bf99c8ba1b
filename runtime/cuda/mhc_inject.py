"""CUDA mhc_inject: the contract of runtime/ops/mhc_inject.py (mhc_inject.cu; bit for bit, out may be x)."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu
from .ops import grid1d

STREAMS = range(1, 9)                    # n instantiated


def launches(op, bufs, rows: int, w) -> list:
    x, y, post, comb, out = (bufs[op[k]] for k in ("x", "y", "post", "comb", "out"))
    n, D = int(op["n"]), int(y.shape[-1])
    if n not in STREAMS:
        raise DeviceUnavailable(f"mhc_inject n {n}: the CUDA kernel takes {STREAMS.start}..{STREAMS.stop - 1} streams; "
                                f"use --device cpu")
    if x.shape[-1] != n * D or out.shape != x.shape or post.shape[-1] != n or comb.shape[-1] != n * n \
            or not x.shape[0] == y.shape[0] == post.shape[0] == comb.shape[0] >= rows:
        raise PlanMismatch(f"mhc_inject {op['out']}: n {n} streams against x {x.shape}, y {y.shape}, post {post.shape}, "
                           f"comb {comb.shape}, out {out.shape}")
    kern = cu.kernel("mhc_inject", f"mhc_inject_k<{n}>")
    args = (x, y, post, comb, out, np.int32(rows), np.int32(D))
    grid = grid1d(rows * D)
    return [lambda: kern(grid, (256,), args)]
