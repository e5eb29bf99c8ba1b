"""The CPU BLAS thread count (NumPy's bundled OpenBLAS, through ctypes; a no-op where the library
or its symbol is not found). Measured on this project's 2-vCPU machine while other processes ran:
OpenBLAS's own default (one thread per core) made a 37-token SmolLM2 prefill 7-8 s instead of
0.2 s with one thread (its spinning threads starve when the cores are shared), and a decode step
45-80 ms instead of 21 ms; so the NumPy executor runs with 1 thread unless told (--threads)."""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads")
_setter = None


def _find():
    global _setter
    if _setter is None:
        _setter = False
        libs = glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*"))
        for path in libs:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for s in _SYMBOLS:
                if hasattr(lib, s):
                    _setter = getattr(lib, s)
                    return _setter
    return _setter


def set_threads(n: int) -> bool:
    """Sets the BLAS thread count; False where it could not be set."""
    f = _find()
    if not f:
        return False
    f(ctypes.c_int(max(1, int(n))))
    return True
