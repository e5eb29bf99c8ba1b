"""Named refusals: each planted defect is refused by its own error, and the message names the
tensor (`where`), the format, what was found and what was expected."""

from __future__ import annotations

import numpy as np
import pytest

from bloomery.core import formats
from bloomery.core.errors import (FormatError, MissingScale, NegativeScale, NonFiniteScale,
                                  NotOnBlockBoundary, ScaleDtypeMismatch, ScaleShapeMismatch,
                                  UnexpectedScale)
from test_formats import E4M3, make

WHERE = "model-00001.safetensors: tensor 'layers.0.mlp.up_proj.weight'"


def _set_byte(p, part, i, byte):
    a = np.array(p[part], copy=True)
    a.view(np.uint8).reshape(-1)[i] = byte
    return {**p, part: a}


def _set(p, part, i, value):
    a = np.array(p[part], copy=True)
    a.reshape(-1)[i] = value
    return {**p, part: a}


def _q8_d(p, value):
    w = np.array(p["weight"], copy=True)
    w.reshape(-1, 34)[1, :2] = np.array([value], np.float16).view(np.uint8)
    return {"weight": w}


def _rng():
    return np.random.default_rng(0)


# (format, shape, defect -> parts, error, words the message must hold)
DEFECTS = [
    ("nvfp4", (4, 64), lambda p: _set_byte(p, "scale", 5, 0x7F), NonFiniteScale, ["scale", "0x7F"]),
    ("nvfp4", (4, 64), lambda p: _set_byte(p, "scale", 0, 0xFF), NonFiniteScale, ["0xFF"]),
    ("nvfp4", (4, 64), lambda p: _set_byte(p, "scale", 3, 0x81), NegativeScale, ["0x81"]),
    ("nvfp4", (4, 64), lambda p: _set_byte(p, "scale", 3, 0xB8), NegativeScale, ["0xB8", ">= 0"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale_2": np.float32(np.nan)}, NonFiniteScale, ["scale_2", "nan"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale_2": np.float32(np.inf)}, NonFiniteScale, ["scale_2", "inf"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale_2": np.float32(-1.0)}, NegativeScale, ["scale_2", "-1.0"]),
    ("nvfp4", (4, 64), lambda p: {k: v for k, v in p.items() if k != "scale_2"}, MissingScale, ["scale_2", "F32"]),
    ("nvfp4", (4, 64), lambda p: {k: v for k, v in p.items() if k != "scale"}, MissingScale, ["'scale'"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale": p["scale"].astype(np.float32)}, ScaleDtypeMismatch, ["F32", "F8_E4M3"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale_2": np.float16(1)}, ScaleDtypeMismatch, ["scale_2", "F16", "F32"]),
    ("nvfp4", (4, 64), lambda p: {**p, "weight": p["weight"].view(np.int8)}, ScaleDtypeMismatch, ["weight", "I8", "U8"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale": p["scale"][:, :3]}, ScaleShapeMismatch, ["[4, 3]", "[4, 4]"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale": p["scale"][:3]}, ScaleShapeMismatch, ["[3, 4]"]),
    ("nvfp4", (4, 64), lambda p: {**p, "scale_2": np.ones(3, np.float32)}, ScaleShapeMismatch, ["scale_2", "[3]"]),
    ("nvfp4", (4, 64), lambda p: {**p, "pre_quant_scale": np.ones(32, np.float32)}, ScaleShapeMismatch, ["pre_quant_scale", "[64]"]),
    ("nvfp4", (4, 64), lambda p: {**p, "pre_quant_scale": np.full(64, np.nan, np.float32)}, NonFiniteScale, ["pre_quant_scale"]),
    ("nvfp4", (4, 64), lambda p: {**p, "input_scale": np.float32(np.inf)}, NonFiniteScale, ["input_scale"]),
    ("nvfp4", (4, 64), lambda p: {**p, "weight_scale_inv": p["scale"]}, UnexpectedScale, ["weight_scale_inv"]),
    ("nvfp4", (4, 64), lambda p: {**p, "weight": p["weight"][:, :12], "scale": p["scale"][:, :2]}, NotOnBlockBoundary, ["24", "16"]),
    ("nvfp4", (4, 64), lambda p: {**p, "weight": p["weight"][0]}, ScaleShapeMismatch, ["weight", "[32]"]),
    ("mxfp8", (4, 64), lambda p: _set_byte(p, "scale", 2, 255), NonFiniteScale, ["0xFF"]),
    ("mxfp8", (4, 64), lambda p: {**p, "scale": p["scale"].astype(np.float32)}, ScaleDtypeMismatch, ["U8"]),
    ("mxfp8", (4, 64), lambda p: {**p, "scale_2": np.float32(1)}, UnexpectedScale, ["scale_2"]),
    ("mxfp8", (4, 64), lambda p: {**p, "weight": p["weight"].view(np.uint8)}, ScaleDtypeMismatch, ["F8_E4M3"]),
    ("mxfp4", (4, 64), lambda p: _set_byte(p, "scale", 7, 255), NonFiniteScale, ["0xFF"]),
    ("mxfp4", (4, 64), lambda p: {**p, "scale": p["scale"][:, :1]}, ScaleShapeMismatch, ["[4, 1]", "[4, 2]"]),
    ("fp8_block32", (40, 70), lambda p: _set_byte(p, "scale", 1, 255), NonFiniteScale, ["0xFF"]),
    ("fp8_block32", (40, 70), lambda p: {**p, "scale": p["scale"][:1]}, ScaleShapeMismatch, ["[1, 3]", "[2, 3]"]),
    ("fp8_tensor", (4, 8), lambda p: {**p, "scale": np.float32(np.nan)}, NonFiniteScale, ["nan"]),
    ("fp8_tensor", (4, 8), lambda p: {**p, "scale": np.float32(-np.inf)}, NonFiniteScale, ["-inf"]),
    ("fp8_tensor", (4, 8), lambda p: {**p, "scale": np.float32(-2.0)}, NegativeScale, ["-2.0"]),
    ("fp8_tensor", (4, 8), lambda p: {**p, "scale": np.float16(2.0)}, ScaleDtypeMismatch, ["F16", "F32"]),
    ("fp8_tensor", (4, 8), lambda p: {**p, "pre_quant_scale": np.ones(8, np.float32)}, UnexpectedScale, ["pre_quant_scale"]),
    ("fp8_tensor", (4, 8), lambda p: {"weight": p["weight"]}, MissingScale, ["scale"]),
    ("fp8_channel", (4, 8), lambda p: _set(p, "scale", 2, np.nan), NonFiniteScale, ["[2]"]),
    ("fp8_channel", (4, 8), lambda p: _set(p, "scale", 1, -0.5), NegativeScale, ["-0.5"]),
    ("fp8_channel", (4, 8), lambda p: {**p, "scale": np.ones(5, np.float32)}, ScaleShapeMismatch, ["[5]", "[4]", "[4, 1]"]),
    ("fp8_block128", (130, 300), lambda p: _set(p, "scale", 4, np.inf), NonFiniteScale, ["inf"]),
    ("fp8_block128", (130, 300), lambda p: {**p, "scale": np.ones((1, 3), np.float32)}, ScaleShapeMismatch, ["[2, 3]", "[2, 1, 3, 1]"]),
    ("q8_0", (4, 64), lambda p: _q8_d(p, np.inf), NonFiniteScale, ["inf"]),
    ("q8_0", (4, 64), lambda p: _q8_d(p, np.nan), NonFiniteScale, ["nan"]),
    ("q8_0", (4, 64), lambda p: _q8_d(p, -1.0), NegativeScale, ["-1.0"]),
    ("q8_0", (4, 64), lambda p: {"weight": p["weight"][:, :60]}, ScaleShapeMismatch, ["[4, 60]"]),
    ("q8_0", (4, 64), lambda p: {**p, "scale": np.float32(1)}, UnexpectedScale, ["scale"]),
    ("bf16", (4, 8), lambda p: {"weight": p["weight"].astype(np.float32)}, ScaleDtypeMismatch, ["F32", "BF16"]),
    ("f32", (4, 8), lambda p: {**p, "scale": np.float32(1)}, UnexpectedScale, ["scale"]),
]


@pytest.mark.parametrize("name,shape,defect,err,words", DEFECTS,
                         ids=[f"{d[0]}-{d[3].__name__}-{i}" for i, d in enumerate(DEFECTS)])
def test_planted_defect_refused(name, shape, defect, err, words):
    f = formats.get(name)
    good = make(name, shape, _rng())
    f.check(good, WHERE)
    bad = defect(good)
    for call in (lambda: f.check(bad, WHERE), lambda: f.decode(bad, WHERE)):
        with pytest.raises(err) as e:
            call()
        assert isinstance(e.value, FormatError)
        msg = str(e.value)
        assert WHERE in msg and name in msg, msg
        for w in words:
            assert w in msg, (w, msg)


def test_negative_zero_scales_accepted():
    """Policy: a set sign bit is refused, except -0.0 (a zero scale)."""
    p = make("nvfp4", (2, 32), _rng())
    p = _set_byte(p, "scale", 0, 0x80)
    v = formats.get("nvfp4").decode(p, WHERE)
    assert (v[0, :16] == 0).all()
    formats.get("fp8_tensor").check({**make("fp8_tensor", (2, 4), _rng()), "scale": np.float32(-0.0)}, WHERE)
    formats.get("q8_0").check(_q8_d(make("q8_0", (2, 64), _rng()), -0.0), WHERE)


def test_every_valid_e4m3_scale_accepted():
    s = np.array([*range(0x7F), 0x80], np.uint8)
    p = {"weight": np.zeros((8, 128), np.uint8), "scale": s.reshape(8, -1).view(E4M3),
         "scale_2": np.float32(1)}
    formats.get("nvfp4").check(p, WHERE)


def test_ggml_blocks_wrong_size_refused():
    from bloomery.core.formats import mxfp4, nvfp4
    with pytest.raises(ScaleShapeMismatch, match="36"):
        nvfp4.from_ggml(np.zeros((2, 35), np.uint8), np.float32(1))
    with pytest.raises(ScaleShapeMismatch, match="17"):
        mxfp4.from_ggml(np.zeros((2, 18), np.uint8))
