"""Decode GEMV of GGML NVFP4 weights for one activation row on the tensor cores, the weights as the mma's A
operand, over a layout made at load time (kernel: runtime/cuda/gemv_row.cu, which says the design;
measurements: docs/kernels.md "One row on the tensor cores, weights as A").

    from bloomery.runtime.cuda import gemv, gemv_row
    lin = gemv.Linear("nvfp4", (out, in), arrays)          # GGML NVFP4 blocks, as the artifact stores them
    run = gemv_row.bind([lin], x, [y])                     # y[0] = W x[0]  (accumulate=True: y[0] += W x[0])
    run()                                                  # no allocation, no checks: graph capture
    gemv_row.bind([q, k, v], x, [yq, yk, yv], norm_weight=w, eps=1e-5)   # an RMSNorm folded in
    gemv_row.bind([gate, up], x, [o], pair=True)           # o = swiglu(gate x, up x)
    gemv_row.bind([lin], x, [y], nb=4)                     # 4 rows, each exactly as launched alone

The artifact is not changed: the first bind of a Linear repacks its GGML blocks on the GPU into the row
layout (`layout(lin)`, kept beside the GGML bytes, which the other kernels read). For each 16-row tile r
and 64-wide k-group G (rows padded to 16; the scale words hold 8 k-groups, the last padded with zeros):

    wa[r, G, lane, i]   uint32  lane = 4 g + t: mma i's A fragment (rows 16 r + g, + 8; k = 64 G + 16 t + 4 i
                                + 0..3) as four f16x2 registers o_k = (rotr(q, a_k) & SIGN) | (rotr(q, b_k) & MAG)
    sa[r, G8, lane, b]  uint8   the E4M3 scale of row 16 r + g + 8 (b & 1) over k-group 8 G8 + b // 2's
                                sub-block t (k = 64 G + 16 t .. + 15)

A weight's nibble s.e1e0m lands at f16 bits 15 and 11..9 (e2m1 * 2^-14, exact). `repack` and `decode` are
the layout's NumPy twins (tests/test_gemv_row_layout.py checks them against gguf-py's decoder on the CPU;
the GPU repack is compared with `repack` byte for byte on the device, tools/bench_gemv_row.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from .gemv_tile import MAG, ROT, SIGN, _ggml_nibbles, _rotr   # the nibble placement both layouts share

MAX_ROWS = 8                              # activation rows a launch (each computed as if alone)
MAX_MEMBERS = 3


@dataclass(frozen=True)
class RowConfig:
    """W warps a CTA (one 16-row tile each), U weight words in flight a warp (2, 4 or 8), the grid aimed at
    `warps` warps in all (k-slices added until the tiles reach it), at least `min_groups` 64-wide k-groups a
    slice (a multiple of 8)."""
    W: int = 4
    U: int = 4
    warps: int = 2112
    min_groups: int = 8

    def __post_init__(self):
        if self.U not in (2, 4, 8) or self.min_groups % 8 or self.min_groups < 8 or not 1 <= self.W <= 32:
            raise ValueError(f"RowConfig: U 2, 4 or 8; min_groups a multiple of 8; 1 <= W <= 32; got {self}")


def groups(inn: int) -> int:
    """The layout's 64-wide k-groups a row (its scale words hold 8 each: the last one padded with zeros)."""
    return inn // 64


