"""CUDA prompt-chunk attention on the tensor cores: the contract of runtime/ops/attention.py without
`select` for prefill programs (attention_chunk.cu), beside the CUDA-core chunk kernel it replaces where it
applies (ops_src.py attn_chunk_k, lever BLOOMERY_CHUNK_ATTENTION=fma). The cache write stays the
executor's; this is the attend step only.

    step = attention_chunk.bind(q, ck, cv, pos, slot, out, rows, H, KV, D, scale, cache=(0, 0))
    step()          # one launch on the current stream: capturable, no allocation, no host sync

Precision: every float32 operand in two bf16 parts, the products above 2^-16 kept (the .cu file's head);
tests/test_cuda_attention_chunk.py bounds the result against float64."""

from __future__ import annotations

import numpy as np

from . import cu

BM = 64                 # query vectors a CTA (4 warps x 16)
BN = 32                 # keys a staged tile (tools/bench_attention.py --chunk compares 32 / 64)
PF = 0                  # 1: the next tile's raw words loaded while this one is computed (docs/kernels.md)


def supports(H: int, KV: int, D: int) -> str | None:
    """None when the kernel takes this head shape, else why not."""
    if H % KV or H // KV > BM:
        return f"heads {H} over kv_heads {KV}: at most {BM} query heads a kv head"
    if D % 16 or D > 128:
        return f"head_dim {D}: a multiple of 16, at most 128"
    return None


def rows_per_cta(H: int, KV: int) -> int:
    return BM // (H // KV)


def smem_bytes(D: int, cache=(0, 0), bn: int = BN) -> int:
    """The query's two parts [2][BM][D + 8], the tile's key and value parts (one part for a bf16 cache), 16-bit."""
    nk, nv = (1 if cache[0] == 1 else 2), (1 if cache[1] == 1 else 2)
    return 2 * (D + 8) * (2 * BM + (nk + nv) * bn)


def kernel_name(D: int, cache=(0, 0), bn: int = BN, pf: int = PF) -> str:
    return f"attention_chunk_tc<{D}, {bn}, {pf}, {cache[0]}, {cache[1]}>"


def bind(q, ck, cv, pos, slot, out, rows: int, H: int, KV: int, D: int, scale: float, cache=(0, 0),
         bn: int = BN, pf: int = PF):
    """cache: the KV cache's type codes (ops.CACHE_CODE) of the keys and the values; bn, pf: the tile's
    keys and the register prefetch (tools/bench_attention.py --chunk times the choices)."""
    why = supports(H, KV, D)
    if why:
        raise ValueError(f"attention_chunk: {why}")
    kern = cu.kernel("attention_chunk", kernel_name(D, cache, bn, pf))
    smem = smem_bytes(D, cache, bn)
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    rb = rows_per_cta(H, KV)
    ctx = int(ck.shape[1])
    args = (q, ck, cv, pos, slot, out, np.int32(rows), np.int32(H), np.int32(KV), np.int32(ctx), np.float32(scale))
    grid = (KV, -(-rows // rb))
    return lambda: kern(grid, (128,), args, shared_mem=smem)


def fma_kernel(H: int, KV: int, D: int, select: bool = False, cache=(0, 0)):
    """(kernel, rows per CTA, shared bytes) of the CUDA-core chunk kernel (ops_src.py attn_chunk_k;
    attn_chunk_sel_k with `select`) for this head shape, or None (the per-row kernel then serves prompt
    chunks); launched (KV, ceil(rows / rows per CTA)) x 256 threads with the executor's arguments."""
    from . import ops as K
    G = H // KV
    qpt = 2 if D <= 128 and G <= 64 else 1 if D <= 256 and G <= 32 else 0
    if not qpt:
        return None
    qn = 32 * qpt
    dpl = next(d for d in (1, 2, 4, 8) if 32 * d >= D)
    smem = 4 * (qn * (D + 1) + 32 * (D + 1) + 32 * D + qn * 33 + (qn if select else 0))   # + the tile masks
    kern = K.cache_kernel("attn_chunk_sel_k" if select else "attn_chunk_k", (dpl, qpt), cache)
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    return kern, qn // G, smem


def bind_fma(q, ck, cv, pos, slot, out, rows: int, H: int, KV: int, D: int, scale: float, cache=(0, 0)):
    """The CUDA-core chunk kernel as one step (no `select`), for comparisons (tests, tools/bench_attention.py)."""
    kern, rb, smem = fma_kernel(H, KV, D, cache=cache)
    args = (q, ck, cv, pos, slot, out, np.int32(rows), np.int32(H), np.int32(KV), np.int32(D),
            np.int32(int(ck.shape[1])), np.float32(scale))
    return lambda: kern((KV, -(-rows // rb)), (256,), args, shared_mem=smem)
