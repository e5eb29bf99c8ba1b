"""GPU: the decode GEMV kernels (runtime/cuda/gemv.py) against float64 references built from
core/formats' own decoders, on artifacts laid out by core/artifact/layout.to_gguf.
Skipped (visibly) where CuPy or a CUDA GPU is absent. tools/bench_kernels.py checks the large
shapes and times them."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="CuPy is not installed: the CUDA kernel tests need it and a GPU")
try:
    _ndev = cp.cuda.runtime.getDeviceCount()
except Exception as e:                                   # no driver / no device
    _ndev, _why = 0, f"{type(e).__name__}: {e}"
else:
    _why = "no CUDA device"
if not _ndev:
    pytest.skip(f"no CUDA GPU ({_why})", allow_module_level=True)

from bloomery.core import formats                        # noqa: E402
from bloomery.core.artifact import layout                 # noqa: E402
from bloomery.runtime.cuda import gemv as G               # noqa: E402

pytestmark = pytest.mark.gpu

FORMATS = ["nvfp4", "mxfp8", "fp8_tensor", "fp8_channel", "fp8_block128", "bf16", "f32", "q8_0"]
SHAPES = [(1, 64), (7, 128), (130, 320), (576, 1536), (1536, 576), (257, 4096)]


def artifact(fmt, shape, rng, stored_nvfp4=False):
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3, (shape[0], 1)).astype(np.float32)
    parts = formats.get(fmt).encode(x)
    if stored_nvfp4:                                      # the stored layout: I8 nibbles + I8 E4M3 scales
        arrays = {"weight": np.asarray(parts["weight"]).view(np.int8),
                  "scale": np.asarray(parts["scale"]).view(np.int8),
                  "scale_2": np.asarray(parts["scale_2"], np.float32).reshape(1)}
    else:
        arrays = layout.to_gguf(fmt, parts)
    if fmt == "bf16":
        arrays["weight"] = np.asarray(arrays["weight"]).view(np.uint16)
    return formats.get(fmt).decode(parts).astype(np.float64), arrays


def check(lin, W, nb, rng, accumulate=False, tol=1e-5):
    x = rng.standard_normal((nb, W.shape[1])).astype(np.float32)
    y0 = rng.standard_normal((nb, W.shape[0])).astype(np.float32)
    y = cp.asarray(y0) if accumulate else cp.full((nb, W.shape[0]), cp.nan, dtype=cp.float32)
    lin(cp.asarray(x), y, accumulate=accumulate)
    got = cp.asnumpy(y).astype(np.float64)
    ref = x.astype(np.float64) @ W.T + (y0 if accumulate else 0)
    bound = np.abs(x.astype(np.float64)) @ np.abs(W).T + (np.abs(y0) if accumulate else 0)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = np.abs(got - ref)
    assert (err <= tol * bound + 1e-30).all(), f"worst {np.max(err / (bound + 1e-30)):.2e}"
    # in L2 against the bound's norm: a lone output whose terms cancel (ref << bound) would otherwise
    # demand more than float32 accumulation can give (seen once: 1 x 64, |ref| 0.026, error 2.5e-6)
    assert np.linalg.norm(err) <= tol * np.linalg.norm(bound)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS + ["nvfp4_stored"])
def test_gemv_matches_float64(fmt, shape):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, shape)).encode()))   # the same data every run
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    if f in ("nvfp4",) and shape[1] % 16 or f in ("mxfp8", "q8_0") and shape[1] % 32:
        pytest.skip("not a valid shape for the format")
    if fmt == "nvfp4" and shape[1] % 64:
        pytest.skip("GGML NVFP4 needs in % 64")
    W, arrays = artifact(f, shape, rng, stored_nvfp4=fmt == "nvfp4_stored")
    lin = G.Linear(f, shape, {k: cp.asarray(v) for k, v in arrays.items()})
    assert lin.kind == ("nvfp4_stored" if fmt == "nvfp4_stored" else "nvfp4_ggml" if f == "nvfp4" else f)
    for nb in (1, 3, 8):
        check(lin, W, nb, rng)
    check(lin, W, 2, rng, accumulate=True)


@pytest.mark.parametrize("shape", [(1536, 576), (257, 4096), (4096, 4096), (1024, 14336)])
@pytest.mark.parametrize("fmt", FORMATS + ["nvfp4_stored"])
def test_gemv_one_launch_rows_equal_one_row_launches(fmt, shape):
    """launch(..., one=True) (the verify program's linears): each of nb rows bit-equal to a launch of
    that row alone, the weight read once for all of them."""
    rng = np.random.default_rng(zlib.crc32(repr(("one", fmt, shape)).encode()))
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    W, arrays = artifact(f, shape, rng, stored_nvfp4=fmt == "nvfp4_stored")
    lin = G.Linear(f, shape, {k: cp.asarray(v) for k, v in arrays.items()})
    for nb in (2, 3, 5, 8):
        x = cp.asarray(rng.standard_normal((nb, shape[1])).astype(np.float32))
        y = cp.full((nb, shape[0]), cp.nan, dtype=cp.float32)
        lin.launch(x, y, nb, one=True)
        for b in range(nb):
            y1 = cp.full((1, shape[0]), cp.nan, dtype=cp.float32)
            lin.launch(x[b:b + 1], y1, 1)
            assert cp.array_equal(y[b], y1[0]), f"{fmt} {shape}: row {b} of {nb} differs from its 1-row launch"


@pytest.mark.parametrize("fmt", FORMATS + ["nvfp4_stored"])
def test_gemv_group_members_equal_their_own_launches(fmt):
    """gemv.Group (q, k and v in one launch): each member's rows bit-equal to a launch of that member alone
    with the group's config (the largest member's: here not the small members' own), within float64's
    bound; the one=True form (verify) row by row bit-equal to 1-row group launches."""
    rng = np.random.default_rng(zlib.crc32(repr(("group", fmt)).encode()))
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    shapes = [(4096, 256), (40, 256), (136, 256)]
    mats = [artifact(f, s, rng, stored_nvfp4=fmt == "nvfp4_stored") for s in shapes]
    lins = [G.Linear(f, s, {k: cp.asarray(v) for k, v in a.items()}) for s, (_, a) in zip(shapes, mats)]
    assert G.Group(lins).config(1) != G.default_config(lins[1].kind, 40, 256, 1), "the test wants differing configs"
    for n in (2, 3):
        grp = G.Group(lins[:n])
        for nb, one in ((1, False), (3, False), (8, False), (5, True)):
            x = cp.asarray(rng.standard_normal((nb, 256)).astype(np.float32))
            ys = [cp.full((nb, L.out), cp.nan, dtype=cp.float32) for L in lins[:n]]
            grp.bind(x, ys, nb, one)()
            c = grp.config(nb, one)
            for L, (W, _), y in zip(lins[:n], mats, ys):
                own = G.Linear(f, (L.out, 256), L.arrays, config=c)
                y1 = cp.full((nb, L.out), cp.nan, dtype=cp.float32)
                own.launch(x, y1, nb, one=one)
                assert cp.array_equal(y, y1), f"{fmt} member {L.out}x256, {nb} rows (one={one}): not its own launch"
                ref = cp.asnumpy(x).astype(np.float64) @ W.T
                bound = np.abs(cp.asnumpy(x).astype(np.float64)) @ np.abs(W).T
                assert (np.abs(cp.asnumpy(y) - ref) <= 1e-5 * bound + 1e-30).all()
            if one:
                for b in range(nb):
                    y1 = [cp.full((1, L.out), cp.nan, dtype=cp.float32) for L in lins[:n]]
                    grp.bind(x[b:b + 1], y1, 1)()
                    assert all(cp.array_equal(y[b], z[0]) for y, z in zip(ys, y1)), f"{fmt}: verify row {b} != 1-row"
    with pytest.raises(ValueError):
        G.Group(lins[:1])


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_tensor", "q8_0", "nvfp4_stored", "mxfp8", "bf16"])
def test_gemv_pdl_chain_in_a_graph(fmt):
    """Programmatic dependent launch (runtime/cuda/pdl.py): a captured chain of GEMV launches, each reading
    the output of the one before (a single linear, a Group of three, a gate / up pair with the SwiGLU, and
    again, accumulating; 12 times over in one graph, the graph run 3 times), gives the same bits as the chain
    without it: no launch reads its x or writes its y before the launch before it has finished and its
    writes are visible (a kernel without griddepcontrol.wait, planted, fails this at once)."""
    from bloomery.runtime.cuda import pdl
    if not pdl.enabled({}):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    rng = np.random.default_rng(zlib.crc32(repr(("pdl", fmt)).encode()))
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    D = 1024
    mats = [artifact(f, (D, D), rng, stored_nvfp4=fmt == "nvfp4_stored")[1] for _ in range(6)]
    nw = cp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32))

    def chain(on):
        lins = [G.Linear(f, (D, D), {k: cp.asarray(v) for k, v in a.items()}, pdl=on) for a in mats]
        bufs = [cp.zeros((1, D), cp.float32) for _ in range(6)]
        x = cp.asarray(np.random.default_rng(1).standard_normal((1, D)).astype(np.float32))
        grp, pair = G.Group(lins[1:4], norm=False), G.Group(lins[4:6], norm=True, pair=True)
        steps = [lambda: lins[0].launch(x, bufs[0], 1),
                 grp.bind(bufs[0], bufs[1:4], 1),
                 pair.bind(bufs[3], [bufs[4]], 1, norm_weight=nw, eps=1e-5),
                 lambda: lins[1].launch(bufs[4], bufs[5], 1),
                 lambda: lins[2].launch(bufs[5], bufs[4], 1, accumulate=True),
                 lambda: lins[0].launch(bufs[4], bufs[5], 1, accumulate=True)]
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            for st in steps:                               # compile, then capture
                st()
            s.synchronize()
            for b in bufs:
                b.fill(0)
            s.begin_capture()
            for _ in range(12):
                for st in steps:
                    st()
            g = s.end_capture()
            runs = []
            for _ in range(3):
                for b in bufs:
                    b.fill(0)
                g.launch(s)
                s.synchronize()
                runs.append([cp.asnumpy(b) for b in bufs])
        return runs

    plain, overlapped = chain(False)[0], chain(True)
    for r, run in enumerate(overlapped):
        for i, (a, b) in enumerate(zip(plain, run)):
            assert np.isfinite(a).all(), f"{fmt}: the chain overflowed (buffer {i}): the test needs smaller values"
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
                f"{fmt}: buffer {i} differs with programmatic dependent launch (graph run {r}: " \
                f"{int((a != b).sum())} of {a.size} values)"


@pytest.mark.parametrize("fmt", FORMATS + ["nvfp4_stored"])
def test_gemv_group_folds_rmsnorm(fmt):
    """gemv.Group(norm=True): W_m rmsnorm(x) in one launch, against float64 of the norm then the matrix
    (1e-5 of the bound) and against the unfused launches (the norm's kernel, then the group: within
    float32 rounding); one=True rows bit-equal to 1-row launches; one member allowed."""
    from bloomery.runtime.cuda import ops as K
    rng = np.random.default_rng(zlib.crc32(repr(("norm", fmt)).encode()))
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    inn, eps = 320 if f not in ("nvfp4",) else 256, 1e-5
    shapes = [(1000, inn), (72, inn), (200, inn)]
    mats = [artifact(f, s, rng, stored_nvfp4=fmt == "nvfp4_stored") for s in shapes]
    lins = [G.Linear(f, s, {k: cp.asarray(v) for k, v in a.items()}) for s, (_, a) in zip(shapes, mats)]
    w = (1 + 0.3 * rng.standard_normal(inn)).astype(np.float32)
    for n in (1, 3):
        grp = G.Group(lins[:n], norm=True)
        for nb, one in ((1, False), (4, False), (3, True)):
            x = (rng.standard_normal((nb, inn)) * rng.uniform(0.1, 20, (nb, 1))).astype(np.float32)
            ys = [cp.full((nb, L.out), cp.nan, dtype=cp.float32) for L in lins[:n]]
            grp.bind(cp.asarray(x), ys, nb, one, norm_weight=cp.asarray(w), eps=eps)()
            x64 = x.astype(np.float64)
            xn = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * w
            xs = cp.empty((nb, inn), cp.float32)                      # the unfused path: rmsnorm_k, then the group
            K.kernels()["rmsnorm_k"]((nb,), (128,), (cp.asarray(x), xs, cp.asarray(w), np.int32(inn), np.float32(eps),
                                                  np.int32(1)))
            plain = [cp.full((nb, L.out), cp.nan, dtype=cp.float32) for L in lins[:n]]
            if n > 1:
                G.Group(lins[:n]).bind(xs, plain, nb, one)()
            else:
                own = G.Linear(f, (lins[0].out, inn), lins[0].arrays, config=grp.config(nb, one))
                own.launch(xs, plain[0], nb, one=one)
            for (W, _), y, z in zip(mats, ys, plain):
                got = cp.asnumpy(y).astype(np.float64)
                bound = np.abs(xn) @ np.abs(W).T
                assert (np.abs(got - xn @ W.T) <= 1e-5 * bound + 1e-30).all(), f"{fmt} {nb} rows: not W rmsnorm(x)"
                assert np.abs(got - cp.asnumpy(z)).max() <= 2e-6 * bound.max(), f"{fmt}: not the unfused launches"
            if one:
                for b in range(nb):
                    y1 = [cp.full((1, L.out), cp.nan, dtype=cp.float32) for L in lins[:n]]
                    grp.bind(cp.asarray(x[b:b + 1]), y1, 1, norm_weight=cp.asarray(w), eps=eps)()
                    assert all(cp.array_equal(y[b], z[0]) for y, z in zip(ys, y1)), f"{fmt}: verify row {b} != 1-row"
    with pytest.raises(ValueError):
        G.Group(lins[:2], norm=True).bind(cp.zeros((1, inn), cp.float32), [cp.zeros((1, 1000), cp.float32)] * 2, 1)


@pytest.mark.parametrize("fmt", FORMATS + ["nvfp4_stored"])
def test_gemv_pair_folds_swiglu(fmt):
    """gemv.Group(pair=True): silu(W_gate x) * (W_up x) in one launch, bit-equal to the grouped launch then
    swiglu_k (and swiglu_limit_k with a clamp), with and without a folded norm; one=True rows bit-equal
    to 1-row launches."""
    from bloomery.runtime.cuda import ops as K
    rng = np.random.default_rng(zlib.crc32(repr(("pair", fmt)).encode()))
    f = "nvfp4" if fmt == "nvfp4_stored" else fmt
    inn, out, eps = 256, 600, 1e-5
    mats = [artifact(f, (out, inn), rng, stored_nvfp4=fmt == "nvfp4_stored") for _ in range(2)]
    lins = [G.Linear(f, (out, inn), {k: cp.asarray(v) for k, v in a.items()}) for _, a in mats]
    w = cp.asarray((1 + 0.3 * rng.standard_normal(inn)).astype(np.float32))
    for norm in (False, True):
        grp, plain = G.Group(lins, norm=norm, pair=True), G.Group(lins, norm=norm)
        nk = dict(norm_weight=w, eps=eps) if norm else {}
        for nb, one, limit in ((1, False, None), (5, False, None), (3, True, None), (2, False, 0.7)):
            x = cp.asarray((rng.standard_normal((nb, inn)) * 3).astype(np.float32))
            o = cp.full((nb, out), cp.nan, dtype=cp.float32)
            grp.bind(x, [o], nb, one, limit=limit, **nk)()
            g, u = (cp.full((nb, out), cp.nan, dtype=cp.float32) for _ in range(2))
            plain.bind(x, [g, u], nb, one, **nk)()
            ref = cp.empty_like(g)
            if limit is None:
                K.kernels()["swiglu_k"]((4,), (256,), (g, u, ref, np.int32(g.size)))
            else:
                K.kernels()["swiglu_limit_k"]((4,), (256,), (g, u, ref, np.int32(g.size), np.float32(limit)))
            assert cp.array_equal(o, ref), f"{fmt} norm={norm} {nb} rows one={one} limit={limit}: not the unfused launches"
            if one:
                for b in range(nb):
                    o1 = cp.full((1, out), cp.nan, dtype=cp.float32)
                    grp.bind(x[b:b + 1], [o1], 1, **nk)()
                    assert cp.array_equal(o[b], o1[0]), f"{fmt}: verify row {b} != its 1-row launch"
    _, half = artifact(f, (out // 2, inn), rng, stored_nvfp4=fmt == "nvfp4_stored")
    with pytest.raises(ValueError):
        G.Group([lins[0], G.Linear(f, (out // 2, inn), {k: cp.asarray(v) for k, v in half.items()})], pair=True)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 64 == 0] + [(16, 14336)])
def test_gemv_nvfp4_tensor_cores(shape):
    """gemv_nvfp4_mma (batch 1; larger batches fall back to the CUDA-core kernel): x split into f16
    hi + lo after a power-of-two scaling, so activations beyond f16's range (1e6 here) stay exact."""
    rng = np.random.default_rng(zlib.crc32(repr(("mma", shape)).encode()))
    W, arrays = artifact("nvfp4", shape, rng)
    lin = G.Linear("nvfp4", shape, {k: cp.asarray(v) for k, v in arrays.items()}, mma=True)
    assert lin.mma and lin.kernel_name(1).startswith("gemv_nvfp4_mma")
    # x carried to ~22 bits; the tensor cores' float32 accumulation is not IEEE round-to-nearest:
    # 2e-5 of the bound, as the exact prompt GEMM (tests/test_cuda_gemm.py)
    check(lin, W, 1, rng, tol=2e-5)
    check(lin, W, 1, rng, accumulate=True, tol=2e-5)
    check(lin, W, 3, rng)
    x = rng.standard_normal((1, shape[1])).astype(np.float32) * np.float32(1e-3)
    x[0, ::7] *= np.float32(1e9)                            # |x| up to ~1e6: past f16's 65504
    y = cp.full((1, shape[0]), cp.nan, dtype=cp.float32)
    lin(cp.asarray(x), y)
    ref = x.astype(np.float64) @ W.T
    bound = np.abs(x.astype(np.float64)) @ np.abs(W).T
    err = np.abs(cp.asnumpy(y).astype(np.float64) - ref)
    assert np.isfinite(cp.asnumpy(y)).all() and (err <= 2e-5 * bound + 1e-30).all()


@pytest.mark.parametrize("cfg", [G.TcConfig(), G.TcConfig(MT=1, W=8, U=2, ctas=132, min_blocks=1), G.TcConfig(NS=3),
                                 G.TcConfig(NS=2, MT=1, W=8, ctas=528), G.TcConfig(NS=2, MT=1, W=8, ctas=264, xg=True),
                                 G.TcConfig(ctas=528, xg=True), G.TcConfig(NS=2, xg=True),
                                 G.TcConfig(NS=2, W=2, xg=True)])
@pytest.mark.parametrize("shape", [(1, 64), (7, 128), (130, 320), (576, 1536), (1536, 576), (257, 4096),
                                   (1024, 4096), (300, 14336)])
def test_gemv_tc_matches_float64(shape, cfg):
    """gemv_nvfp4_tc (several rows on the tensor cores, split-K with an in-order reduction): every
    batch size 1..16, accumulate, activations past f16's range, and bit-identical repeats."""
    rng = np.random.default_rng(zlib.crc32(repr(("tc", shape)).encode()))
    W, arrays = artifact("nvfp4", shape, rng)
    lin = G.Linear("nvfp4", shape, {k: cp.asarray(v) for k, v in arrays.items()})
    part, sem = (cp.zeros(n, t) for n, t in zip(lin.tc_need(16, cfg), (cp.float32, cp.int32)))

    class Tc:                                             # check()'s calling convention
        def __call__(self, x, y, accumulate=False):
            lin.launch_tc(x, y, x.shape[0], accumulate, part[:lin.tc_need(x.shape[0], cfg)[0]], sem, cfg)
    for nb in (1, 2, 3, 4, 5, 8, 9, 13, 16):
        check(Tc(), W, nb, rng, tol=2e-5)
    check(Tc(), W, 6, rng, accumulate=True, tol=2e-5)
    assert not cp.asnumpy(sem).any(), "tile counters not left at zero"
    x = rng.standard_normal((11, shape[1])).astype(np.float32) * np.float32(1e-3)
    x[3, ::7] *= np.float32(1e9)                            # |x| up to ~1e6 in one row: past f16's 65504
    x[5] = 0.0
    ys = []
    for _ in range(2):
        y = cp.full((11, shape[0]), cp.nan, dtype=cp.float32)
        Tc()(cp.asarray(x), y)
        ys.append(cp.asnumpy(y))
    ref = x.astype(np.float64) @ W.T
    bound = np.abs(x.astype(np.float64)) @ np.abs(W).T
    err = np.abs(ys[0].astype(np.float64) - ref)
    assert np.isfinite(ys[0]).all() and (err <= 2e-5 * bound + 1e-30).all()
    assert (ys[0] == ys[1]).all(), "two launches differ: the reduction is not deterministic"


@pytest.mark.parametrize("cfg", [None, G.TcConfig(NS=2, MT=1, W=8, ctas=264, xg=True), G.TcConfig(NS=2, xg=True)])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("outs, inn", [((4096, 1024, 1024), 4096), ((320, 64, 130), 1536), ((14336, 14336), 4096),
                                       ((257, 7), 128)])
def test_gemv_tc_group_is_each_member_alone(outs, inn, pdl, cfg):
    """gemv.TcGroup (q, k, v or gate, up in one tensor-core launch): each member's rows bit for bit what a
    launch of it alone computes, at every batch size, accumulate included; tile counters left at zero; with
    programmatic dependent launch as the executor launches it, and a chained launch reading the group's
    output (the wait before x); x's fragments made by each CTA or once (xg)."""
    rng = np.random.default_rng(zlib.crc32(repr(("tcg", outs, inn)).encode()))
    lins = []
    for o in outs:
        W, arrays = artifact("nvfp4", (o, inn), rng)
        lins.append(G.Linear("nvfp4", (o, inn), {k: cp.asarray(v) for k, v in arrays.items()}, pdl=pdl))
    for nb in (1, 3, 4, 8, 9, 16):
        grp = G.TcGroup(lins, nb, cfg)
        pf, si = grp.need()
        part, sem = cp.zeros(pf, cp.float32), cp.zeros(si, cp.int32)
        x = cp.asarray(rng.standard_normal((nb, inn)).astype(np.float32))
        for acc in (False, True):
            y0 = [cp.asarray(rng.standard_normal((nb, L.out)).astype(np.float32)) for L in lins]
            ys = [a.copy() if acc else cp.full_like(a, cp.nan) for a in y0]
            grp.launch(x, ys, acc, part, sem)
            for L, a, y in zip(lins, y0, ys):
                alone = a.copy() if acc else cp.full_like(a, cp.nan)
                L.launch_tc(x, alone, nb, acc, cfg=cfg)
                assert (cp.asnumpy(y) == cp.asnumpy(alone)).all(), (L.out, nb, acc)
        assert not cp.asnumpy(sem).any(), "tile counters not left at zero"
    # a chain: member 0's output of one launch is the next launch's x (square members only), in a graph
    if outs[0] == inn:
        nb = 16
        grp = G.TcGroup(lins, nb, cfg)
        part, sem = cp.zeros(grp.need()[0], cp.float32), cp.zeros(grp.need()[1], cp.int32)
        x0 = cp.asarray(rng.standard_normal((nb, inn)).astype(np.float32) * np.float32(0.05))
        bufs = [x0] + [[cp.empty((nb, L.out), cp.float32) for L in lins] for _ in range(4)]
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            x = bufs[0]
            for ys in bufs[1:]:
                grp.launch(x, ys, False, part, sem)
                x = ys[0]
            g = s.end_capture()
            g.launch(s)
        s.synchronize()
        x = bufs[0]
        for ys in bufs[1:]:                           # the same chain launch by launch, synchronised
            ref = [cp.empty_like(y) for y in ys]
            for L, r in zip(lins, ref):
                L.launch_tc(x, r, nb, cfg=cfg)
            cp.cuda.Device().synchronize()
            for y, r in zip(ys, ref):
                assert (cp.asnumpy(y) == cp.asnumpy(r)).all(), "a chained launch read x before it was written"
            x = ref[0]


def test_gemv_tc_group_refusals():
    rng = np.random.default_rng(3)
    mk = lambda o, i, f="nvfp4": G.Linear(f, (o, i), {k: cp.asarray(v) for k, v in artifact(f, (o, i), rng)[1].items()})
    a, b = mk(4096, 4096), mk(14336, 4096)
    with pytest.raises(ValueError, match="one kernel shape"):       # 8 warps a CTA against 4 at 16 rows (tc_config)
        G.TcGroup([a, b], 16)
    with pytest.raises(ValueError, match="one width"):
        G.TcGroup([a, mk(64, 128)], 16)
    with pytest.raises(ValueError, match="GGML NVFP4"):
        G.TcGroup([a, mk(64, 4096, "q8_0")], 16)
    assert not G.TcGroup.fits([a, a, a, a], 16) and G.TcGroup.fits([a, a, a], 16)


@pytest.mark.parametrize("cfg", [None, G.Bf16TcConfig(), G.Bf16TcConfig(MT=1, W=8, ctas=132), G.Bf16TcConfig(MT=4, W=4, ctas=64),
                                 G.Bf16TcConfig(xs=True), G.Bf16TcConfig(MT=1, W=8, ctas=132, xs=True)])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (130, 320), (576, 1536), (1536, 576), (257, 4096), (300, 14336)])