def repack(blocks, out: int, inn: int) -> tuple[np.ndarray, np.ndarray]:
    """The row layout of GGML NVFP4 blocks: (wa uint32 [ntile, NG, 32, 4], sa uint8 [ntile, NG/8, 32, 16])."""
    if inn % 64:
        raise ValueError(f"gemv_row: rows of {inn} values; GGML NVFP4 needs a multiple of 64")
    nib, sc = _ggml_nibbles(blocks, out, inn)
    nt, ng = -(-out // 16), groups(inn)
    n8 = -(-ng // 8)
    nib = np.pad(nib, ((0, nt * 16 - out), (0, 0))).astype(np.uint32)
    sc = np.pad(sc, ((0, nt * 16 - out), (0, n8 * 32 - inn // 16)))
    # n7[r, h, g, G, t, i, e]: row 16 r + 8 h + g, k = 64 G + 16 t + 4 i + e
    n7 = nib.reshape(nt, 2, 8, ng, 4, 4, 4)
    wa = np.zeros((nt, ng, 8, 4, 4), np.uint32)                  # [r, G, g, t, i]
    for o, (ra, rb) in enumerate(ROT):
        for h in range(2):
            v = n7[:, o & 1, :, :, :, :, 2 * (o >> 1) + h]       # [r, g, G, t, i]
            v = v.transpose(0, 2, 1, 3, 4)                       # [r, G, g, t, i]
            q = ((v >> 3) & 1) << ((15 + 16 * h + ra) & 31)
            for bit in range(3):
                q |= ((v >> bit) & 1) << ((9 + bit + 16 * h + rb) & 31)
            wa |= q.astype(np.uint32)
    s6 = sc.reshape(nt, 2, 8, n8, 8, 4)                          # [r, h, g, G8, G%8, t]
    sa = s6.transpose(0, 3, 2, 5, 4, 1)                          # [r, G8, g, t, G%8, h]
    return (np.ascontiguousarray(wa.reshape(nt, ng, 32, 4)),
            np.ascontiguousarray(sa.reshape(nt, n8, 32, 16)))


def decode(wa: np.ndarray, sa: np.ndarray, out: int, inn: int) -> np.ndarray:
    """The weights the kernel multiplies, read back from the row layout as it extracts them (row_a, the
    scales), float64 [out, in], without scale_2 (times 2^14 undone)."""
    import ml_dtypes
    nt, ng = wa.shape[0], wa.shape[1]
    Wt = np.zeros((nt, 2, 8, ng, 4, 4, 4))                       # [r, h, g, G, t, i, e]
    w5 = wa.reshape(nt, ng, 8, 4, 4)                             # [r, G, g, t, i]
    for o, (ra, rb) in enumerate(ROT):
        reg = (_rotr(w5, ra) & SIGN) | (_rotr(w5, rb) & MAG)
        for h in range(2):
            v = ((reg >> (16 * h)) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64) * 16384.0
            Wt[:, o & 1, :, :, :, :, 2 * (o >> 1) + h] = v.transpose(0, 2, 1, 3, 4)
    n8 = sa.shape[1]
    s8 = sa.reshape(nt, n8, 8, 4, 8, 2).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # [r, G8, g, t, G%8, h]
    s = s8.transpose(0, 5, 2, 1, 4, 3).reshape(nt, 2, 8, n8 * 8, 4)[:, :, :, :ng]   # [r, h, g, G, t]
    Wt *= s[..., None, None]
    return Wt.reshape(nt * 16, ng * 64)[:out, :inn]


# -- the device side -------------------------------------------------------------------------------
def layout(lin):
    """(wa, sa) of a GGML NVFP4 gemv.Linear on the device, repacked on the GPU at the first call and kept."""
    got = getattr(lin, "_row", None)
    if got is not None:
        return got
    why = supported([lin])
    if why:
        raise NotImplementedError(f"gemv_row: {why}")
    from . import cu
    out, inn = lin.out, lin.inn
    nt, ng = -(-out // 16), groups(inn)
    wa = cp.empty(nt * ng * 128, cp.uint32)
    sa = cp.empty(nt * -(-ng // 8) * 512, cp.uint8)
    for name, arr in (("row_repack_w", wa), ("row_repack_s", sa)):
        n = int(arr.size)
        cu.kernel("gemv_row", name)((-(-n // 256),), (256,), (lin.w, arr, np.int32(out), np.int32(inn), np.int32(ng),
                                                              np.int64(n)))
    lin._row = (wa, sa)
    return lin._row


def supported(lins, pair: bool = False) -> str | None:
    """None when one row-kernel launch takes these linears, else why not."""
    lins = list(lins)
    if not 1 <= len(lins) <= MAX_MEMBERS:
        return f"{len(lins)} matrices; a launch takes 1..{MAX_MEMBERS}"
    if any(L.kind != "nvfp4_ggml" or L.experts for L in lins):
        return "GGML NVFP4 matrices only (not experts), got " + ", ".join(f"{L.kind} {L.out}x{L.inn}" for L in lins)
    if len({L.inn for L in lins}) != 1 or lins[0].inn % 64:
        return "one row width, a multiple of 64"
    if pair and (len(lins) != 2 or lins[0].out != lins[1].out):
        return "a pair is a gate and an up of one shape"
    return None


def plan(outs, inn: int, pair: bool = False, cfg: RowConfig = RowConfig()):
    """(grid, k-groups a slice, CTA column cuts c1, c2) of members with `outs` rows: from the shapes only,
    never from the activation rows, so a row's result is the same in a launch of any number of rows."""
    W, ng = cfg.W, groups(inn)
    if pair:
        cols = [-(-(-(-outs[0] // 16)) // (W // 2))]
    else:
        cols = [-(-(-(-o // 16)) // W) for o in outs]
    ctas = sum(cols)
    ks = max(1, min(round(cfg.warps / (ctas * W)), ng // cfg.min_groups))
    sl = -(-(-(-ng // ks)) // 8) * 8
    ks = -(-ng // sl)
    cuts = [min(sum(cols[:i + 1]), ctas) for i in range(MAX_MEMBERS - 1)]
    return (ctas, ks), sl, cuts


def need(outs, inn: int, nb: int = 1, pair: bool = False, cfg: RowConfig = RowConfig()) -> tuple[int, int]:
    """(float32 scratch, int32 counters) a launch of nb rows needs."""
    (ctas, ks), _, _ = plan(outs, inn, pair, cfg)
    return (ks * ctas * (cfg.W * 16 + 1) * nb if ks > 1 else 0), ctas


def kernel_name(nb: int = 1, norm: bool = False, pair: bool = False, cfg: RowConfig = RowConfig()) -> str:
    return f"gemv_row<{cfg.W}, {cfg.U}, {nb}, {int(norm)}, {int(pair)}>"


_KERN: dict = {}


def kernel(nb: int = 1, norm: bool = False, pair: bool = False, cfg: RowConfig = RowConfig(), defines=()):
    name = kernel_name(nb, norm, pair, cfg)
    key = (name, tuple(defines))
    if key not in _KERN:
        from . import cu
        opts = cu.OPTIONS + tuple(f"-D{d}" for d in defines)
        mod = cp.RawModule(code=cu.source("gemv_row"), options=opts, name_expressions=[name])
        k = mod.get_function(name)
        optin = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["sharedMemPerBlockOptin"]
        k.max_dynamic_shared_size_bytes = optin - k.shared_size_bytes
        _KERN[key] = (mod, k)
    return _KERN[key][1]


def bind(lins, x, ys, nb: int = 1, norm_weight=None, eps: float = 0.0, pair: bool = False, limit=None,
         accumulate: bool = False, part=None, sem=None, pdl: bool = False, cfg: RowConfig = RowConfig(), defines=()):
    """A launch of ys[m][:nb] = W_m x'[:nb] for each member (pair: ys = [swiglu(gate, up)]; norm_weight: x' the
    RMSNorm of x), its arguments fixed now; part / sem: scratch of need()'s sizes (sem zero; every launch
    leaves it so), made here when not given (not inside a graph capture)."""
    from . import pdl as PDL
    lins = list(lins)
    why = supported(lins, pair)
    if why:
        raise NotImplementedError(f"gemv_row: {why}")
    if not 1 <= nb <= MAX_ROWS:
        raise ValueError(f"gemv_row: {nb} activation rows; a launch takes 1..{MAX_ROWS}")
    if pair and accumulate:
        raise ValueError("gemv_row: a gate / up pair writes its SwiGLU; it does not accumulate")
    if pair and cfg.W % 2:
        raise ValueError(f"gemv_row: a gate / up pair needs an even W, got {cfg}")
    norm = norm_weight is not None
    inn = lins[0].inn
    if norm and (int(norm_weight.size) != inn or norm_weight.data.ptr % 16):
        raise ValueError(f"gemv_row: a norm weight of {int(norm_weight.size)} float32 values, 16-byte aligned, "
                         f"for rows of {inn}")
    outs = [L.out for L in lins]
    grid, sl, (c1, c2) = plan(outs, inn, pair, cfg)
    if part is None or sem is None:
        pf, si = need(outs, inn, nb, pair, cfg)
        part, sem = cp.empty(max(pf, 1), cp.float32), cp.zeros(si, cp.int32)
    lays = [layout(L) for L in lins]
    pad = lambda v, fill: list(v) + [fill] * (MAX_MEMBERS - len(v))  # noqa: E731
    i32 = np.int32
    args = (*pad([a for a, _ in lays], lays[0][0]), *pad([b for _, b in lays], lays[0][1]),
            *pad([L.sc for L in lins], lins[0].sc), *pad(ys, ys[0]), *pad([i32(o) for o in outs], i32(0)),
            i32(c1), i32(c2), x, i32(inn), i32(groups(inn)), i32(int(accumulate)), part, sem, i32(sl),
            norm_weight if norm else x, np.float32(eps), i32(limit is not None), np.float32(limit or 0.0))
    kern = kernel(nb, norm, pair, cfg, defines)
    go = PDL.launcher(pdl)
    smem = nb * sl * 256
    return lambda: go(kern, grid, (32 * cfg.W,), args, shared_mem=smem)
