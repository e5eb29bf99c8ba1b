"""CUDA ple_gate: the contract of runtime/ops/ple_gate.py (ple_gate.cu: one block per (stream, row))."""

from __future__ import annotations

import numpy as np

from ..errors import PlanMismatch
from . import cu


def launches(op, bufs, rows: int, w) -> list:
    kn, qn, v, out = bufs[op["kn"]], bufs[op["qn"]], bufs[op["v"]], bufs[op["out"]]
    n, D = int(op["n"]), int(v.shape[-1])
    want = (v.shape[0], n * D)
    if v.ndim != 2 or kn.shape != want or qn.shape != want or out.shape != want:
        raise PlanMismatch(f"ple_gate {op['out']}: kn {kn.shape}, qn {qn.shape}, v {v.shape}, out {out.shape}, n {n} "
                           f"(kn, qn, out [rows, n*D], v [rows, D] expected)")
    kern = cu.kernel("ple_gate", "ple_gate_k")
    T = 256 if D >= 256 else max(32, -(-D // 32) * 32)
    args = (kn, qn, v, out, np.int32(n), np.int32(D), np.float32(np.sqrt(D)))
    return [lambda: kern((n, rows), (T,), args)]
