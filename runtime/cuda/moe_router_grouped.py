"""CUDA moe_router_grouped: the choice of runtime/ops/moe_router_grouped.py (moe_router_grouped.cu),
after the router's GEMV (the executor's, float32: `exact`). One warp per row."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu


def launches(op, logits, bias, ids, wts, rows: int) -> list:
    E = int(logits.shape[-1])
    k, ng, kg = int(op["top_k"]), int(op["n_group"]), int(op["topk_group"])
    if bias.size != E or ids.shape[-1] != k or wts.shape[-1] != k:
        raise PlanMismatch(f"moe_router_grouped {op['bias']}: {bias.size} bias values, {E} experts, ids {ids.shape}, "
                           f"weights {wts.shape}, top_k {k}")
    if ng < 1 or E % ng or not 1 <= kg <= ng or (kg < ng and E // ng < 2) or not 1 <= k <= min(E, 128):
        raise DeviceUnavailable(f"moe_router_grouped: {E} experts, n_group {ng}, topk_group {kg}, top_k {k}: the CUDA "
                                f"kernel needs groups of >= 2 experts and top_k <= 128; use --device cpu")
    kern = cu.kernel("moe_router_grouped", "moe_router_grouped_k")
    smem = 4 * (2 * E + ng + 2 * k)
    args = (logits, bias, ids, wts, np.int32(E), np.int32(k), np.int32(ng), np.int32(kg), np.int32(bool(op["norm"])),
            np.float32(op["scale"]))
    return [lambda: kern((rows,), (32,), args, shared_mem=smem)]
