"""Tensor-parallel cuts: decode(cut(p)) == decode(p)[slice] bit for bit, the pieces join back to
the whole, and a cut off the block boundary is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from bloomery.core import formats
from bloomery.core.errors import NotOnBlockBoundary
from test_formats import LAYOUTS, NAMES, make, same_bits

UNITS = {"nvfp4": (16, 1), "nvfp4_g32": (32, 1), "mxfp4": (32, 1), "mxfp8": (32, 1), "fp8_tensor": (1, 1),
         "fp8_channel": (1, 1), "fp8_block128": (128, 128), "fp8_block32": (32, 32),
         "bf16": (1, 1), "f16": (1, 1), "f32": (1, 1), "q8_0": (32, 1)}
SHAPES = {"nvfp4": (2, 9, 96), "nvfp4_g32": (2, 9, 160), "mxfp4": (2, 9, 128), "mxfp8": (9, 128), "fp8_tensor": (3, 9, 20),
          "fp8_channel": (3, 9, 20), "fp8_block128": (2, 300, 390), "fp8_block32": (70, 100),
          "bf16": (9, 20), "f16": (9, 20), "f32": (2, 9, 20), "q8_0": (2, 9, 128)}


def test_cut_units():
    for name in NAMES:
        f = formats.get(name)
        assert (f.cut_unit(-1), f.cut_unit(-2)) == UNITS[name], name


def _bounds(dim, unit):
    """Cut points on the unit, ending on the (possibly partial) last block."""
    pts = sorted({0, unit, 2 * unit, (dim // unit) * unit, dim} & set(range(dim + 1)))
    return list(zip(pts[:-1], pts[1:]))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("axis", [-1, -2])
def test_cut_decodes_to_slice_and_joins(name, axis):
    f = formats.get(name)
    for layout in range(LAYOUTS.get(name, 1)):
        p = make(name, SHAPES[name], np.random.default_rng(abs(axis) + layout), layout)
        with np.errstate(over="ignore"):
            whole = f.decode(p)
        dim = whole.shape[axis]
        pieces, weights = [], []
        for a, b in _bounds(dim, f.cut_unit(axis)):
            c = f.cut(p, axis, a, b, "t")
            f.check(c, "t")
            idx = [slice(None)] * whole.ndim
            idx[axis] = slice(a, b)
            with np.errstate(over="ignore"):
                d = f.decode(c)
            same_bits(d, whole[tuple(idx)])
            pieces.append(d)
            weights.append(np.asarray(c["weight"]))
            for k in ("scale_2", "input_scale"):
                if k in p:
                    assert c[k].tobytes() == p[k].tobytes()
        same_bits(np.concatenate(pieces, axis=axis), whole)
        joined = np.concatenate(weights, axis=axis)
        assert joined.dtype == p["weight"].dtype and joined.tobytes() == np.ascontiguousarray(p["weight"]).tobytes()


def test_nvfp4_cut_slices_pre_quant_scale():
    p = make("nvfp4", (4, 64), np.random.default_rng(0))
    p["pre_quant_scale"] = np.arange(64, dtype=np.float32)
    p["input_scale"] = np.float32(0.5)
    c = formats.get("nvfp4").cut(p, -1, 16, 48)
    assert list(c["pre_quant_scale"]) == list(range(16, 48)) and c["input_scale"] == 0.5
    c = formats.get("nvfp4").cut(p, -2, 1, 3)
    assert c["pre_quant_scale"].shape == (64,)


@pytest.mark.parametrize("name,axis,start,stop", [
    ("nvfp4", -1, 8, 32), ("nvfp4", -1, 0, 40), ("mxfp4", -1, 16, 64), ("mxfp8", -1, 0, 48),
    ("fp8_block128", -2, 64, 128), ("fp8_block128", -1, 0, 200), ("fp8_block32", -2, 0, 16),
    ("fp8_block32", -1, 40, 64), ("q8_0", -1, 0, 16)])
def test_cut_off_boundary_refused(name, axis, start, stop):
    f = formats.get(name)
    p = make(name, SHAPES[name], np.random.default_rng(0))
    with pytest.raises(NotOnBlockBoundary) as e:
        f.cut(p, axis, start, stop, "blk.3.ffn_up")
    msg = str(e.value)
    assert "blk.3.ffn_up" in msg and name in msg and f"[{start}, {stop})" in msg
    assert str(f.cut_unit(axis)) in msg


def test_cut_out_of_range_refused():
    p = make("fp8_channel", (9, 20), np.random.default_rng(0))
    with pytest.raises(ValueError):
        formats.get("fp8_channel").cut(p, -2, 4, 10)
    with pytest.raises(ValueError):
        formats.get("fp8_channel").cut(p, 0, 0, 1)
