"""CUDA gated_delta: the contract of runtime/ops/gated_delta.py (kernels: gated_delta.cu).

    steps = gated_delta.launches(op, bufs, rows, w, scratch=pool)   # w: DeviceWeights (w.vector: float32 on the device)
    for f in steps: f()                                              # capturable: every launch is argument-bound

Both modes of the op run the recurrent form token by token (a slot's rows in row order, its state
held in registers between rows), the NumPy "prefill" form (chunked, WY) agreeing with it to float32
rounding:
- "decode" (one row per slot): one kernel, gated_delta_k, 16 columns of S per warp (64-byte state
  segments per row, the fewest warps; 8 below 4 slots); each warp normalises its row's q, k and
  computes the gates.
- "prefill" (a prompt chunk): gated_delta_prep_k (normalised q, k, exp(g), beta of every row, in
  parallel, into two scratch arrays shared by the executor's ops: `scratch(key, shape)`) then
  gated_delta_run_k (the recurrence alone, software-pipelined over rows, 8 columns per warp).
- "prefill", chunked (opt-in: `chunked=True` or BLOOMERY_GATED_DELTA_CHUNKED=1; not yet the
  default: not measured on a GPU when written): the NumPy op's chunkwise WY form over blocks of 64
  rows, float32 on the CUDA cores: prep, then gated_delta_plan_k (is the call one run? rows [0, n)
  one slot with consecutive positions, rows [n, rows) inactive: decided on the device, the layout
  being device data under one captured graph), then gated_delta_run_k (returns at once when the
  call is one run: it handles every other layout), gated_delta_chunk_a_k (per block and v head:
  the masked attentions, the triangular solve for u and w) and gated_delta_chunk_b_k (per 32
  v columns and v head: the blocks in order, S in shared memory), both returning at once when the
  call is not one run. Needs k_dim in {16, 32, 64, 128} and v_dim % 32 == 0 (else the token-by-
  token path alone); scratch of rows * v_heads * (k_dim + v_dim + 65) floats.
"""

from __future__ import annotations

import os

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu

STEM = "gated_delta"
MAX_NI = {False: 16, True: 8}            # state rows per lane (x 4 columns): decode kernel / prompt kernel
                                         # (ptxas sm_90a: 196 / 166 registers, no spills; 16 spills in the prompt one)
WARPS = 2                                # warps per block (independent: no barrier; small blocks spread a
                                         # single slot's warps over every SM)
QW_OF_MODE = {"decode": 4, "prefill": 2}   # decode with fewer than 4 slots: 2 (more warps for one slot's state)


