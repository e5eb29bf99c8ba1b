"""CUDA dsa_index: the contract of runtime/ops/dsa_index.py (kernels: dsa_index.cu): the cache write,
the pooled keys of every complete pool of each slot, the pool scores of every row, the fixed-size
top-k (radix select, ties to the lower pool) with the tail, -1 padded.

    steps = dsa_index.launches(op, bufs, rows, w, scratch=pool)    # scratch(key, shape): shared arrays

Scratch: pooled keys [slots, ctx // kpool, head_dim] and scores [rows, ctx // kpool], float32.
"""

from __future__ import annotations

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu

STEM = "dsa_index"
POOL_BLOCKS = 256                        # dsa_pool_k: blocks per slot (striding over 8 pools at a time)
SCORE_THREADS, TOPK_THREADS = 256, 512   # dsa_index.cu SCORE_THREADS, TOPK_THREADS


def launches(op, bufs, rows: int, w, scratch=None) -> list:
    Hi, Di, kpool, topk = (int(op[k]) for k in ("heads", "head_dim", "kpool", "topk"))
    q, k, gs, hw = (bufs[op[n]] for n in ("q", "k", "gs", "hw"))
    pos, slot, cache, sel = bufs[op["pos"]], bufs[op["slot"]], bufs[op["cache"]], bufs[op["sel"]]
    W = topk + kpool - 1
    for n, a, width in (("q", q, Hi * Di), ("k", k, Di), ("gs", gs, Di), ("hw", hw, Hi), ("sel", sel, W)):
        if a.ndim != 2 or a.shape[-1] != width or a.shape[0] < rows:
            raise PlanMismatch(f"dsa_index {op[n]}: {tuple(a.shape)}, [rows, {width}] expected")
    if sel.dtype != np.int32:
        raise PlanMismatch(f"dsa_index {op['sel']}: {sel.dtype}, int32 expected")
    if cache.ndim != 3 or cache.shape[-1] != 2 * Di:
        raise PlanMismatch(f"dsa_index {op['cache']}: {tuple(cache.shape)}, [slots, ctx, 2*head_dim = {2 * Di}] expected")
    ape = w.vector(op["ape"])
    if ape.size != kpool * Di:
        raise PlanMismatch(f"dsa_index {op['ape']}: {ape.size} values, kpool {kpool} x head_dim {Di} expected")
    if Di % 4 or kpool < 1:
        raise DeviceUnavailable(f"dsa_index head_dim {Di}, kpool {kpool}: the CUDA kernels need head_dim % 4 == 0; "
                                f"use --device cpu")
    nslots, ctx = int(cache.shape[0]), int(cache.shape[1])
    NP = max(1, ctx // kpool)
    new = scratch or (lambda key, shape: cp.zeros(shape, cp.float32))
    pk, scores = new("dsa_index.pk", (nslots, NP, Di)), new("dsa_index.scores", (rows, NP))
    kw, kp, ks, kt = (cu.kernel(STEM, n) for n in ("dsa_write_k", "dsa_pool_k", "dsa_score_k", "dsa_topk_k"))
    smem = 4 * (Hi * Di + Hi)
    if smem > 227 * 1024:
        raise DeviceUnavailable(f"dsa_index heads {Hi} x head_dim {Di}: the query does not fit in shared memory")
    if smem > 48 * 1024 and ks.max_dynamic_shared_size_bytes < smem:   # one kernel object serves every op: never lower it
        ks.max_dynamic_shared_size_bytes = smem
    i32 = np.int32
    wargs = (k, gs, pos, slot, cache, i32(nslots), i32(ctx), i32(Di))
    pargs = (cache, pos, slot, ape, pk, i32(rows), i32(nslots), i32(ctx), i32(Di), i32(kpool), i32(NP))
    sargs = (q, hw, pos, slot, pk, scores, i32(nslots), i32(ctx), i32(Hi), i32(Di), i32(kpool), i32(NP),
             np.float32(Hi ** -0.5), np.float32(Di ** -0.5))
    targs = (scores, pos, slot, sel, i32(nslots), i32(ctx), i32(NP), i32(kpool), i32(topk // kpool), i32(W),
             i32(bool(op["tail"])))
    pgrid = (min(POOL_BLOCKS, -(-NP // 8)), nslots)
    sgrid = (-(-NP // SCORE_THREADS), rows)
    return [lambda: kw((rows,), (128,), wargs),
            lambda: kp(pgrid, (256,), pargs),
            lambda: ks(sgrid, (SCORE_THREADS,), sargs, shared_mem=smem),
            lambda: kt((rows,), (TOPK_THREADS,), targs)]
