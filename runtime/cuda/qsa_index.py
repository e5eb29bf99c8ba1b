"""CUDA qsa_index: the contract of runtime/ops/qsa_index.py (kernels: qsa_index.cu).

    steps = qsa_index.launches(op, bufs, rows, w, scratch=pool)   # w: DeviceWeights; pool(key, shape)

Four launches: the keys into the cache, the block keys of every slot with rows (recomputed from the raw
keys on every call: the plan keeps only the raw cache, so a rewound or reset slot needs nothing else),
the scores of every (row, complete block), and a fixed-size top-k per row. The scratch arrays
(block keys [slots, ctx / ratio, head_dim], scores [rows, ctx / ratio]) come from `scratch` (shared
by the executor's ops: each call fills them before it reads them).

Cost: a call reads each active slot's raw keys up to its last position (head_dim floats a position,
once per slot, not per row) and scores every complete block of every row: O(context) a step, as
full attention, at head_dim floats a position (the attention's cache holds 2 * kv_heads * its
head_dim). Persistent pooled keys (a plan state [slots, ctx / ratio, head_dim] filled as blocks
complete) would cut the first term by `ratio`; the plan has no such state today.
"""

from __future__ import annotations

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from ..errors import DeviceUnavailable, PlanMismatch
from ..ops.rope import inv_freq
from . import cu

STEM = "qsa_index"
SMEM_MAX = 227 * 1024


def launches(op, bufs, rows: int, w, scratch=None) -> list:
    H, Di, R, budget = (int(op[k]) for k in ("heads", "head_dim", "ratio", "budget"))
    RD = int(op.get("rotary_dim") or Di)
    q, k, pos, slot, cache, sel = (bufs[op[n]] for n in ("q", "k", "pos", "slot", "cache", "sel"))
    W = budget + R - 1
    if q.shape != (rows, H * Di) or k.shape != (rows, Di) or cache.ndim != 3 or cache.shape[2] != Di \
            or sel.shape != (rows, W) or sel.dtype != np.int32:
        raise PlanMismatch(f"qsa_index {op['cache']}: heads {H}, head_dim {Di}, ratio {R}, budget {budget} against "
                           f"q {q.shape}, k {k.shape}, cache {cache.shape}, sel {sel.shape} {sel.dtype} "
                           f"(q [rows, heads*head_dim], k [rows, head_dim], cache [slots, ctx, head_dim], "
                           f"sel i32 [rows, budget + ratio - 1] expected)")
    if R < 1 or RD % 2 or RD > Di:
        raise PlanMismatch(f"qsa_index {op['cache']}: ratio {R}, rotary_dim {RD} with head_dim {Di} "
                           f"(ratio >= 1, an even rotary_dim <= head_dim expected)")
    if Di % 4 or Di > 256 or 4 * H * Di > SMEM_MAX:
        raise DeviceUnavailable(f"qsa_index heads {H}, head_dim {Di}: the CUDA kernels need head_dim % 4 == 0, "
                                f"<= 256 and heads * head_dim floats in shared memory; use --device cpu")
    wk = w.vector(op["k_norm"], float(op["offset"] or 0.0))        # offset + k_norm, summed as NumPy does
    if wk.size != Di:
        raise PlanMismatch(f"qsa_index {op['k_norm']}: {wk.size} values, head_dim {Di} expected")
    nslots, ctx = int(cache.shape[0]), int(cache.shape[1])
    nbmax = ctx // R
    new = scratch or (lambda key, shape: cp.zeros(shape, cp.float32))
    kb = new("qsa_index.kb", (nslots, max(1, nbmax), Di))
    sc = new("qsa_index.scores", (rows, max(1, nbmax)))
    invf = cp.asarray(inv_freq(float(op["theta"]), RD) if RD else np.zeros(1, np.float32))
    i32 = np.int32
    dpl = next(d for d in (1, 2, 4, 8) if 32 * d >= Di)
    kw, kp = cu.kernel(STEM, "qsa_write_k"), cu.kernel(STEM, f"qsa_pool_k<{dpl}>")
    ks, kt = cu.kernel(STEM, "qsa_score_k"), cu.kernel(STEM, "qsa_select_k")
    ssm = 4 * H * Di
    if ssm > 48 * 1024 and ks.max_dynamic_shared_size_bytes < ssm:    # one kernel object: never lower it
        ks.max_dynamic_shared_size_bytes = ssm
    wargs = (k, pos, slot, cache, i32(Di), i32(ctx), i32(nslots))
    pargs = (cache, pos, slot, wk, invf, kb, i32(rows), i32(nslots), i32(ctx), i32(Di), i32(R), i32(RD),
             np.float32(op["eps"]))
    sargs = (q, kb, pos, slot, sc, i32(nslots), i32(ctx), i32(H), i32(Di), i32(R), np.float32(np.sqrt(Di)))
    targs = (sc, pos, slot, sel, i32(nslots), i32(ctx), i32(R), i32(budget // R), i32(W))
    pgrid = (max(1, min(512, -(-nbmax // 8))), nslots)
    sgrid = (max(1, min(256, -(-nbmax // 256))), rows)
    return [lambda: kw((rows,), (128,), wargs),
            lambda: kp(pgrid, (256,), pargs, shared_mem=4 * 8 * Di),
            lambda: ks(sgrid, (256,), sargs, shared_mem=ssm),
            lambda: kt((rows,), (256,), targs)]
