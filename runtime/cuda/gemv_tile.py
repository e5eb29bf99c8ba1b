"""Decode GEMV of GGML NVFP4 weights on the tensor cores, over a tile layout made at load time
(kernel: runtime/cuda/gemv_tile.cu; design and measurements: docs/kernels.md "The NVFP4 tile layout").

    from bloomery.runtime.cuda import gemv, gemv_tile
    lin = gemv.Linear("nvfp4", (out, in), arrays)          # GGML NVFP4 blocks, as the artifact stores them
    run = gemv_tile.bind([lin], x, [y], nb)                  # y[:nb] = W x[:nb], 1 <= nb <= 16
    run()                                                    # no allocation, no checks: graph capture
    gemv_tile.bind([q, k, v], x, [yq, yk, yv], nb, norm_weight=w, eps=1e-5)   # an RMSNorm folded in
    gemv_tile.bind([gate, up], x, [o], nb, pair=True)        # o = swiglu(gate x, up x)

The artifact is not changed: the first bind of a Linear repacks its GGML blocks on the GPU into the tile
layout (`layout(lin)`, kept beside the GGML bytes, which the prompt GEMM and the CUDA-core kernels
read). The layout, for each 64-output column c and 16-wide k-step s:

    wt[c, s, lane, j]  uint32   lane = 4 g + t; word j: the mma B fragments of n-tiles 2j and 2j + 1
                                (output 64 c + 8 nt + g; k = 16 s + 2t + {0, 1, 8, 9}) as four f16x2
                                registers o0..o3, o_k = (rotr(q, a_k) & 0x80008000) | (rotr(q, b_k) & 0x0E000E00)
    st[c, s, g, nt]    uint8    the E4M3 scale of output 64 c + 8 nt + g over k-step s

A weight's nibble s.e1e0m lands at f16 bits 15 and 11..9 (e2m1 * 2^-14, exact). `repack` and `decode`
are the layout's NumPy twins (tests/test_gemv_tile_layout.py checks them against the format's decoder on
the CPU; the GPU repack is compared with `repack` byte for byte on the device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

ROT = ((0, 0), (1, 3), (2, 12), (9, 9))   # (sign rotation a_k, magnitude rotation b_k) of register o_k
SIGN, MAG = 0x80008000, 0x0E000E00
MAX_ROWS = 16                             # activation rows a launch (two m-tiles of 8)
MAX_MEMBERS = 3


@dataclass(frozen=True)
class TileConfig:
    """W warps a CTA (one 64-output column each), a ring of P k-steps in flight a warp (a power of two, >= 4;
    768 bytes of shared memory a step), the grid aimed at `warps` warps in all (k-slices added until the
    columns reach it), at least `min_steps` k-steps a slice and at most `max_steps` (the x slice's shared
    memory: 64 bytes a step and batch row)."""
    W: int = 4
    P: int = 8
    warps: int = 2112
    min_steps: int = 8
    max_steps: int = 96

    def __post_init__(self):
        if self.P < 4 or self.P & (self.P - 1) or self.max_steps % 4:
            raise ValueError(f"TileConfig: P a power of two >= 4 and max_steps a multiple of 4, got {self}")


# -- the layout's NumPy twins ----------------------------------------------------------------------
def _ggml_nibbles(blocks: np.ndarray, out: int, inn: int) -> np.ndarray:
    """GGML NVFP4 bytes [out, in/64*36] -> nibbles uint8 [out, in] and scales uint8 [out, in/16]."""
    b = np.asarray(blocks, np.uint8).reshape(out, inn // 64, 36)
    sc = b[:, :, :4].reshape(out, inn // 16)
    d = b[:, :, 4:].reshape(out, inn // 64, 4, 8)                # [.., sub-block, byte j]
    nib = np.concatenate([d & 15, d >> 4], axis=-1)              # element j low, j + 8 high
    return nib.reshape(out, inn), sc


def repack(blocks, out: int, inn: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile layout of GGML NVFP4 blocks: (wt uint32 [ncol, nks, 32, 4], st uint8 [ncol, nks, 8, 8])."""
    if inn % 64:
        raise ValueError(f"gemv_tile: rows of {inn} values; GGML NVFP4 needs a multiple of 64")
    nib, sc = _ggml_nibbles(blocks, out, inn)
    ncol, nks = -(-out // 64), inn // 16
    pad = ncol * 64 - out
    nib = np.pad(nib, ((0, pad), (0, 0))).astype(np.uint32)
    sc = np.pad(sc, ((0, pad), (0, 0)))
    # nib[c, nt, g, s, kk]: output 64 c + 8 nt + g, k = 16 s + kk
    n5 = nib.reshape(ncol, 8, 8, nks, 16)
    wt = np.zeros((ncol, nks, 8, 4, 4), np.uint32)               # [c, s, g, t, j]
    for j in range(4):
        for o, (ra, rb) in enumerate(ROT):
            nt, reg = 2 * j + (o >> 1), o & 1
            for h in range(2):
                kk = 2 * np.arange(4) + h + 8 * reg              # per t
                v = n5[:, nt][:, :, :, kk]                       # [c, g, s, t]
                v = v.transpose(0, 2, 1, 3)                      # [c, s, g, t]
                q = ((v >> 3) & 1) << ((15 + 16 * h + ra) & 31)
                for bit in range(3):
                    q |= ((v >> bit) & 1) << ((9 + bit + 16 * h + rb) & 31)
                wt[..., j] |= q.astype(np.uint32)
    st = sc.reshape(ncol, 8, 8, nks).transpose(0, 3, 2, 1)       # [c, s, g, nt]
    return np.ascontiguousarray(wt.reshape(ncol, nks, 32, 4)), np.ascontiguousarray(st)


def _rotr(q: np.ndarray, r: int) -> np.ndarray:
    q = q.astype(np.uint64)
    return (((q >> r) | (q << (32 - r))) & 0xFFFFFFFF).astype(np.uint32) if r else q.astype(np.uint32)


def _f16_bits(h: np.ndarray) -> np.ndarray:
    return h.astype(np.uint16).view(np.float16).astype(np.float64)


def decode(wt: np.ndarray, st: np.ndarray, out: int, inn: int) -> np.ndarray:
    """The weights the kernel multiplies, from the tile layout as it extracts them (tile_b, the scales),
    float64 [out, in], without scale_2 (times 2^14 undone)."""
    import ml_dtypes
    ncol, nks = wt.shape[0], wt.shape[1]
    W = np.zeros((ncol, 8, 8, nks, 16))                          # [c, nt, g, s, kk]
    s8 = st.view(ml_dtypes.float8_e4m3fn).astype(np.float64)     # [c, s, g, nt]
    w5 = wt.reshape(ncol, nks, 8, 4, 4)                          # [c, s, g, t, j]
    for j in range(4):
        q = w5[..., j]
        for o, (ra, rb) in enumerate(ROT):
            reg = (_rotr(q, ra) & SIGN) | (_rotr(q, rb) & MAG)
            nt = 2 * j + (o >> 1)
            for h in range(2):
                v = _f16_bits((reg >> (16 * h)) & 0xFFFF) * 16384.0       # [c, s, g, t]
                kk = 2 * np.arange(4) + h + 8 * (o & 1)
                W[:, nt][:, :, :, kk] = (v * s8[:, :, :, nt][..., None]).transpose(0, 2, 1, 3)
    return W.reshape(ncol * 64, inn)[:out]


# -- the device side -------------------------------------------------------------------------------
def layout(lin):
    """(wt, st) of a GGML NVFP4 gemv.Linear on the device, repacked on the GPU at the first call and kept."""
    got = getattr(lin, "_tile", None)
    if got is not None:
        return got
    if lin.kind != "nvfp4_ggml" or lin.experts:
        raise NotImplementedError(f"gemv_tile: GGML NVFP4 matrices only, got {lin.kind} {lin.out}x{lin.inn}")
    from . import cu
    out, inn = lin.out, lin.inn
    ncol, nks = -(-out // 64), inn // 16
    wt = cp.empty(ncol * nks * 128, cp.uint32)
    st = cp.empty(ncol * nks * 64, cp.uint8)
    for name, arr in (("tile_repack_w", wt), ("tile_repack_s", st)):
        n = int(arr.size)
        cu.kernel("gemv_tile", name)((-(-n // 256),), (256,), (lin.w, arr, np.int32(out), np.int32(inn), np.int64(n)))
    lin._tile = (wt, st)
    return lin._tile


def supported(lins, pair: bool = False) -> str | None:
    """None when one tile launch takes these linears, else why not."""
    if not 1 <= len(lins) <= MAX_MEMBERS:
        return f"{len(lins)} matrices; a launch takes 1..{MAX_MEMBERS}"
    if any(L.kind != "nvfp4_ggml" or L.experts for L in lins):
        return "GGML NVFP4 matrices only (not experts)"
    if len({L.inn for L in lins}) != 1 or lins[0].inn % 64:
        return "one row width, a multiple of 64"
    if pair and (len(lins) != 2 or lins[0].out != lins[1].out):
        return "a pair is a gate and an up of one shape"
    return None


def plan(lins, pair: bool = False, cfg: TileConfig = TileConfig()):
    """(grid, k-steps a slice, CTA column cuts c1, c2): from the shapes only, never from the rows, so a
    batch row's result is the same in a launch of any number of rows."""
    W, nks = cfg.W, lins[0].inn // 16
    if pair:
        cols = [-(-(-(-lins[0].out // 64)) // (W // 2))]
    else:
        cols = [-(-(-(-L.out // 64)) // W) for L in lins]
    ctas = sum(cols)
    units = ctas * W
    ks = max(1, min(round(cfg.warps / units), max(1, nks // cfg.min_steps)))
    sl = min(-(-nks // ks), cfg.max_steps)
    sl = -(-sl // 4) * 4                 # the kernel takes four k-steps an iteration (nks is a multiple of 4)
    ks = -(-nks // sl)
    cuts = [sum(cols[:i + 1]) for i in range(MAX_MEMBERS - 1)]
    cuts = [min(c, ctas) for c in cuts]
    return (ctas, ks), sl, cuts


def need(lins, nb: int, pair: bool = False, cfg: TileConfig = TileConfig()) -> tuple[int, int]:
    """(float32 scratch, int32 counters) a launch of nb rows needs."""
    (ctas, ks), _, _ = plan(lins, pair, cfg)
    return ks * nb * ctas * cfg.W * 64 + ctas * ks * nb, ctas


def shared_bytes(nb: int, sl: int, norm: bool, cfg: TileConfig = TileConfig()) -> int:
    """Dynamic shared memory of a launch: the x slice's fragments, the norm weight's slice, the warps' rings."""
    return (1 if nb <= 8 else 2) * sl * min(nb, 8) * 64 + (sl * 64 if norm else 0) + cfg.W * cfg.P * 768


def kernel_name(nb: int, norm: bool, pair: bool, cfg: TileConfig = TileConfig()) -> str:
    return f"gemv_tile<{cfg.W}, {1 if nb <= 8 else 2}, {cfg.P}, {int(norm)}, {int(pair)}>"


_KERN: dict = {}


def kernel(nb: int, norm: bool, pair: bool, cfg: TileConfig = TileConfig()):
    name = kernel_name(nb, norm, pair, cfg)
    if name not in _KERN:
        from . import cu
        k = cu.kernel("gemv_tile", name)
        optin = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["sharedMemPerBlockOptin"]
        k.max_dynamic_shared_size_bytes = optin - k.shared_size_bytes
        _KERN[name] = k
    return _KERN[name]


def bind(lins, x, ys, nb: int, norm_weight=None, eps: float = 0.0, pair: bool = False, limit=None,
         accumulate: bool = False, part=None, sem=None, pdl: bool = False, cfg: TileConfig = TileConfig()):
    """A launch of ys[m][:nb] = W_m x'[:nb] for each member (pair: ys = [swiglu(gate, up)]), its arguments
    fixed now; part / sem: scratch of need()'s sizes (sem zero; every launch leaves it so), made here when
    not given (not inside a graph capture)."""
    from . import pdl as PDL
    lins = list(lins)
    why = supported(lins, pair)
    if why:
        raise NotImplementedError(f"gemv_tile: {why}")
    if not 1 <= nb <= MAX_ROWS:
        raise ValueError(f"gemv_tile: {nb} activation rows; a launch takes 1..{MAX_ROWS}")
    if pair and accumulate:
        raise ValueError("gemv_tile: a gate / up pair writes its SwiGLU; it does not accumulate")
    grid, sl, (c1, c2) = plan(lins, pair, cfg)
    if part is None or sem is None:
        pf, si = need(lins, nb, pair, cfg)
        part, sem = cp.empty(pf, cp.float32), cp.zeros(si, cp.int32)
    lays = [layout(L) for L in lins]
    pad = lambda v, fill: list(v) + [fill] * (MAX_MEMBERS - len(v))  # noqa: E731
    i32 = np.int32
    norm = norm_weight is not None
    if norm and (int(norm_weight.size) != lins[0].inn or norm_weight.data.ptr % 16):
        raise ValueError(f"gemv_tile: a norm weight of {int(norm_weight.size)} float32 values, 16-byte aligned, "
                         f"for rows of {lins[0].inn}")
    ws = pad([a for a, _ in lays], lays[0][0])
    ss = pad([b for _, b in lays], lays[0][1])
    scs = pad([L.sc for L in lins], lins[0].sc)
    yy = pad(ys, ys[0])
    ns = pad([i32(L.out) for L in lins], i32(0))
    args = (*ws, *ss, *scs, *yy, *ns, i32(c1), i32(c2), x, i32(lins[0].inn), i32(nb), i32(int(accumulate)),
            part, sem, i32(sl), norm_weight if norm else x, np.float32(eps), i32(limit is not None),
            np.float32(limit or 0.0))
    smem = shared_bytes(nb, sl, norm, cfg)
    kern = kernel(nb, norm, pair, cfg)
    go = PDL.launcher(pdl)
    block = (32 * cfg.W,)
    return lambda: go(kern, grid, block, args, shared_mem=smem)
