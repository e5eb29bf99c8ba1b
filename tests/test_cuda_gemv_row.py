"""GPU: the one-row NVFP4 GEMV on the tensor cores (runtime/cuda/gemv_row.cu) against float64 and against
itself: odd shapes (rows and k-groups padded), accumulate, activations past f16's range and all-zero rows,
split-K and not, bit-identical repeats, a row of an NB-row launch equal to that row alone, q/k/v with the
RMSNorm folded in and gate/up with the SwiGLU, the GPU repack equal to the NumPy twin, and a chain of launches
under programmatic dependent launch in a graph."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="CuPy is not installed: the CUDA kernel tests need it and a GPU")
try:
    _n = cp.cuda.runtime.getDeviceCount()
    _why = "" if _n else "no device"
except Exception as e:                                   # pragma: no cover - depends on the machine
    _n, _why = 0, f"{type(e).__name__}: {e}"
if not _n:
    pytest.skip(f"no CUDA GPU ({_why})", allow_module_level=True)

from bloomery.core import formats                        # noqa: E402
from bloomery.core.artifact import layout                 # noqa: E402
from bloomery.runtime.cuda import gemv as G               # noqa: E402
from bloomery.runtime.cuda import gemv_row as R           # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(1, 64), (7, 128), (130, 320), (576, 1536), (1536, 576), (257, 4096), (300, 14336)]
CFGS = [R.RowConfig(), R.RowConfig(U=8), R.RowConfig(W=8, U=2), R.RowConfig(warps=132, W=2)]


def artifact(fmt, shape, rng):
    """Random weights of row scales 0.01..3 encoded by the format's encoder, as the artifact stores them (GGML
    NVFP4 blocks), and their float64 decode (the device has no tests package to import helpers from)."""
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3, (shape[0], 1)).astype(np.float32)
    parts = formats.get(fmt).encode(x)
    return formats.get(fmt).decode(parts).astype(np.float64), layout.to_gguf(fmt, parts)


def linear(shape, seed):
    rng = np.random.default_rng(zlib.crc32(repr(("row", shape, seed)).encode()))
    W, arrays = artifact("nvfp4", shape, rng)
    return W, G.Linear("nvfp4", shape, {k: cp.asarray(v) for k, v in arrays.items()}, pdl=True), rng


def run(lins, x, ys, nb=1, **kw):
    R.bind(lins, cp.asarray(x), ys, nb, **kw)()
    cp.cuda.runtime.deviceSynchronize()


def within(got, x, W, y0=None, tol=2e-5):
    x64 = x.astype(np.float64)
    ref = x64 @ W.T + (y0 if y0 is not None else 0)
    bound = np.abs(x64) @ np.abs(W).T + (np.abs(y0) if y0 is not None else 0)
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = np.abs(got - ref)
    assert (err <= tol * bound + 1e-30).all(), f"worst {np.max(err / (bound + 1e-30)):.2e}"
    assert np.linalg.norm(err) <= tol * np.linalg.norm(bound)


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_row_matches_float64(shape, cfg):
    W, lin, rng = linear(shape, 0)
    out, inn = shape
    for scale in (1.0, 1e-4, 1e4):
        x = (rng.standard_normal((1, inn)) * scale).astype(np.float32)
        y = cp.full((1, out), cp.nan, cp.float32)
        run([lin], x, [y], cfg=cfg)
        within(cp.asnumpy(y), x, W)
    x = rng.standard_normal((1, inn)).astype(np.float32)
    y0 = rng.standard_normal((1, out)).astype(np.float32)
    y = cp.asarray(y0)
    run([lin], x, [y], accumulate=True, cfg=cfg)
    within(cp.asnumpy(y), x, W, y0)
    x = (rng.standard_normal((1, inn)) * 1e-3).astype(np.float32)
    x[0, ::7] *= np.float32(1e9)                          # |x| up to ~1e6: past f16's 65504
    ys = []
    for _ in range(2):
        y = cp.full((1, out), cp.nan, cp.float32)
        run([lin], x, [y], cfg=cfg)
        ys.append(cp.asnumpy(y))
    within(ys[0], x, W)
    assert (ys[0].view(np.uint32) == ys[1].view(np.uint32)).all(), "two launches differ"
    y = cp.full((1, out), cp.nan, cp.float32)
    run([lin], np.zeros((1, inn), np.float32), [y], cfg=cfg)
    assert not cp.asnumpy(y).any(), "a zero row gives nonzero outputs"


@pytest.mark.parametrize("nb", [2, 3, 8])
@pytest.mark.parametrize("shape", [(130, 320), (1536, 576), (257, 4096), (300, 14336)])
def test_gemv_row_rows_equal_the_row_alone(shape, nb):
    """The verify program's contract: each row of an nb-row launch is bit for bit that row launched alone."""
    W, lin, rng = linear(shape, 1)
    out, inn = shape
    x = rng.standard_normal((nb, inn)).astype(np.float32)
    x[nb - 1] *= np.float32(1e4)
    y = cp.full((nb, out), cp.nan, cp.float32)
    run([lin], x, [y], nb)
    within(cp.asnumpy(y), x, W)
    for b in range(nb):
        y1 = cp.full((1, out), cp.nan, cp.float32)
        run([lin], x[b:b + 1], [y1])
        assert (cp.asnumpy(y1)[0].view(np.uint32) == cp.asnumpy(y)[b].view(np.uint32)).all(), f"row {b} differs"


