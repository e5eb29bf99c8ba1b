"""CUDA causal_conv1d: the contract of runtime/ops/causal_conv1d.py (kernel: causal_conv1d.cu; one
thread per (slot, channel) walking the rows in order: out may be x)."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu

STEM = "causal_conv1d"
KERNELS = range(2, 9)                    # kernel widths instantiated


def launches(op, bufs, rows: int, w) -> list:
    K = int(op["kernel"])
    x, out, pos, slot, state = (bufs[op[k]] for k in ("x", "out", "pos", "slot", "state"))
    C = int(x.shape[-1])
    if K not in KERNELS:
        raise DeviceUnavailable(f"causal_conv1d kernel {K}: the CUDA kernel takes {KERNELS.start}..{KERNELS.stop - 1}; "
                                f"use --device cpu")
    if out.shape != x.shape or state.ndim != 3 or tuple(state.shape[1:]) != (K - 1, C):
        raise PlanMismatch(f"causal_conv1d {op['state']}: x {x.shape}, out {out.shape}, state {state.shape}, kernel {K}")
    wt = w.vector(op["weight"])
    if wt.size != C * K:
        raise PlanMismatch(f"causal_conv1d {op['weight']}: {wt.size} values, {C} channels x kernel {K} expected")
    kern = cu.kernel(STEM, f"causal_conv1d_k<{K}>")
    nslots = int(state.shape[0])
    grid = (-(-C // 64), nslots)
    args = (x, out, pos, slot, wt, state, np.int32(rows), np.int32(nslots), np.int32(C))
    return [lambda: kern(grid, (64,), args)]
