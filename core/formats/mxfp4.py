"""MXFP4 (OCP MX): E2M1 pairs packed like NVFP4, an E8M0 scale per 32; value = e2m1 * 2^(e-127)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import NotOnBlockBoundary, ScaleShapeMismatch
from . import minifloat as mf
from .base import PartSpec
from .common import Scaled

BLOCK = 32


class MXFP4(Scaled):
    name = "mxfp4"
    parts = (PartSpec("weight", ("U8",)), PartSpec("scale", ("U8", "F8_E8M0")),
             PartSpec("input_scale", ("F32",), False))
    elem, scale_kind, bo, bi = "e2m1", "e8m0", 1, BLOCK

    def encode(self, x):
        """E8M0 scale 2^ceil(log2(block_amax/6)); elements nearest E2M1 (ties to even)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim < 2 or x.shape[-1] % BLOCK:
            raise NotOnBlockBoundary(f"mxfp4: encode needs [..., out, in] with in % {BLOCK} == 0, got {list(x.shape)}")
        xb = x.reshape(*x.shape[:-1], -1, BLOCK)
        e = mf.e8m0_exponent(np.abs(xb).max(axis=-1), mf.E2M1_MAX)
        codes = mf.encode_e2m1(xb / mf.E8M0[e][..., None])
        return {"weight": mf.pack_nibbles(codes.reshape(x.shape)), "scale": e}


FORMAT = MXFP4()


def to_ggml(parts, where: str = "") -> tuple[np.ndarray, GGMLQuantizationType]:
    """Lossless repack into GGML MXFP4 blocks: uint8 [..., out, in/32*17], each block the E8M0
    byte then 16 bytes, byte j = element j (low nibble) and j+16 (high). GGML's value
    (kvalue * 2^(e-128)) equals decode() (GGML reads nibble 8 as +0, decode as -0)."""
    FORMAT.check(parts, where)
    shape = FORMAT.shape(parts)
    lead, nb = tuple(shape[:-1]), shape[-1] // BLOCK
    codes = mf.unpack_nibbles(np.asarray(parts["weight"])).reshape(*lead, nb, 2, 16)
    qs = codes[..., 0, :] | (codes[..., 1, :] << 4)
    e = np.asarray(parts["scale"]).view(np.uint8).reshape(*lead, nb, 1)
    blocks = np.concatenate([e, qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(*lead, nb * 17)), GGMLQuantizationType.MXFP4


def from_ggml(blocks, where: str = "") -> dict:
    """Inverse of to_ggml: GGML MXFP4 bytes [..., out, n*17] -> parts (scale as U8)."""
    b = np.asarray(blocks, dtype=np.uint8)
    if b.ndim < 2 or b.shape[-1] % 17:
        raise ScaleShapeMismatch(f"{where + ': ' if where else ''}mxfp4: GGML MXFP4 blocks of shape "
                                 f"{list(b.shape)}; expected [..., out, n*17]")
    lead, nb = b.shape[:-1], b.shape[-1] // 17
    bb = b.reshape(*lead, nb, 17)
    qs = bb[..., 1:]
    codes = np.stack([qs & 0xF, qs >> 4], axis=-2)                  # [..., nb, 2, 16]
    parts = {"weight": mf.pack_nibbles(codes.reshape(*lead, nb * BLOCK)),
             "scale": np.ascontiguousarray(bb[..., 0])}
    FORMAT.check(parts, where)
    return parts