@pytest.mark.parametrize("nb", [1, 3])
@pytest.mark.parametrize("outs, inn", [((4096, 1024, 1024), 4096), ((320, 64, 130), 1536), ((576, 192, 192), 576)])
def test_gemv_row_group_folds_rmsnorm(outs, inn, nb):
    rng = np.random.default_rng(zlib.crc32(repr(("rowg", outs, inn)).encode()))
    mats = [artifact("nvfp4", (o, inn), rng) for o in outs]
    lins = [G.Linear("nvfp4", (o, inn), {k: cp.asarray(v) for k, v in a.items()}, pdl=True) for o, (_, a) in zip(outs, mats)]
    nw = rng.uniform(0.5, 1.5, inn).astype(np.float32)
    x = (3 * rng.standard_normal((nb, inn))).astype(np.float32)
    ys = [cp.full((nb, o), cp.nan, cp.float32) for o in outs]
    eps = 1e-5
    run(lins, x, ys, nb, norm_weight=cp.asarray(nw), eps=eps)
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * nw
    for (W, _), y in zip(mats, ys):
        within(cp.asnumpy(y), xn, W)
    ys = [cp.full((nb, o), cp.nan, cp.float32) for o in outs]           # and without the norm
    run(lins, x, ys, nb)
    for (W, _), y in zip(mats, ys):
        within(cp.asnumpy(y), x, W)


@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("shape", [(14336, 4096), (1536, 576), (130, 320)])
def test_gemv_row_pair_folds_swiglu(shape, limit):
    rng = np.random.default_rng(zlib.crc32(repr(("rowp", shape)).encode()))
    (Wg, ag), (Wu, au) = artifact("nvfp4", shape, rng), artifact("nvfp4", shape, rng)
    g, u = (G.Linear("nvfp4", shape, {k: cp.asarray(v) for k, v in a.items()}, pdl=True) for a in (ag, au))
    nw = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    x = (3 * rng.standard_normal((1, shape[1]))).astype(np.float32)
    o = cp.full((1, shape[0]), cp.nan, cp.float32)
    eps = 1e-6
    run([g, u], x, [o], norm_weight=cp.asarray(nw), eps=eps, pair=True, limit=limit)
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * nw
    gv, uv = xn @ Wg.T, xn @ Wu.T
    if limit is not None:
        gv, uv = np.minimum(gv, limit), np.clip(uv, -limit, limit)
    ref = gv / (1 + np.exp(-gv)) * uv
    bg, bu = np.abs(xn) @ np.abs(Wg).T, np.abs(xn) @ np.abs(Wu).T
    bound = 1.1 * bg * np.abs(uv) + np.abs(gv / (1 + np.exp(-gv))) * bu
    err = np.abs(cp.asnumpy(o).astype(np.float64) - ref)
    assert np.isfinite(cp.asnumpy(o)).all() and (err <= 2e-5 * bound + 1e-30).all(), f"worst {np.max(err / (bound + 1e-30)):.2e}"


@pytest.mark.parametrize("shape", [(100, 192), (40, 576), (1024, 4096)])
def test_gemv_row_repack_equals_the_numpy_twin(shape):
    _, lin, _ = linear(shape, 2)
    wa, sa = R.layout(lin)
    w_np, s_np = R.repack(cp.asnumpy(lin.w), *shape)
    assert cp.asnumpy(wa).tobytes() == w_np.tobytes() and cp.asnumpy(sa).tobytes() == s_np.tobytes()


def test_gemv_row_pdl_chain_in_a_graph():
    """Launches that read what the one before wrote (x -> y1 -> y2 ...), split-K and not, captured with
    programmatic dependent launch and replayed: each equals its launch alone."""
    if cp.cuda.Device().compute_capability < "90":
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    W1, L1, rng = linear((4096, 4096), 3)
    W2, L2, _ = linear((14336, 4096), 4)
    W3, L3, _ = linear((4096, 14336), 5)
    x = cp.asarray(rng.standard_normal((1, 4096)).astype(np.float32))
    a, b, c = cp.zeros((1, 4096), cp.float32), cp.zeros((1, 14336), cp.float32), cp.zeros((1, 4096), cp.float32)
    steps = [R.bind([L1], x, [a], pdl=True), R.bind([L2], a, [b], pdl=True), R.bind([L3], b, [c], pdl=True),
             R.bind([L1], c, [a], accumulate=True, pdl=True)]
    ref = []
    for s in steps:
        s()
        cp.cuda.runtime.deviceSynchronize()
        ref.append((cp.asnumpy(a).copy(), cp.asnumpy(b).copy(), cp.asnumpy(c).copy()))
    want = ref[-1]
    s = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        a[...] = 0
        b[...] = 0
        c[...] = 0
        cp.cuda.runtime.deviceSynchronize()
        with s:
            s.begin_capture()
            for st in steps:
                st()
            gr = s.end_capture()
        gr.launch(s)
        s.synchronize()
        for got, w in zip((a, b, c), want):
            assert (cp.asnumpy(got).view(np.uint32) == w.view(np.uint32)).all()
