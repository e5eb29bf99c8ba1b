"""Kernels kept in `.cu` files beside their Python binding (runtime/cuda/<op>.cu), compiled by NVRTC
through cupy.RawModule from the file's text, once per process per kernel (CuPy also caches the
compiled module on disk, keyed by the source and options).

    k = cu.kernel("gated_delta", "gated_delta_k<16, 4>")     # a cupy.RawKernel
    cu.source("gated_delta")                                  # the file's text (importable without CuPy)

The .cu files are package data of bloomery.runtime.cuda (pyproject.toml); each includes at most the
shared headers beside it (numerics.cuh: the number formats' conversions and the tensor-core wrappers),
which source() pastes in, so nvcc compiles a file as it stands with -I runtime/cuda: `nvcc -arch=sm_90a
-std=c++17 -I runtime/cuda -c` with explicit instantiations (tools/bench_hybrid.py --nvcc prints the
command and the ptxas report)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

HERE = Path(__file__).resolve().parent
OPTIONS = ("-std=c++17",)


@lru_cache(maxsize=None)
def header(stem: str) -> str:
    """The text of runtime/cuda/<stem>.cuh, without its #pragma once (pasted into one source once)."""
    return "".join(line for line in (HERE / f"{stem}.cuh").read_text().splitlines(keepends=True)
                   if line.strip() != "#pragma once")


@lru_cache(maxsize=None)
def source(stem: str) -> str:
    """The text of runtime/cuda/<stem>.cu, each `#include "<name>.cuh"` line replaced by that header's text
    (the compiled source, and so CuPy's cache key, holds every line it compiles)."""
    out = []
    for line in (HERE / f"{stem}.cu").read_text().splitlines(keepends=True):
        t = line.strip()
        if t.startswith('#include "') and t.endswith('.cuh"'):
            out.append(header(t[len('#include "'):-len('.cuh"')]))
        else:
            out.append(line)
    return "".join(out)


def prefetch_args(arrays, slots: int, unused) -> tuple:
    """The (pointer, bytes) argument pairs of a kernel with `slots` L2-prefetch ranges (numerics.cuh
    l2_prefetch_share: a kernel bringing the next launches' weights into the L2): each array's, then `unused`
    with 0 bytes (nothing fetched) in the slots left."""
    import numpy as np
    arrays = list(arrays)
    if len(arrays) > slots:
        raise ValueError(f"{len(arrays)} arrays to prefetch, the kernel takes at most {slots}")
    return tuple(v for a in arrays + [None] * (slots - len(arrays))
                 for v in ((unused, np.int64(0)) if a is None else (a, np.int64(a.nbytes))))


_MODS: dict = {}


def kernel(stem: str, name: str):
    """The cupy.RawKernel `name` (a template instance is named as C++ writes it: "k<16, 4>") of
    <stem>.cu, compiled on first use (one NVRTC module per kernel: a program compiles only the
    instances it launches)."""
    key = (stem, name)
    if key not in _MODS:
        mod = cp.RawModule(code=source(stem), options=OPTIONS, name_expressions=[name])
        _MODS[key] = (mod, mod.get_function(name))
    return _MODS[key][1]


def history(op, bufs, rows: int, state):
    """A state op's `history` buffer in the verify program ([rows, *the state's per-slot shape]: the
    slot's state after each row, which Engine.accept restores), or a null pointer where the op has none."""
    import numpy as np
    if "history" not in op:
        return np.uintp(0)
    h = bufs[op["history"]]
    if h.shape[0] < rows or tuple(h.shape[1:]) != tuple(state.shape[1:]):
        from ..errors import PlanMismatch
        raise PlanMismatch(f"{op['op']} {op['history']}: history {tuple(h.shape)}, [rows {rows}, "
                           f"{', '.join(map(str, state.shape[1:]))}] expected")
    return h
