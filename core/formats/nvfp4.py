"""NVFP4 (also W4A16_NVFP4, NVFP4_AWQ): E2M1 pairs, an E4M3 scale per 16, an F32 global scale;
nvfp4_g32 (W4A8_NVFP4_FP8): the same with an E4M3 scale per 32.

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

    def decode(self, parts, where="", check=True):
        v = super().decode(parts, where, check)    # e2m1 * e4m3, exact
        s2 = np.asarray(parts["scale_2"], dtype=np.float32)
        if s2.ndim and s2.shape != (1,):
            s2 = s2.reshape(*s2.shape, 1, 1)
        else:
            s2 = s2.reshape(())
        with np.errstate(over="ignore"):
            v *= s2                                 # the one rounding
        return v

    def cut(self, parts, axis, start, stop, where="", check=True):
        out = super().cut(parts, axis, start, stop, where, check)
        if axis == -1 and "pre_quant_scale" in parts:
            p = np.asarray(parts["pre_quant_scale"])
            out["pre_quant_scale"] = np.ascontiguousarray(p[sl(p.ndim, -1, start, stop)])
        return out

    def encode(self, x, scale_2=None, input_scale=None, pre_quant_scale=None):
        """ModelOpt's recipe: scale_2 = amax/(6*448); block scale e4m3(block_amax/(6*scale_2)),
        0 -> 1, clamped to [2^-9, 448]; elements nearest E2M1 of x/(e4m3*scale_2)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim < 2 or x.shape[-1] % self.bi:
            raise NotOnBlockBoundary(f"{self.name}: encode needs [..., out, in] with in % {self.bi} == 0, "
                                     f"got {list(x.shape)}")
        if scale_2 is None:
            scale_2 = np.float32(np.abs(x).max(initial=0.0)) / np.float32(mf.E2M1_MAX * mf.E4M3_MAX)
            if scale_2 == 0:
                scale_2 = np.float32(1.0)            # an all-zero tensor: any scale decodes to 0
        s2 = np.float32(scale_2)
        xb = x.reshape(*x.shape[:-1], -1, self.bi)
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


class NVFP4G32(NVFP4):
    """W4A8_NVFP4_FP8 as ModelOpt exports it (its preset W4A8_NVFP4_FP8_CFG): weight U8 [.., out,
    in/2] as NVFP4, weight_scale F8_E4M3 [.., out, in/32] (one scale per 32 elements),
    weight_scale_2 F32 (amax/448 there, for its FP8 activations), input_scale F32. Same value
    rule. The artifact holds it as nvfp4 (`held`): each scale once per 16-element half of its
    block, so every element decodes to the same value bit for bit."""

    name = "nvfp4_g32"
    bi = 32
    held_as = "nvfp4"

    def held(self, parts, where=""):
        self.check(parts, where)
        out = dict(parts)
        out["scale"] = np.repeat(np.asarray(parts["scale"]), self.bi // BLOCK, axis=-1)
        return out


FORMAT = NVFP4()
FORMAT_G32 = NVFP4G32()


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
    return ggml_blocks(parts["weight"], parts["scale"]), GGMLQuantizationType.NVFP4


_M0F, _MF0 = np.uint64(0x000F000F000F000F), np.uint64(0x00F000F000F000F0)


def _spread(x: np.ndarray) -> np.ndarray:
    """Each uint64 holding 4 bytes b0..b3 in its low half -> b0 0 b1 0 b2 0 b3 0 (in place)."""
    x |= x << np.uint64(16)
    x &= np.uint64(0x0000FFFF0000FFFF)
    x |= x << np.uint64(8)
    x &= np.uint64(0x00FF00FF00FF00FF)
    return x


def ggml_blocks(weight, scale) -> np.ndarray:
    """to_ggml's bytes from checked parts' weight [..., in/2] and scale [..., in/16] (in a multiple
    of 64), without its checks (layout.iter_gguf repacks parts it checked once). Word at a time: a
    sub-block's 8 stored bytes are one little-endian uint64 whose low 4 bytes hold elements 0..7
    (byte m: 2m low, 2m+1 high) and high 4 bytes elements 8..15; GGML's byte 2m takes the low
    nibbles of byte m of each half (element 2m low, 2m+8 high), byte 2m+1 their high nibbles."""
    w = np.ascontiguousarray(weight).view(np.uint8)
    lead, nsb = w.shape[:-1], w.shape[-1] // 32
    words = w.reshape(-1).view("<u8")
    lo = _spread(words & np.uint64(0xFFFFFFFF))
    hi = _spread(words >> np.uint64(32))
    q = lo & _M0F
    lo &= _MF0
    lo <<= np.uint64(4)
    q |= lo
    q |= (hi & _M0F) << np.uint64(4)
    hi &= _MF0
    hi <<= np.uint64(8)
    q |= hi
    out = np.empty((*lead, nsb, 36), np.uint8)
    out[..., :4] = np.asarray(scale).view(np.uint8).reshape(*lead, nsb, 4)
    out[..., 4:] = q.astype("<u8", copy=False).view(np.uint8).reshape(*lead, nsb, 32)
    return out.reshape(*lead, nsb * 36)


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