def configs(dk: int, dv: int, pipe: bool = False) -> list[tuple[int, int]]:
    """The (NI, QW) instances that fit k_dim dk, v_dim dv: QW column quads per warp (32/QW row
    groups of NI = dk*QW/32 rows), dv a multiple of 4*QW, NI <= MAX_NI[pipe]."""
    out = []
    for qw in (4, 2, 1):
        g = 32 // qw
        if dk % g == 0 and dv % (4 * qw) == 0 and 1 <= dk // g <= MAX_NI[pipe]:
            out.append((dk // g, qw))
    return out


def pick(dk: int, dv: int, qw: int | None = None, mode: str = "decode", pipe: bool = False) -> tuple[int, int]:
    cfg = configs(dk, dv, pipe)
    if not cfg:
        raise DeviceUnavailable(f"gated_delta k_dim {dk}, v_dim {dv}: the CUDA kernel needs v_dim % 4 == 0 and "
                                f"k_dim a multiple of 8, 16 or 32 of at most {32 * MAX_NI[pipe]}; use --device cpu")
    want = qw or QW_OF_MODE.get(mode, 4)
    for c in cfg:
        if c[1] == want:
            return c
    return cfg[0]


def kernel_name(ni: int, qw: int, pipe: bool) -> str:
    return f"gated_delta_{'run_' if pipe else ''}k<{ni}, {qw}>"


CHUNK = 64                               # rows per block of the chunked form (gated_delta.cu CH)
CHUNK_DK = (16, 32, 64, 128)             # gated_delta_chunk_b_k instances
CHUNK_COLS, CHUNK_THREADS = 32, 512      # gated_delta_chunk_b_k: v columns and threads per block


def chunked_default() -> bool:
    """Lever BLOOMERY_GATED_DELTA_CHUNKED (specs/levers.yaml; off: measured slower)."""
    from bloomery.core import levers
    return levers.flag("BLOOMERY_GATED_DELTA_CHUNKED", os.environ)


def chunk_fits(dk: int, dv: int) -> bool:
    return dk in CHUNK_DK and dv % CHUNK_COLS == 0 and max(chunk_smem(dk, dv)) <= 227 * 1024


def chunk_smem(dk: int, dv: int) -> tuple[int, int]:
    """Dynamic shared memory bytes of gated_delta_chunk_a_k and gated_delta_chunk_b_k."""
    C = CHUNK
    a = 2 * C * (dk + 1) + C * (dv + dk) + C * (C + 1) + 3 * C
    b = 3 * C * dk + C * C + 2 * C * CHUNK_COLS + dk * CHUNK_COLS + 2 * C + 4   # ec [C], el [C + 1]
    return 4 * a, 4 * b


_ZERO: dict = {}


def _zero_meta():
    dev = cp.cuda.Device().id
    if dev not in _ZERO:
        _ZERO[dev] = cp.zeros(4, cp.int32)
        cp.cuda.Device().synchronize()
    return _ZERO[dev]


def launches(op, bufs, rows: int, w, qw: int | None = None, pipe: bool | None = None, scratch=None,
             chunked: bool | None = None) -> list:
    """The op's launches. qw: column quads per warp (default by mode, QW_OF_MODE); pipe: the prompt
    path (prep + pipelined recurrence; default: prefill mode); scratch(key, shape): a float32 device
    array shared by the ops that ask for the same key (default: a new one); chunked: with pipe, the
    chunkwise form whenever the call's rows are one run (decided on the device; default:
    BLOOMERY_GATED_DELTA_CHUNKED, off)."""
    Hk, Hv, dk, dv = (int(op[k]) for k in ("k_heads", "v_heads", "k_dim", "v_dim"))
    qkv, a, b = bufs[op["qkv"]], bufs[op["a"]], bufs[op["b"]]
    pos, slot, state, out = bufs[op["pos"]], bufs[op["slot"]], bufs[op["state"]], bufs[op["out"]]
    width = 2 * Hk * dk + Hv * dv
    if Hv % Hk or qkv.shape[-1] != width or out.shape[-1] != Hv * dv or a.shape[-1] != Hv or b.shape[-1] != Hv \
            or state.ndim != 4 or tuple(state.shape[1:]) != (Hv, dk, dv):
        raise PlanMismatch(f"gated_delta {op['state']}: k_heads {Hk}, v_heads {Hv}, k_dim {dk}, v_dim {dv} against "
                           f"qkv {qkv.shape}, a {a.shape}, b {b.shape}, out {out.shape}, state {state.shape}")
    A_log, dt = w.vector(op["A_log"]), w.vector(op["dt_bias"])
    if A_log.size != Hv or dt.size != Hv:
        raise PlanMismatch(f"gated_delta {op['A_log']}, {op['dt_bias']}: {A_log.size}, {dt.size} values, v_heads {Hv}")
    mode = op.get("mode", "decode")
    if mode == "verify":                 # a one-row decode step's kernel, its rows in order, + history
        mode = "decode"
        pipe = False
    pipe = mode == "prefill" if pipe is None else bool(pipe)
    nslots = int(state.shape[0])
    if qw is None and mode == "decode" and nslots < 4:
        qw = 2                           # measured at Qwen3-Next dims: batch 1 4.2 us (16 columns: 4.7), batch 8 12.7 us (8: 13.9)
    ni, q = pick(dk, dv, qw, mode, pipe)
    kern = cu.kernel(STEM, kernel_name(ni, q, pipe))
    warps = Hv * (dv // (4 * q))
    grid, block = (-(-warps // WARPS), nslots), (32 * WARPS,)
    i32 = np.int32
    qscale = np.float32(1 / np.sqrt(dk))
    if not pipe:
        args = (qkv, a, b, pos, slot, A_log, dt, state, out, cu.history(op, bufs, rows, state), i32(rows),
                i32(nslots), i32(Hk), i32(Hv), i32(dk), i32(dv), qscale)
        return [lambda: kern(grid, block, args)]
    new = scratch or (lambda key, shape: cp.zeros(shape, cp.float32))
    qk, gb = new("gated_delta.qk", (rows, 2 * Hk * dk)), new("gated_delta.gb", (rows, Hv, 2))
    prep = cu.kernel(STEM, "gated_delta_prep_k")
    pargs = (qkv, a, b, pos, A_log, dt, qk, gb, i32(Hk), i32(Hv), i32(dk), i32(dv), qscale)
    chunked = chunked_default() if chunked is None else bool(chunked)
    chunked = chunked and chunk_fits(dk, dv) and rows > 0
    # chunked: this op's own meta, written by gated_delta_plan_k before any kernel reads it; else a zero
    # one that gated_delta_run_k reads (made once, synchronised: the ops run on a non-blocking stream)
    meta = cp.empty(4, cp.int32) if chunked else _zero_meta()
    rargs = (qkv, qk, gb, pos, slot, state, out, i32(rows), i32(nslots), i32(Hk), i32(Hv), i32(dk), i32(dv), meta)
    steps = [lambda: prep((rows,), (256,), pargs)]
    if chunked:
        plan = cu.kernel(STEM, "gated_delta_plan_k")
        ka, kb = cu.kernel(STEM, "gated_delta_chunk_a_k"), cu.kernel(STEM, f"gated_delta_chunk_b_k<{dk}>")
        sa, sb = chunk_smem(dk, dv)
        for k_, n_ in ((ka, sa), (kb, sb)):         # one kernel object serves every op bound: never lower it
            if k_.max_dynamic_shared_size_bytes < n_:
                k_.max_dynamic_shared_size_bytes = n_
        uw = new("gated_delta.uw", (Hv, rows, dv + dk))
        pm = new("gated_delta.pm", (Hv, rows, CHUNK))
        cg = new("gated_delta.cg", (Hv, rows))
        plargs = (pos, slot, i32(rows), i32(nslots), meta)
        aargs = (qkv, qk, gb, a, A_log, dt, meta, uw, pm, cg, i32(rows), i32(Hk), i32(Hv), i32(dk), i32(dv))
        bargs = (qk, uw, pm, cg, meta, state, out, i32(rows), i32(Hk), i32(Hv), i32(dv))
        ga, gbk = (-(-rows // CHUNK), Hv), (dv // CHUNK_COLS, Hv)
        step_plan = lambda: plan((1,), (1024,), plargs)           # noqa: E731
        step_plan.meta = meta            # {one run?, n, slot, first position} after it ran (tests read it)
        steps.append(step_plan)
        steps.append(lambda: kern(grid, block, rargs))
        steps.append(lambda: ka(ga, (256,), aargs, shared_mem=sa))
        steps.append(lambda: kb(gbk, (CHUNK_THREADS,), bargs, shared_mem=sb))
        return steps
    return steps + [lambda: kern(grid, block, rargs)]


def state_bytes(op, active_slots: int) -> int:
    """State bytes one call reads and writes for `active_slots` slots continuing their sequences."""
    return 2 * active_slots * int(op["v_heads"]) * int(op["k_dim"]) * int(op["v_dim"]) * 4
