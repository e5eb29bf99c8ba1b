"""NVFP4 (also W4A16_NVFP4, NVFP4_AWQ): E2M1 pairs, an E4M3 scale per 16, an F32 global scale.

value = (e2m1 * e4m3(scale)) * scale_2 in float32: the first product is exact, so this is
the correctly rounded value of the three-way product. ModelOpt's NVFP4QTensor.dequantize
computes e2m1 * (e4m3 * scale_2) instead (two roundings): the two agree bit for bit when
scale_2 is a power of two (barring underflow), and otherwise differ by at most 1 ulp, only
where |e2m1| is 1.5, 3 or 6 (tests/test_formats.py measures it). NVFP4QTensor and GGML also read
E2M1 code 8 as +0.0 where this decoder (like ml_dtypes) gives -0.0.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import NotOnBlockBoundary, ScaleShapeMismatch
from . import minifloat as mf
from .base import PartSpec
from .common import SCALAR_SHAPES, Scaled, check_shape, check_values, sl

BLOCK = 16
GGML_BLOCK = 64


class NVFP4(Scaled):
    name = "nvfp4"
    parts = (PartSpec("weight", ("U8",)), PartSpec("scale", ("F8_E4M3",)),
             PartSpec("scale_2", ("F32",)), PartSpec("input_scale", ("F32",), False),
             PartSpec("pre_quant_scale", ("BF16", "F16", "F32"), False))
    elem, scale_kind, bo, bi = "e2m1", "e4m3", 1, BLOCK

    def check(self, parts, where=""):
        super().check(parts, where)
        lead = tuple(self.shape(parts)[:-2])
        check_shape(self, "scale_2", parts["scale_2"], [*SCALAR_SHAPES, lead], where)
        check_values(self, "scale_2", parts["scale_2"], "f", where)
        if "pre_quant_scale" in parts:
            inn = self.shape(parts)[-1]
            check_shape(self, "pre_quant_scale", parts["pre_quant_scale"], [(inn,), lead + (inn,)], where)
            # a smoothing factor, not a weight scale: its sign is not refused
            check_values(self, "pre_quant_scale", parts["pre_quant_scale"], "f", where, allow_negative=True)

    def decode(self, parts, where=""):
        v = super().decode(parts, where)           # e2m1 * e4m3, exact
        s2 = np.asarray(parts["scale_2"], dtype=np.float32)
        if s2.ndim and s2.shape != (1,):
            s2 = s2.reshape(*s2.shape, 1, 1)
        else:
            s2 = s2.reshape(())
        with np.errstate(over="ignore"):
            v *= s2                                 # the one rounding
        return v

    def cut(self, parts, axis, start, stop, where=""):
        out = super().cut(parts, axis, start, stop, where)
        if axis == -1 and "pre_quant_scale" in parts:
            p = np.asarray(parts["pre_quant_scale"])
            out["pre_quant_scale"] = np.ascontiguousarray(p[sl(p.ndim, -1, start, stop)])
        return out

    def encode(self, x, scale_2=None, input_scale=None, pre_quant_scale=None):
        """ModelOpt's recipe: scale_2 = amax/(6*448); block scale e4m3(block_amax/(6*scale_2)),
        0 -> 1, clamped to [2^-9, 448]; elements nearest E2M1 of x/(e4m3*scale_2)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim < 2 or x.shape[-1] % BLOCK:
            raise NotOnBlockBoundary(f"nvfp4: encode needs [..., out, in] with in % {BLOCK} == 0, got {list(x.shape)}")
        if scale_2 is None:
            scale_2 = np.float32(np.abs(x).max(initial=0.0)) / np.float32(mf.E2M1_MAX * mf.E4M3_MAX)
            if scale_2 == 0:
                scale_2 = np.float32(1.0)            # an all-zero tensor: any scale decodes to 0
        s2 = np.float32(scale_2)
        xb = x.reshape(*x.shape[:-1], -1, BLOCK)
        bs = np.abs(xb).max(axis=-1) / (np.float32(mf.E2M1_MAX) * s2)
        bs[bs == 0] = 1.0
        scale = mf.encode_e4m3(np.clip(bs, 2.0 ** -9, mf.E4M3_MAX))
        q = xb / (mf.decode_e4m3(scale) * s2)[..., None]
        codes = mf.encode_e2m1(q.reshape(x.shape))
        parts = {"weight": mf.pack_nibbles(codes), "scale": scale, "scale_2": np.array(s2, dtype=np.float32)}
        if input_scale is not None:
            parts["input_scale"] = np.asarray(input_scale, dtype=np.float32)
        if pre_quant_scale is not None:
            parts["pre_quant_scale"] = np.asarray(pre_quant_scale)
        return parts


