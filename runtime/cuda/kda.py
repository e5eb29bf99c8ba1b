"""CUDA kda: the contract of runtime/ops/kda.py (kernel: kda.cu).

Both modes of the op run the recurrent form row by row (a slot's rows in row order, its state held in
registers between rows); the NumPy "prefill" form (chunked) agrees with it to float32 rounding. One
kernel, kda_k<NI, QW, PIPE>: a warp per (slot, head, 4*QW state columns), NI = head_dim*QW/32 state
rows per lane; 8 columns per warp (QW 2) for prompt chunks and for decode with fewer than 4 slots
(more warps for one slot's state, shorter per-row chains), else 16. Prompt chunks (PIPE) load the
slot's next row while the current one is computed (NI <= 8: two rows' inputs in registers).
"""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailable, PlanMismatch
from . import cu

STEM = "kda"
MAX_NI = {False: 16, True: 8}            # state rows per lane (x 4 columns): plain / pipelined kernel (ptxas
                                         # sm_90a: at most 229 / 168 registers, no spills)
WARPS = 2                                # warps per block (independent: no barrier)


def configs(d: int, pipe: bool = False) -> list[tuple[int, int]]:
    """The (NI, QW) instances that fit head_dim d: d a multiple of 4*QW and of the 32/QW row groups."""
    out = []
    for qw in (4, 2, 1):
        g = 32 // qw
        if d % g == 0 and d % (4 * qw) == 0 and 1 <= d // g <= MAX_NI[pipe]:
            out.append((d // g, qw))
    return out


def pick(d: int, mode: str, nslots: int, pipe: bool) -> tuple[int, int]:
    cfg = configs(d, pipe)
    if not cfg:
        raise DeviceUnavailable(f"kda head_dim {d}: the CUDA kernel needs head_dim a multiple of 8 and at most "
                                f"{32 * MAX_NI[pipe]}; use --device cpu")
    want = 2 if mode == "prefill" or nslots < 4 else 4
    return next((c for c in cfg if c[1] == want), cfg[0])


def kernel_name(ni: int, qw: int, pipe: bool) -> str:
    return f"kda_k<{ni}, {qw}, {'true' if pipe else 'false'}>"


def launches(op, bufs, rows: int, w, qw: int | None = None, pipe: bool | None = None) -> list:
    """The op's launch; qw: state column quads per warp (default: by mode and slots, `pick`); pipe: the
    pipelined row loop (default: prefill mode)."""
    H, d = int(op["heads"]), int(op["head_dim"])
    q, k, v, g, b = (bufs[op[n]] for n in ("q", "k", "v", "g", "b"))
    pos, slot, state, out = bufs[op["pos"]], bufs[op["slot"]], bufs[op["state"]], bufs[op["out"]]
    W = H * d
    for n, a in (("q", q), ("k", k), ("v", v), ("g", g), ("out", out)):
        if a.ndim != 2 or a.shape[-1] != W or a.shape[0] < rows:
            raise PlanMismatch(f"kda {op[n]}: {tuple(a.shape)}, [rows, heads*head_dim = {W}] expected")
    if b.shape[-1] != H or state.ndim != 4 or tuple(state.shape[1:]) != (H, d, d):
        raise PlanMismatch(f"kda {op['state']}: heads {H}, head_dim {d} against b {b.shape}, state {state.shape}")
    A_log, dt = w.vector(op["A_log"]), w.vector(op["dt_bias"])
    if A_log.size != H or dt.size != W:
        raise PlanMismatch(f"kda {op['A_log']}, {op['dt_bias']}: {A_log.size}, {dt.size} values, heads {H}, "
                           f"head_dim {d}")
    nslots = int(state.shape[0])
    mode = op.get("mode", "decode")
    if mode == "verify":                 # a one-row decode step's kernel, its rows in order, + history
        mode, pipe = "decode", False
    pipe = mode == "prefill" if pipe is None else bool(pipe)
    ni, q_ = pick(d, mode, nslots, pipe) if qw is None else next(
        (c for c in configs(d, pipe) if c[1] == qw), (None, None))
    if ni is None:
        raise DeviceUnavailable(f"kda head_dim {d}: no {'pipelined ' if pipe else ''}instance with {4 * qw} "
                                f"columns per warp")
    kern = cu.kernel(STEM, kernel_name(ni, q_, pipe))
    warps = H * (d // (4 * q_))
    grid, block = (-(-warps // WARPS), nslots), (32 * WARPS,)
    lb = op["lower_bound"]
    i32 = np.int32
    args = (q, k, v, g, b, pos, slot, A_log, dt, state, out, cu.history(op, bufs, rows, state), i32(rows),
            i32(nslots), i32(H), i32(d),
            np.float32(1 / np.sqrt(d)), np.float32(0.0 if lb is None else lb), i32(lb is not None))
    return [lambda: kern(grid, block, args)]


def state_bytes(op, active_slots: int) -> int:
    """State bytes one call reads and writes for `active_slots` slots continuing their sequences."""
    return 2 * active_slots * int(op["heads"]) * int(op["head_dim"]) ** 2 * 4
