"""Q8_0 (GGML, the output of the BLOOMERY_PREPARE_Q8 lever): blocks of 32 along in, each an
F16 d then 32 int8; value = q * d (exact in float32). Stored as U8 [..., out, in/32*34]."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import NotOnBlockBoundary, ScaleShapeMismatch
from .base import Format, PartSpec
from .common import _w, check_axis, check_cut, check_parts, check_values, sl

BLOCK, BYTES = 32, 34


class Q8_0(Format):
    name = "q8_0"
    parts = (PartSpec("weight", ("U8",)),)

    def shape(self, parts):
        w = np.shape(parts["weight"])
        return (*w[:-1], w[-1] // BYTES * BLOCK)

    def _blocks(self, w):
        w = np.asarray(w)
        return w.reshape(*w.shape[:-1], w.shape[-1] // BYTES, BYTES)

    def _d(self, w) -> np.ndarray:
        return np.ascontiguousarray(self._blocks(w)[..., :2]).view(np.float16)[..., 0]

    def check(self, parts, where=""):
        check_parts(self, parts, where)
        w = np.asarray(parts["weight"])
        if w.ndim < 2 or w.shape[-1] % BYTES:
            raise ScaleShapeMismatch(f"{_w(where)}q8_0: weight has shape {list(w.shape)}; "
                                     f"expected [..., out, n*{BYTES}] (GGML Q8_0 blocks)")
        check_values(self, "scale (block d)", self._d(w), "f", where)

    def cut_unit(self, axis):
        return {-1: BLOCK, -2: 1}[check_axis(self, axis)]

    def cut(self, parts, axis, start, stop, where="", check=True):
        if check:
            self.check(parts, where)
        shape = self.shape(parts)
        check_cut(self, axis, start, stop, shape[axis], self.cut_unit(axis), where)
        w = np.asarray(parts["weight"])
        a, b = (start // BLOCK * BYTES, stop // BLOCK * BYTES) if axis == -1 else (start, stop)
        return {"weight": np.ascontiguousarray(w[sl(w.ndim, axis, a, b)])}

    def decode(self, parts, where="", check=True):
        if check:
            self.check(parts, where)
        bl = self._blocks(parts["weight"])
        d = self._d(parts["weight"]).astype(np.float32)
        q = bl[..., 2:].view(np.int8).astype(np.float32)
        return (q * d[..., None]).reshape(self.shape(parts))

    def encode(self, x):
        """Bit-exact with gguf.quants.quantize(x, Q8_0) (ggml-quants.c): d = amax/127,
        q = round-half-away(x * (1/d)), d stored as F16."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim < 1 or x.shape[-1] % BLOCK:
            raise NotOnBlockBoundary(f"q8_0: encode needs in % {BLOCK} == 0, got {list(x.shape)}")
        xb = x.reshape(*x.shape[:-1], -1, BLOCK)
        d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        v = xb * inv
        a = np.abs(v)
        fl = np.floor(a)
        q = (np.sign(v) * (fl + np.floor(2 * (a - fl)))).astype(np.int8)
        blocks = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
        return {"weight": blocks.reshape(*x.shape[:-1], -1)}


FORMAT = Q8_0()


def to_ggml(parts, where: str = "") -> tuple[np.ndarray, GGMLQuantizationType]:
    """Q8_0 is stored as GGML blocks already: the weight bytes as is."""
    FORMAT.check(parts, where)
    return np.asarray(parts["weight"]), GGMLQuantizationType.Q8_0


def from_ggml(blocks, where: str = "") -> dict:
    parts = {"weight": np.asarray(blocks, dtype=np.uint8)}
    FORMAT.check(parts, where)
    return parts
