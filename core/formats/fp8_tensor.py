"""FP8 with one F32 scale per tensor: value = f32(e4m3) * s (one rounding).
Scale shape () or (1,) (shared by a stack), or [...] one per stacked matrix."""

from __future__ import annotations

import numpy as np

from . import minifloat as mf
from .base import PartSpec
from .common import Scaled


class FP8Tensor(Scaled):
    name = "fp8_tensor"
    parts = (PartSpec("weight", ("F8_E4M3",)), PartSpec("scale", ("F32",)),
             PartSpec("input_scale", ("F32",), False))
    elem, scale_kind, bo, bi = "e4m3", "f", None, None

    def layouts(self, lead, nbo, nbi):
        ones = (1,) * len(lead) + (1, 1)
        return [((), ones), ((1,), ones), (lead, lead + (1, 1))]

    def encode(self, x):
        """s = amax/448 (1 for an all-zero tensor); elements e4m3(x / s)."""
        x = np.asarray(x, dtype=np.float32)
        s = np.float32(np.abs(x).max(initial=0.0)) / np.float32(mf.E4M3_MAX)
        s = np.float32(1.0) if s == 0 else s
        return {"weight": mf.encode_e4m3(x / s), "scale": np.array(s, dtype=np.float32)}


FORMAT = FP8Tensor()
