"""CUDA causal_conv1d: the contract of runtime/ops/causal_conv1d.py (kernel: causal_conv1d.cu; one
thread per (slot, channel) walking the rows in order: out may be x; the verify program's `history`
written row by row). Dilation d: the kernel's
template argument, its window of (kernel-1)*d inputs held in registers (at most MAX_WINDOW)."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu

STEM = "causal_conv1d"
KERNELS = range(2, 9)                    # kernel widths instantiated
MAX_WINDOW = 32                          # (kernel - 1) * dilation: the window a thread keeps in registers


def launches(op, bufs, rows: int, w) -> list:
    K, dil = int(op["kernel"]), int(op.get("dilation", 1))
    x, out, pos, slot, state = (bufs[op[k]] for k in ("x", "out", "pos", "slot", "state"))
    C = int(x.shape[-1])
    if K not in KERNELS or dil < 1 or (K - 1) * dil > MAX_WINDOW:
        raise DeviceUnavailable(f"causal_conv1d kernel {K}, dilation {dil}: the CUDA kernel takes kernel "
                                f"{KERNELS.start}..{KERNELS.stop - 1} and (kernel-1)*dilation <= {MAX_WINDOW}; "
                                f"use --device cpu")
    if out.shape != x.shape or state.ndim != 3 or tuple(state.shape[1:]) != ((K - 1) * dil, C):
        raise PlanMismatch(f"causal_conv1d {op['state']}: x {x.shape}, out {out.shape}, state {state.shape}, kernel {K}, "
                           f"dilation {dil} (state [slots, {(K - 1) * dil}, {C}] expected)")
    wt = w.vector(op["weight"])
    if "channels" in op:                  # rows a..b of a fused conv weight (glm5_next's [q | k | v])
        a, b = (int(v) for v in op["channels"])
        wt = wt[a * K:b * K]
    if wt.size != C * K:
        raise PlanMismatch(f"causal_conv1d {op['weight']}: {wt.size} values, {C} channels x kernel {K} expected")
    kern = cu.kernel(STEM, f"causal_conv1d_k<{K}, {dil}>")
    nslots = int(state.shape[0])
    grid = (-(-C // 64), nslots)
    hist = cu.history(op, bufs, rows, state)
    args = (x, out, pos, slot, wt, state, hist, np.int32(rows), np.int32(nslots), np.int32(C))
    return [lambda: kern(grid, (64,), args)]