FORMAT = NVFP4()


def to_ggml(parts, where: str = "") -> tuple[np.ndarray, GGMLQuantizationType]:
    """Lossless repack into GGML NVFP4 blocks: uint8 [..., out, in/64*36], each super-block
    4 scale bytes (the E4M3 bytes as is) then 4 x 8 bytes; in sub-block s, byte j holds element
    j (low nibble) and j+8 (high). GGML's value (kvalue/2 * ue4m3) is e2m1 * e4m3, so
    gguf dequantize * scale_2 equals decode() (GGML reads nibble 8 as +0, decode as -0)."""
    FORMAT.check(parts, where)
    shape = FORMAT.shape(parts)
    inn = shape[-1]
    if inn % GGML_BLOCK:
        raise NotOnBlockBoundary(f"{where + ': ' if where else ''}nvfp4: row length {inn} is not a multiple "
                                 f"of GGML NVFP4's super-block of {GGML_BLOCK}")
    lead, nsb = tuple(shape[:-1]), inn // GGML_BLOCK
    codes = mf.unpack_nibbles(np.asarray(parts["weight"])).reshape(*lead, nsb, 4, 2, 8)
    qs = codes[..., 0, :] | (codes[..., 1, :] << 4)                 # [..., nsb, 4, 8]
    d = np.asarray(parts["scale"]).view(np.uint8).reshape(*lead, nsb, 4)
    blocks = np.concatenate([d, qs.reshape(*lead, nsb, 32)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(*lead, nsb * 36)), GGMLQuantizationType.NVFP4


def from_ggml(blocks, scale_2, input_scale=None, pre_quant_scale=None, where: str = "") -> dict:
    """Inverse of to_ggml: GGML NVFP4 bytes [..., out, n*36] plus the side tensors -> parts."""
    import ml_dtypes
    b = np.asarray(blocks, dtype=np.uint8)
    if b.ndim < 2 or b.shape[-1] % 36:
        raise ScaleShapeMismatch(f"{where + ': ' if where else ''}nvfp4: GGML NVFP4 blocks of shape "
                                 f"{list(b.shape)}; expected [..., out, n*36]")
    lead, nsb = b.shape[:-1], b.shape[-1] // 36
    sb = b.reshape(*lead, nsb, 36)
    d = np.ascontiguousarray(sb[..., :4]).reshape(*lead, nsb * 4)
    qs = sb[..., 4:].reshape(*lead, nsb, 4, 8)
    codes = np.stack([qs & 0xF, qs >> 4], axis=-2)                  # [..., nsb, 4, 2, 8]
    parts = {"weight": mf.pack_nibbles(codes.reshape(*lead, nsb * 64)),
             "scale": d.view(ml_dtypes.float8_e4m3fn),
             "scale_2": np.asarray(scale_2, dtype=np.float32)}
    if input_scale is not None:
        parts["input_scale"] = np.asarray(input_scale, dtype=np.float32)
    if pre_quant_scale is not None:
        parts["pre_quant_scale"] = np.asarray(pre_quant_scale)
    FORMAT.check(parts, where)
    return parts
