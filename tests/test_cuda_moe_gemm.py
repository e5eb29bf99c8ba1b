"""GPU: the routed experts' grouped GEMM (runtime/cuda/moe_gemm.cu) against float64 references built from
core/formats' own NVFP4 decoder, and against the per-pair expert GEMV it replaces in prefill. Skipped
(visibly) where CuPy or a CUDA GPU is absent."""

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
from bloomery.runtime.cuda import moe_gemm as MG          # noqa: E402

pytestmark = pytest.mark.gpu

# Bands against float64, relative to |x| @ |W|^T per element and in L2: two bf16 parts keep 16
# significant bits of each activation (2^-16 relative), one part 8 (2^-8); the weights are exact.
BAND = {2: 4e-5, 1: 8e-3}


FMTS = {"nvfp4": "scale_2", "fp8_tensor": "scale"}        # format -> its per-tensor factor's array


def stacked(E, out, inn, rng, fmt="nvfp4"):
    """E experts of `fmt` [out, inn] with distinct per-tensor factors: (float64 [E, out, inn], arrays)."""
    dec, ws, s2 = [], [], []
    for e in range(E):
        w = rng.standard_normal((out, inn)).astype(np.float32) * rng.uniform(0.01, 3, (out, 1)).astype(np.float32)
        parts = formats.get(fmt).encode(w * (e + 1))
        a = layout.to_gguf(fmt, parts)
        dec.append(formats.get(fmt).decode(parts).astype(np.float64))
        ws.append(np.asarray(a["weight"]))
        s2.append(np.asarray(a[FMTS[fmt]], np.float32).reshape(1))
    return np.stack(dec), {"weight": np.stack(ws), FMTS[fmt]: np.concatenate(s2)}


def run(lin, x, ids, xdiv, parts, bm=MG.BM, stages=MG.STAGES):
    """The executor's steps: the sort, the activations split into their bf16 parts, the grouped GEMM."""
    pairs = ids.size
    y = cp.full((pairs, lin.out), cp.nan, dtype=cp.float32)
    route = MG.Route(pairs, lin.experts, bm=bm)
    xd = cp.asarray(x)
    steps = [route.bind(cp.asarray(ids))]
    xs = cp.full((parts, *x.shape), 0xFFFF, dtype=cp.uint16)       # NaN-poisoned
    steps.append(MG.split(xd, xs))
    xd = xs
    steps.append(MG.bind(lin, xd, y, route, xdiv, parts, stages=stages))
    for s in steps:
        s()
    return cp.asnumpy(y).astype(np.float64), route


