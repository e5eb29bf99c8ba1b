"""Unquantized weights (BF16, F16, F32): the value is the stored element, widened to float32 (exact)."""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .base import Format, PartSpec
from .common import check_axis, check_cut, check_parts, sl


class Dense(Format):
    def __init__(self, name: str, st_dtype: str):
        self.name, self.st_dtype = name, st_dtype
        self.parts = (PartSpec("weight", (st_dtype,)),)

    def shape(self, parts):
        return tuple(np.shape(parts["weight"]))

    def check(self, parts, where=""):
        check_parts(self, parts, where)

    def cut_unit(self, axis):
        check_axis(self, axis)
        return 1

    def cut(self, parts, axis, start, stop, where="", check=True):
        if check:
            self.check(parts, where)
        w = np.asarray(parts["weight"])
        check_cut(self, axis, start, stop, w.shape[axis], 1, where)
        return {"weight": np.ascontiguousarray(w[sl(w.ndim, axis, start, stop)])}

    def decode(self, parts, where="", check=True):
        if check:
            self.check(parts, where)
        return np.asarray(parts["weight"]).astype(np.float32)

    def encode(self, x):
        """Round to nearest even (ml_dtypes / NumPy casts)."""
        return {"weight": np.asarray(x, dtype=np.float32).astype(dtypes.to_numpy(self.st_dtype))}


BF16 = Dense("bf16", "BF16")
F16 = Dense("f16", "F16")
F32 = Dense("f32", "F32")