def test_gemv_bf16_tc_matches_float64(shape, cfg):
    """gemv_bf16_tc (BF16 weights, several rows on the tensor cores, x in three bf16 parts; split-K where the
    row tiles are few; cfg None: gemv.bf16_tc_config's choice at each row count): every batch size,
    accumulate, large and zero activations, bit-identical repeats, tile counters left at zero."""
    rng = np.random.default_rng(zlib.crc32(repr(("bf16tc", shape)).encode()))
    W, arrays = artifact("bf16", shape, rng)
    lin = G.Linear("bf16", shape, {k: cp.asarray(v) for k, v in arrays.items()})
    part, sem = (cp.zeros(n, t) for n, t in zip(lin.tc_need(16, cfg), (cp.float32, cp.int32)))

    class Tc:                                             # check()'s calling convention
        def __call__(self, x, y, accumulate=False):
            lin.launch_tc(x, y, x.shape[0], accumulate, part, sem, cfg)
    for nb in (1, 2, 3, 7, 8, 9, 13, 16):
        check(Tc(), W, nb, rng, tol=2e-5)
    check(Tc(), W, 10, rng, accumulate=True, tol=2e-5)
    assert not cp.asnumpy(sem).any(), "tile counters not left at zero"
    x = rng.standard_normal((11, shape[1])).astype(np.float32) * np.float32(1e-3)
    x[3, ::7] *= np.float32(1e12)                           # |x| up to ~1e9 in one row, tiny ones beside
    x[5] = 0.0
    ys = []
    for _ in range(2):
        y = cp.full((11, shape[0]), cp.nan, dtype=cp.float32)
        Tc()(cp.asarray(x), y)
        ys.append(cp.asnumpy(y))
    ref = x.astype(np.float64) @ W.T
    bound = np.abs(x.astype(np.float64)) @ np.abs(W).T
    err = np.abs(ys[0].astype(np.float64) - ref)
    assert np.isfinite(ys[0]).all() and (err <= 2e-5 * bound + 1e-30).all()
    assert (ys[0][5] == 0).all()
    assert (ys[0] == ys[1]).all(), "two launches differ: the reduction is not deterministic"


