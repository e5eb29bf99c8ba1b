"""MXFP8 (OCP MX): E4M3 elements, an E8M0 scale per 32 along in; value = e4m3 * 2^(e-127) (exact)."""

from __future__ import annotations

import numpy as np

from ..errors import NotOnBlockBoundary
from . import minifloat as mf
from .base import PartSpec
from .common import Scaled

BLOCK = 32


class MXFP8(Scaled):
    name = "mxfp8"
    parts = (PartSpec("weight", ("F8_E4M3",)), PartSpec("scale", ("U8", "F8_E8M0")),
             PartSpec("input_scale", ("F32",), False))
    elem, scale_kind, bo, bi = "e4m3", "e8m0", 1, BLOCK

    def encode(self, x):
        """ModelOpt's recipe: E8M0 scale 2^ceil(log2(block_amax/448)); elements e4m3(x / scale)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim < 2 or x.shape[-1] % BLOCK:
            raise NotOnBlockBoundary(f"mxfp8: encode needs [..., out, in] with in % {BLOCK} == 0, got {list(x.shape)}")
        xb = x.reshape(*x.shape[:-1], -1, BLOCK)
        e = mf.e8m0_exponent(np.abs(xb).max(axis=-1), mf.E4M3_MAX)
        return {"weight": mf.encode_e4m3(xb / mf.E8M0[e][..., None]).reshape(x.shape), "scale": e}


FORMAT = MXFP8()
