"""FP8 with an F32 scale per output row: value = e4m3 * s[row] (one rounding).
Scale [..., out] or [..., out, 1]."""

from __future__ import annotations

import numpy as np

from . import minifloat as mf
from .base import PartSpec
from .common import Scaled


class FP8Channel(Scaled):
    name = "fp8_channel"
    parts = (PartSpec("weight", ("F8_E4M3",)), PartSpec("scale", ("F32",)),
             PartSpec("input_scale", ("F32",), False))
    elem, scale_kind, bo, bi = "e4m3", "f", 1, None

    def layouts(self, lead, nbo, nbi):
        return [(lead + (nbo,), lead + (nbo, 1)), (lead + (nbo, 1), lead + (nbo, 1))]

    def encode(self, x):
        """s = row_amax/448 (1 for an all-zero row); elements e4m3(x / s); scale [..., out, 1]."""
        x = np.asarray(x, dtype=np.float32)
        s = np.abs(x).max(axis=-1, keepdims=True) / np.float32(mf.E4M3_MAX)
        s[s == 0] = 1.0
        return {"weight": mf.encode_e4m3(x / s), "scale": s.astype(np.float32)}


FORMAT = FP8Channel()
