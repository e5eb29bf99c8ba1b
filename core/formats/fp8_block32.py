"""FP8 with an E8M0 scale per 32x32 block: value = e4m3 * 2^(e-127) (exact).
Scale [..., ceil(out/32), ceil(in/32)]; edges that are not a multiple of 32 are allowed."""

from __future__ import annotations

import numpy as np

from . import minifloat as mf
from .base import PartSpec
from .common import Scaled, cdiv

BLOCK = 32


class FP8Block32(Scaled):
    name = "fp8_block32"
    parts = (PartSpec("weight", ("F8_E4M3",)), PartSpec("scale", ("U8", "F8_E8M0")),
             PartSpec("input_scale", ("F32",), False))
    elem, scale_kind, bo, bi, exact_in = "e4m3", "e8m0", BLOCK, BLOCK, False

    def encode(self, x):
        """E8M0 scale 2^ceil(log2(block_amax/448)) per 32x32 block; elements e4m3(x / scale)."""
        x = np.asarray(x, dtype=np.float32)
        amax = block_amax(x, BLOCK)
        e = mf.e8m0_exponent(amax, mf.E4M3_MAX)
        s = _expand(mf.E8M0[e], x.shape, BLOCK)
        return {"weight": mf.encode_e4m3(x / s), "scale": e}


def block_amax(x: np.ndarray, b: int) -> np.ndarray:
    """max |x| over b x b blocks of the last two axes (edges padded with zeros)."""
    out, inn = x.shape[-2:]
    po, pi = cdiv(out, b) * b - out, cdiv(inn, b) * b - inn
    a = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 2) + [(0, po), (0, pi)])
    a = a.reshape(*x.shape[:-2], cdiv(out, b), b, cdiv(inn, b), b)
    return a.max(axis=(-3, -1))


def _expand(s: np.ndarray, shape, b: int) -> np.ndarray:
    out, inn = shape[-2:]
    return np.repeat(np.repeat(s, b, axis=-2)[..., :out, :], b, axis=-1)[..., :inn]


FORMAT = FP8Block32()
