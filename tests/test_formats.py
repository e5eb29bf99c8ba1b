"""Stored formats: decoders bit-exact against independent references (ml_dtypes value tables,
gguf-py, ModelOpt), GGML repacks, encoders. Helpers here are shared by test_formats_*.py."""

from __future__ import annotations

import time
import zlib

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ

from bloomery.core import formats
from bloomery.core.errors import NotOnBlockBoundary
from bloomery.core.formats import mxfp4 as mxfp4_mod
from bloomery.core.formats import nvfp4 as nvfp4_mod
from bloomery.core.formats import q8_0 as q8_0_mod

# -- independent value tables (ml_dtypes), float64 -------------------------------------
E2M1_REF = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
E4M3_REF = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E8M0_REF = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
E4M3_SCALE_OK = np.array([*range(0x7F), 0x80], dtype=np.uint8)   # every code a valid scale (-0 incl.)
E4M3 = ml_dtypes.float8_e4m3fn

NAMES = ["nvfp4", "nvfp4_g32", "mxfp4", "mxfp8", "fp8_tensor", "fp8_channel", "fp8_block128", "fp8_block32",
         "bf16", "f16", "f32", "q8_0"]

SHAPES = {
    "nvfp4": [(1, 16), (7, 64), (3, 5, 128), (64, 256), (2, 33, 192)],
    "nvfp4_g32": [(1, 32), (7, 96), (3, 5, 128)],
    "mxfp4": [(1, 32), (7, 64), (3, 5, 128), (2, 33, 96)],
    "mxfp8": [(1, 32), (7, 64), (3, 5, 128), (2, 33, 96)],
    "fp8_tensor": [(1, 1), (7, 13), (3, 5, 40), (33, 64)],
    "fp8_channel": [(1, 1), (7, 13), (3, 5, 40), (33, 64)],
    "fp8_block128": [(1, 1), (130, 300), (256, 384), (2, 129, 257)],
    "fp8_block32": [(1, 1), (33, 70), (64, 96), (3, 40, 33)],
    "bf16": [(1,), (7, 13), (3, 5, 8)],
    "f16": [(1,), (7, 13), (3, 5, 8)],
    "f32": [(1,), (7, 13), (3, 5, 8)],
    "q8_0": [(1, 32), (7, 64), (3, 5, 128)],
}
NVFP4_BLOCK = {"nvfp4": 16, "nvfp4_g32": 32}
# scale layouts each format accepts (index passed to make())
LAYOUTS = {"fp8_tensor": 3, "fp8_channel": 2, "fp8_block128": 2, "nvfp4": 3, "nvfp4_g32": 3}


def cdiv(a, b):
    return -(-a // b)


def same_bits(got, want, zeros_equal=False):
    """float32 bit patterns equal (NaN matches NaN); zeros_equal: +0 and -0 count as equal."""
    got, want = np.asarray(got), np.asarray(want, dtype=np.float32)
    assert got.dtype == np.float32, got.dtype
    assert got.shape == want.shape, (got.shape, want.shape)
    gn, wn = np.isnan(got), np.isnan(want)
    assert (gn == wn).all(), f"NaN at different places: first {np.argwhere(gn != wn)[0]}"
    g, w = np.where(gn, 0, got), np.where(wn, 0, want)
    if zeros_equal:
        g, w = g + np.float32(0), w + np.float32(0)
    bad = g.view(np.uint32) != w.view(np.uint32)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{int(bad.sum())} of {bad.size} differ; first at {i}: got {g[i]!r} "
                             f"(0x{g[i].view(np.uint32):08X}) want {w[i]!r} (0x{w[i].view(np.uint32):08X})")


def _plant(rng, n, codes):
    """n random picks from codes, the first len(codes) of them being every code once."""
    out = rng.choice(codes, size=n)
    k = min(n, len(codes))
    out[:k] = rng.permutation(codes)[:k] if n < len(codes) else codes
    return out


def _f32_scales(rng, n):
    """float32 scales with edges: 0, -0, the smallest subnormal, a subnormal, huge, powers of two."""
    s = np.exp(rng.uniform(-12, 6, n)).astype(np.float32)
    edges = np.array([0.0, -0.0, 1.4e-45, 3e-39, 1e30, 2.0 ** -20, 1.0, 0.5], dtype=np.float32)
    k = min(n, len(edges))
    s[:k] = edges[:k]
    return rng.permutation(s)


