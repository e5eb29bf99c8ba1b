"""CUDA mhc_weights: the contract of runtime/ops/mhc_weights.py (mhc_weights.cu; one block per row)."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu


def launches(op, bufs, rows: int, w) -> list:
    z, x, pre, post, comb = (bufs[op[k]] for k in ("z", "x", "pre", "post", "comb"))
    n = int(op["n"])
    if n * n > 32:
        raise DeviceUnavailable(f"mhc_weights n {n}: the CUDA kernel holds the n x n mix in one warp (n <= 5); "
                                f"use --device cpu")
    N = int(x.shape[-1])
    if z.shape[-1] != (2 + n) * n or N % n or pre.shape[-1] != n or post.shape[-1] != n or comb.shape[-1] != n * n \
            or not z.shape[0] == x.shape[0] == pre.shape[0] == post.shape[0] == comb.shape[0] >= rows:
        raise PlanMismatch(f"mhc_weights {op['z']}: n {n} against z {z.shape}, x {x.shape}, pre {pre.shape}, "
                           f"post {post.shape}, comb {comb.shape}")
    base, scale = w.vector(op["base"]), w.vector(op["scale"])
    if base.size != (2 + n) * n or scale.size != 3:
        raise PlanMismatch(f"mhc_weights {op['base']}, {op['scale']}: {base.size} and {scale.size} values, "
                           f"{(2 + n) * n} and 3 expected")
    kern = cu.kernel("mhc_weights", "mhc_weights_k")
    T = 256 if N >= 2048 else max(32, min(256, -(-N // 32) * 32))
    args = (z, x, base, scale, pre, post, comb, np.int32(n), np.int32(N // n), np.int32(op["iters"]),
            np.float32(op["hc_eps"]), np.float32(op["eps"]))
    return [lambda: kern((rows,), (T,), args)]
