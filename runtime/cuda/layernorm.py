"""CUDA layernorm: the contract of runtime/ops/layernorm.py (layernorm.cu; one block per group, out may be x)."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu


def launches(op, bufs, rows: int, w) -> list:
    x, out = bufs[op["x"]], bufs[op["out"]]
    g = int(op["group"])
    wt, b = w.vector(op["weight"]), w.vector(op["bias"])
    if wt.size != g or b.size != g or x.shape[-1] % g or out.shape != x.shape or x.shape[0] < rows:
        raise PlanMismatch(f"layernorm {op['weight']}: weight {wt.size} and bias {b.size} values, group {g}, "
                           f"x {x.shape}, out {out.shape}")
    kern = cu.kernel("layernorm", "layernorm_k")
    T = 256 if g >= 256 else max(32, -(-g // 32) * 32)
    args = (x, out, wt, b, np.int32(g), np.float32(op["eps"]))
    groups = rows * (int(x.shape[-1]) // g)
    return [lambda: kern((groups,), (T,), args)]
