"""Decode-time linear (GEMV, 1..8 activation rows) reading each weight in its artifact layout.

    from bloomery.runtime.cuda import gemv
    lin = gemv.Linear("nvfp4", (out, in), arrays)     # arrays: suffix -> cupy array, to_gguf's
    y = lin(x)                                         # x cupy float32 [nb, in] (or [in]); y float32 [nb, out]
    lin(x, y=y, accumulate=True)                       # y += W x (residual add fused)

`arrays` are layout.to_gguf's arrays uploaded as they are (cupy.asarray of the mmapped GGUF
data; uint8 block bytes / int8 / float32): no dequantized copy is made. Formats: nvfp4 (GGML
NVFP4 blocks + scale_2, or the stored layout I8 nibbles + I8 E4M3 scales + scale_2 when the
artifact has `scale`), mxfp8, fp8_tensor, fp8_channel, fp8_block128, bf16, f32, q8_0.
x and y are float32 (activations are a few KB; float32 keeps the GPU equal to the NumPy
executor's arithmetic); accumulation is float32 always.

Every launch is asynchronous on the current CuPy stream and does no host synchronization or
allocation when `y` is given, so a sequence of calls can be captured into a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Mapping

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from bloomery.core import levers
from . import cu
from . import pdl as PDL
from .gemv_src import SOURCE

FMT_ID = {"f32": 0, "bf16": 1, "fp8_tensor": 2, "fp8_channel": 3, "fp8_block128": 4, "mxfp8": 5,
          "nvfp4_stored": 6}
EPW = {"f32": 1, "bf16": 2, "fp8_tensor": 4, "fp8_channel": 4, "fp8_block128": 4, "mxfp8": 4,
       "nvfp4_stored": 8}
FORMATS = ("nvfp4", "mxfp8", "fp8_tensor", "fp8_channel", "fp8_block128", "bf16", "f32", "q8_0", "mxfp4")
BATCHES = (1, 2, 3, 4, 5, 6, 7, 8)        # a kernel per row count: no rows of zeros multiplied (docs/kernels.md)
MAX_BATCH = 8


@dataclass(frozen=True)
class Config:
    """Launch shape: R output rows per CTA, T threads per CTA (multiple of 32, <= 256),
    U chunks in flight per thread, WPC words per chunk (4: 16-byte loads; plain formats only)."""
    R: int = 4
    T: int = 128
    U: int = 2
    WPC: int = 4


def kernel_kind(fmt: str, arrays: Mapping) -> str:
    """The kernel family of a format as laid out in the artifact."""
    if fmt == "nvfp4":
        return "nvfp4_stored" if "scale" in arrays else "nvfp4_ggml"
    if fmt not in FORMATS:
        raise KeyError(f"gemv: no kernel for format {fmt!r}; known: {', '.join(FORMATS)}")
    return fmt


def kernel_name(kind: str, R: int, B: int, U: int, WPC: int = 4, experts: bool = False) -> str:
    """The kernel's name expression; experts=True: the MoE form (device-side expert ids, one row per pair)."""
    if experts:
        if kind == "nvfp4_ggml":
            return f"gemv_nvfp4_ggml_e<{R}, {U}>"
        if kind == "q8_0":
            return f"gemv_q8_0_e<{R}, {U}>"
        if kind == "mxfp4":
            return "gemv_mxfp4_ggml_e"
        return f"gemv_plain_e<{FMT_ID[kind]}, {R}, {U}, {WPC}>"
    if kind == "mxfp4":
        return f"gemv_mxfp4_ggml<{B}>"
    if kind == "nvfp4_ggml":
        return f"gemv_nvfp4_ggml<{R}, {B}, {U}>"
    if kind == "q8_0":
        return f"gemv_q8_0<{R}, {B}, {U}>"
    return f"gemv_plain<{FMT_ID[kind]}, {R}, {B}, {U}, {WPC}>"


_MODULES: dict = {}
_FUNCS: dict = {}
OPTIONS = ("-std=c++17",)


def compile_kernels(names, defines=()):
    """Compile (NVRTC, one module) every kernel named in `names`; cached per process.
    Returns {name: cupy.RawKernel}. defines: extra -D options (e.g. BLOOMERY_NA)."""
    key_opts = tuple(f"-D{d}" for d in defines)
    todo = [n for n in dict.fromkeys(names) if (n, key_opts) not in _FUNCS]
    if todo:
        opts = OPTIONS + key_opts          # CuPy adds -arch for the current device (sm_90 on the H200)
        mod = cp.RawModule(code=SOURCE, options=opts, name_expressions=todo)
        _MODULES[(tuple(todo), key_opts)] = mod
        for n in todo:
            _FUNCS[(n, key_opts)] = mod.get_function(n)
    return {n: _FUNCS[(n, key_opts)] for n in names}


def lazy_launch(name: str, defines, grid, block, args, go=None):
    """A launch of kernel `name` with its arguments fixed, compiled at its first run (the executor precompiles
    its names first); go: the launcher (pdl.launcher's; default a plain launch)."""
    kern, go = [], go or (lambda k, g, b, a: k(g, b, a))

    def run():
        if not kern:
            kern.append(compile_kernels([name], defines)[name])
        go(kern[0], grid, block, args)
    return run


def batch_bucket(nb: int) -> int:
    if not 1 <= nb <= MAX_BATCH:
        raise ValueError(f"gemv: {nb} activation rows; this kernel takes 1..{MAX_BATCH}")
    return next(b for b in BATCHES if b >= nb)


def supported(kind: str, out: int, inn: int) -> str | None:
    """None when the kernels take this shape, else why not."""
    if kind == "nvfp4_ggml":
        return None if inn % 64 == 0 else "GGML NVFP4 needs in % 64 == 0"
    if kind == "q8_0":
        return None if inn % 32 == 0 else "Q8_0 needs in % 32 == 0"
    if kind == "mxfp4":
        return None if inn % 32 == 0 else "MXFP4 needs in % 32 == 0"
    if inn % EPW[kind]:
        return f"{kind} needs in % {EPW[kind]} == 0 (one 4-byte word per thread step)"
    if kind == "mxfp8" and inn % 32:
        return "MXFP8 needs in % 32 == 0"
    if kind == "nvfp4_stored" and inn % 16:
        return "NVFP4 needs in % 16 == 0"
    return None


