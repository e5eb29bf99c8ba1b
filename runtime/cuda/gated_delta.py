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
  A chunked tensor-core form is the next step for long prompts (tools/bench_hybrid.py measures this).
"""

from __future__ import annotations

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


def launches(op, bufs, rows: int, w, qw: int | None = None, pipe: bool | None = None, scratch=None) -> list:
    """The op's launches. qw: column quads per warp (default by mode, QW_OF_MODE); pipe: the prompt
    path (prep + pipelined recurrence; default: prefill mode); scratch(key, shape): a float32 device
    array shared by the ops that ask for the same key (default: a new one)."""
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
        args = (qkv, a, b, pos, slot, A_log, dt, state, out, i32(rows), i32(nslots), i32(Hk), i32(Hv), i32(dk),
                i32(dv), qscale)
        return [lambda: kern(grid, block, args)]
    new = scratch or (lambda key, shape: cp.zeros(shape, cp.float32))
    qk, gb = new("gated_delta.qk", (rows, 2 * Hk * dk)), new("gated_delta.gb", (rows, Hv, 2))
    prep = cu.kernel(STEM, "gated_delta_prep_k")
    pargs = (qkv, a, b, pos, A_log, dt, qk, gb, i32(Hk), i32(Hv), i32(dk), i32(dv), qscale)
    rargs = (qkv, qk, gb, pos, slot, state, out, i32(rows), i32(nslots), i32(Hk), i32(Hv), i32(dk), i32(dv))
    return [lambda: prep((rows,), (256,), pargs), lambda: kern(grid, block, rargs)]


def state_bytes(op, active_slots: int) -> int:
    """State bytes one call reads and writes for `active_slots` slots continuing their sequences."""
    return 2 * active_slots * int(op["v_heads"]) * int(op["k_dim"]) * int(op["v_dim"]) * 4