@pytest.mark.parametrize("shape", [(130, 320), (257, 4096), (1536, 576)])
def test_gemv_bf16_tc_xsplit_bit_for_bit(shape):
    """x's three bf16 parts made once a launch (gemv_bf16_xsplit, Bf16TcConfig.xs) are the words each warp
    makes itself otherwise: the outputs are equal bit for bit at every row count, with and without split-K."""
    rng = np.random.default_rng(zlib.crc32(repr(("bf16xs", shape)).encode()))
    W, arrays = artifact("bf16", shape, rng)
    lin = G.Linear("bf16", shape, {k: cp.asarray(v) for k, v in arrays.items()})
    for base in (G.Bf16TcConfig(), G.Bf16TcConfig(MT=1, W=8, ctas=16)):
        xs = G.Bf16TcConfig(base.MT, base.W, base.ctas, xs=True)
        part, sem = (cp.zeros(n, t) for n, t in zip(lin.tc_need(16, xs), (cp.float32, cp.int32)))
        for nb in (1, 5, 8, 9, 16):
            x = cp.asarray(rng.standard_normal((nb, shape[1])).astype(np.float32))
            x[0, ::5] *= np.float32(1e6)
            ys = []
            for cfg in (base, xs):
                y = cp.full((nb, shape[0]), cp.nan, dtype=cp.float32)
                lin.launch_tc(x, y, nb, False, part, sem, cfg)
                ys.append(cp.asnumpy(y))
            assert np.isfinite(ys[0]).all() and (ys[0].view(np.uint32) == ys[1].view(np.uint32)).all(), (base, nb)


