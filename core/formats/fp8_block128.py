"""FP8 with an F32 scale per 128x128 block: value = e4m3 * s[r//128, c//128] (one rounding).
Scale [..., ceil(out/128), ceil(in/128)], or ModelOpt fp8_pb_wo's [..., ob, 1, ib, 1]; a
DeepSeek-style weight_scale_inv is a multiplier too (the reader maps it onto `scale`)."""

from __future__ import annotations

import numpy as np

from . import minifloat as mf
from .base import PartSpec
from .common import Scaled
from .fp8_block32 import _expand, block_amax

BLOCK = 128


class FP8Block128(Scaled):
    name = "fp8_block128"
    parts = (PartSpec("weight", ("F8_E4M3",)), PartSpec("scale", ("F32",)),
             PartSpec("input_scale", ("F32",), False))
    elem, scale_kind, bo, bi, exact_in = "e4m3", "f", BLOCK, BLOCK, False

    def layouts(self, lead, nbo, nbi):
        c = lead + (nbo, nbi)
        return [(c, c), (lead + (nbo, 1, nbi, 1), c)]

    def encode(self, x):
        """s = block_amax/448 (1 where the block is all zero); elements e4m3(x / s)."""
        x = np.asarray(x, dtype=np.float32)
        s = block_amax(x, BLOCK) / np.float32(mf.E4M3_MAX)
        s[s == 0] = 1.0
        return {"weight": mf.encode_e4m3(x / _expand(s, x.shape, BLOCK)), "scale": s.astype(np.float32)}


FORMAT = FP8Block128()
