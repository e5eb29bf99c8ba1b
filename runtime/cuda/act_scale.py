"""CUDA act_scale: the contract of runtime/ops/act_scale.py (act_scale.cu; elementwise, out may be x)."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu
from .ops import grid1d

ACTS = {"silu": 0, "sigmoid": 1}         # act_scale.cu's act codes (rmsnorm_gated.cu reads the same)


def act_code(op_name: str, act: str) -> int:
    if act not in ACTS:
        raise DeviceUnavailable(f"{op_name}: act {act!r}: the CUDA kernel knows {', '.join(ACTS)}; use --device cpu")
    return ACTS[act]


def launches(op, bufs, rows: int, w) -> list:
    x, out = bufs[op["x"]], bufs[op["out"]]
    if out.shape != x.shape:
        raise PlanMismatch(f"act_scale {op['out']}: x {x.shape}, out {out.shape} (one shape expected)")
    act = act_code("act_scale", op["act"])
    mul = op.get("mul", 1)
    kern = cu.kernel("act_scale", "act_scale_k")
    n = rows * int(np.prod(x.shape[1:]))
    args = (x, out, np.int64(n), np.int32(act), np.float32(op["scale"]), np.int32(mul != 1), np.float32(mul))
    grid = grid1d(n)
    return [lambda: kern(grid, (256,), args)]