@pytest.mark.parametrize("cfg", [None, G.Bf16TcConfig(xs=True)])
def test_gemv_bf16_tc_pdl_chain(cfg):
    """gemv_bf16_tc launched with programmatic dependent launch in a graph, each launch reading what the one
    before wrote (the weights before the wait, x after it; xs: gemv_bf16_xsplit's launch between): the same
    values as plain launches."""
    rng = np.random.default_rng(5)
    W, arrays = artifact("bf16", (512, 512), rng)
    plain = G.Linear("bf16", (512, 512), {k: cp.asarray(v) for k, v in arrays.items()})
    pdl = G.Linear("bf16", (512, 512), plain.arrays, pdl=True)
    nb = 16
    part, sem = (cp.zeros(n, t) for n, t in zip(plain.tc_need(nb, cfg), (cp.float32, cp.int32)))
    x0 = cp.asarray(rng.standard_normal((nb, 512)).astype(np.float32))
    want = [x0]
    for _ in range(4):
        y = cp.empty_like(x0)
        plain.launch_tc(want[-1], y, nb, False, part, sem, cfg)
        want.append(y)
    bufs = [x0.copy()] + [cp.full_like(x0, cp.nan) for _ in range(4)]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for i in range(4):
            pdl.launch_tc(bufs[i], bufs[i + 1], nb, False, part, sem, cfg)
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
    for a, b in zip(want, bufs):
        assert (cp.asnumpy(a) == cp.asnumpy(b)).all()