# Tuned on the H200 (tools/bench_kernels.py --sweep, 2026-11-30; docs/kernels.md): batch 1 takes the
# measured best for the shapes that were swept, a rule drawn from them otherwise. Batches of 2..8 take
# the rule the batch-8 column of docs/kernels.md was measured with (2 rows per CTA: registers).
TUNED = {                        # (kind, out, in) -> batch-1 best of the R x T x U sweep (docs/kernels.md)
    ("nvfp4_ggml", 576, 1536): Config(1, 256, 1, 1),
    ("nvfp4_ggml", 1536, 576): Config(4, 128, 1, 1),
    ("nvfp4_ggml", 49152, 576): Config(8, 128, 1, 1),
    ("nvfp4_ggml", 4096, 4096): Config(4, 128, 1, 1),
    ("nvfp4_ggml", 1024, 4096): Config(2, 256, 4, 1),
    ("nvfp4_ggml", 14336, 4096): Config(4, 128, 1, 1),
    ("nvfp4_ggml", 4096, 14336): Config(4, 256, 1, 1),
    ("nvfp4_ggml", 128256, 4096): Config(4, 64, 1, 1),
    ("nvfp4_stored", 576, 1536): Config(2, 64, 2, 4),
    ("nvfp4_stored", 1536, 576): Config(2, 32, 1, 4),
    ("nvfp4_stored", 49152, 576): Config(2, 32, 1, 4),
    ("nvfp4_stored", 4096, 4096): Config(8, 128, 1, 4),
    ("nvfp4_stored", 1024, 4096): Config(4, 128, 1, 4),
    ("nvfp4_stored", 14336, 4096): Config(8, 64, 1, 4),
    ("nvfp4_stored", 4096, 14336): Config(8, 128, 1, 4),
    ("nvfp4_stored", 128256, 4096): Config(8, 64, 1, 4),
    ("mxfp8", 576, 1536): Config(1, 128, 2, 4),
    ("mxfp8", 1536, 576): Config(2, 128, 1, 4),
    ("mxfp8", 49152, 576): Config(8, 64, 1, 4),
    ("mxfp8", 4096, 4096): Config(4, 128, 1, 4),
    ("mxfp8", 1024, 4096): Config(4, 256, 1, 4),
    ("mxfp8", 14336, 4096): Config(8, 128, 1, 4),
    ("mxfp8", 4096, 14336): Config(4, 128, 1, 4),
    ("mxfp8", 128256, 4096): Config(8, 128, 1, 4),
    ("fp8_tensor", 576, 1536): Config(2, 128, 1, 4),
    ("fp8_tensor", 1536, 576): Config(4, 64, 1, 4),
    ("fp8_tensor", 49152, 576): Config(8, 64, 1, 4),
    ("fp8_tensor", 4096, 4096): Config(4, 128, 1, 4),
    ("fp8_tensor", 1024, 4096): Config(4, 256, 1, 4),
    ("fp8_tensor", 14336, 4096): Config(8, 64, 1, 4),
    ("fp8_tensor", 4096, 14336): Config(4, 128, 1, 4),
    ("fp8_tensor", 128256, 4096): Config(4, 128, 1, 4),
    ("fp8_channel", 576, 1536): Config(1, 128, 1, 4),
    ("fp8_channel", 1536, 576): Config(2, 128, 2, 4),
    ("fp8_channel", 49152, 576): Config(8, 64, 1, 4),
    ("fp8_channel", 4096, 4096): Config(4, 128, 1, 4),
    ("fp8_channel", 1024, 4096): Config(4, 256, 1, 4),
    ("fp8_channel", 14336, 4096): Config(8, 64, 1, 4),
    ("fp8_channel", 4096, 14336): Config(4, 128, 1, 4),
    ("fp8_channel", 128256, 4096): Config(8, 128, 1, 4),
    ("fp8_block128", 576, 1536): Config(1, 128, 1, 4),
    ("fp8_block128", 1536, 576): Config(2, 64, 1, 4),
    ("fp8_block128", 49152, 576): Config(8, 64, 1, 4),
    ("fp8_block128", 4096, 4096): Config(4, 128, 1, 4),
    ("fp8_block128", 1024, 4096): Config(4, 256, 1, 4),
    ("fp8_block128", 14336, 4096): Config(4, 128, 1, 4),
    ("fp8_block128", 4096, 14336): Config(4, 128, 1, 4),
    ("fp8_block128", 128256, 4096): Config(4, 128, 1, 4),
    ("bf16", 576, 1536): Config(2, 256, 1, 4),
    ("bf16", 1536, 576): Config(2, 128, 1, 4),
    ("bf16", 49152, 576): Config(4, 128, 1, 4),
    ("bf16", 4096, 4096): Config(2, 128, 1, 4),
    ("bf16", 1024, 4096): Config(2, 256, 2, 4),
    ("bf16", 14336, 4096): Config(4, 256, 1, 4),
    ("bf16", 4096, 14336): Config(2, 128, 1, 4),
    ("bf16", 128256, 4096): Config(2, 256, 1, 4),
    ("f32", 576, 1536): Config(1, 256, 2, 4),
    ("f32", 1536, 576): Config(2, 256, 1, 4),
    ("f32", 49152, 576): Config(2, 64, 1, 4),
    ("f32", 4096, 4096): Config(2, 128, 1, 4),
    ("f32", 1024, 4096): Config(1, 256, 1, 4),
    ("f32", 14336, 4096): Config(2, 256, 1, 4),
    ("f32", 4096, 14336): Config(2, 256, 1, 4),
    ("f32", 128256, 4096): Config(2, 128, 1, 4),
    ("q8_0", 576, 1536): Config(1, 256, 4, 1),
    ("q8_0", 1536, 576): Config(2, 256, 1, 1),
    ("q8_0", 49152, 576): Config(2, 64, 1, 1),
    ("q8_0", 4096, 4096): Config(2, 128, 1, 1),
    ("q8_0", 1024, 4096): Config(1, 256, 4, 1),
    ("q8_0", 14336, 4096): Config(2, 128, 1, 1),
    ("q8_0", 4096, 14336): Config(2, 256, 1, 1),
    ("q8_0", 128256, 4096): Config(4, 64, 4, 1),
}


def default_config(kind: str, out: int, inn: int, nb: int = 1) -> Config:
    B = batch_bucket(nb)
    if kind == "mxfp4":                      # one warp per row, R rows (warps) per CTA
        return Config(R=4, T=128, U=1, WPC=1)
    if kind in ("nvfp4_ggml", "q8_0"):
        nblk = inn // (64 if kind == "nvfp4_ggml" else 32)
        if B == 1:
            return TUNED.get((kind, out, inn)) or Config(R=4 if out >= 4096 else 2, T=256 if out <= 1024 else 128,
                                                       U=1, WPC=1)
        return Config(R=2, T=128 if nblk >= 32 else 64, U=1, WPC=1)
    wpr = inn // EPW[kind]
    WPC = 4 if wpr % 4 == 0 else 1
    nch = wpr // WPC
    if B == 1:
        t = TUNED.get((kind, out, inn))
        if t is not None and t.WPC == WPC:
            return t
        R = {"f32": 2, "bf16": 2, "nvfp4_stored": 8}.get(kind, 4)
        T = 256 if out <= 1024 else 128 if nch >= 128 else 64 if nch >= 48 else 32
        return Config(R=R, T=T, U=1, WPC=WPC)
    return Config(R=2, T=128 if nch >= 512 else 64 if nch >= 64 else 32, U=1, WPC=WPC)