def make(name, shape, rng, layout=0, scale_2=None):
    """Random valid parts of the logical shape, edge codes planted."""
    lead, out, inn = tuple(shape[:-2]), shape[-2] if len(shape) > 1 else None, shape[-1]
    n = int(np.prod(shape))
    if name in ("bf16", "f16", "f32"):
        dt = {"bf16": (np.uint16, ml_dtypes.bfloat16), "f16": (np.uint16, np.float16),
              "f32": (np.uint32, np.float32)}[name]
        bits = rng.integers(0, np.iinfo(dt[0]).max, size=shape, dtype=dt[0], endpoint=True)
        return {"weight": bits.view(dt[1])}
    if name == "q8_0":
        nb = n // 32
        d = rng.choice(np.array([0.0, -0.0, 2 ** -24, 6e-5, 1.0, 65504.0, 0.01, 3e-3], dtype=np.float16), nb)
        q = rng.integers(-128, 128, size=(nb, 32), dtype=np.int8)
        blocks = np.concatenate([d.reshape(nb, 1).view(np.uint8), q.view(np.uint8)], axis=1)
        return {"weight": blocks.reshape(*shape[:-1], inn // 32 * 34)}
    if name in ("nvfp4", "nvfp4_g32", "mxfp4"):
        w = _plant(rng, n // 2, np.arange(256, dtype=np.uint8)).reshape(*shape[:-1], inn // 2)
    else:
        w = _plant(rng, n, np.arange(256, dtype=np.uint8)).reshape(shape).view(E4M3)
    if name in ("nvfp4", "nvfp4_g32"):
        b = NVFP4_BLOCK[name]
        s = _plant(rng, n // b, E4M3_SCALE_OK).reshape(*shape[:-1], inn // b).view(E4M3)
        if scale_2 is None:
            s2 = _f32_scales(rng, max(1, int(np.prod(lead))))
            s2 = np.abs(s2) + np.float32(1e-8)
        else:
            s2 = np.full(max(1, int(np.prod(lead))), scale_2, dtype=np.float32)
        s2 = [s2[:1].reshape(()), s2[:1], s2.reshape(lead) if lead else s2[:1].reshape(())][layout]
        return {"weight": w, "scale": s, "scale_2": s2}
    e8m0 = np.arange(255, dtype=np.uint8)
    if name in ("mxfp4", "mxfp8"):
        return {"weight": w, "scale": _plant(rng, n // 32, e8m0).reshape(*shape[:-1], inn // 32)}
    if name == "fp8_block32":
        ob, ib = cdiv(out, 32), cdiv(inn, 32)
        return {"weight": w, "scale": _plant(rng, int(np.prod(lead)) * ob * ib, e8m0).reshape(*lead, ob, ib)}
    if name == "fp8_tensor":
        s = np.abs(_f32_scales(rng, max(1, int(np.prod(lead)))))
        s = [s[:1].reshape(()), s[:1], s.reshape(lead) if lead else s[:1].reshape(())][layout]
        return {"weight": w, "scale": s}
    if name == "fp8_channel":
        s = np.abs(_f32_scales(rng, int(np.prod(lead)) * out)).reshape(*lead, out)
        return {"weight": w, "scale": s if layout == 0 else s[..., None]}
    if name == "fp8_block128":
        ob, ib = cdiv(out, 128), cdiv(inn, 128)
        s = np.abs(_f32_scales(rng, int(np.prod(lead)) * ob * ib)).reshape(*lead, ob, ib)
        return {"weight": w, "scale": s if layout == 0 else s.reshape(*lead, ob, 1, ib, 1)}
    raise KeyError(name)


# -- independent reference decoders (float64 products, one rounding to float32) ---------
def _codes(packed):
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _rep(s, shape, bo, bi):
    """Scale [..., nbo, nbi] repeated to shape [..., out, in]."""
    out, inn = shape[-2:]
    return np.repeat(np.repeat(s, bo, axis=-2)[..., :out, :], bi, axis=-1)[..., :inn]


def ref_decode(name, p):
    w = p["weight"]
    if name in ("bf16", "f16", "f32"):
        if name == "bf16":
            return (w.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        with np.errstate(invalid="ignore"):
            return w.view({"f16": np.float16, "f32": np.float32}[name]).astype(np.float64).astype(np.float32)
    if name == "q8_0":
        return gguf.quants.dequantize(w, GQ.Q8_0)
    if name in ("nvfp4", "nvfp4_g32", "mxfp4"):
        v = E2M1_REF[_codes(w)]
    else:
        v = E4M3_REF[w.view(np.uint8)]
    shape = v.shape
    lead = shape[:-2]
    if name in ("nvfp4", "nvfp4_g32"):
        s2 = np.asarray(p["scale_2"], np.float64)
        s2 = s2.reshape(*lead, 1, 1) if s2.ndim and s2.shape != (1,) else s2.reshape(())
        s = _rep(E4M3_REF[p["scale"].view(np.uint8)], shape, 1, NVFP4_BLOCK[name])
        return (v * s * s2).astype(np.float32)
    if name in ("mxfp4", "mxfp8"):
        return (v * _rep(E8M0_REF[p["scale"]], shape, 1, 32)).astype(np.float32)
    if name == "fp8_block32":
        return (v * _rep(E8M0_REF[p["scale"]], shape, 32, 32)).astype(np.float32)
    s = np.asarray(p["scale"], np.float64)
    if name == "fp8_tensor":
        s = s.reshape(*lead, 1, 1) if s.ndim and s.shape != (1,) else s.reshape(())
        return (v * s).astype(np.float32)
    if name == "fp8_channel":
        return (v * s.reshape(*shape[:-1], 1)).astype(np.float32)
    if name == "fp8_block128":
        return (v * _rep(s.reshape(*lead, cdiv(shape[-2], 128), cdiv(shape[-1], 128)), shape, 128, 128)).astype(np.float32)
    raise KeyError(name)


def cases():
    for name in NAMES:
        for shape in SHAPES[name]:
            for layout in range(LAYOUTS.get(name, 1)):
                yield pytest.param(name, shape, layout, id=f"{name}-{'x'.join(map(str, shape))}-L{layout}")


# -- tables ---------------------------------------------------------------------------------
def test_registry():
    assert list(formats.FORMATS) == NAMES
    for n in NAMES:
        assert formats.get(n).name == n and isinstance(formats.get(n), formats.Format)
    with pytest.raises(KeyError, match="nvfp4"):
        formats.get("nvfp5")


def test_tables_match_ml_dtypes():
    from bloomery.core.formats import minifloat as mf
    same_bits(mf.E2M1, E2M1_REF)
    same_bits(mf.E4M3, E4M3_REF)
    same_bits(mf.E8M0, E8M0_REF)
    assert mf.E8M0[0].view(np.uint32) == 0x00400000 and mf.E8M0[254] == 2.0 ** 127


# -- decode against the ml_dtypes / gguf references ---------------------------------------------
@pytest.mark.parametrize("name,shape,layout", list(cases()))
def test_decode_matches_reference(name, shape, layout):
    rng = np.random.default_rng(zlib.crc32(repr((name, shape, layout)).encode()))
    p = make(name, shape, rng, layout)
    f = formats.get(name)
    f.check(p, "t")
    assert f.shape(p) == tuple(shape)
    with np.errstate(over="ignore"):
        same_bits(f.decode(p), ref_decode(name, p))


@pytest.mark.parametrize("s2", [1 / 2688 * 1.2345, 1e-40, 1e-44, 1e35, 0.0, 2.0 ** -126])
def test_nvfp4_rounding_is_one_rounding(s2):
    # e2m1 * e4m3 * scale_2 rounds once (subnormal and overflowing scale_2 incl.): compare
    # with the exact float64 product on all codes
    rng = np.random.default_rng(1)
    p = make("nvfp4", (128, 256), rng, scale_2=np.float32(s2))
    exact = E2M1_REF[_codes(p["weight"])] * _rep(E4M3_REF[p["scale"].view(np.uint8)], (128, 256), 1, 16)
    with np.errstate(over="ignore"):
        same_bits(formats.get("nvfp4").decode(p), (exact * np.float64(p["scale_2"])).astype(np.float32))


# -- GGML repacks ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 64), (5, 128), (2, 3, 192), (64, 512)])
def test_nvfp4_ggml_roundtrip(shape):
    rng = np.random.default_rng(sum(shape))
    for layout in range(3):
        p = make("nvfp4", shape, rng, layout)
        blocks, qt = nvfp4_mod.to_ggml(p)
        assert qt == GQ.NVFP4 and blocks.dtype == np.uint8
        assert blocks.shape == gguf.quants.quant_shape_to_byte_shape(shape, GQ.NVFP4)
        g = gguf.quants.dequantize(blocks, GQ.NVFP4)
        s2 = p["scale_2"].reshape(*p["scale_2"].shape, 1, 1) if p["scale_2"].ndim and p["scale_2"].shape != (1,) else p["scale_2"]
        # GGML has no -0 (kvalue 0 for code 8): zeros compare by value, all else by bits
        same_bits(formats.get("nvfp4").decode(p), g * s2, zeros_equal=True)
        q = nvfp4_mod.from_ggml(blocks, p["scale_2"])
        assert q["weight"].tobytes() == p["weight"].tobytes()
        assert q["scale"].dtype == E4M3 and q["scale"].tobytes() == p["scale"].tobytes()
        same_bits(formats.get("nvfp4").decode(q), formats.get("nvfp4").decode(p))
        assert nvfp4_mod.to_ggml(q)[0].tobytes() == blocks.tobytes()


@pytest.mark.parametrize("shape", SHAPES["nvfp4_g32"])
def test_nvfp4_g32_held_as_nvfp4(shape):
    """W4A8_NVFP4_FP8's blocks of 32 held as nvfp4 (each scale once per half): the same values, every
    layout of scale_2; and into GGML NVFP4 where the row is a multiple of 64."""
    rng = np.random.default_rng(sum(shape))
    g32, nv = formats.get("nvfp4_g32"), formats.get("nvfp4")
    for layout in range(3):
        p = make("nvfp4_g32", shape, rng, layout)
        h = g32.held(p)
        nv.check(h, "held")
        assert h["weight"] is p["weight"] and h["scale"].shape[-1] == p["scale"].shape[-1] * 2
        with np.errstate(over="ignore"):
            same_bits(nv.decode(h), g32.decode(p))
            if shape[-1] % 64 == 0:
                s2 = p["scale_2"]
                s2 = s2.reshape(*s2.shape, 1, 1) if s2.ndim and s2.shape != (1,) else s2
                g = gguf.quants.dequantize(nvfp4_mod.to_ggml(h)[0], GQ.NVFP4)
                same_bits(g * s2, g32.decode(p), zeros_equal=True)


def test_nvfp4_ggml_layout_by_hand():
    # element j of a 16-block in the low nibble of byte j, element j+8 in its high nibble
    codes = np.arange(64, dtype=np.uint8) % 16
    w = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 32)
    p = {"weight": w, "scale": np.full((1, 4), 0x38, np.uint8).view(E4M3), "scale_2": np.float32(1.0)}
    b, _ = nvfp4_mod.to_ggml(p)
    assert list(b[0, :4]) == [0x38] * 4
    assert b[0, 4] == (0 | (8 << 4)) and b[0, 5] == (1 | (9 << 4))


def test_nvfp4_ggml_refuses_short_rows():
    p = make("nvfp4", (4, 48), np.random.default_rng(0))
    with pytest.raises(NotOnBlockBoundary, match=r"blk\.0\.w.*48.*64"):
        nvfp4_mod.to_ggml(p, "blk.0.w")


@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (2, 3, 64)])
def test_mxfp4_ggml_roundtrip(shape):
    rng = np.random.default_rng(sum(shape))
    p = make("mxfp4", shape, rng)
    blocks, qt = mxfp4_mod.to_ggml(p)
    assert qt == GQ.MXFP4 and blocks.shape == gguf.quants.quant_shape_to_byte_shape(shape, GQ.MXFP4)
    with np.errstate(over="ignore"):
        same_bits(formats.get("mxfp4").decode(p), gguf.quants.dequantize(blocks, GQ.MXFP4), zeros_equal=True)
    q = mxfp4_mod.from_ggml(blocks)
    assert q["weight"].tobytes() == p["weight"].tobytes() and q["scale"].tobytes() == p["scale"].tobytes()
    assert mxfp4_mod.to_ggml(q)[0].tobytes() == blocks.tobytes()


def test_mxfp4_ggml_layout_by_hand():
    codes = np.arange(32, dtype=np.uint8) % 16
    p = {"weight": (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16), "scale": np.array([[127]], np.uint8)}
    b, _ = mxfp4_mod.to_ggml(p)
    assert b[0, 0] == 127 and b[0, 1] == (0 | (0 << 4)) and b[0, 2] == (1 | (1 << 4))   # j and j+16


def test_q8_0_ggml_is_identity():
    p = make("q8_0", (3, 64), np.random.default_rng(0))
    b, qt = q8_0_mod.to_ggml(p)
    assert qt == GQ.Q8_0 and b.tobytes() == p["weight"].tobytes()
    assert q8_0_mod.from_ggml(b)["weight"].tobytes() == b.tobytes()


# -- encoders ------------------------------------------------------------------------------
def test_q8_0_encode_matches_gguf():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((33, 256)) * np.exp(rng.uniform(-8, 8, (33, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = np.arange(32) - 15.5
    x[1, 0] = 127.0                            # d = 1: x * (1/d) = x, exact ties at .5
    x[2, :32] = np.arange(32) * 2 - 31.0
    x[2, 0] = 254.0                            # d = 2: ties at odd x
    x[3, :32] = 1e-30
    x[4, :32] = -65504.0 * 127
    with np.errstate(over="ignore"):
        want = gguf.quants.quantize(x, GQ.Q8_0)
        got = formats.get("q8_0").encode(x)["weight"]
    assert got.dtype == np.uint8 and got.tobytes() == want.tobytes()
    x3 = x.reshape(3, 11, 256)
    with np.errstate(over="ignore"):
        assert formats.get("q8_0").encode(x3)["weight"].tobytes() == gguf.quants.quantize(x3, GQ.Q8_0).tobytes()


def test_e2m1_encode_nearest_even():
    from bloomery.core.formats import minifloat as mf
    vals = E2M1_REF[:8].astype(np.float32)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
    x = np.concatenate([vals, mids, -vals, -mids, [7.0, 1e9, -1e9, 0.1, -0.1]]).astype(np.float32)
    want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)   # RNE, saturating
    got = E2M1_REF[mf.encode_e2m1(x)].astype(np.float32)
    same_bits(got, want, zeros_equal=True)


@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_close(name):
    rng = np.random.default_rng(7)
    shape = {"fp8_block128": (2, 130, 260), "fp8_block32": (2, 40, 70)}.get(name, (2, 24, 128))
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, 0, :32] = 0.0
    f = formats.get(name)
    p = f.encode(x)
    f.check(p, "enc")
    assert f.shape(p) == shape
    tol = {"nvfp4": 0.2, "nvfp4_g32": 0.2, "mxfp4": 0.35, "q8_0": 0.01}.get(name, 0.07)
    err = np.abs(f.decode(p) - x).max() / np.abs(x).max()
    assert err < tol, err


# -- ModelOpt's own dequantization -----------------------------------------------------------------
def _mo():
    torch = pytest.importorskip("torch", reason="torch not installed: ModelOpt comparison skipped")
    qt = pytest.importorskip("modelopt.torch.quantization.qtensor",
                             reason="nvidia-modelopt not installed: ModelOpt comparison skipped")
    return torch, qt


def _t(torch, a):
    a = np.ascontiguousarray(a)
    if a.dtype == E4M3:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a.copy())


def _mo_nvfp4(p, shape):
    torch, qt = _mo()
    q = qt.NVFP4QTensor(torch.Size(shape), torch.float32, _t(torch, p["weight"]))
    return q.dequantize(dtype=torch.float32, scale=_t(torch, p["scale"]),
                        double_scale=_t(torch, np.asarray(p["scale_2"], np.float32)),
                        block_sizes={-1: 16}).numpy()


@pytest.mark.parametrize("shape", [(16, 64), (2, 33, 128)])
def test_modelopt_nvfp4_pow2_scale_2_exact(shape):
    p = make("nvfp4", shape, np.random.default_rng(11), scale_2=np.float32(2.0 ** -9))
    # ModelOpt's table has +0 for code 8: zeros compare by value
    same_bits(formats.get("nvfp4").decode(p), _mo_nvfp4(p, shape), zeros_equal=True)


def test_modelopt_nvfp4_general_scale_2_within_one_ulp():
    """ModelOpt computes e2m1 * (e4m3 * scale_2): two roundings. Finding: at most 1 ulp from
    the correctly rounded value, and only where |e2m1| is 1.5, 3 or 6 (0.5/1/2/4 are exact)."""
    shape = (64, 256)
    rng = np.random.default_rng(12)
    ndiff = 0
    for s2 in (1 / 2688 * 1.2345, 0.1, 3.0e-7, 7.77):
        p = make("nvfp4", shape, rng, scale_2=np.float32(s2))
        ours, mo = formats.get("nvfp4").decode(p), _mo_nvfp4(p, shape)
        ours, mo = ours + np.float32(0), mo + np.float32(0)
        diff = np.abs(ours.view(np.int32).astype(np.int64) - mo.view(np.int32).astype(np.int64))
        assert diff.max() <= 1
        mag = np.abs(E2M1_REF[_codes(p["weight"])])
        assert np.isin(mag[diff > 0], [1.5, 3.0, 6.0]).all()
        ndiff += int((diff > 0).sum())
    assert ndiff > 0   # the two orders do differ: why the decoder fixes one order


def test_modelopt_nvfp4_encode_bytes():
    torch, qt = _mo()
    x = np.random.default_rng(5).standard_normal((32, 128)).astype(np.float32)
    x[0, :16] = 0.0
    q, s, s2 = qt.NVFP4QTensor.quantize(torch.from_numpy(x.copy()), 16)
    p = formats.get("nvfp4").encode(x)
    assert p["weight"].tobytes() == q._quantized_data.numpy().tobytes()
    assert p["scale"].view(np.uint8).tobytes() == s.view(torch.uint8).numpy().tobytes()
    assert p["scale_2"].tobytes() == s2.numpy().astype(np.float32).tobytes()


@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 96)])
def test_modelopt_mx_exact(shape):
    torch, qt = _mo()
    rng = np.random.default_rng(13)
    p = make("mxfp8", shape, rng)
    mo = qt.MXFP8QTensor(torch.Size(shape), torch.float32, _t(torch, p["weight"])).dequantize(
        dtype=torch.float32, scale=_t(torch, p["scale"])).numpy()
    with np.errstate(over="ignore"):
        same_bits(formats.get("mxfp8").decode(p), mo)
    p = make("mxfp4", shape, rng)
    mo = qt.MXFP4QTensor(torch.Size(shape), torch.float32, _t(torch, p["weight"])).dequantize(
        dtype=torch.float32, scale=_t(torch, p["scale"]), block_sizes={-1: 32}).numpy()
    with np.errstate(over="ignore"):
        same_bits(formats.get("mxfp4").decode(p), mo)


def test_modelopt_mxfp8_encode():
    torch, qt = _mo()
    x = (np.random.default_rng(6).standard_normal((8, 128)) * 3).astype(np.float32)
    q, s = qt.MXFP8QTensor.quantize(torch.from_numpy(x.copy()))
    p = formats.get("mxfp8").encode(x)
    assert p["scale"].tobytes() == s.numpy().tobytes()
    assert p["weight"].view(np.uint8).tobytes() == q._quantized_data.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name,layout", [("fp8_tensor", 0), ("fp8_tensor", 2), ("fp8_channel", 1),
                                         ("fp8_block128", 0), ("fp8_block32", 0)])
