"""CUDA decode attention split over the context: the contract of runtime/ops/attention.py without
`select` (attention_decode.cu), for decode programs: float32 FMAs over the decoded cache
(attention_decode_k, every cache type), or, for 16-bit caches, the tensor cores over the stored
values with the query and the probabilities split into 16-bit parts (attention_decode_tc). The cache
write stays the executor's kv_write_k (or the fused rope kernel); this is the attend step only.

    step = attention_decode.bind(q, ck, cv, pos, slot, out, rows, H, KV, D, scale, pool)
    step()          # one launch on the current stream: capturable, no allocation, no host sync

`pool(key, shape, dtype)` gives scratch shared by the executor's ops (the split partials and the
merge counters, which every launch leaves at zero)."""

from __future__ import annotations

import numpy as np

from . import cu
from . import pdl as PDL

MAX_G = 16                                  # query heads a kv head (4 warps x 4 heads)


def supports(H: int, KV: int, D: int) -> str | None:
    """None when the kernel takes this head shape, else why not."""
    if H % KV or H // KV > MAX_G:
        return f"heads {H} over kv_heads {KV}: at most {MAX_G} query heads a kv head"
    if D % 4 or D > 256:
        return f"head_dim {D}: a multiple of 4, at most 256"
    return None


TC_MAX_G = 8                                # the tensor-core form: query heads a kv head (the mma's 8 rows)
TC_STAGES = 2                               # its chunks of 16 keys in flight a warp (tools/bench_attention.py)


def tc_supports(H: int, KV: int, D: int, cache=(0, 0)) -> str | None:
    """None when the tensor-core form (attention_decode_tc) takes this head shape and cache, else why not."""
    if any(c not in (1, 2) for c in cache):
        return "a float32 cache (the tensor cores take the 16-bit caches: bf16, f16)"
    if H % KV or H // KV > TC_MAX_G:
        return f"heads {H} over kv_heads {KV}: at most {TC_MAX_G} query heads a kv head"
    if D % 16 or D > 128:
        return f"head_dim {D}: a multiple of 16, at most 128"
    return None


def tc_smem_bytes(D: int, cache, stages: int = TC_STAGES) -> int:
    """The query's parts (bf16 keys: 3 parts in 2 A tiles, f16: 2 in 1) and each warp's key / value stages."""
    rs = D + 8
    aq = 2 if cache[0] == 1 else 1
    return 2 * (aq * 16 * rs + 4 * stages * 2 * 16 * rs)


WAVES = 2        # CTAs a multiprocessor the splits aim at (tools/bench_attention.py --waves compares)


def splits(KV: int, rows: int, ctx: int, sms: int = 132, waves: int | None = None, tc: bool = False) -> int:
    """Context splits of a launch, each at least 64 keys of the longest context: the FMA form (or any
    given `waves`) enough CTAs for `waves` (default WAVES) CTAs on each of `sms` multiprocessors; the
    tensor-core form at most one CTA a multiprocessor (no split once kv heads x rows fill them: its
    merge costs more than the CTAs gain. tools/bench_attention.py --rows 1 2 4 8 16 --waves 1 2
    --splits 1, H100, 2026-12-07: at 16 rows and 1,024 keys 29.9 us against 40.8 at WAVES, at 4,096
    keys 97.9 against 114.2; at 1 row and 4,096 keys 21.4 against 26.9; never slower)."""
    if tc and waves is None:
        return int(max(1, min(sms // (KV * rows), -(-ctx // 64))))
    return int(max(1, min(-(-(waves or WAVES) * sms // (KV * rows)), -(-ctx // 64))))


def k_stride(D: int) -> int:
    """The shared K tile's row stride in floats (attention_decode.cu DP): 16-byte rows, DP / 4 odd."""
    return D + (8 if (D // 4) % 2 else 4)


def smem_bytes(G: int, D: int) -> int:
    return 4 * (G * D + 32 * k_stride(D) + 32 * D + G * 32)


def kernel_name(G: int, D: int, cache=(0, 0), warps: int = 4, pv_unroll: int = 0) -> str:
    """cache: the KV cache's type codes (ops.CACHE_CODE) of the keys and the values; warps: a CTA's (4 or 8;
    a warp's query heads: every warps-th); pv_unroll: the P.V loop over a tile's keys unrolled by this many
    (0: as the compiler chooses). The template arguments at their defaults are left out, as C++ names it."""
    if warps not in (4, 8):
        raise ValueError(f"attention_decode: {warps} warps a CTA (4 or 8)")
    hpw = -(-G // warps)
    targs = [-(-D // 32), 4 if hpw == 3 else hpw, *cache, warps, pv_unroll]
    while len(targs) > 2 and targs[-1] == (0, 0, 0, 0, 4, 0)[len(targs) - 1]:   # CK, CV, NW, PVU defaults
        targs.pop()
    return f"attention_decode_k<{', '.join(map(str, targs))}>"


def bind(q, ck, cv, pos, slot, out, rows: int, H: int, KV: int, D: int, scale: float, pool, sms: int = 132,
         split_rows: int | None = None, cache=(0, 0), waves: int | None = None, pdl: bool = False,
         tc: bool | None = None, stages: int = TC_STAGES, warps: int = 4, pv_unroll: int = 0, prefetch=None):
    """split_rows: the row count the context splits are chosen for (default rows; the verify program
    passes 1, so each row is split, summed and merged as a one-row decode step does it); cache: the KV
    cache's type codes (ops.CACHE_CODE) of the keys and the values; waves: splits' (default WAVES);
    pdl: launched with programmatic dependent launch (runtime/cuda/pdl.py); tc: the tensor-core form
    (None: wherever tc_supports allows it; True: it or an error; False: the float32 FMA form);
    stages: the tensor-core form's chunks in flight a warp; warps, pv_unroll: the FMA form's (kernel_name);
    prefetch: a device array (the next linear's weights) the launch brings into the L2 meanwhile."""
    why = supports(H, KV, D)
    if why:
        raise ValueError(f"attention_decode: {why}")
    tc_why = tc_supports(H, KV, D, cache)
    if tc and tc_why:
        raise ValueError(f"attention_decode (tensor cores): {tc_why}")
    use_tc = tc_why is None if tc is None else bool(tc)
    ctx = int(ck.shape[1])
    G, S = H // KV, splits(KV, split_rows or rows, ctx, sms, waves, use_tc)
    if use_tc:
        kern = cu.kernel("attention_decode", f"attention_decode_tc<{D}, {stages}, {cache[0]}, {cache[1]}>")
        smem, threads = tc_smem_bytes(D, cache, stages), 128
    else:
        kern = cu.kernel("attention_decode", kernel_name(G, D, cache, warps, pv_unroll))
        smem, threads = smem_bytes(G, D), 32 * warps
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    part = pool("attention_decode.part", (rows * H * S * (D + 2) if S > 1 else 1,))   # S == 1: unused
    sem = pool("attention_decode.sem", (rows * KV,), np.int32)
    pf = cu.prefetch_args([] if prefetch is None else [prefetch], 1, q)
    if use_tc:
        args = (q, ck, cv, pos, slot, out, part, sem, np.int32(H), np.int32(KV), np.int32(ctx), np.float32(scale), *pf)
    else:
        args = (q, ck, cv, pos, slot, out, part, sem, np.int32(H), np.int32(KV), np.int32(D), np.int32(ctx),
                np.float32(scale), *pf)
    go = PDL.launcher(pdl)
    return lambda: go(kern, (KV, rows, S), (threads,), args, shared_mem=smem)