def test_gemv_bf16_tc_refusals():
    with pytest.raises(ValueError, match="multiple of 32"):
        G.bf16_tc_launch_shape(64, 48, 4)
    with pytest.raises(ValueError, match="1..16"):
        G.bf16_tc_launch_shape(64, 64, 17)
    assert not G.tc_wins("bf16", 128256, 4080, 16) and G.tc_wins("bf16", 128256, 4096, 16)


def test_gemv_1d_and_refusals():
    rng = np.random.default_rng(1)
    W, arrays = artifact("fp8_channel", (64, 128), rng)
    lin = G.Linear("fp8_channel", (64, 128), {k: cp.asarray(v) for k, v in arrays.items()})
    x = rng.standard_normal(128).astype(np.float32)
    y = cp.asnumpy(lin(cp.asarray(x)))
    assert y.shape == (64,)
    np.testing.assert_allclose(y, W @ x, rtol=1e-5, atol=1e-5 * float((np.abs(W) @ np.abs(x)).max()))
    with pytest.raises(ValueError):
        lin(cp.zeros((9, 128), cp.float32))               # more than 8 activation rows
    with pytest.raises(ValueError):
        lin(cp.zeros((1, 128), cp.float64))
    with pytest.raises(NotImplementedError):
        G.Linear("fp8_tensor", (4, 6), {"weight": cp.zeros((4, 6), cp.int8), "scale": cp.ones(1, cp.float32)})
