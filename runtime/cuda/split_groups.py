"""CUDA split_groups: the contract of runtime/ops/split_groups.py as one gather (split_groups.cu)
over a column map built here from groups / widths / split (static)."""

from __future__ import annotations

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from ..errors import PlanMismatch
from . import cu
from .ops import grid1d


def column_map(groups: int, widths, split: int) -> tuple[np.ndarray, int]:
    """x's column of each output column [out | rest], and out's width."""
    widths = [int(v) for v in widths]
    total, starts = sum(widths), np.cumsum([0] + widths)[:-1]
    cols = [g * total + starts[f] + np.arange(widths[f]) for f in range(len(widths)) for g in range(groups)]
    nout = groups * sum(widths[:split])
    return np.concatenate(cols).astype(np.int32), nout


def launches(op, bufs, rows: int, w) -> list:
    x, out, rest = bufs[op["x"]], bufs[op["out"]], bufs[op["rest"]]
    src, nout = column_map(int(op["groups"]), op["widths"], int(op["split"]))
    nrest = src.size - nout
    if x.shape[-1] != src.size or out.shape[-1] != nout or rest.shape[-1] != nrest:
        raise PlanMismatch(f"split_groups {op['x']}: groups {op['groups']} x widths {op['widths']} against x {x.shape}, "
                           f"out {out.shape}, rest {rest.shape}")
    if any(b is x or (b.data.ptr < x.data.ptr + x.nbytes and x.data.ptr < b.data.ptr + b.nbytes) for b in (out, rest)):
        raise PlanMismatch(f"split_groups {op['x']}: out / rest overlap x (the CUDA gather is not in place)")
    smap = cp.asarray(src)
    kern = cu.kernel("split_groups", "split_groups_k")
    args = (x, out, rest, smap, np.int32(rows), np.int32(x.shape[-1]), np.int32(nout), np.int32(nrest))
    grid = grid1d(rows * src.size)
    return [lambda: kern(grid, (256,), args)]
