"""Shared checks and the block-scaled base class behind most stored formats.

Sign policy (every format): a scale with its sign bit set is refused as NegativeScale,
except negative zero (-0.0, E4M3 byte 0x80), which is a zero scale and is accepted.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .. import dtypes
from ..errors import (MissingScale, NegativeScale, NonFiniteScale, NotOnBlockBoundary,
                            ScaleDtypeMismatch, ScaleShapeMismatch, UnexpectedScale)
from . import minifloat as mf
from .base import Format


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _w(where: str) -> str:
    return f"{where}: " if where else ""


def check_parts(fmt: Format, parts: Mapping[str, np.ndarray], where: str) -> None:
    """Missing / unexpected parts and stored dtypes, from fmt.parts."""
    known = {p.name: p for p in fmt.parts}
    for name in parts:
        if name not in known:
            raise UnexpectedScale(f"{_w(where)}{fmt.name}: part '{name}' is present but the format "
                                  f"has only {sorted(known)}")
    for p in fmt.parts:
        if p.name not in parts:
            if p.required:
                raise MissingScale(f"{_w(where)}{fmt.name}: part '{p.name}' is missing "
                                   f"(expected dtype {'/'.join(p.dtypes)})")
            continue
        dt = np.asarray(parts[p.name]).dtype
        if dt not in [dtypes.to_numpy(n) for n in p.dtypes]:
            try:
                found = dtypes.st_name(dt)
            except KeyError:
                found = str(dt)
            raise ScaleDtypeMismatch(f"{_w(where)}{fmt.name}: part '{p.name}' has dtype {found}; "
                                     f"expected {'/'.join(p.dtypes)}")


def check_shape(fmt: Format, name: str, a: np.ndarray, allowed: list, where: str) -> int:
    """Index of the first allowed shape that `a` has, or ScaleShapeMismatch."""
    shp = tuple(np.shape(a))
    for i, s in enumerate(allowed):
        if shp == tuple(s):
            return i
    exp = " or ".join(str(list(s)) for s in allowed)
    raise ScaleShapeMismatch(f"{_w(where)}{fmt.name}: part '{name}' has shape {list(shp)}; expected {exp}")


def check_values(fmt: Format, name: str, a: np.ndarray, kind: str, where: str,
                 allow_negative: bool = False) -> None:
    """NaN/Inf and negative refusals. kind: 'f' (IEEE float), 'e4m3', 'e8m0'."""
    a = np.asarray(a)
    if kind == "e8m0":
        bad = a.view(np.uint8) == 255
        neg = np.zeros_like(bad)
    elif kind == "e4m3":
        b = a.view(np.uint8)
        bad = (b & 0x7F) == 0x7F
        neg = (b > 0x80) & ~bad
    else:
        f = a.astype(np.float32)
        bad = ~np.isfinite(f)
        neg = f < 0
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise NonFiniteScale(f"{_w(where)}{fmt.name}: part '{name}' holds NaN/Inf "
                             f"({int(bad.sum())} entries, first at {list(i)}: {_show(a, i, kind)}); "
                             f"expected finite scales")
    if not allow_negative and neg.any():
        i = tuple(int(j) for j in np.argwhere(neg)[0])
        raise NegativeScale(f"{_w(where)}{fmt.name}: part '{name}' holds negative values "
                            f"({int(neg.sum())} entries, first at {list(i)}: {_show(a, i, kind)}); "
                            f"expected scales >= 0")


def _show(a, i, kind):
    v = a[i] if a.ndim else a[()]
    if kind in ("e4m3", "e8m0"):
        return f"byte 0x{int(np.asarray(v).view(np.uint8)):02X}"
    return repr(float(v))


def check_axis(fmt: Format, axis: int) -> int:
    if axis not in (-1, -2):
        raise ValueError(f"{fmt.name}: cut axis must be -1 (in) or -2 (out), got {axis}")
    return axis


def check_cut(fmt: Format, axis: int, start: int, stop: int, dim: int, unit: int, where: str) -> None:
    check_axis(fmt, axis)
    if not 0 <= start <= stop <= dim:
        raise ValueError(f"{_w(where)}{fmt.name}: cut [{start}, {stop}) is outside axis {axis} of size {dim}")
    for v in (start, stop):
        if v % unit and v != dim:
            raise NotOnBlockBoundary(
                f"{_w(where)}{fmt.name}: cut [{start}, {stop}) along axis {axis} (size {dim}): "
                f"{v} is not a multiple of the block of {unit} elements")


def sl(ndim: int, axis: int, start, stop) -> tuple:
    """Index tuple slicing `axis` (negative) of an ndim array."""
    idx = [slice(None)] * ndim
    idx[ndim + axis] = slice(start, stop)
    return tuple(idx)


SCALAR_SHAPES = ((), (1,))


class Scaled(Format):
    """weight elements times a scale per block of bo x bi elements (None: the whole axis).

    Subclasses set: elem ('e2m1' packed two per byte, or 'e4m3'), scale_kind ('f', 'e4m3',
    'e8m0'), bo, bi, exact_in (the in length must be a multiple of bi), and layouts()."""

    elem = "e4m3"
    scale_kind = "f"
    bo: int | None = 1
    bi: int | None = None
    exact_in = True

    # stored scale shapes accepted for weight lead dims, out, in; each maps to the canonical
    # [lead', nbo, nbi] (lead' = lead, or all ones when one scale is shared by a stack)
    def layouts(self, lead: tuple, nbo: int, nbi: int) -> list[tuple[tuple, tuple]]:
        return [(lead + (nbo, nbi), lead + (nbo, nbi))]

    # -- structure -------------------------------------------------------------
    def shape(self, parts):
        w = np.shape(parts["weight"])
        if self.elem == "e2m1":
            return (*w[:-1], w[-1] * 2)
        return tuple(w)

    def nblocks(self, shape) -> tuple[int, int]:
        out, inn = shape[-2], shape[-1]
        return (1 if self.bo is None else cdiv(out, self.bo), 1 if self.bi is None else cdiv(inn, self.bi))

    def _layout(self, parts, where: str) -> tuple[int, list]:
        shape = self.shape(parts)
        lays = self.layouts(tuple(shape[:-2]), *self.nblocks(shape))
        i = check_shape(self, "scale", parts["scale"], [s for s, _ in lays], where)
        return i, lays

    def check(self, parts, where=""):
        check_parts(self, parts, where)
        w = np.asarray(parts["weight"])
        if w.ndim < 2:
            raise ScaleShapeMismatch(f"{_w(where)}{self.name}: weight has shape {list(w.shape)}; "
                                     f"expected [..., out, in]")
        shape = self.shape(parts)
        if self.exact_in and self.bi and shape[-1] % self.bi:
            raise NotOnBlockBoundary(f"{_w(where)}{self.name}: row length {shape[-1]} is not a multiple "
                                     f"of the block of {self.bi}")
        self._layout(parts, where)
        check_values(self, "scale", parts["scale"], self.scale_kind, where)
        if "input_scale" in parts:
            check_shape(self, "input_scale", parts["input_scale"],
                        [*SCALAR_SHAPES, tuple(shape[:-2])], where)
            check_values(self, "input_scale", parts["input_scale"], "f", where)

    def cut_unit(self, axis: int) -> int:
        b = {-1: self.bi, -2: self.bo}[check_axis(self, axis)]
        return b or 1

    # -- values ----------------------------------------------------------------
    def scale_f32(self, scale) -> np.ndarray:
        if self.scale_kind == "e4m3":
            return mf.decode_e4m3(scale)
        if self.scale_kind == "e8m0":
            return mf.decode_e8m0(scale)
        return np.asarray(scale, dtype=np.float32)

    def elements(self, w) -> np.ndarray:
        if self.elem == "e2m1":
            return mf.unpack_e2m1(w)
        return mf.decode_e4m3(w)

    def canonical_scale(self, parts, where="") -> np.ndarray:
        i, lays = self._layout(parts, where)
        return np.asarray(parts["scale"]).reshape(lays[i][1])

    def decode(self, parts, where="", check=True):
        if check:
            self.check(parts, where)
        v = self.elements(parts["weight"])
        s = self.scale_f32(self.canonical_scale(parts, where))
        return apply_blocks(v, s, self.bo, self.bi)

    # -- cuts ------------------------------------------------------------------
    def cut(self, parts, axis, start, stop, where="", check=True):
        if check:
            self.check(parts, where)
        shape = self.shape(parts)
        check_cut(self, axis, start, stop, shape[axis], self.cut_unit(axis), where)
        out = {k: np.array(v, copy=True) for k, v in parts.items() if k not in ("weight", "scale")}
        w = np.asarray(parts["weight"])
        pk = 2 if (self.elem == "e2m1" and axis == -1) else 1
        out["weight"] = np.ascontiguousarray(w[sl(w.ndim, axis, start // pk, stop // pk)])
        b = {-1: self.bi, -2: self.bo}[axis]
        if b is not None:
            i, lays = self._layout(parts, where)
            s = np.asarray(parts["scale"]).reshape(lays[i][1])
            s = s[sl(s.ndim, axis, start // b, cdiv(stop, b))]
            new = self.shape(out)
            new_lay = self.layouts(tuple(new[:-2]), *self.nblocks(new))[i][0]
            out["scale"] = np.ascontiguousarray(s).reshape(new_lay)
        else:
            out["scale"] = np.array(parts["scale"], copy=True)
        return out


def apply_blocks(v: np.ndarray, s: np.ndarray, bo, bi) -> np.ndarray:
    """v [..., out, in] float32 (a fresh array, scaled in place) times canonical scale
    s [..., nbo, nbi] (float32): one rounding. Overflow to Inf is the float32 value, not an error."""
    out, inn = v.shape[-2], v.shape[-1]
    bo = out if bo is None else bo
    bi = inn if bi is None else bi
    with np.errstate(over="ignore"):
        if bo and bi and out % bo == 0 and inn % bi == 0:
            vb = v.reshape(*v.shape[:-2], out // bo, bo, inn // bi, bi)
            vb *= s[..., :, None, :, None]
        else:
            v *= np.repeat(np.repeat(s, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :inn]
    return v