def test_modelopt_fp8_exact(name, layout):
    torch, qt = _mo()
    shape = (2, 256, 384) if name != "fp8_block32" else (2, 64, 96)
    p = make(name, shape, np.random.default_rng(14), layout)
    s = np.asarray(p["scale"], np.float32) if name != "fp8_block32" else E8M0_REF[p["scale"]].astype(np.float32)
    kw = {}
    if name == "fp8_tensor" and s.ndim:
        s = s.reshape(*s.shape, 1, 1)
    if name in ("fp8_block128", "fp8_block32"):
        b = 128 if name == "fp8_block128" else 32
        kw = {"block_sizes": {-1: b, -2: b}}
    mo = qt.FP8QTensor(torch.Size(shape), torch.float32, _t(torch, p["weight"])).dequantize(
        dtype=torch.float32, scale=_t(torch, s), **kw).numpy()
    same_bits(formats.get(name).decode(p), mo)


# -- speed ---------------------------------------------------------------------------------
def test_nvfp4_decode_speed():
    rng = np.random.default_rng(0)
    out, inn = 4096, 6144                     # ~25M parameters
    p = {"weight": rng.integers(0, 256, (out, inn // 2), dtype=np.uint8),
         "scale": rng.integers(0, 0x7F, (out, inn // 16), dtype=np.uint8).view(E4M3),
         "scale_2": np.array([1e-3], np.float32)}
    t = time.perf_counter()
    v = formats.get("nvfp4").decode(p)
    dt = time.perf_counter() - t
    assert v.shape == (out, inn) and v.dtype == np.float32
    assert dt < 3.0, f"nvfp4 decode of {out * inn / 1e6:.0f}M params took {dt:.2f} s"
