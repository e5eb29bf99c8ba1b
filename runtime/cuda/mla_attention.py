"""CUDA mla_attention: the contract of runtime/ops/mla_attention.py (kernels: mla_attention.cu), absorbed:
the latent cache write, q absorbed into the latent space by W_uk, attention over the latent (the
selection, or the causal prefix), W_uv applied to the attended latent.

    steps = mla_attention.launches(op, bufs, rows, w, scratch=pool)   # scratch(key, shape): shared arrays

kv_b is read as float32 (the stored weight decoded once by w.vector, times its pre_quant_scale
where stored: NumPy's values): H * (dn + dv) * r * 4 bytes on the device per layer. Scratch: the
absorbed queries and the attended latents, [rows, heads, r] float32 each.
"""

from __future__ import annotations

import weakref

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu

STEM = "mla_attention"
RPL = (1, 2, 4, 8, 16)                   # mla_attend_k instances: latent values per lane (r <= 32 * RPL)
TILE, ROW_BLOCK = 32, 8                  # mla_attention.cu TILE, ROW_BLOCK
_KV_B: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # DeviceWeights -> {name: kv_b float32}


def kv_b(w, name: str, rank_r: int):
    """kv_b as float32 on the device (flat), its pre_quant_scale [r] applied (as the NumPy op: wb * pq)."""
    cache = _KV_B.setdefault(w, {})
    if name not in cache:
        wb = w.vector(name)
        pq = w.pre_quant(name)
        if pq is not None:
            wb = (wb.reshape(-1, rank_r) * pq.reshape(1, -1).astype(cp.float32)).reshape(-1)
            cp.cuda.Device().synchronize()
        cache[name] = wb
    return cache[name]


def launches(op, bufs, rows: int, w, scratch=None) -> list:
    H, dn, dv = int(op["heads"]), int(op["nope_dim"]), int(op["v_dim"])
    q, c, pos, slot = bufs[op["q"]], bufs[op["c"]], bufs[op["pos"]], bufs[op["slot"]]
    cache, out = bufs[op["cache"]], bufs[op["out"]]
    R = int(c.shape[-1])
    for n, a, width in (("q", q, H * dn), ("c", c, R), ("out", out, H * dv)):
        if a.ndim != 2 or a.shape[-1] != width or a.shape[0] < rows:
            raise PlanMismatch(f"mla_attention {op[n]}: {tuple(a.shape)}, [rows, {width}] expected")
    if cache.ndim != 3 or cache.shape[-1] != R:
        raise PlanMismatch(f"mla_attention {op['cache']}: {tuple(cache.shape)}, [slots, ctx, {R}] expected")
    sel = bufs[op["sel"]] if "sel" in op else None
    if sel is not None and (sel.ndim != 2 or sel.shape[0] < rows or sel.dtype != np.int32):
        raise PlanMismatch(f"mla_attention {op['sel']}: {tuple(sel.shape)} {sel.dtype}, [rows, W] int32 expected")
    rpl = next((v for v in RPL if 32 * v >= R), None)
    if rpl is None:
        raise DeviceUnavailable(f"mla_attention kv_lora_rank {R}: the CUDA kernel takes at most {32 * RPL[-1]}; "
                                f"use --device cpu")
    wkv = kv_b(w, op["kv_b"], R)
    if wkv.size != H * (dn + dv) * R:
        raise PlanMismatch(f"mla_attention {op['kv_b']}: {wkv.size} values, heads {H} x (nope {dn} + v {dv}) x "
                           f"rank {R} expected")
    hg = next(g for g in (8, 4, 2, 1) if H % g == 0)
    smem_att = 4 * (TILE * (R + 1) + hg * R + TILE)
    smem_abs, smem_out = 4 * ROW_BLOCK * dn, 4 * ROW_BLOCK * R
    if max(smem_att, smem_abs, smem_out) > 227 * 1024:
        raise DeviceUnavailable(f"mla_attention rank {R}, nope {dn}: the tiles do not fit in shared memory")
    ka, kt, ko = cu.kernel(STEM, "mla_absorb_k"), cu.kernel(STEM, f"mla_attend_k<{rpl}>"), cu.kernel(STEM, "mla_out_k")
    for k_, n_ in ((ka, smem_abs), (kt, smem_att), (ko, smem_out)):   # one kernel object serves every op: never lower it
        if n_ > 48 * 1024 and k_.max_dynamic_shared_size_bytes < n_:
            k_.max_dynamic_shared_size_bytes = n_
    kw = cu.kernel(STEM, "mla_write_k")
    new = scratch or (lambda key, shape: cp.zeros(shape, cp.float32))
    qa, ctxb = new("mla_attention.qa", (rows, H, R)), new("mla_attention.ctx", (rows, H, R))
    nslots, ctx = int(cache.shape[0]), int(cache.shape[1])
    i32 = np.int32
    W = int(sel.shape[-1]) if sel is not None else 0
    selb = sel if sel is not None else pos                      # not read without sel
    wargs = (c, pos, slot, cache, i32(nslots), i32(ctx), i32(R))
    aargs = (q, wkv, pos, qa, i32(rows), i32(H), i32(dn), i32(dv), i32(R))
    targs = (qa, cache, pos, slot, selb, ctxb, i32(nslots), i32(ctx), i32(H), i32(R), i32(W), i32(sel is not None),
             np.float32(op["scale"]))
    oargs = (ctxb, wkv, pos, out, i32(rows), i32(H), i32(dn), i32(dv), i32(R))
    rb = -(-rows // ROW_BLOCK)
    return [lambda: kw((rows,), (128,), wargs),
            lambda: ka((-(-R // 128), H, rb), (128,), aargs, shared_mem=smem_abs),
            lambda: kt((H // hg, rows), (32 * hg,), targs, shared_mem=smem_att),
            lambda: ko((H, rb), (256,), oargs, shared_mem=smem_out)]