def mma_warps(out: int) -> int:
    """Warps per CTA of gemv_nvfp4_mma (16 rows a CTA): enough warps in flight on 132 SMs."""
    ctas = -(-out // 16)
    return 16 if ctas < 264 else 8 if ctas < 1024 else 4


# -- several activation rows on the tensor cores (gemv_tc.cu) ---------------------------------------
TC_KINDS = ("nvfp4_ggml", "bf16")        # GGML NVFP4 (gemv_nvfp4_tc, TcGroup) and BF16 (gemv_bf16_tc)
TC_ROWS = 16                              # activation rows per launch (4 per n-tile, NT <= 4)
TC_SMEM = 64 * 1024                       # cap on a CTA's x slice in shared memory
TC_SMEM_MAX = 227 * 1024 - 1024           # H100/H200 opt-in limit less the kernel's static shared memory


@dataclass(frozen=True)
class TcConfig:
    """gemv_nvfp4_tc's shape: MT m-tiles (16 rows) per warp, W warps per CTA, U blocks of loads in
    flight, `ctas` the grid it aims at (split-K adds slices until the row tiles fill it), at least
    `min_blocks` 64-blocks a slice."""
    MT: int = 2
    W: int = 4
    U: int = 4
    ctas: int = 264
    min_blocks: int = 4
    NS: int = 0                           # > 0: weights staged through shared memory, NS chunks deep
    xcap: int = TC_SMEM                   # cap on the x slice's shared bytes (fewer: more slices, more CTAs a SM)
    xg: bool = False                      # x's fragments made once by gemv_tc_xfrag (global), not by each CTA


def tc_staged(inn: int, cfg: TcConfig) -> bool:
    """Whether a launch stages the weights (cp.async needs 16-byte aligned 4-block chunks)."""
    return cfg.NS > 0 and cfg.U == 4 and inn % 256 == 0


def tc_config(out: int, inn: int, nb: int, members: int = 1) -> TcConfig:
    """The measured best shape (tools/bench_gemv_tc.py --variants, H200, 2026-12-01 and 2026-12-04,
    docs/kernels.md): weights staged two chunks deep; four m-tiles a warp for the output head; from 5
    rows (two or four n-tiles) 8 warps a CTA, one m-tile a warp and a 264-CTA grid, except the wide
    gate / up (two m-tiles); up to 4 rows one m-tile a warp and a wider grid up to
    4096 x 4096. Past 8 rows (the 16-row sweep, tools/bench_gemv_tc.py --sweep, H100, 2026-12-07) the
    staged (in % 256 == 0) wide shapes (gate / up, down, the head) take small CTAs of two m-tiles a warp
    on a 264-CTA grid with x's fragments made once (TcConfig.xg): 4 warps (2 for the head), 1.21-1.31x
    the rule before it. members: the matrices of the TcGroup launch, whose CTAs add up: from 5 rows the
    q / k / v of 4096 in (the width measured) take two m-tiles a warp on a 132-CTA grid each (the group
    sweep, --groups --sweep: 1.22x at 8 rows, 1.25x at 16). BLOOMERY_TC_XG=off keeps each shape and
    makes x per CTA."""
    cfg = _tc_config(out, inn, nb, members)
    return cfg if _x_once() else dataclasses.replace(cfg, xg=False)


def _x_once() -> bool:
    """BLOOMERY_TC_XG: whether the rules' x-made-once shapes (TcConfig.xg, Bf16TcConfig.xs) stand."""
    return levers.value("BLOOMERY_TC_XG", os.environ) == "on"


def _align4(n: int) -> int:
    """n floats rounded up to 16 bytes (where a uint4 array may start inside `part`)."""
    return -(-n // 4) * 4


def _tc_config(out: int, inn: int, nb: int, members: int = 1) -> TcConfig:
    if nb > 4 and members > 2 and out <= 4096 and inn == 4096:     # the 8B q / k / v (the group sweep,
        return TcConfig(MT=2, W=8, ctas=132, NS=2)                  # H100, 2026-12-07: the one width measured)
    if nb > 8 and inn % 256 == 0:                    # 16-row sweep, H100, 2026-12-07 (docs/kernels.md)
        if out >= 65536:
            return TcConfig(MT=2, W=2, ctas=264, NS=2, xg=True)
        if inn > 8192 or (out > inn and out > 4096):
            return TcConfig(MT=2, W=4, ctas=264, NS=2, xg=True)
    if out >= 65536:
        return TcConfig(MT=4 if nb > 4 else 2, W=8, ctas=528, NS=2)
    if nb > 4:
        if out > inn and out > 4096:
            return TcConfig(W=8, ctas=264, NS=2)
        return TcConfig(MT=1, W=8, ctas=264, NS=2)
    if out <= 4096 and inn <= 4096:
        return TcConfig(MT=1, ctas=528, NS=2)
    return TcConfig(NS=2)


def tc_takes(kind: str, inn: int) -> bool:
    """Whether a tensor-core GEMV reads this kind at this width (BF16: in % 32 == 0)."""
    return kind in TC_KINDS and (kind != "bf16" or inn % BF16_TC_K == 0)


def tc_wins(kind: str, out: int, inn: int, nb: int) -> bool:
    """Whether the tensor-core launch of nb rows beats the CUDA-core kernels (launches of <= 8 rows) on
    this shape: measured from 2 rows on weights of >= 2^25 / nb values (docs/kernels.md); BF16 (in % 32
    == 0) from 3 rows (at 2 it ties the CUDA cores: 0.95-0.98x on the 8B shapes)."""
    return tc_takes(kind, inn) and (3 if kind == "bf16" else 2) <= nb <= TC_ROWS and out * inn * nb >= 1 << 25


def tc_launch_shape(out: int, inn: int, nb: int, cfg: TcConfig = TcConfig()):
    """(NT, grid, blocks per slice, shared bytes) of a launch of nb rows."""
    if not 1 <= nb <= TC_ROWS:
        raise ValueError(f"gemv_tc: {nb} activation rows; a launch takes 1..{TC_ROWS}")
    NT = 1 if nb <= 4 else 2 if nb <= 8 else 4
    nblk = inn // 64
    tiles = -(-out // (16 * cfg.MT * cfg.W))
    ks = max(1, min(nblk, -(-cfg.ctas // tiles)))
    bps = max(-(-nblk // ks), min(cfg.min_blocks, nblk))
    if not cfg.xg:
        bps = min(bps, max(1, cfg.xcap // (NT * 1024)))
    staged = tc_staged(inn, cfg)
    if staged:
        bps = -(-bps // 4) * 4
    ks = -(-nblk // bps)
    wbytes = cfg.W * (cfg.NS if staged else 0) * 16 * cfg.MT * 160
    smem = (0 if cfg.xg else bps * NT * 1024) + wbytes
    if smem > TC_SMEM_MAX:
        raise ValueError(f"gemv_tc {cfg}: {smem} bytes of shared memory a CTA (x slice + weight stages), "
                         f"over the {TC_SMEM_MAX} a Hopper CTA may have")
    return NT, (tiles, ks), bps, smem


BF16_TC_K = 32                            # k a chunk of gemv_bf16_tc (in % 32 == 0)


@dataclass(frozen=True)
class Bf16TcConfig:
    """gemv_bf16_tc's shape: MT m-tiles (16 rows) per warp, W warps per CTA, `ctas` the grid it aims at
    (split-K adds slices until the row tiles fill it)."""
    MT: int = 2
    W: int = 4
    ctas: int = 528
    xs: bool = False                      # x's bf16 parts made once by gemv_bf16_xsplit, not by each warp


def bf16_tc_config(out: int, inn: int, nb: int) -> Bf16TcConfig:
    """The measured best (tools/bench_gemv_tc.py --bf16, H200, 2026-12-04, docs/kernels.md): two m-tiles a
    warp and 4 warps, a 528-CTA grid; the output head up to 8 rows one m-tile a warp and 8 warps (128256 x
    4096: 308 against 323 us); a 264-CTA grid for narrow matrices (in < 1024: 49152 x 576 19.7 against
    24.8 us) and for wide ones past 8 rows (14336 x 4096 at 16 rows: 53.6 against 67.2 us).
    The output heads with x's three parts made once (Bf16TcConfig.xs: 128256 x 4096 at 16 rows 373.3 against
    419.2 us, at 8 rows 313.0 against 327.9; narrower matrices lose, 0.88-0.99x, 2026-12-06), unless
    BLOOMERY_TC_XG=off."""
    cfg = _bf16_tc_config(out, inn, nb)
    return cfg if _x_once() else dataclasses.replace(cfg, xs=False)


def _bf16_tc_config(out: int, inn: int, nb: int) -> Bf16TcConfig:
    if out >= 65536:
        return Bf16TcConfig(MT=1, W=8, xs=True) if nb <= 8 else Bf16TcConfig(ctas=264, xs=True)
    if inn < 1024 or (nb > 8 and out > inn and out < 65536):
        return Bf16TcConfig(ctas=264)
    return Bf16TcConfig()


def bf16_tc_launch_shape(out: int, inn: int, nb: int, cfg: Bf16TcConfig = Bf16TcConfig()):
    """(NT, tiles, KS, chunks per slice) of a gemv_bf16_tc launch of nb rows."""
    if not 1 <= nb <= TC_ROWS:
        raise ValueError(f"gemv_bf16_tc: {nb} activation rows; a launch takes 1..{TC_ROWS}")
    if inn % BF16_TC_K:
        raise ValueError(f"gemv_bf16_tc: in = {inn}, a multiple of {BF16_TC_K} needed")
    NT = 1 if nb <= 8 else 2
    nch = inn // BF16_TC_K
    tiles = -(-out // (16 * cfg.MT * cfg.W))
    ks = max(1, min(nch, -(-cfg.ctas // tiles)))
    cps = -(-nch // ks)
    return NT, tiles, -(-nch // cps), cps


TC_MEMBERS = 3                            # matrices a tensor-core launch takes (q, k, v; gate, up)


class TcGroup:
    """Linears of one format and width that read the same x (q, k and v; gate and up), as one launch of
    gemv_nvfp4_tc for nb rows: the grid is the members' CTAs one after another, each member with its own
    tc_config shape (which must give the same kernel instance as the others'), so each member's rows are
    bit for bit what a launch of it alone computes (tests/test_cuda_kernels.py)."""

    def __init__(self, lins, nb: int, cfg: TcConfig | None = None):
        lins = list(lins)
        cfgs, shapes = self.shapes_of(lins, nb, cfg)
        self.lins, self.nb, self.cfg, self.shapes = lins, int(nb), cfgs[0], shapes
        self.inn = lins[0].inn
        self.pdl = all(L.pdl for L in lins)          # launched with programmatic dependent launch
        self.grid = sum(t * ks for _, (t, ks), _, _ in shapes)
        self.smem = max(s[3] for s in shapes)

    @staticmethod
    def shapes_of(lins, nb: int, cfg: TcConfig | None = None):
        """(each member's TcConfig, each member's tc_launch_shape); ValueError where they cannot be one launch."""
        if not 1 <= len(lins) <= TC_MEMBERS or any(L.kind != "nvfp4_ggml" or L.experts for L in lins) \
                or len({L.inn for L in lins}) != 1:
            raise ValueError(f"gemv_tc: 1..{TC_MEMBERS} GGML NVFP4 matrices of one width, got "
                             f"{[(L.kind, L.out, L.inn) for L in lins]}")
        cfgs = [cfg or tc_config(L.out, L.inn, nb, len(lins)) for L in lins]
        shapes = [tc_launch_shape(L.out, L.inn, nb, c) for L, c in zip(lins, cfgs)]
        if len(set(cfgs)) != 1 or len({s[0] for s in shapes}) != 1:
            raise ValueError(f"gemv_tc: members of one launch need one kernel shape, got {cfgs}")
        return cfgs, shapes

    @staticmethod
    def fits(lins, nb: int) -> bool:
        """Whether these linears can be one launch of nb rows (shapes_of accepts them)."""
        try:
            TcGroup.shapes_of(list(lins), nb)
        except ValueError:
            return False
        return True

    def need(self) -> tuple[int, int]:
        """(float32 partial sums, int32 tile counters) the launch needs: its members' one after another."""
        pf = self._partials()
        if self.cfg.xg:                              # then x's powers of two and fragments (16-byte aligned)
            pf = self._xofs(pf)[1] + (self.inn // 64) * self.shapes[0][0] * 256
        return max(1, pf), sum(t for _, (t, _), _, _ in self.shapes)

    def _partials(self) -> int:
        """Float32 split-K partial sums of the members, one after another."""
        return sum(ks * self.nb * L.out for L, (_, (_, ks), _, _) in zip(self.lins, self.shapes) if ks > 1)

    def _xofs(self, pf: int) -> tuple[int, int]:
        """Float offsets in `part` of gemv_tc_xfrag's powers of two (16) and fragments, after pf partial sums."""
        a = _align4(pf)
        return a, a + 16

    def kernel(self):
        cfg, L0 = self.cfg, self.lins[0]
        NT = self.shapes[0][0]
        ns = cfg.NS if tc_staged(self.inn, cfg) else 0
        key = ("tc", NT, ns, cfg)
        if key not in L0._kern:
            k = cu.kernel("gemv_tc", f"gemv_nvfp4_tc<{cfg.MT}, {cfg.W}, {NT}, {cfg.U}, {ns}, {int(cfg.xg)}>")
            optin = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["sharedMemPerBlockOptin"]
            k.max_dynamic_shared_size_bytes = optin - k.shared_size_bytes    # the limit; launches ask for less
            L0._kern[key] = k
            if cfg.xg:
                self.xfrag_kernel()
        return L0._kern[key]

    def launch(self, x, ys, accumulate: bool = False, part=None, sem=None):
        """ys[m][:nb] = W_m x[:nb] (+ ys[m]). part / sem: scratch of need()'s sizes (float32 / int32, sem all
        zero: every launch leaves it so); made here when not given (not inside a graph capture)."""
        if part is None or sem is None:
            pf, si = self.need()
            part, sem = cp.empty(pf, cp.float32), cp.zeros(si, cp.int32)
        i32, n = cp.int32, len(self.lins)
        xf = xi = part
        if self.cfg.xg:
            a, b = self._xofs(self._partials())
            xi, xf = part[a:], part[b:]
            NT = self.shapes[0][0]
            PDL.launcher(self.pdl)(self.xfrag_kernel(), (4 * NT,), (256,), (x, xf, xi, i32(self.inn), i32(self.nb)))
        pad = lambda v: list(v) + [v[0]] * (TC_MEMBERS - n)      # unused member slots (never read)
        L = pad(self.lins)
        args = (*[l.w for l in L], *[l.sc for l in L], x, *pad(list(ys)), part, sem, *[i32(l.out) for l in L],
                i32(self.inn), i32(self.nb), i32(int(accumulate)), *[i32(s[2]) for s in pad(self.shapes)],
                *[i32(s[1][1]) for s in pad(self.shapes)], i32(n), xf, xi)
        PDL.launcher(self.pdl)(self.kernel(), (self.grid,), (32 * self.cfg.W,), args, shared_mem=self.smem)

    def xfrag_kernel(self):
        NT, L0 = self.shapes[0][0], self.lins[0]
        key = ("tcx", NT)
        if key not in L0._kern:
            L0._kern[key] = cu.kernel("gemv_tc", f"gemv_tc_xfrag<{NT}>")
        return L0._kern[key]


class Linear:
    """One weight matrix in its artifact layout on the device, with its kernel chosen.
    mma=True: GGML NVFP4 at batch 1 on the tensor cores (gemv_nvfp4_mma). Off by default: exact,
    but measured 0.47-0.73x the CUDA-core kernel's speed on the Llama-3-8B shapes
    (docs/kernels.md); kept, tested, for the next iteration."""

    def __init__(self, fmt: str, shape, arrays: Mapping, config: Config | None = None, defines=(),
                 mma: bool = False, pdl: bool = False):
        if cp is None:
            raise RuntimeError("gemv.Linear needs CuPy and a CUDA GPU")
        self.fmt = fmt
        self.kind = kernel_kind(fmt, arrays)
        self.out, self.inn = (int(shape[-2]), int(shape[-1]))
        self.experts = int(math.prod(shape[:-2])) if len(shape) > 2 else 0     # stacked [E, out, in]
        why = supported(self.kind, self.out, self.inn)
        if why:
            raise NotImplementedError(f"gemv {fmt} [{self.out}, {self.inn}]: {why}")
        self.arrays = {k: cp.asarray(v) for k, v in arrays.items()}
        self.config = config
        self.defines = tuple(defines)
        self.pdl = bool(pdl)                 # launch() with programmatic dependent launch (runtime/cuda/pdl.py)
        self._go = PDL.launcher(self.pdl)
        w = self.arrays["weight"]
        self.w = w
        self.s = None
        self.sc = None
        if self.kind in ("nvfp4_ggml", "nvfp4_stored"):
            self.sc = self.arrays["scale_2"].astype(cp.float32, copy=False).reshape(-1)
            if self.kind == "nvfp4_stored":
                self.s = self.arrays["scale"]
        elif self.kind in ("fp8_tensor", "fp8_channel"):
            self.sc = self.arrays["scale"].astype(cp.float32, copy=False).reshape(-1)
        elif self.kind in ("fp8_block128", "mxfp8"):
            self.s = self.arrays["scale"]
        self.nbytes = sum(int(a.nbytes) for k, a in self.arrays.items() if k in ("weight", "scale", "scale_2"))
        self._kern = {}
        ok = self.kind == "nvfp4_ggml" and not self.experts
        self.mma = ok and bool(mma)
        if mma and not ok:
            raise NotImplementedError(f"gemv {fmt} [{self.out}, {self.inn}]: the tensor-core GEMV reads GGML NVFP4 only")
        if self.experts:                     # per-expert strides in the kernels' pointer units
            E = self.experts
            wb = int(self.w.nbytes) // E
            self.wst = wb if self.kind in ("nvfp4_ggml", "q8_0", "mxfp4") else wb // 4
            self.sst = int(self.s.nbytes) // E if self.s is not None else 0
            self.scst = int(self.sc.size) // E if self.sc is not None and self.sc.size > 1 else 0
            self.expert_nbytes = self.nbytes // E

    def kernel_name(self, nb: int, one: bool = False) -> str:
        """The name of the kernel a launch of nb rows uses (for precompiling); one: launch's `one`."""
        if self.mma and (nb == 1 or one):
            return f"gemv_nvfp4_mma<{mma_warps(self.out)}>"
        c = self.config or default_config(self.kind, self.out, self.inn, 1 if one else nb)
        return kernel_name(self.kind, c.R, batch_bucket(nb), c.U, c.WPC)

    def _mma_kernel(self):
        """(gemv_nvfp4_mma kernel, its shared bytes: x's f16 hi and lo parts)."""
        if "mma" not in self._kern:
            name = self.kernel_name(1)
            k = compile_kernels([name], self.defines)[name]
            smem = 4 * self.inn
            if smem > 48 * 1024:
                k.max_dynamic_shared_size_bytes = smem
            self._kern["mma"] = (k, smem)
        return self._kern["mma"]

    def kernel(self, nb: int, one: bool = False):
        B = batch_bucket(nb)
        key = (B, one and B > 1)
        if key not in self._kern:
            c = self.config or default_config(self.kind, self.out, self.inn, 1 if one else nb)
            name = kernel_name(self.kind, c.R, B, c.U, c.WPC)
            self._kern[key] = (compile_kernels([name], self.defines)[name], c)
        return self._kern[key]

    def kernel_experts(self):
        if "e" not in self._kern:
            c = self.config or default_config(self.kind, self.out, self.inn, 1)
            name = kernel_name(self.kind, c.R, 1, c.U, c.WPC, experts=True)
            self._kern["e"] = (compile_kernels([name], self.defines)[name], c)
        return self._kern["e"]

    def launch_experts(self, x, y, eid, pairs: int, xdiv: int, accumulate: bool = False):
        """The MoE form: for each pair p < pairs, y[p] = W[eid[p]] x[p // xdiv] (+ y[p]); eid int32 on
        the device (the router's output), read by the kernel. No checks, no allocation."""
        kern, c = self.kernel_experts()
        i32, i64 = cp.int32, cp.int64
        rows_per_cta = c.T // 32 if self.kind == "mxfp4" else c.R
        grid = (math.ceil(self.out / rows_per_cta), int(pairs))
        tail = (eid, i32(self.experts), i32(xdiv))
        if self.kind == "nvfp4_ggml":
            args = (self.w, self.sc, x, y, i32(self.out), i32(self.inn), i32(int(accumulate)), *tail,
                    i64(self.wst), i64(self.scst))
        elif self.kind in ("q8_0", "mxfp4"):
            args = (self.w, x, y, i32(self.out), i32(self.inn), i32(int(accumulate)), *tail, i64(self.wst))
        else:
            args = (*self._plain_ptrs(x), x, y, i32(self.out), i32(self.inn), i32(int(accumulate)), *tail,
                    i64(self.wst), i64(self.sst), i64(self.scst))
        kern(grid, (c.T,), args)

    def _plain_ptrs(self, x) -> tuple:
        """The plain-format kernels' (W, S, sc) arguments: the block scales and the per-tensor / per-channel
        factors where the format has them, else a pointer the kernel never reads."""
        return self.w, (self.s if self.s is not None else self.w), (self.sc if self.sc is not None else x)

    def topk_name(self, nb: int, norm: bool = False) -> str:
        """The name of bind_topk's kernel: the 1-launch router of nb rows (norm: the RMSNorm folded in)."""
        c = default_config(self.kind, self.out, self.inn, nb)
        return f"gemv_plain_topk<{FMT_ID[self.kind]}, {c.R}, {batch_bucket(nb)}, {c.U}, {c.WPC}, {int(norm)}>"

    def bind_topk(self, x, y, nb: int, ids, wts, k: int, renorm: bool, sem, norm_weight=None, eps: float = 0.0):
        """moe_router in one launch (gemv_plain_topk): y[:nb] = W x[:nb] (this Linear: the router's [experts,
        in] matrix; y the logits scratch [nb, experts]), then each row's top-k choice as moe_topk_k makes it
        into ids / wts [nb, k] (renorm: the weights renormalised). The logits are launch()'s and the choice
        moe_topk_k's, bit for bit. norm_weight (float32 [inn]): x is the input of an RMSNorm of that weight and
        eps, folded in as Group(norm=True) folds it (the same bits as that launch). sem: one int32, zero (every
        launch leaves it so). Returns the launch."""
        why = topk_supported(self, nb, k)
        if why:
            raise ValueError(f"gemv.Linear.bind_topk: {why}")
        if norm_weight is not None and norm_weight.size != self.inn:
            raise ValueError(f"gemv.Linear.bind_topk: norm weight of {norm_weight.size} values for {self.inn} inputs")
        c, i32 = default_config(self.kind, self.out, self.inn, nb), cp.int32
        name = self.topk_name(nb, norm_weight is not None)
        args = (*self._plain_ptrs(x), x, y, i32(self.out), i32(self.inn), i32(nb), x if norm_weight is None else norm_weight,
                np.float32(eps), sem, ids, wts, i32(k), i32(bool(renorm)))
        smem = 4 * (c.T // 32) * self.out
        go = PDL.launcher(self.pdl)
        return lazy_launch(name, self.defines, (math.ceil(self.out / c.R),), (c.T,), args,
                           lambda kern, g, b, a: go(kern, g, b, a, shared_mem=smem))

    def pair_experts_name(self, R: int | None = None, norm: bool = False, prefetch: bool = False) -> str:
        """The name of bind_pair_experts' kernel (GGML NVFP4): the experts config's U, R rows a CTA;
        norm: the RMSNorm folded in; prefetch: the down matrices brought into the L2."""
        c = self.config or default_config(self.kind, self.out, self.inn, 1)
        return f"gemv_nvfp4_ggml_pair_e<{R or PAIR_E_R}, {c.U}, {int(norm)}{', 1' if prefetch else ''}>"

    def bind_pair_experts(self, up: "Linear", x, O, eid, pairs: int, xdiv: int, limit=None, R: int | None = None,
                          norm_weight=None, eps: float = 0.0, prefetch: "Linear | None" = None):
        """The MoE form's gate (this Linear) and up and the SwiGLU after them in one launch: for each pair
        p < pairs, O[p] = silu(W_gate[eid[p]] x[p // xdiv]) * (W_up[eid[p]] x[p // xdiv]) (limit: the clamp of
        the swiglu op). The thread count of launch_experts, so O is its two launches and the swiglu op's
        values bit for bit. norm_weight (float32 [inn]): x is the input of an RMSNorm of that weight and eps,
        folded in (Group(norm=True)'s arithmetic: to float32 rounding of the norm's launch, not bit for bit).
        prefetch (the stacked down Linear after it): each pair's CTAs also bring its expert's down matrix into
        the L2 for the combine launch (values unchanged). GGML NVFP4 experts of one shape only
        (pair_experts_supported). Returns the launch."""
        why = pair_experts_supported(self, up)
        if why:
            raise ValueError(f"gemv.Linear.bind_pair_experts: {why}")
        if norm_weight is not None and norm_weight.size != self.inn:
            raise ValueError(f"gemv.Linear.bind_pair_experts: norm weight of {norm_weight.size} values for "
                             f"{self.inn} inputs")
        c = self.config or default_config(self.kind, self.out, self.inn, 1)
        R = R or PAIR_E_R
        if prefetch is not None and (prefetch.kind != "nvfp4_ggml" or prefetch.experts != self.experts):
            raise ValueError(f"gemv.Linear.bind_pair_experts: prefetch of {prefetch.kind} {prefetch.experts}x experts "
                             f"after {self.experts} GGML NVFP4 experts")
        name, i32 = self.pair_experts_name(R, norm_weight is not None, prefetch is not None), cp.int32
        grid = (math.ceil(self.out / R), int(pairs))
        args = (self.w, up.w, self.sc, up.sc, O, i32(self.out), x, i32(self.inn), i32(xdiv), eid, i32(self.experts),
                np.int64(self.wst), np.int64(self.scst), i32(limit is not None), np.float32(limit or 0.0),
                x if norm_weight is None else norm_weight, np.float32(eps),
                self.w if prefetch is None else prefetch.w, np.int64(0 if prefetch is None else prefetch.wst))
        return lazy_launch(name, self.defines, grid, (c.T,), args)

    def combine_experts_name(self, cfg: "Config | None" = None) -> str:
        c = cfg or EC_CONFIG
        return f"gemv_nvfp4_ggml_ec<{c.R}, {c.U}>"

    def bind_combine_experts(self, d, wts, y, eid, rows: int, k: int, add: bool = False, cfg: "Config | None" = None,
                             prefetch=()):
        """The MoE form's down (this Linear) and the weighted sum of each row's k choices in one launch:
        y[r] (+)= sum_j wts[r, j] * (W[eid[r * k + j]] d[r * k + j]) for r < rows (moe_experts' combine; add:
        the residual add after it). The k experts' rows are one K range the CTA's threads share
        (gemv_nvfp4_ggml_ec); each block's sum is scaled by its expert's scale_2 and its weight before the
        sum, so the values are the unfused launches' to float32 rounding, not bit for bit. GGML NVFP4 only.
        prefetch: up to 3 device arrays (the next linears' weights) the launch brings into the L2 meanwhile.
        Returns the launch."""
        why = combine_experts_supported(self, k)
        if why:
            raise ValueError(f"gemv.Linear.bind_combine_experts: {why}")
        pf = cu.prefetch_args(prefetch, 3, self.w)
        c = cfg or EC_CONFIG
        name, i32 = self.combine_experts_name(c), cp.int32
        grid = (math.ceil(self.out / c.R), int(rows))
        args = (self.w, self.sc, d, wts, y, i32(self.out), i32(self.inn), i32(int(add)), eid, i32(self.experts), i32(k),
                np.int64(self.wst), np.int64(self.scst), *pf)
        return lazy_launch(name, self.defines, grid, (c.T,), args)

    def tc_need(self, nb: int, cfg=None) -> tuple[int, int]:
        """(float32 partial sums, int32 tile counters) a tensor-core launch of nb rows needs."""
        if self.kind == "bf16":
            cfg = cfg or bf16_tc_config(self.out, self.inn, nb)
            NT, tiles, ks, _ = bf16_tc_launch_shape(self.out, self.inn, nb, cfg)
            pf = self._bf16_partials(nb, ks)
            if cfg.xs:                                   # then x's parts: 8 NT rows x in/8 x 3 uint4
                pf = _align4(pf) + 8 * NT * self.inn * 3 // 2
            return pf, tiles
        return TcGroup([self], nb, cfg).need()

    def tc_kernel(self, nb: int, cfg=None):
        if self.kind == "bf16":
            cfg = cfg or bf16_tc_config(self.out, self.inn, nb)
            NT = bf16_tc_launch_shape(self.out, self.inn, nb, cfg)[0]
            key = ("bf16tc", NT, cfg)
            if key not in self._kern:
                self._kern[key] = cu.kernel("gemv_tc", f"gemv_bf16_tc<{cfg.MT}, {cfg.W}, {NT}, {int(cfg.xs)}>")
                if cfg.xs:
                    self._kern["bf16xs"] = cu.kernel("gemv_tc", "gemv_bf16_xsplit")
            return self._kern[key]
        return TcGroup([self], nb, cfg).kernel()

    def launch_tc(self, x, y, nb: int, accumulate: bool = False, part=None, sem=None, cfg=None):
        """y[:nb] = W x[:nb] (+ y) on the tensor cores, the weight read once for the nb rows (GGML NVFP4:
        gemv_nvfp4_tc; BF16: gemv_bf16_tc). part / sem: scratch of tc_need's sizes (float32 / int32, sem
        all zero: every launch leaves it so); made here when not given (not inside a graph capture)."""
        if self.kind != "bf16":
            TcGroup([self], nb, cfg).launch(x, [y], accumulate, part, sem)
            return
        cfg = cfg or bf16_tc_config(self.out, self.inn, nb)
        NT, tiles, ks, cps = bf16_tc_launch_shape(self.out, self.inn, nb, cfg)
        if part is None or sem is None:
            pf, si = self.tc_need(nb, cfg)
            part, sem = cp.empty(pf, cp.float32), cp.zeros(si, cp.int32)
        i32 = cp.int32
        kern, xs = self.tc_kernel(nb, cfg), part
        if cfg.xs:                                       # gemv_bf16_xsplit's words after the partial sums
            xs = part[_align4(self._bf16_partials(nb, ks)):]
            self._go(self._kern["bf16xs"], (-(-self.inn // 2048), 8 * NT), (256,), (x, xs, i32(self.inn), i32(nb)))
        args = (self.w, x, y, part, sem, i32(self.out), i32(self.inn), i32(nb), i32(int(accumulate)), i32(cps), i32(ks), xs)
        self._go(kern, (tiles * ks,), (32 * cfg.W,), args)

    def _bf16_partials(self, nb: int, ks: int) -> int:
        """Float32 split-K partial sums of a gemv_bf16_tc launch (1: a placeholder when there are none)."""
        return ks * nb * self.out if ks > 1 else 1

    def __call__(self, x, y=None, accumulate: bool = False):
        squeeze = x.ndim == 1
        x2 = x.reshape(1, -1) if squeeze else x
        nb = x2.shape[0]
        if x2.dtype != cp.float32 or not x2.flags.c_contiguous or x2.shape[1] != self.inn:
            raise ValueError(f"gemv: x must be C-contiguous float32 [nb, {self.inn}], got {x2.dtype}{list(x2.shape)}")
        if y is None:
            if accumulate:
                raise ValueError("gemv: accumulate=True needs y")
            y = cp.empty((nb, self.out), dtype=cp.float32)
        elif y.dtype != cp.float32 or not y.flags.c_contiguous or y.size != nb * self.out:
            raise ValueError(f"gemv: y must be C-contiguous float32 with {nb}x{self.out} elements")
        self.launch(x2, y, nb, accumulate)
        return y.reshape(self.out) if squeeze else y

    def launch(self, x, y, nb: int, accumulate: bool = False, one: bool = False):
        """Raw launch, no checks (x, y device arrays as in __call__). one: each row computed exactly as a
        launch of that row alone computes it (the verify program: the 1-row kernel's shape, its CTA
        split and reduction order, for every row; the rows still read the weight once)."""
        if one and self.mma and nb > 1:
            for b in range(nb):
                self.launch(x[b:b + 1], y[b:b + 1], 1, accumulate)
            return
        if nb == 1 and self.mma:
            kern, smem = self._mma_kernel()
            kern((-(-self.out // 16),), (32 * mma_warps(self.out),),
                 (self.w, self.sc, x, y, cp.int32(self.out), cp.int32(self.inn), cp.int32(int(accumulate))),
                 shared_mem=smem)
            return
        kern, c = self.kernel(nb, one)
        grid = (math.ceil(self.out / (c.T // 32 if self.kind == "mxfp4" else c.R)),)
        i32 = cp.int32
        if self.kind in ("q8_0", "mxfp4"):
            args = (self.w, x, y, i32(self.out), i32(self.inn), i32(nb), i32(int(accumulate)))
        elif self.kind == "nvfp4_ggml":
            args = (self.w, self.sc, x, y, i32(self.out), i32(self.inn), i32(nb), i32(int(accumulate)))
        else:
            args = (*self._plain_ptrs(x), x, y, i32(self.out), i32(self.inn), i32(nb), i32(int(accumulate)))
        self._go(kern, grid, (c.T,), args)


GROUP_KINDS = ("nvfp4_ggml", "q8_0") + tuple(FMT_ID)
GROUP_MAX = 3


def topk_supported(lin, nb: int, k: int) -> str | None:
    """None when Linear.bind_topk takes this router matrix (nb rows, the top k), else why not."""
    if lin.kind not in FMT_ID or lin.experts or lin.mma or lin.config:
        return f"a plain-format matrix at its default launch, got {lin.kind} (experts {lin.experts})"
    if not 1 <= nb <= MAX_BATCH:
        return f"{nb} rows (1..{MAX_BATCH})"
    c = default_config(lin.kind, lin.out, lin.inn, nb)
    if not 1 <= k <= lin.out or 4 * (c.T // 32) * lin.out > 48 * 1024:
        return f"the top {k} of {lin.out} experts, {c.T // 32} warps' probabilities in 48 KiB of shared memory"
    return None


PAIR_E_R = 8                              # rows a CTA of gemv_nvfp4_ggml_pair_e (tools/bench_moe_gemm.py --decode)
EC_CONFIG = Config(R=8, T=128, U=2, WPC=1)  # gemv_nvfp4_ggml_ec's launch shape (the same benchmark)
EC_KMAX = 32                              # choices a row gemv_nvfp4_ggml_ec takes (gemv_src.py EC_KMAX)


def pair_experts_supported(gate, up) -> str | None:
    """None when gate and up run as one gemv_nvfp4_ggml_pair_e launch, else why not."""
    if not (gate.kind == up.kind == "nvfp4_ggml" and gate.experts and gate.experts == up.experts
            and (gate.out, gate.inn) == (up.out, up.inn) and gate.wst == up.wst and gate.scst == up.scst):
        return (f"a gate and an up of stacked GGML NVFP4 experts of one shape, got {gate.kind} {gate.experts}x"
                f"[{gate.out}, {gate.inn}] and {up.kind} {up.experts}x[{up.out}, {up.inn}]")
    return None


def combine_experts_supported(down, k: int) -> str | None:
    """None when down and the combine of k choices run as one gemv_nvfp4_ggml_ec launch, else why not."""
    if down.kind != "nvfp4_ggml" or not down.experts:
        return f"stacked GGML NVFP4 experts, got {down.kind} ({down.experts} experts)"
    if not 1 <= k <= EC_KMAX:
        return f"top_k {k}: the kernel takes 1..{EC_KMAX} choices a row"
    return None


def group_name(kind: str, R: int, B: int, U: int, WPC: int = 4, norm: bool = False, pair: bool = False) -> str:
    """The grouped kernel's name expression (up to GROUP_MAX matrices reading one x in one launch;
    norm: with an RMSNorm of x folded in; pair: a gate and an up with the SwiGLU after them)."""
    n, k = int(norm), "pair" if pair else "g"
    if kind == "nvfp4_ggml":
        return f"gemv_nvfp4_ggml_{k}<{R}, {B}, {U}, {n}>"
    if kind == "q8_0":
        return f"gemv_q8_0_{k}<{R}, {B}, {U}, {n}>"
    return f"gemv_plain_{k}<{FMT_ID[kind]}, {R}, {B}, {U}, {WPC}, {n}>"


class Group:
    """Linears that read the same x (q, k and v; gate and up) in one launch of the CUDA-core kernel: one
    kernel launch instead of one a matrix. Every member runs with the config its largest member would
    use alone, so a member's rows are computed exactly as a launch of that member alone with that
    config computes them (tests/test_cuda_kernels.py). With `norm`, the launch also folds in the
    RMSNorm whose output the members read: ys = W_m rmsnorm(x) (one member allowed)."""

    def __init__(self, lins, norm: bool = False, pair: bool = False):
        lins = list(lins)
        kinds = {(L.kind, L.inn) for L in lins}
        if pair and (len(lins) != 2 or lins[0].out != lins[1].out):
            raise ValueError(f"gemv.Group(pair=True): a gate and an up of one shape, got {[(L.out, L.inn) for L in lins]}")
        if not (1 if norm else 2) <= len(lins) <= GROUP_MAX or len(kinds) != 1 or lins[0].kind not in GROUP_KINDS \
                or any(L.experts or L.mma or L.config for L in lins):
            raise ValueError(f"gemv.Group: {1 if norm else 2}..{GROUP_MAX} linears of one kernel family and width, got "
                             f"{[(L.kind, L.out, L.inn) for L in lins]}")
        self.lins, self.norm, self.pair = lins, bool(norm), bool(pair)
        self.pdl = all(L.pdl for L in lins)          # launched with programmatic dependent launch
        self.kind, self.inn = lins[0].kind, lins[0].inn
        self.lead = max(lins, key=lambda L: L.out)

    def config(self, nb: int, one: bool = False) -> Config:
        return default_config(self.kind, self.lead.out, self.inn, 1 if one else nb)

    def kernel_name(self, nb: int, one: bool = False) -> str:
        c = self.config(nb, one)
        return group_name(self.kind, c.R, batch_bucket(nb), c.U, c.WPC, self.norm, self.pair)

    def bind(self, x, ys, nb: int, one: bool = False, norm_weight=None, eps: float = 0.0, limit=None):
        """A launch of ys[m][:nb] = W_m x[:nb] for every member m, its arguments fixed now: the returned
        callable does no checks and no allocation (graph capture). one: each row as a 1-row launch.
        A norm group: ys[m] = W_m (x / sqrt(mean(x^2) + eps) * norm_weight), norm_weight float32 [in].
        A pair: ys = [O], O = silu(W_gate x') * (W_up x') as the swiglu op (limit: its clamp)."""
        if self.norm != (norm_weight is not None) or (self.norm and int(norm_weight.size) != self.inn):
            raise ValueError(f"gemv.Group: norm {self.norm}, a norm weight of {getattr(norm_weight, 'size', None)} "
                             f"values for rows of {self.inn}")
        if limit is not None and not self.pair:
            raise ValueError("gemv.Group: a SwiGLU clamp (limit) for a group that is not a gate / up pair")
        c, name = self.config(nb, one), self.kernel_name(nb, one)
        ctas = [math.ceil(L.out / c.R) for L in self.lins]
        i32 = cp.int32
        scales = [L.s if L.s is not None else L.w for L in self.lins]     # the kernels ignore an absent one
        factors = [L.sc if L.sc is not None else x for L in self.lins]
        nw = norm_weight if self.norm else x
        if self.pair:                    # ys: [the SwiGLU's output]; limit: glm5_next's clamp (None: none)
            (g, u), grid = self.lins, (ctas[0],)
            args = (g.w, u.w, *scales, *factors, ys[0], i32(g.out), x, i32(self.inn), i32(nb), nw, np.float32(eps),
                    i32(limit is not None), np.float32(limit or 0.0))
        else:
            cuts = [sum(ctas[:i + 1]) for i in range(GROUP_MAX - 1)]     # an unused slot's cut: the grid's end
            pad = lambda v, fill: list(v) + [fill] * (GROUP_MAX - len(v))  # noqa: E731
            grid = (sum(ctas),)
            args = (*pad([L.w for L in self.lins], self.lins[0].w), *pad(scales, self.lins[0].w), *pad(factors, x),
                    *pad(ys, ys[0]), *pad([i32(L.out) for L in self.lins], i32(0)),
                    i32(cuts[0]), i32(cuts[1]), x, i32(self.inn), i32(nb), i32(0), nw, np.float32(eps))
        return lazy_launch(name, self.lins[0].defines, grid, (c.T,), args, PDL.launcher(self.pdl))


def gemv(fmt: str, shape, arrays: Mapping, x, y=None, accumulate: bool = False, config: Config | None = None):
    """One-shot y = W x (+ y): builds a Linear (compiles once per kernel) and calls it."""
    return Linear(fmt, shape, arrays, config)(x, y, accumulate)
