"""core/artifact/layout.py: every stored format in GGUF, round trip bit for bit."""

from __future__ import annotations

import zlib

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ

from bloomery.core import formats
from bloomery.core.artifact import layout
from bloomery.core.errors import ArtifactMalformed
from test_formats import LAYOUTS, NAMES, SHAPES, make, same_bits

HELD = [n for n in NAMES if formats.get(n).held_as]      # no layout of their own (nvfp4_g32: held as nvfp4)
NAMES = [n for n in NAMES if n not in HELD]

EXTRA_SHAPES = {"nvfp4": [(4, 48), (2, 3, 80)], "fp8_block128": [(2, 256, 128)], "fp8_block32": [(2, 64, 70)]}


def with_optional(name, parts, shape, rng, variant):
    """Add input_scale / pre_quant_scale in one of their stored shapes."""
    p = dict(parts)
    lead = tuple(shape[:-2])
    if name in ("bf16", "f16", "f32", "q8_0"):
        return p, ()
    if variant >= 1:
        p["input_scale"] = (np.array(0.25, np.float32) if variant == 1 or not lead
                            else rng.uniform(0.1, 2, lead).astype(np.float32))
    if name == "nvfp4" and variant >= 1:
        inn = shape[-1]
        q = rng.uniform(-2, 2, (*lead, inn) if (variant == 2 and lead) else (inn,))
        p["pre_quant_scale"] = q.astype(ml_dtypes.bfloat16 if variant == 1 else np.float16)
    return p, tuple(k for k in ("input_scale", "pre_quant_scale") if k in p)


def cases():
    for name in NAMES:
        for shape in SHAPES[name] + EXTRA_SHAPES.get(name, []):
            for lay in range(LAYOUTS.get(name, 1)):
                for var in range(3):
                    yield pytest.param(name, shape, lay, var, id=f"{name}-{'x'.join(map(str, shape))}-L{lay}-o{var}")


@pytest.mark.parametrize("name,shape,lay,var", list(cases()))
def test_round_trip(name, shape, lay, var):
    rng = np.random.default_rng(zlib.crc32(repr((name, shape, lay, var)).encode()))
    parts, optional = with_optional(name, make(name, shape, rng, lay), shape, rng, var)
    fmt = formats.get(name)
    spec = layout.gguf_parts(name, shape, optional)
    arrs = layout.to_gguf(name, parts)
    assert [s for s, _, _ in spec] == list(arrs)
    for suffix, gshape, qt in spec:
        a = arrs[suffix]
        assert a.shape == layout.byte_shape(gshape, qt), (suffix, a.shape, gshape)
        assert a.nbytes == layout.nbytes(gshape, qt)
    back = layout.from_gguf(name, arrs)
    same_bits(fmt.decode(back), fmt.decode(parts))
    for k in optional:      # kept values (broadcast per matrix), widened exactly to f32
        want = np.broadcast_to(np.asarray(parts[k], np.float32), back[k].shape)
        same_bits(back[k], want)
    # streamed chunks concatenate to the same bytes
    got = {}
    for suffix, chunk in layout.iter_gguf(name, parts, chunk_bytes=37):
        got.setdefault(suffix, []).append(chunk.view(np.uint8).reshape(-1))
    for suffix, a in arrs.items():
        assert np.array_equal(np.concatenate(got[suffix]), a.view(np.uint8).reshape(-1)), suffix


def test_layout_types():
    g = layout.gguf_parts
    assert g("nvfp4", (8, 128), ()) == [("weight", (8, 128), GQ.NVFP4), ("scale_2", (1,), GQ.F32)]
    assert g("nvfp4", (4, 8, 48), ("input_scale",)) == [
        ("weight", (4, 8, 24), GQ.I8), ("scale", (4, 8, 3), GQ.I8), ("scale_2", (4,), GQ.F32),
        ("input_scale", (4,), GQ.F32)]
    assert g("mxfp4", (2, 8, 64), ()) == [("weight", (2, 8, 64), GQ.MXFP4)]
    assert g("fp8_block128", (130, 300), ()) == [("weight", (130, 300), GQ.I8), ("scale", (2, 3), GQ.F32)]
    assert g("fp8_channel", (3, 7, 5), ()) == [("weight", (3, 7, 5), GQ.I8), ("scale", (3, 7), GQ.F32)]
    assert g("bf16", (7,), ()) == [("weight", (7,), GQ.BF16)]
    assert g("q8_0", (2, 64), ()) == [("weight", (2, 64), GQ.Q8_0)]
    with pytest.raises(ArtifactMalformed):
        g("q8_0", (2, 64), ("input_scale",))
    with pytest.raises(ArtifactMalformed):
        g("fp8_tensor", (2, 64), ("pre_quant_scale",))
    with pytest.raises(ArtifactMalformed, match="nvfp4_g32 has no artifact layout.*holds it as nvfp4"):
        g("nvfp4_g32", (8, 128), ())


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 128)])
def test_nvfp4_against_gguf_dequantize(shape):
    """GGML NVFP4 in the artifact read by gguf-py's own dequantize, times scale_2."""
    rng = np.random.default_rng(1)
    parts = make("nvfp4", shape, rng, 2 if len(shape) > 2 else 0)
    arrs = layout.to_gguf("nvfp4", parts)
    ref = gguf.quants.dequantize(arrs["weight"], GQ.NVFP4).astype(np.float32)
    s2 = arrs["scale_2"].reshape(*shape[:-2], 1, 1) if len(shape) > 2 else arrs["scale_2"].reshape(())
    same_bits(formats.get("nvfp4").decode(parts), ref * s2, zeros_equal=True)


def test_mxfp4_q8_0_bf16_against_gguf_dequantize():
    rng = np.random.default_rng(2)
    for name, qt in (("mxfp4", GQ.MXFP4), ("q8_0", GQ.Q8_0), ("bf16", GQ.BF16)):
        parts = make(name, (5, 64), rng)
        a = layout.to_gguf(name, parts)["weight"]
        raw = a.view(np.uint8) if name == "bf16" else a
        ref = gguf.quants.dequantize(raw, qt).astype(np.float32)
        same_bits(formats.get(name).decode(parts), ref, zeros_equal=True)


@pytest.mark.parametrize("name", NAMES)
def test_subset_rows(name):
    """take_lead + rows_of_gguf on the GGUF arrays == the format's own cut of the parts."""
    shape = {"fp8_block128": (2, 300, 256), "fp8_block32": (2, 70, 64), "bf16": (2, 9, 8),
             "f16": (2, 9, 8), "f32": (2, 9, 8)}.get(name, (2, 9, 128))
    rng = np.random.default_rng(3)
    parts = make(name, shape, rng)
    fmt = formats.get(name)
    arrs = layout.to_gguf(name, parts)
    u = fmt.cut_unit(-2)
    out = shape[-2]
    for r0, r1 in ((0, min(u, out)), ((out - 1) // u * u, out)):
        sub = layout.from_gguf(name, layout.rows_of_gguf(name, shape, layout.take_lead(arrs, shape[:-2], 1), r0, r1))
        want = fmt.decode(fmt.cut(layout.take_lead(parts, shape[:-2], 1), -2, r0, r1))
        same_bits(fmt.decode(sub), want)
