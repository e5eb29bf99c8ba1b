"""The routed experts of a prompt chunk as grouped GEMMs on the tensor cores (moe_gemm.cu): the CUDA side of
runtime/ops' moe_experts for prefill programs, beside the per-pair expert GEMV (gemv.Linear.launch_experts)
that decode steps and the other formats use (lever BLOOMERY_MOE_GEMM=gemv: that one everywhere).

    r = moe_gemm.Route(pairs, experts)              # the sort's scratch, fixed at bind time
    steps = [r.bind(ids),                           # the pairs grouped by expert, on the device
             moe_gemm.bind(lin, x, y, r, xdiv)]      # y[p] = W[ids[p]] x[p // xdiv] for every pair p
    for s in steps: s()                             # launches on the current stream: capturable, no host sync

The sort (moe_route_k) runs once per op and serves the gate, up and down matrices. Row tiles hold bm pairs
of one expert (BM 64; 128 selectable). The grid is sized for the worst case (ceil(pairs / bm) + min(experts,
pairs) row tiles; a tile beyond the real ones exits), so the captured graph holds for every routing.

Precision: GGML NVFP4 and FP8 (per-tensor) weights exact in bf16, activations in two bf16 parts (parts=2, the bf16x2 prefill:
16 significant bits) or one (parts=1, the bf16 lever), float32 accumulation;
tests/test_cuda_moe_gemm.py bounds the result against float64."""

from __future__ import annotations

import numpy as np

from . import cu

BN = 128                              # outputs a CTA (moe_gemm.cu)
BMS = (64, 128)                       # pairs a row tile (32 WM: the kernel's WM 2, 4)
# 64: 128 (twice the rows a decoded weight tile serves, 256 threads) was slower on Qwen3-30B-A3B's experts in
# bf16x2 at 512 and 4,096 tokens and within 2% in bf16 (2026-12-03, H200, tools/bench_moe_gemm.py;
# docs/kernels.md); it stays selectable (Route(bm=128))
BM = 64
KINDS = {"nvfp4_ggml": 0, "fp8_tensor": 1}    # the weight layouts the grouped kernel decodes (its FMT codes)


def supports(lin) -> str | None:
    """None where moe_gemm takes this stacked matrix, else why not."""
    if not lin.experts:
        return "not a stacked expert matrix"
    if lin.kind not in KINDS:
        return f"{lin.kind} experts: the grouped GEMM decodes {', '.join(KINDS)} (the per-pair GEMV serves the rest)"
    if lin.inn % 64:
        return f"in {lin.inn}: a multiple of 64"
    return None


def tiles(pairs: int, experts: int, bm: int) -> int:
    """The row tiles of the grid: every expert's last tile may be partial."""
    return -(-pairs // bm) + min(experts, pairs)


class Route:
    """The pairs of one moe_experts op grouped by expert (perm) and the tile table, device int32 arrays."""

    def __init__(self, pairs: int, experts: int, alloc=None, bm: int = BM):
        """alloc(name, shape): the int32 device arrays (default: fresh zeros); every element is written by bind's
        step before any kernel reads it, so a shared scratch serves."""
        import cupy as cp
        mk = alloc or (lambda name, shape: cp.zeros(shape, np.int32))
        self.bm = int(bm)
        if self.bm not in BMS:
            raise ValueError(f"moe_gemm: bm {self.bm}: one of {BMS}")
        self.pairs, self.experts, self.ntiles = int(pairs), int(experts), tiles(pairs, experts, self.bm)
        self.perm = mk("perm", (self.pairs,))
        self.tile = mk("tile", (3, self.ntiles))            # expert, first sorted position, expert's end

    def bind(self, ids):
        """The sort of ids (int32 [pairs], the router's) as one step."""
        kern = cu.kernel("moe_gemm", "moe_route_k")
        i32 = np.int32
        args = (ids, i32(self.pairs), i32(self.experts), i32(self.bm), i32(self.ntiles), self.perm,
                self.tile[0], self.tile[1], self.tile[2])
        smem = 4 * 3 * (self.experts + 1)
        return lambda: kern((1,), (1024,), args, shared_mem=smem)


STAGES = 2                            # shared-memory stages of the main loop (moe_gemm.cu ST: 1 or 2)


def kernel_name(kind: str, parts: int, bm: int, stages: int = STAGES) -> str:
    return f"moe_gemm_k<{KINDS[kind]}, {int(parts)}, {bm // 32}, {int(stages)}>"


def smem_bytes(parts: int, bm: int, stages: int = STAGES) -> int:
    """A CTA's shared memory: per stage the activations' parts [parts][bm][64] and the weight tile [128][64], bf16."""
    return stages * (parts * bm + BN) * 64 * 2


def split(x, xs):
    """x (float32 [nx, in]) into its bf16 parts xs (uint16 [parts, nx, in]: hi, lo) as one step: gemm_src.py's
    x_to_bf16_k (the dense prompt GEMM's split), what bind's kernel reads."""
    from . import gemm as M
    kern = M.kernels()["x_to_bf16_k"]
    n = int(x.size)
    if xs.shape[1:] != x.shape or xs.shape[0] not in (1, 2):
        raise ValueError(f"moe_gemm.split: parts {tuple(xs.shape)} for x {tuple(x.shape)}")
    lo = xs[1] if xs.shape[0] == 2 else np.uint64(0)
    args, grid = (x, xs[0], lo, np.int64(n)), M._grid(n)
    return lambda: kern(grid, (256,), args)


def bind(lin, x, y, route: Route, xdiv: int, parts: int = 2, stages: int = STAGES):
    """y[p] = W[ids[p]] x[p // xdiv] (float32 [pairs, out]) as one step, reading route's sort (bind it first, in
    the same program). x: the activations' bf16 parts (uint16 [parts, pairs // xdiv, in], split's output)."""
    why = supports(lin)
    if why:
        raise ValueError(f"moe_gemm: {why}")
    if parts not in (1, 2):
        raise ValueError(f"moe_gemm: parts {parts}: 1 (bf16) or 2 (bf16x2)")
    if x.dtype != np.uint16 or x.ndim != 3 or x.shape[0] != parts:
        raise ValueError(f"moe_gemm: activations {x.dtype} {tuple(x.shape)}: their bf16 parts (moe_gemm.split), "
                         f"uint16 [{parts}, rows, in] expected")
    if stages not in (1, 2):
        raise ValueError(f"moe_gemm: stages {stages}: 1 or 2")
    kern = cu.kernel("moe_gemm", kernel_name(lin.kind, parts, route.bm, stages))
    smem = smem_bytes(parts, route.bm, stages)
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    i32, i64 = np.int32, np.int64
    wst = int(lin.w.nbytes) // lin.experts                 # bytes an expert
    args = (lin.w, lin.sc, i64(wst), i64(lin.scst), x, i64(x.shape[-2]), i32(xdiv), y, i32(lin.out), i32(lin.inn),
            route.perm, route.tile[0], route.tile[1], route.tile[2])
    grid = (-(-lin.out // BN), route.ntiles)
    return lambda: kern(grid, (2 * route.bm,), args, shared_mem=smem)