def check(Wd, x, ids, xdiv, got, parts):
    E = Wd.shape[0]
    e = np.clip(ids, 0, E - 1)
    xs = x.astype(np.float64)[np.arange(ids.size) // xdiv]
    ref = np.einsum("pk,pnk->pn", xs, Wd[e])
    bound = np.einsum("pk,pnk->pn", np.abs(xs), np.abs(Wd[e]))
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = np.abs(got - ref)
    tol = BAND[parts]
    assert (err <= tol * bound + 1e-30).all(), f"worst {np.max(err / (bound + 1e-30)):.2e}"
    assert np.linalg.norm(err) <= tol * np.linalg.norm(bound)
    return float(np.max(err / (bound + 1e-30)))


CASES = [  # E, out, in, rows, top_k, routing
    (8, 128, 128, 40, 2, "random"),
    (8, 200, 192, 33, 2, "random"),            # a partial output tile, odd row count
    (16, 96, 256, 70, 4, "skewed"),            # one expert takes most pairs (several tiles), some none
    (4, 130, 64, 9, 1, "clamped"),             # ids outside [0, E) clamp as the GEMV kernels clamp them
    (128, 64, 128, 12, 8, "random"),           # more experts than pairs
    (8, 256, 512, 300, 2, "one"),              # every pair on one expert: 10 tiles of one expert
]


def routing(kind, rows, k, E, rng):
    if kind == "random":
        return np.stack([rng.permutation(E)[:k] for _ in range(rows)]).astype(np.int32).reshape(-1)
    if kind == "skewed":
        ids = rng.choice(E, size=(rows, k), p=np.r_[0.7, np.full(E - 1, 0.3 / (E - 1))]).astype(np.int32)
        ids[:, :] = np.where(np.isin(ids, [3, 5]), 0, ids)         # experts 3 and 5 receive nothing
        return ids.reshape(-1)
    if kind == "clamped":
        return rng.integers(-3, E + 3, rows * k).astype(np.int32)
    return np.full(rows * k, E - 1, np.int32)


@pytest.mark.parametrize("bm", MG.BMS)
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("parts", [2, 1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + "-" + c[5])
def test_moe_gemm_matches_float64(case, parts, fmt, bm):
    E, out, inn, rows, k, kind = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    Wd, arrays = stacked(E, out, inn, rng, fmt)
    lin = G.Linear(fmt, (E, out, inn), arrays)
    ids = routing(kind, rows, k, E, rng)
    x = (rng.standard_normal((rows, inn)) * rng.uniform(0.01, 10, (rows, 1))).astype(np.float32)
    got, route = run(lin, x, ids, k, parts, bm)             # x read per row (xdiv = top_k), as gate / up do
    check(Wd, x, ids, k, got, parts)
    # the sort: every pair once, grouped by expert, the tile table covering each expert's pairs
    perm, tile = cp.asnumpy(route.perm), cp.asnumpy(route.tile)
    assert sorted(perm.tolist()) == list(range(ids.size))
    e = np.clip(ids, 0, E - 1)[perm]
    assert (np.diff(e) >= 0).all()
    used = tile[0] >= 0
    assert used.sum() == sum(-(-int((e == j).sum()) // bm) for j in range(E))
    covered = np.concatenate([np.arange(o, min(o + bm, end)) for o, end in zip(tile[1][used], tile[2][used])])
    assert sorted(covered.tolist()) == list(range(ids.size))
    # per pair (xdiv = 1, as down reads its own row): the same rows give the same bits
    xp = x[np.arange(ids.size) // k]
    got1, _ = run(lin, xp, ids, 1, parts, bm)
    assert np.array_equal(got1, got)
    other = MG.BMS[1 - MG.BMS.index(bm)]                    # a row's bits do not depend on the tile's height
    assert np.array_equal(run(lin, x, ids, k, parts, other)[0], got)
    assert np.array_equal(run(lin, x, ids, k, parts, bm, stages=3 - MG.STAGES)[0], got)   # nor on the stages


def test_moe_gemm_rows_independent_of_their_tile_mates():
    """A pair's result does not depend on the other pairs routed with it (tile mates, sort order): the
    same row alone, among others and repeated gives the same bits."""
    rng = np.random.default_rng(7)
    E, out, inn = 8, 128, 256
    Wd, arrays = stacked(E, out, inn, rng)
    lin = G.Linear("nvfp4", (E, out, inn), arrays)
    x = rng.standard_normal((100, inn)).astype(np.float32)
    ids = rng.integers(0, E, 100).astype(np.int32)
    a, _ = run(lin, x, ids, 1, 2)
    b, _ = run(lin, x[::-1].copy(), ids[::-1].copy(), 1, 2)
    assert np.array_equal(a, b[::-1])
    one, _ = run(lin, x[17:18], ids[17:18], 1, 2)
    assert np.array_equal(one[0], a[17])
    for _ in range(3):
        assert np.array_equal(run(lin, x, ids, 1, 2)[0], a)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_moe_gemm_near_the_expert_gemv(fmt):
    """Against the per-pair expert GEMV (float32 throughout) it replaces in prefill: within the bf16x2 band."""
    rng = np.random.default_rng(11)
    E, out, inn, rows, k = 16, 384, 512, 64, 4
    Wd, arrays = stacked(E, out, inn, rng, fmt)
    lin = G.Linear(fmt, (E, out, inn), arrays)
    ids = rng.integers(0, E, rows * k).astype(np.int32)
    x = rng.standard_normal((rows, inn)).astype(np.float32)
    got, _ = run(lin, x, ids, k, 2)
    y = cp.zeros((rows * k, out), cp.float32)
    lin.launch_experts(cp.asarray(x), y, cp.asarray(ids), rows * k, k)
    ref = cp.asnumpy(y).astype(np.float64)
    assert np.linalg.norm(got - ref) <= 2e-5 * np.linalg.norm(ref)


def test_moe_gemm_refuses_what_it_does_not_decode():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2 * 64, 128)).astype(np.float32)
    arrays = layout.to_gguf("mxfp8", formats.get("mxfp8").encode(w))
    arrays = {k: np.asarray(v).reshape(2, 64, -1) if np.asarray(v).ndim == 2 else v for k, v in arrays.items()}
    lin = G.Linear("mxfp8", (2, 64, 128), arrays)
    assert "mxfp8" in MG.supports(lin)
    with pytest.raises(ValueError, match="moe_gemm: mxfp8 experts"):
        MG.bind(lin, None, None, MG.Route(4, 2), 1)


# -- a decode step's routed experts in two launches (gemv_nvfp4_ggml_pair_e, gemv_nvfp4_ggml_ec) ----------------

def _decode_setup(rng, E=16, k=4, hidden=384, inter=512, rows=3):
    Wg, ag = stacked(E, inter, hidden, rng)
    Wu, au = stacked(E, inter, hidden, rng)
    Wd, ad = stacked(E, hidden, inter, rng)
    gate, up, down = (G.Linear("nvfp4", W.shape, a) for W, a in ((Wg, ag), (Wu, au), (Wd, ad)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(rows)]).astype(np.int32).reshape(-1)
    w = np.abs(rng.standard_normal((rows, k))).astype(np.float32)
    return (Wg, Wu, Wd), (gate, up, down), ids, w / w.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("R", [2, G.PAIR_E_R])
def test_pair_experts_are_the_unfused_launches_bit_for_bit(limit, R):
    """gate, up and the SwiGLU of every pair in one launch: the two expert GEMVs and the swiglu op's kernel,
    bit for bit (each half is the expert GEMV's body at its thread count)."""
    from bloomery.runtime.cuda import ops as K
    rng = np.random.default_rng(21)
    _, (gate, up, down), ids, _ = _decode_setup(rng)
    k, rows = 4, ids.size // 4
    x = cp.asarray(rng.standard_normal((rows, gate.inn)).astype(np.float32) * 2)
    dids, pairs = cp.asarray(ids), ids.size
    g, u = (cp.full((pairs, gate.out), cp.nan, cp.float32) for _ in range(2))
    gate.launch_experts(x, g, dids, pairs, k)
    up.launch_experts(x, u, dids, pairs, k)
    kk = K.kernels()
    if limit is None:
        kk["swiglu_k"](K.grid1d(g.size), (256,), (g, u, g, np.int32(g.size)))
    else:
        assert float(cp.abs(g).max()) > limit, "the clamp must be exercised"
        kk["swiglu_limit_k"](K.grid1d(g.size), (256,), (g, u, g, np.int32(g.size), np.float32(limit)))
    o = cp.full((pairs, gate.out), cp.nan, cp.float32)
    gate.bind_pair_experts(up, x, o, dids, pairs, k, limit, R=R)()
    assert bool(cp.isfinite(o).all())
    assert cp.array_equal(o, g)
    # the down matrices brought into the L2 by the same launch (BLOOMERY_MOE_PREFETCH): the same bits
    o[...] = cp.nan
    gate.bind_pair_experts(up, x, o, dids, pairs, k, limit, R=R, prefetch=down)()
    assert cp.array_equal(o, g), "the prefetching launch changed the values"
    with pytest.raises(ValueError, match="prefetch of"):
        one = G.Linear("nvfp4", (down.out, down.inn), {"weight": down.w[0], "scale_2": down.sc[:1]})   # not stacked
        gate.bind_pair_experts(up, x, o, dids, pairs, k, limit, R=R, prefetch=one)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_pair_experts_fold_the_rmsnorm(limit):
    """The pair launch with the RMSNorm before it folded in (norm_weight): against float64 of the norm, the two
    matrices and the SwiGLU (1e-5 of the bound), and within float32 rounding of the unfused path (rmsnorm_k,
    then the pair launch on its output); rows of very different scales, a weight far from one."""
    from bloomery.runtime.cuda import ops as K
    rng = np.random.default_rng(24)
    (Wg, Wu, _), (gate, up, _), ids, _ = _decode_setup(rng)
    k, rows, hidden, eps = 4, ids.size // 4, gate.inn, 1e-6
    x = (rng.standard_normal((rows, hidden)) * np.array([[0.05], [3.0], [40.0]])).astype(np.float32)
    nw = (1 + 0.5 * rng.standard_normal(hidden)).astype(np.float32)
    dids, pairs = cp.asarray(ids), ids.size
    o = cp.full((pairs, gate.out), cp.nan, cp.float32)
    gate.bind_pair_experts(up, cp.asarray(x), o, dids, pairs, k, limit, norm_weight=cp.asarray(nw), eps=eps)()
    xs = cp.empty((rows, hidden), cp.float32)
    K.kernels()["rmsnorm_k"]((rows,), (128,), (cp.asarray(x), xs, cp.asarray(nw), np.int32(hidden), np.float32(eps),
                                             np.int32(1)))
    plain = cp.full((pairs, gate.out), cp.nan, cp.float32)
    gate.bind_pair_experts(up, xs, plain, dids, pairs, k, limit)()
    got, unf = cp.asnumpy(o).astype(np.float64), cp.asnumpy(plain).astype(np.float64)
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * nw
    for p in range(pairs):
        a, b = Wg[ids[p]] @ xn[p // k], Wu[ids[p]] @ xn[p // k]
        ba, bb = np.abs(Wg[ids[p]]) @ np.abs(xn[p // k]), np.abs(Wu[ids[p]]) @ np.abs(xn[p // k])
        if limit is not None:
            a, b = np.minimum(a, limit), np.clip(b, -limit, limit)
        ref = a / (1 + np.exp(-a)) * b
        bound = (np.abs(b) + bb) * ba + np.abs(a) * bb + 1e-30     # |d(silu(a) b)| <= |b| |da| + |a| |db|
        assert (np.abs(got[p] - ref) <= 1e-5 * bound).all(), f"pair {p}: not the norm, the experts and the SwiGLU"
        assert (np.abs(got[p] - unf[p]) <= 2e-6 * bound).all(), f"pair {p}: not the unfused launches"
    with pytest.raises(ValueError, match="norm weight of 3 values"):
        gate.bind_pair_experts(up, cp.asarray(x), o, dids, pairs, k, norm_weight=cp.zeros(3, cp.float32))


@pytest.mark.parametrize("add", [False, True])
def test_combine_experts_against_float64(add):
    """The down of a row's k choices, weighted and summed (and added) in one launch: against float64 from
    core/formats' decoder, per element relative to the sum of |terms|; each row as that row launched alone."""
    rng = np.random.default_rng(22)
    (_, _, Wd), (_, _, down), ids, w = _decode_setup(rng)
    k, rows, inter, hidden = 4, ids.size // 4, down.inn, down.out
    d = rng.standard_normal((rows * k, inter)).astype(np.float32)
    res = rng.standard_normal((rows, hidden)).astype(np.float32)
    y = cp.asarray(res) if add else cp.full((rows, hidden), cp.nan, cp.float32)
    down.bind_combine_experts(cp.asarray(d), cp.asarray(w), y, cp.asarray(ids), rows, k, add=add)()
    got = cp.asnumpy(y).astype(np.float64)
    ref = res.astype(np.float64) if add else np.zeros((rows, hidden))
    bound = np.abs(ref).copy()
    for p in range(rows * k):
        r, j = divmod(p, k)
        ref[r] += w[r, j] * (Wd[ids[p]] @ d[p].astype(np.float64))
        bound[r] += w[r, j] * (np.abs(Wd[ids[p]]) @ np.abs(d[p].astype(np.float64)))
    err = np.abs(got - ref)
    assert np.isfinite(got).all()
    assert (err <= 1e-5 * bound).all(), f"worst {np.max(err / bound):.2e}"
    for r in range(rows):
        one = cp.asarray(res[r:r + 1]) if add else cp.zeros((1, hidden), cp.float32)
        down.bind_combine_experts(cp.asarray(d[r * k:(r + 1) * k]), cp.asarray(w[r:r + 1]), one,
                                  cp.asarray(ids[r * k:(r + 1) * k]), 1, k, add=add)()
        assert cp.array_equal(one[0], y[r]), f"row {r} differs from itself launched alone"
    # with the next linears' weights brought into the L2 by the same launch (BLOOMERY_MOE_PREFETCH): the same bits
    y2 = cp.asarray(res) if add else cp.full((rows, hidden), cp.nan, cp.float32)
    down.bind_combine_experts(cp.asarray(d), cp.asarray(w), y2, cp.asarray(ids), rows, k, add=add,
                              prefetch=[down.w, down.sc, cp.zeros(3 << 20, cp.uint8)])()
    assert cp.array_equal(y2, y), "the prefetching launch changed the values"
    with pytest.raises(ValueError, match="at most 3"):
        down.bind_combine_experts(cp.asarray(d), cp.asarray(w), y2, cp.asarray(ids), rows, k, prefetch=[down.w] * 4)


def test_combine_experts_refuses_what_it_does_not_take():
    rng = np.random.default_rng(23)
    _, (gate, _, down), _, _ = _decode_setup(rng, E=4, rows=1)
    with pytest.raises(ValueError, match="top_k 33"):
        down.bind_combine_experts(None, None, None, None, 1, G.EC_KMAX + 1)
    w = rng.standard_normal((2 * 64, 128)).astype(np.float32)
    arrays = layout.to_gguf("mxfp8", formats.get("mxfp8").encode(w))
    arrays = {kk: np.asarray(v).reshape(2, 64, -1) if np.asarray(v).ndim == 2 else v for kk, v in arrays.items()}
    other = G.Linear("mxfp8", (2, 64, 128), arrays)
    assert "GGML NVFP4" in G.combine_experts_supported(other, 4)
    assert G.pair_experts_supported(gate, other) is not None


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("E,k,renorm", [(128, 8, True), (512, 10, False), (8, 2, True)])
def test_router_in_one_launch_is_the_two_launches_bit_for_bit(rows, norm, E, k, renorm):
    """moe_router in one launch (Linear.bind_topk, gemv_plain_topk): the router GEMV's logits (launch(), or the
    Group(norm=True) launch that folds the RMSNorm before it) and moe_topk_k's ids and weights after it, bit for
    bit; the choice is also NumPy's moe_router op on those logits; two launches in a row give the same bits
    and leave the counter at zero. Rows of very different scales; tied logits (equal router rows)."""
    from bloomery.runtime.cuda import ops as K
    from bloomery.runtime.ops import moe_router
    rng = np.random.default_rng(E + k + rows)
    hidden, eps = 2048, 1e-6
    W = rng.standard_normal((E, hidden)).astype(np.float32) * 0.05
    W[E // 2] = W[E // 2 - 1]                              # two experts with equal logits: ties to the lower index
    words = (W.view(np.uint32) >> 16).astype(np.uint16)   # bf16 (truncated; the kernel reads the words as stored)
    lin = G.Linear("bf16", (E, hidden), {"weight": cp.asarray(words)})
    assert G.topk_supported(lin, rows, k) is None
    x = (rng.standard_normal((rows, hidden)) * np.array([[0.05], [3.0], [40.0]] * 3)[:rows]).astype(np.float32)
    nw = (1 + 0.5 * rng.standard_normal(hidden)).astype(np.float32)
    dx, dnw = cp.asarray(x), cp.asarray(nw)
    sem = cp.zeros(1, cp.int32)
    lg, ids, wts = cp.full((rows, E), cp.nan, cp.float32), cp.full((rows, k), -1, cp.int32), cp.full((rows, k), cp.nan, cp.float32)
    one = lin.bind_topk(dx, lg, rows, ids, wts, k, renorm, sem, norm_weight=dnw if norm else None, eps=eps)
    one()
    got = [cp.asnumpy(a) for a in (lg, ids, wts)]
    lg2, ids2, wts2 = cp.full((rows, E), cp.nan, cp.float32), cp.full((rows, k), -1, cp.int32), cp.full((rows, k), cp.nan, cp.float32)
    if norm:
        G.Group([lin], norm=True).bind(dx, [lg2], rows, norm_weight=dnw, eps=eps)()
    else:
        lin.launch(dx, lg2, rows)
    K.kernels()["moe_topk_k"]((rows,), (32,), (lg2, ids2, wts2, np.int32(E), np.int32(k), np.int32(renorm)), shared_mem=4 * E)
    want = [cp.asnumpy(a) for a in (lg2, ids2, wts2)]
    for name, a, b in zip(("logits", "ids", "weights"), got, want):
        assert np.array_equal(a, b), f"{name}: not the two launches' bits"
    buf = {"x": got[0], "ids": np.zeros((rows, k), np.int64), "wts": np.zeros((rows, k), np.float32)}
    moe_router.run({"x": "x", "weight": "eye", "ids": "ids", "weights": "wts", "top_k": k, "norm": renorm},
                   buf, {"eye": np.eye(E, dtype=np.float32)})
    assert np.array_equal(buf["ids"], got[1]), "not NumPy's choice on the same logits"
    assert np.allclose(buf["wts"], got[2], rtol=1e-6, atol=0)
    assert int(sem.get()[0]) == 0, "the counter not left at zero"
    one()
    assert all(np.array_equal(a, cp.asnumpy(b)) for a, b in zip(got, (lg, ids, wts))), "a second launch differs"
    with pytest.raises(ValueError, match="norm weight of 3 values"):
        lin.bind_topk(dx, lg, rows, ids, wts, k, renorm, sem, norm_weight=cp.zeros(3, cp.float32))
    assert G.topk_supported(lin, 9, k) is not None and G.topk_supported(lin, rows, E + 1) is not None
