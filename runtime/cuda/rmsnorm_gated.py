"""CUDA rmsnorm_gated: the contract of runtime/ops/rmsnorm_gated.py (kernel: rmsnorm_gated.cu; one
block per group, out may be x; act silu (default) or sigmoid, act_scale's codes)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu
from .act_scale import act_code


def launches(op, bufs, rows: int, w) -> list:
    x, gate, out = bufs[op["x"]], bufs[op["gate"]], bufs[op["out"]]
    g = int(op["group"])
    wt = w.vector(op["weight"])
    if wt.size != g or x.size % g or gate.shape != x.shape or out.shape != x.shape:
        raise PlanMismatch(f"rmsnorm_gated {op['weight']}: weight of {wt.size} values, group {g}, x {x.shape}, "
                           f"gate {gate.shape}, out {out.shape}")
    act = act_code("rmsnorm_gated", op.get("act", "silu"))
    kern = cu.kernel("rmsnorm_gated", "rmsnorm_gated_k")
    T = 512 if g >= 2048 else 256 if g >= 256 else max(32, -(-g // 32) * 32)
    args = (x, gate, out, wt, np.int32(g), np.float32(op["eps"]), np.int32(act))
    groups = x.size // g
    return [lambda: kern((groups,), (T,), args)]
