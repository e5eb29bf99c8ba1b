"""GPU: the prompt-chunk GEMM (runtime/cuda/gemm.py) against float64 references built from
core/formats' own decoders: "bf16" (activations rounded to BF16 by ml_dtypes, weights as BF16
holds them), "bf16x2" and bf16 with exact=True (the router's: float32-level). Skipped, visibly,
without CuPy and a GPU."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from bloomery.runtime.cuda import gemm as M
from bloomery.runtime.cuda import gemv as G

from test_cuda_kernels import artifact, cp                # skips, visibly, without CuPy or a GPU

pytestmark = pytest.mark.gpu

# formats whose decoded weight BF16 holds exactly (per-tensor factor in alpha); the others are rounded once
EXACT = {"nvfp4", "nvfp4_stored", "mxfp8", "fp8_tensor", "bf16", "mxfp4"}
FORMATS = ["nvfp4", "nvfp4_stored", "mxfp8", "fp8_tensor", "fp8_channel", "fp8_block128", "bf16", "f32", "q8_0",
           "mxfp4"]
SHAPES = [(64, 128), (130, 320), (576, 1536), (257, 4096)]


def bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def tile_ref(fmt, W, exact):
    """The weight as the BF16 tile(s) hold it, times alpha (float64): exact mode splits the
    formats BF16 cannot hold into hi + lo (16 significant bits)."""
    if fmt in EXACT or exact:
        return W
    return bf16(W)


@pytest.mark.parametrize("mode", [*M.MODES, "bf16+exact"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_matches_float64(fmt, shape, mode):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, shape, mode)).encode()))
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    if f == "nvfp4" and shape[1] % (16 if fmt == "nvfp4_stored" else 64) or f in ("mxfp8", "q8_0", "mxfp4") and shape[1] % 32:
        pytest.skip("not a valid shape for the format")
    W, arrays = artifact(f, shape, rng, stored_nvfp4=fmt == "nvfp4_stored")
    lin = G.Linear(f, shape, {k: cp.asarray(v) for k, v in arrays.items()})
    stream = cp.cuda.Stream(non_blocking=True)
    exact = mode != "bf16"
    mm = M.Matmul(stream, mode.split("+")[0])
    for rows, accumulate in ((9, False), (100, True)):
        x = (rng.standard_normal((rows, shape[1])) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        y0 = rng.standard_normal((rows, shape[0])).astype(np.float32)
        y = cp.asarray(y0) if accumulate else cp.full((rows, shape[0]), cp.nan, cp.float32)
        step = mm.bind(lin, cp.asarray(x), y, rows, accumulate, exact=mode == "bf16+exact")
        with stream:
            step()
        stream.synchronize()
        got = cp.asnumpy(y).astype(np.float64)
        xr = bf16(x) if not exact else x.astype(np.float64)
        Wr = tile_ref(fmt if fmt != "nvfp4_stored" else "nvfp4", W, exact)
        ref = xr @ Wr.T + (y0 if accumulate else 0)
        bound = np.abs(xr) @ np.abs(Wr).T + (np.abs(y0) if accumulate else 0)
        assert np.isfinite(got).all(), "unwritten or non-finite outputs"
        # exact: hi + lo carry 16 bits of x (and of a rounded format's w): <= 2^-17 relative each,
        # float32 accumulation on top
        tol = 2e-5 if exact else 1e-5
        err = np.abs(got - ref)
        assert (err <= tol * bound + 1e-30).all(), f"{fmt} {shape} {mode}: worst {np.max(err / (bound + 1e-30)):.2e}"


def test_gemm_captures_into_a_graph():
    rng = np.random.default_rng(3)
    W, arrays = artifact("nvfp4", (256, 512), rng)
    lin = G.Linear("nvfp4", (256, 512), {k: cp.asarray(v) for k, v in arrays.items()})
    stream = cp.cuda.Stream(non_blocking=True)
    mm = M.Matmul(stream, "bf16x2")
    x = cp.asarray(rng.standard_normal((64, 512)).astype(np.float32))
    y = cp.zeros((64, 256), cp.float32)
    step = mm.bind(lin, x, y, 64)
    with stream:
        step()                                    # eager first (cuBLAS picks its kernels)
        stream.begin_capture()
        step()
        g = stream.end_capture()
    stream.synchronize()
    first = cp.asnumpy(y).copy()
    y.fill(0)
    g.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), first)
    np.testing.assert_allclose(first, cp.asnumpy(x).astype(np.float64) @ W.T, rtol=1e-4,
                               atol=1e-4 * float(np.abs(first).max()))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_tensor", "fp8_channel", "bf16"])
@pytest.mark.parametrize("shape", [(130, 320), (257, 4096)])
def test_gemm_split_k_matches_float64(fmt, shape):
    """BLOOMERY_PREFILL_SPLIT_K: the product as GEMMs over 256-column slices (320 = 256 + 64: a short
    last slice), summed by the beta = 1 epilogue: the same band against float64 as one GEMM, with and
    without accumulating into y."""
    rng = np.random.default_rng(zlib.crc32(repr(("split", fmt, shape)).encode()))
    W, arrays = artifact(fmt, shape, rng)
    lin = G.Linear(fmt, shape, {k: cp.asarray(v) for k, v in arrays.items()})
    stream = cp.cuda.Stream(non_blocking=True)
    mm = M.Matmul(stream, "bf16x2", split_k=256)
    for rows, accumulate in ((9, False), (100, True)):
        x = (rng.standard_normal((rows, shape[1])) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        y0 = rng.standard_normal((rows, shape[0])).astype(np.float32)
        y = cp.asarray(y0) if accumulate else cp.full((rows, shape[0]), cp.nan, cp.float32)
        step = mm.bind(lin, cp.asarray(x), y, rows, accumulate)
        with stream:
            step()
        stream.synchronize()
        got = cp.asnumpy(y).astype(np.float64)
        xr, Wr = x.astype(np.float64), W
        ref = xr @ Wr.T + (y0 if accumulate else 0)
        bound = np.abs(xr) @ np.abs(Wr).T + (np.abs(y0) if accumulate else 0)
        err = np.abs(got - ref)
        assert (err <= 2e-5 * bound + 1e-30).all(), f"{fmt} {shape}: worst {np.max(err / (bound + 1e-30)):.2e}"
    with pytest.raises(ValueError):
        M.Matmul(stream, "bf16x2", split_k=100)


def test_gemm_split_k_bounds_the_truncation_of_a_cancelling_sum():
    """A sum whose running value grows to ~70 and ends near 0.05 (products of 16 significant bits over
    six octaves: the case that fails the FP8 teacher-forced check, docs/PERF.md): the whole-depth GEMM's
    error is the tensor cores' truncating accumulation; slices of 256 summed in float32 must not be
    worse (tools/emulate_prefill.py's model of the accumulation predicts 4.2e-4 against 2.0e-5)."""
    rng = np.random.default_rng(7)
    K, out, rows = 4096, 8, 4
    h = bf16(np.exp(rng.uniform(-6, 0, (out, K // 2))))
    W = np.concatenate([h, -h], 1)
    xh = bf16(np.exp(rng.uniform(-6, 0, (rows, K // 2))))
    x = np.concatenate([xh, bf16(xh * (1 + rng.uniform(-1e-2, 1e-2, xh.shape)))], 1).astype(np.float32)
    ref = x.astype(np.float64) @ W.T
    lin = G.Linear("bf16", (out, K), {"weight": cp.asarray(W.astype(ml_dtypes.bfloat16).view(np.uint16))})
    stream = cp.cuda.Stream(non_blocking=True)
    errs = {}
    for sk in (0, 256):
        y = cp.zeros((rows, out), cp.float32)
        step = M.Matmul(stream, "bf16x2", split_k=sk).bind(lin, cp.asarray(x), y, rows)
        with stream:
            step()
        stream.synchronize()
        errs[sk] = float(np.abs(cp.asnumpy(y) - ref).max())
    print("max abs error, whole depth / slices of 256:", errs)
    assert errs[0] > 0, f"the whole-depth GEMM was exact here, so this case does not exercise the truncation: {errs}"
    assert errs[256] <= errs[0], errs
