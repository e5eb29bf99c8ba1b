"""GPU: glm5_next's CUDA ops (runtime/cuda/<op>.cu + <op>.py, wired into the CUDA executor as
bind_op) against their NumPy ops (runtime/ops/<op>.py: the contract) on random inputs:
mhc_weights, hc_collapse, hc_mean, mhc_inject, layernorm, kda, dsa_index, mla_attention and the
`limit` of swiglu and moe_experts; calls with several slots, prompt chunks (rows > 1) and decode
rows, idle rows (position -1) between them, sequences continued across calls from states left by
the previous call (garbage states where a row at position 0 must ignore them). Then a mini
glm5_next plan through the real CudaExecutor (both programs captured into CUDA graphs, replayed)
against the NumpyExecutor, and the tiny glm5_next test models end to end (64 greedy steps).

Tolerances (float32 everywhere):
- hc_collapse, hc_mean, mhc_inject: bit for bit (the products and sums in NumPy's order: einsum and
  mean over the stream axis add the streams in order).
- the caches dsa_index and mla_attention write: bit for bit (copies); dsa_index's selections equal,
  except where two pool scores tie to float32 rounding at the cut (the dots are not NumPy's BLAS
  order): such a row must still be a top-k of the float64 scores within 1e-5 of the largest score,
  in NumPy's layout, and at most 2% of the active rows may differ.
- layernorm, swiglu `limit`: relative L2 1e-6 (block reductions against NumPy's pairwise sums; expf
  against NumPy's exp: an ulp or two).
- mhc_weights 1e-5 (its RMS is a block reduction, then sigmoids, a softmax and 20 Sinkhorn
  iterations of divisions).
- kda 1e-5 per call, outputs and states (the recurrent form in both modes; the NumPy prefill form is
  the chunked one: they agree to float32 rounding, as gated_delta's).
- mla_attention 1e-5 (the absorbed products and an online softmax against NumPy's einsum / softmax
  orders).
Idle rows must give exact zeros (-1 selections) and leave the states and caches bit for bit
unchanged. A failure names the op, the buffer and the call. Skipped, visibly, without CuPy or a GPU.
Run: .venv/bin/python -m pytest -q -m gpu tests/test_cuda_glm5_next.py
"""

from __future__ import annotations

import numpy as np
import pytest

from test_cuda_kernels import cp                          # skips, visibly, without CuPy or a GPU
from test_cuda_hybrid import DevW, FakeArtifact, HostW, bare, dev, f32, rel, run_both, same   # noqa: E402

from bloomery.core import plan as P                       # noqa: E402
from bloomery.runtime.cuda import kda as KDA              # noqa: E402
from bloomery.runtime.cuda.executor import CudaExecutor   # noqa: E402
from bloomery.runtime.numpy_executor import NumpyExecutor  # noqa: E402
from bloomery.runtime.ops import IMPL                     # noqa: E402
from bloomery.runtime.ops.dsa_index import pool_keys      # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 1e-6
TOL_HC = 1e-5
TOL_KDA = 1e-5
TOL_MLA = 1e-5


class HostWQ(dict):
    """CpuWeights' interface with pre_quant_scale vectors."""

    def __init__(self, values, pre_quant=None):
        super().__init__(values)
        self.pre_quant = pre_quant or {}


class DevWQ(DevW):
    """DeviceWeights' interface with pre_quant_scale vectors."""

    def __init__(self, host, pre_quant=None):
        super().__init__(host)
        self.pq = {k: cp.asarray(np.asarray(v, np.float32)) for k, v in (pre_quant or {}).items()}

    def pre_quant(self, name):
        return self.pq.get(name)


def bind(op, dev_bufs, weights, rows, prog, pre_quant=None):
    """The CUDA op bound through a bare executor (ex.bind_op, its scratch pool)."""
    ex = bare(weights)
    if pre_quant:
        ex.w = DevWQ(weights, pre_quant)
    return ex, ex.bind_op(op, dev_bufs, rows, prog)


def launch(ex, steps):
    with ex.stream:
        for f in steps:
            f()
    ex.stream.synchronize()


# -- calls: several slots, interleaved prompt chunks, idle rows, then decode rows ---------------------------

def scenario(rng, seqs, calls, slots, ubatch):
    """[(mode, pos i32 [rows], slot i32 [rows])] for `calls` [(mode, {seq: (t0, t1)})] over `seqs` {seq: slot}:
    a prompt call's rows merged in a random order that keeps each slot's order, with idle rows (position -1,
    any slot id: -1 and out-of-range ones too) between them, padded with idle rows to `ubatch`; a decode
    call has one row per slot (idle slots idle)."""
    out = []
    for mode, spans in calls:
        queues = {}
        for n, (t0, t1) in spans.items():
            queues.setdefault(seqs[n], []).extend(range(t0, t1))
        if mode == "decode":
            assert all(len(v) == 1 for v in queues.values())
            pos = [queues[s][0] if s in queues else -1 for s in range(slots)]
            out.append((mode, np.array(pos, np.int32), np.arange(slots, dtype=np.int32)))
            continue
        order = []
        while queues:
            if rng.random() < 0.15:
                order.append((int(rng.integers(-1, slots + 2)), -1))
            s = int(rng.choice(sorted(queues)))
            order.append((s, queues[s].pop(0)))
            if not queues[s]:
                del queues[s]
        assert len(order) <= ubatch, f"{len(order)} rows in a call of {ubatch}"
        while len(order) < ubatch:
            order.append((int(rng.integers(-1, slots + 2)), -1))
        out.append((mode, np.array([p for _, p in order], np.int32), np.array([s for s, _ in order], np.int32)))
    return out


SLOTS = 4                                   # slot 3 only ever sees idle rows
# short sequences (KDA): slot 1 restarts at position 0 inside the first chunk (C after B)
SEQS = {"A": 0, "B": 1, "C": 1, "D": 2}
CALLS = [("prefill", {"A": (0, 40), "B": (0, 5), "C": (0, 20), "D": (0, 1)}),
         ("prefill", {"A": (40, 70), "C": (20, 66)})] + \
        [("decode", {"A": (70 + i, 71 + i), "C": (66 + i, 67 + i), **({"D": (1 + i, 2 + i)} if i < 3 else {})})
         for i in range(4)]
UBATCH = 96
# long sequences (DSA, MLA): past the indexer's budget, so the selections are sparse. Slot 1 restarts
# at a chunk boundary (C's first chunk is the second call), as the engine does: a chunk that wrote one
# cache position twice would leave it to whichever row came last, a case no caller makes
LONG_CALLS = [("prefill", {"A": (0, 60), "B": (0, 9), "D": (0, 3)}),
              ("prefill", {"A": (60, 120), "C": (0, 100), "D": (3, 38)})] + \
             [("decode", {"A": (120 + i, 121 + i), "C": (100 + i, 101 + i), **({"D": (38 + i, 39 + i)} if i < 3 else {})})
              for i in range(4)]
LONG_UBATCH = 256


def check_idle_state(name, got, before, slot):
    assert np.array_equal(cp.asnumpy(got[slot]), before[slot]), f"{name}: the idle slot {slot}'s state changed"


# -- hc_collapse, hc_mean, mhc_inject: bit for bit ----------------------------------------------------------

HC_SHAPES = [(4, 128), (4, 4096), (2, 64), (3, 100)]     # (n, D): glm5_next tiny / default, other n


@pytest.mark.parametrize("n,D", HC_SHAPES, ids=[f"n{n}-D{d}" for n, d in HC_SHAPES])
def test_hc_collapse_and_mean(n, D):
    rng = np.random.default_rng(n * D)
    rows = 7
    x = f32(rng, rows, n * D)
    hb = {"x": x, "w": f32(rng, rows, n), "o": np.full((rows, D), 7.0, np.float32),
          "m": np.full((rows, D), 7.0, np.float32)}
    db = dev(hb)
    run_both({"op": "hc_collapse", "x": "x", "w": "w", "out": "o", "n": n}, hb, db, {}, rows)
    same("hc_collapse out", db["o"], hb["o"], 0, f" (n {n}, D {D})")
    run_both({"op": "hc_mean", "x": "x", "out": "m", "n": n}, hb, db, {}, rows)
    same("hc_mean out", db["m"], hb["m"], 0, f" (n {n}, D {D})")


@pytest.mark.parametrize("n,D", HC_SHAPES, ids=[f"n{n}-D{d}" for n, d in HC_SHAPES])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_mhc_inject(n, D, inplace):
    rng = np.random.default_rng(n + D)
    rows = 6
    hb = {"x": f32(rng, rows, n * D), "y": f32(rng, rows, D), "post": f32(rng, rows, n),
          "comb": np.abs(f32(rng, rows, n * n)), "o": np.full((rows, n * D), 7.0, np.float32)}
    db = dev(hb)
    op = {"op": "mhc_inject", "x": "x", "y": "y", "post": "post", "comb": "comb", "out": "x" if inplace else "o",
          "n": n}
    run_both(op, hb, db, {}, rows)
    same("mhc_inject out", db[op["out"]], hb[op["out"]], 0, f" (n {n}, D {D}, {'in place' if inplace else 'out'})")


# -- mhc_weights --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,D,iters", [(4, 128, 20), (4, 4096, 20), (2, 64, 3), (5, 40, 1)])
def test_mhc_weights(n, D, iters):
    """z = x @ fn.T as the plan's linear gives it; base / scale / hc_eps as glm5_next's (hc_eps 1e-6)."""
    rng = np.random.default_rng(n * D + iters)
    rows = 9
    x = f32(rng, rows, n * D)
    x[3] *= 1e-3                                             # a small row: the RMS matters
    fn = f32(rng, (2 + n) * n, n * D, scale=1 / np.sqrt(n * D))
    w = {"base": f32(rng, (2 + n) * n, scale=0.5), "scale": (1 + 0.3 * f32(rng, 3))}
    hb = {"x": x, "z": (x @ fn.T).astype(np.float32), "pre": np.zeros((rows, n), np.float32),
          "post": np.zeros((rows, n), np.float32), "comb": np.zeros((rows, n * n), np.float32)}
    db = dev(hb)
    op = {"op": "mhc_weights", "z": "z", "x": "x", "pre": "pre", "post": "post", "comb": "comb", "base": "base",
          "scale": "scale", "n": n, "iters": iters, "hc_eps": 1e-6, "eps": 1e-5}
    run_both(op, hb, db, w, rows)
    for k in ("pre", "post", "comb"):
        same(f"mhc_weights {k}", db[k], hb[k], TOL_HC, f" (n {n}, D {D}, iters {iters})")
    c = cp.asnumpy(db["comb"]).reshape(rows, n, n)
    assert np.allclose(c.sum(axis=1), 1, atol=1e-3), "mhc_weights comb: columns not normalised (Sinkhorn)"


# -- layernorm ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group,per_row", [(32, 1), (128, 1), (128, 3), (300, 2)])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_layernorm(group, per_row, inplace):
    rng = np.random.default_rng(group + per_row)
    rows = 6
    w = {"w": 1 + f32(rng, group, scale=0.2), "b": f32(rng, group, scale=0.2)}
    x = 3 + f32(rng, rows, per_row * group)                  # a mean to subtract
    hb = {"x": x.copy(), "y": np.full_like(x, 7.0)}
    db = dev(hb)
    op = {"op": "layernorm", "x": "x", "out": "x" if inplace else "y", "weight": "w", "bias": "b", "eps": 1e-6,
          "group": group}
    run_both(op, hb, db, w, rows)
    same("layernorm out", db[op["out"]], hb[op["out"]], TOL, f" (group {group})")


# -- swiglu / moe_experts `limit` -----------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [None, 0.5, 10.0])
def test_swiglu_limit(limit):
    rng = np.random.default_rng(11)
    rows, n = 5, 3000
    g, u = f32(rng, rows, n, scale=3.0), f32(rng, rows, n, scale=3.0)
    op = {"op": "swiglu", "gate": "g", "up": "u", "out": "o"}
    if limit is not None:
        op["limit"] = limit
        assert (g > limit).any() and (np.abs(u) > limit).any(), "the clamp must be exercised"
    hb = {"g": g, "u": u, "o": np.zeros_like(g)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("swiglu out", db["o"], hb["o"], TOL, f" (limit {limit})")
    if limit is not None:
        unclamped = IMPL["swiglu"].swiglu(g, u)
        assert rel(cp.asnumpy(db["o"]), unclamped) > 1e-2, "swiglu: the limit changed nothing"


@pytest.mark.parametrize("limit", [None, 0.5])
def test_moe_experts_limit(limit, monkeypatch):
    """The experts as the executor binds them (the expert GEMVs, float32 weights here), the clamp inside
    every expert."""
    monkeypatch.setenv("BLOOMERY_PREFILL_GEMM", "off")
    rng = np.random.default_rng(12)
    E, k, hidden, inter, rows = 8, 2, 64, 48, 5
    w = {"eg": f32(rng, E, inter, hidden, scale=0.5), "eu": f32(rng, E, inter, hidden, scale=0.5),
         "ed": f32(rng, E, hidden, inter, scale=0.2)}
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(rows)]).astype(np.int32)
    op = {"op": "moe_experts", "x": "x", "ids": "ids", "weights": "wts", "out": "o", "gate": "eg", "up": "eu",
          "down": "ed", "experts": E, "top_k": k}
    if limit is not None:
        op["limit"] = limit
    hb = {"x": f32(rng, rows, hidden), "ids": ids, "wts": np.abs(f32(rng, rows, k)),
          "o": np.zeros((rows, hidden), np.float32)}
    db = dev(hb)
    run_both(op, hb, db, w, rows)
    same("moe_experts out", db["o"], hb["o"], 1e-5, f" (limit {limit})")
    if limit is not None:
        plain = {kk: v.copy() for kk, v in hb.items()}
        IMPL["moe_experts"].run({kk: v for kk, v in op.items() if kk != "limit"}, plain, HostW(w))
        assert rel(hb["o"], plain["o"]) > 1e-2, "moe_experts: the limit changed nothing"


# -- kda -----------------------------------------------------------------------------------------------------

KDA_DIMS = [(4, 32), (2, 16), (4, 64), (32, 128)]          # (heads, head_dim): tiny glm5_next, small, default at TP=2
KDA_IDS = ["tiny", "d16", "d64", "big-glm5-tp2"]


def kda_op(H, d, mode, lower_bound):
    return {"op": "kda", "q": "q", "k": "k", "v": "v", "g": "g", "b": "b", "pos": "pos", "slot": "slot",
            "state": "st", "out": "out", "A_log": "A_log", "dt_bias": "dt", "heads": H, "head_dim": d,
            "lower_bound": lower_bound, "mode": mode}


def kda_weights(rng, H, d):
    """Decays exp(gate) mostly 0.2 .. 1 a token (bounded by -5, or softplus): the state carries over."""
    return {"A_log": (0.5 * f32(rng, H) - 1).astype(np.float32), "dt": f32(rng, H * d, scale=0.5)}


def kda_call(op, hb, db, w, pos, slot, rng, qw=None, pipe=None):
    H, d = op["heads"], op["head_dim"]
    rows = len(pos)
    inp = {n: f32(rng, rows, H * d) for n in ("q", "k", "v")}
    inp.update(g=f32(rng, rows, H * d), b=f32(rng, rows, H), out=np.full((rows, H * d), 7.0, np.float32))
    hb.update({n: v.copy() for n, v in inp.items()}, pos=pos, slot=slot)
    db.update(dev(inp), pos=cp.asarray(pos), slot=cp.asarray(slot))
    ex = bare(w)
    steps = KDA.launches(op, db, rows, ex.w, qw=qw, pipe=pipe) if qw is not None else \
        ex.bind_op(op, db, rows, op["mode"])
    IMPL["kda"].run(op, hb, HostW(w))
    launch(ex, steps)


@pytest.mark.parametrize("dims", KDA_DIMS, ids=KDA_IDS)
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_kda_scenario(dims, lower_bound):
    """Four slots interleaved in prompt chunks, slot 1 restarting at position 0 inside a chunk, prompts
    continued over two chunks, then decode steps; from garbage states (position 0 must ignore them)."""
    H, d = dims
    rng = np.random.default_rng(H * d + (lower_bound is None))
    w = kda_weights(rng, H, d)
    st = f32(rng, SLOTS, H, d, d, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    for i, (mode, pos, slot) in enumerate(scenario(rng, SEQS, CALLS, SLOTS, UBATCH)):
        kda_call(kda_op(H, d, mode, lower_bound), hb, db, w, pos, slot, rng)
        what = f" (call {i}, {mode}, heads {H}, head_dim {d}, lower_bound {lower_bound})"
        same("kda out", db["out"], hb["out"], TOL_KDA, what)
        assert not cp.asnumpy(db["out"])[pos < 0].any(), f"kda out{what}: idle rows must give zeros"
        for s in range(SLOTS):
            same("kda state", db["st"][s], hb["st"][s], TOL_KDA, f"{what}, slot {s}")
        check_idle_state("kda state", db["st"], st, 3)


@pytest.mark.parametrize("dims", [(4, 32), (2, 64)], ids=["tiny", "d64"])
@pytest.mark.parametrize("qw", [4, 2, 1])
@pytest.mark.parametrize("pipe", [False, True], ids=["plain", "pipelined"])
def test_kda_every_config(dims, qw, pipe):
    """Every kernel instance (16 / 8 / 4 state columns per warp; the plain row loop and the pipelined one)
    on a prompt of 50 rows, then decode steps with 3 slots (one idle), and several rows of one slot in
    one decode call."""
    H, d = dims
    if all(c[1] != qw for c in KDA.configs(d, pipe)):
        pytest.skip(f"no {'pipelined ' if pipe else ''}instance with {4 * qw} columns per warp for head_dim {d}")
    rng = np.random.default_rng(qw + d)
    w = kda_weights(rng, H, d)
    st = f32(rng, 3, H, d, d, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    feeds = [("prefill", np.arange(50, dtype=np.int32), np.full(50, 2, np.int32)),
             ("decode", np.array([5, -1, 50], np.int32), np.array([0, 1, 2], np.int32)),
             ("decode", np.array([6, 7, 51, 8], np.int32), np.array([0, 0, 2, 0], np.int32))]
    for i, (mode, pos, slot) in enumerate(feeds):
        kda_call(kda_op(H, d, mode, -5.0), hb, db, w, pos, slot, rng, qw=qw, pipe=pipe)
        same("kda out", db["out"], hb["out"], TOL_KDA, f" (call {i}, qw {qw}, {'pipelined' if pipe else 'plain'})")
        same("kda state", db["st"], hb["st"], TOL_KDA, f" (call {i}, qw {qw}, {'pipelined' if pipe else 'plain'})")


# -- dsa_index ---------------------------------------------------------------------------------------------

DSA_DIMS = [(8, 32, 4, 32, True), (8, 32, 4, 32, False), (16, 16, 4, 16, True), (32, 128, 16, 64, True)]
DSA_IDS = ["tiny-tail", "tiny-notail", "k16", "big-glm5-heads"]


def dsa_op(Hi, Di, kpool, topk, tail):
    return {"op": "dsa_index", "q": "q", "k": "k", "gs": "gs", "hw": "hw", "pos": "pos", "slot": "slot",
            "cache": "cache", "sel": "sel", "ape": "ape", "heads": Hi, "head_dim": Di, "topk": topk, "kpool": kpool,
            "tail": tail}


def dsa_scores64(cache, ape, q, hw, Hi, Di, kpool, t):
    """A row's pool scores in float64, from the (bit-equal) cache."""
    P_ = (t + 1) // kpool
    pk = pool_keys(cache.astype(np.float64), ape.astype(np.float64), P_) if P_ else np.zeros((0, Di))
    sc = np.maximum(q.reshape(Hi, Di).astype(np.float64) @ pk.T * Di ** -0.5, 0)
    return (hw.astype(np.float64) * Hi ** -0.5) @ sc


def check_sel(op, got, want, hb, w, what):
    """sel equal to NumPy's, except rows whose pools tie at the cut to float32 rounding (see the docstring)."""
    Hi, Di, kpool, topk = op["heads"], op["head_dim"], op["kpool"], op["topk"]
    pos, slot = hb["pos"], hb["slot"]
    bad = np.nonzero((got != want).any(axis=-1))[0]
    active = int((pos >= 0).sum())
    assert len(bad) <= max(1, 0.02 * active), \
        f"dsa_index sel{what}: {len(bad)} of {active} active rows differ (first: row {bad[0]}, got " \
        f"{got[bad[0]].tolist()}, want {want[bad[0]].tolist()})"
    for r in bad:
        t = int(pos[r])
        assert t >= 0, f"dsa_index sel{what}: idle row {r} is not all -1: {got[r].tolist()}"
        npool = (t + 1) // kpool
        top = min(topk // kpool, npool)
        sc = dsa_scores64(hb["cache"][slot[r]], w["ape"], hb["q"][r], hb["hw"][r], Hi, Di, kpool, t)
        g = got[r]
        pools = g[:top * kpool:kpool] // kpool
        assert np.array_equal(g[:top * kpool].reshape(top, kpool), pools[:, None] * kpool + np.arange(kpool)) \
            and np.all(np.diff(pools) > 0), f"dsa_index sel{what}: row {r}: not ascending whole pools: {g.tolist()}"
        assert np.array_equal(g[top * kpool:], want[r][top * kpool:]), f"dsa_index sel{what}: row {r}: tail / padding"
        rest = np.setdiff1d(np.arange(npool), pools)
        tol = 1e-5 * max(1e-30, np.abs(sc).max())
        assert rest.size == 0 or sc[pools].min() >= sc[rest].max() - tol, \
            f"dsa_index sel{what}: row {r}: pools {pools.tolist()} are not a top-{top} of the float64 scores " \
            f"(chosen min {sc[pools].min():.9g}, left max {sc[rest].max():.9g})"


def dsa_call(op, hb, db, w, pos, slot, rng, prog):
    Hi, Di = op["heads"], op["head_dim"]
    rows = len(pos)
    W = op["topk"] + op["kpool"] - 1
    inp = {"q": f32(rng, rows, Hi * Di), "k": f32(rng, rows, Di), "gs": f32(rng, rows, Di, scale=2.0),
           "hw": f32(rng, rows, Hi), "sel": np.full((rows, W), 7, np.int32)}
    hb.update({n: v.copy() for n, v in inp.items()}, pos=pos, slot=slot)
    db.update(dev(inp), pos=cp.asarray(pos), slot=cp.asarray(slot))
    ex, steps = bind(op, db, w, rows, prog)
    IMPL["dsa_index"].run(op, hb, HostW(w))
    launch(ex, steps)


@pytest.mark.parametrize("dims", DSA_DIMS, ids=DSA_IDS)
def test_dsa_index_scenario(dims):
    """Slots interleaved in prompt chunks (slot 1 restarting at the second), prompts continued over two
    chunks past the budget (topk / kpool pools), then decode steps; the cache from garbage."""
    Hi, Di, kpool, topk, tail = dims
    rng = np.random.default_rng(Hi * Di + kpool + tail)
    ctx = 256
    w = {"ape": f32(rng, kpool, Di, scale=0.5)}
    cache = f32(rng, SLOTS, ctx, 2 * Di)
    hb, db = {"cache": cache.copy()}, {"cache": cp.asarray(cache)}
    op = dsa_op(Hi, Di, kpool, topk, tail)
    sparse = 0
    for i, (mode, pos, slot) in enumerate(scenario(rng, SEQS, LONG_CALLS, SLOTS, LONG_UBATCH)):
        dsa_call(op, hb, db, w, pos, slot, rng, mode)
        what = f" (call {i}, {mode}, heads {Hi}, head_dim {Di}, kpool {kpool}, topk {topk}, tail {tail})"
        same("dsa_index cache", db["cache"], hb["cache"], 0, what)
        got, want = cp.asnumpy(db["sel"]), hb["sel"]
        assert (got[pos < 0] == -1).all(), f"dsa_index sel{what}: idle rows must be all -1"
        check_sel(op, got, want, hb, w, what)
        sparse += int(((pos + 1) // kpool > topk // kpool).sum())
    assert sparse > 50, f"only {sparse} rows saw more pools than the budget: the top-k was hardly exercised"
    check_idle_state("dsa_index cache", db["cache"], cache, 3)


def test_dsa_index_ties():
    """Scores that tie exactly: q = 0 on every head of some rows (every score 0: the lowest pools win), and
    integer-valued inputs (many exact ties at the cut): the selection is NumPy's, bit for bit."""
    Hi, Di, kpool, topk = 8, 32, 4, 32
    rng = np.random.default_rng(3)
    ctx, rows = 256, 64
    op = dsa_op(Hi, Di, kpool, topk, True)
    w = {"ape": np.zeros((kpool, Di), np.float32)}
    hb = {"cache": np.zeros((2, ctx, 2 * Di), np.float32)}
    db = {"cache": cp.asarray(hb["cache"])}
    pos = np.r_[np.arange(rows - 4), [-1] * 4].astype(np.int32)
    slot = np.r_[np.zeros(rows - 4), [0, 1, -1, 5]].astype(np.int32)
    W = topk + kpool - 1
    k = rng.integers(-1, 2, (rows, Di)).astype(np.float32)
    q = rng.integers(0, 2, (rows, Hi * Di)).astype(np.float32)
    q[::3] = 0                                               # every score 0
    inp = {"q": q, "k": k, "gs": np.zeros((rows, Di), np.float32), "hw": np.ones((rows, Hi), np.float32),
           "sel": np.full((rows, W), 7, np.int32)}
    hb.update({n: v.copy() for n, v in inp.items()}, pos=pos, slot=slot)
    db.update(dev(inp), pos=cp.asarray(pos), slot=cp.asarray(slot))
    ex, steps = bind(op, db, w, rows, "prefill")
    IMPL["dsa_index"].run(op, hb, HostW(w))
    launch(ex, steps)
    got = cp.asnumpy(db["sel"])
    bad = np.nonzero((got != hb["sel"]).any(axis=-1))[0]
    assert bad.size == 0, f"dsa_index sel (ties): rows {bad.tolist()} differ; first got {got[bad[0]].tolist()}, " \
                          f"want {hb['sel'][bad[0]].tolist()}"
    r = 3 * 15                                               # q = 0 at position 45: 11 pools, the first 8 win
    assert got[r, :32].tolist() == list(range(32)) and got[r, 32:34].tolist() == [44, 45]


# -- mla_attention ----------------------------------------------------------------------------------------

MLA_DIMS = [(4, 32, 32, 32), (2, 16, 24, 40), (4, 32, 32, 512), (32, 256, 256, 512)]   # heads, nope, v, rank
MLA_IDS = ["tiny", "odd", "rank512", "big-glm5-tp2"]


def mla_op(H, dn, dv, mode, sel=True):
    op = {"op": "mla_attention", "q": "q", "c": "c", "pos": "pos", "slot": "slot", "cache": "cache", "out": "out",
          "kv_b": "kv_b", "heads": H, "nope_dim": dn, "v_dim": dv, "scale": 1 / np.sqrt(dn), "mode": mode}
    if sel:
        op["sel"] = "sel"
    return op


def random_sel(rng, pos, W):
    """dsa_index-like selections: ascending distinct positions <= pos (some beyond it too, which must be
    skipped), -1 padded; some rows empty, some with every position."""
    out = np.full((len(pos), W), -1, np.int32)
    for r, t in enumerate(pos):
        if t < 0:
            continue
        kind = r % 5
        if kind == 0:
            continue                                         # empty: zeros
        cand = np.arange(t + 1 + (3 if kind == 1 else 0))    # kind 1: a few future positions (skipped)
        m = min(W, len(cand)) if kind == 2 else int(rng.integers(1, min(W, len(cand)) + 1))
        out[r, :m] = np.sort(rng.choice(cand, m, replace=False))
    return out


def mla_call(op, hb, db, w, pq, pos, slot, rng, prog, W):
    H, dn, dv = op["heads"], op["nope_dim"], op["v_dim"]
    R = hb["cache"].shape[-1]
    rows = len(pos)
    inp = {"q": f32(rng, rows, H * dn), "c": f32(rng, rows, R), "out": np.full((rows, H * dv), 7.0, np.float32)}
    if "sel" in op:
        inp["sel"] = random_sel(rng, pos, W)
    hb.update({n: v.copy() for n, v in inp.items()}, pos=pos, slot=slot)
    db.update(dev(inp), pos=cp.asarray(pos), slot=cp.asarray(slot))
    ex, steps = bind(op, db, w, rows, prog, pre_quant=pq)
    IMPL["mla_attention"].run(op, hb, HostWQ(w, pq))
    launch(ex, steps)


@pytest.mark.parametrize("dims", MLA_DIMS, ids=MLA_IDS)
@pytest.mark.parametrize("with_sel", [True, False], ids=["sel", "causal"])
def test_mla_attention_scenario(dims, with_sel):
    """Slots interleaved in prompt chunks then decode steps, over a selection (empty ones included) or the
    causal prefix; kv_b with a pre_quant_scale in the tiny case; the cache from garbage."""
    H, dn, dv, R = dims
    rng = np.random.default_rng(H + dn + dv + R + with_sel)
    ctx, W = 256, 35
    w = {"kv_b": f32(rng, H * (dn + dv), R, scale=1 / np.sqrt(R))}
    pq = {"kv_b": (0.5 + rng.random(R)).astype(np.float32)} if dims == MLA_DIMS[0] else None
    cache = f32(rng, SLOTS, ctx, R)
    hb, db = {"cache": cache.copy()}, {"cache": cp.asarray(cache)}
    for i, (mode, pos, slot) in enumerate(scenario(rng, SEQS, LONG_CALLS, SLOTS, LONG_UBATCH)):
        op = mla_op(H, dn, dv, mode, with_sel)
        mla_call(op, hb, db, w, pq, pos, slot, rng, mode, W)
        what = f" (call {i}, {mode}, heads {H}, nope {dn}, v {dv}, rank {R}, {'sel' if with_sel else 'causal'})"
        same("mla_attention cache", db["cache"], hb["cache"], 0, what)
        same("mla_attention out", db["out"], hb["out"], TOL_MLA, what)
        assert not cp.asnumpy(db["out"])[pos < 0].any(), f"mla_attention out{what}: idle rows must give zeros"
        if with_sel:
            empty = (pos >= 0) & ~(hb["sel"] >= 0).any(axis=-1)
            assert not cp.asnumpy(db["out"])[empty].any(), f"mla_attention out{what}: empty selections must give zeros"
    check_idle_state("mla_attention cache", db["cache"], cache, 3)


# -- a mini glm5_next plan through the real CudaExecutor (graphs captured and replayed) ---------------------

HID, NS, VOCAB = 64, 4, 50                   # hidden, hc streams, vocab
KH, KD, KC = 2, 16, 4                        # KDA heads, head_dim, conv kernel
MH, MN, MV, QR, KR = 2, 16, 16, 32, 32       # MLA heads, nope, v, q rank, kv rank
IH, ID, KP, TOPK = 8, 16, 4, 16              # indexer heads, head_dim, kpool, topk
LIMIT = 0.7


def mini_plan() -> tuple[dict, dict]:
    """One KDA block, one MLA + DSA block and one clamped SwiGLU FFN between manifold hyper-connections, in
    the op order of compiler/lower.py's _Glm5Next (hc_expand, mhc_weights, hc_collapse, rmsnorm, the
    block, mhc_inject; hc_mean and the norm before the head)."""
    rng = np.random.default_rng(42)
    Z = (2 + NS) * NS
    w = {"emb": f32(rng, VOCAB, HID), "head": f32(rng, VOCAB, HID, scale=0.2), "norm": 1 + f32(rng, HID, scale=0.1)}
    for p in ("a", "m", "f"):                               # the three hyper-connections
        w.update({f"{p}_fn": f32(rng, Z, NS * HID, scale=0.05), f"{p}_base": f32(rng, Z, scale=0.5),
                  f"{p}_scale": 1 + f32(rng, 3, scale=0.2)})
    KW = KH * KD
    w.update({f"kda_{x}": f32(rng, KW, HID, scale=0.2) for x in ("q", "k", "v")})
    w.update({f"conv_{x}": f32(rng, KW, 1, KC, scale=0.5) for x in ("q", "k", "v")})
    w.update(kda_fa=f32(rng, KD, HID, scale=0.2), kda_fb=f32(rng, KW, KD, scale=0.3), kda_b=f32(rng, KH, HID, scale=0.3),
             kda_ga=f32(rng, KD, HID, scale=0.2), kda_gb=f32(rng, KW, KD, scale=0.3), kda_onorm=1 + f32(rng, KD, scale=0.1),
             kda_o=f32(rng, HID, KW, scale=0.2), A_log=(0.5 * f32(rng, KH) - 1), dt=f32(rng, KW, scale=0.5))
    w.update(q_a=f32(rng, QR, HID, scale=0.2), q_an=1 + f32(rng, QR, scale=0.1), q_b=f32(rng, MH * MN, QR, scale=0.2),
             kv_a=f32(rng, KR, HID, scale=0.2), kv_an=1 + f32(rng, KR, scale=0.1),
             kv_b=f32(rng, MH * (MN + MV), KR, scale=0.2), mla_o=f32(rng, HID, MH * MV, scale=0.2),
             idx_q=f32(rng, IH * ID, QR, scale=0.2), idx_k=f32(rng, ID, HID, scale=0.2),
             idx_kn=1 + f32(rng, ID, scale=0.1), idx_kb=f32(rng, ID, scale=0.1), idx_g=f32(rng, ID, HID, scale=0.2),
             idx_w=f32(rng, IH, HID, scale=0.2), ape=f32(rng, KP, ID, scale=0.5))
    w.update(ffn_g=f32(rng, 96, HID, scale=0.3), ffn_u=f32(rng, 96, HID, scale=0.3), ffn_d=f32(rng, HID, 96, scale=0.2))
    for n in ("an", "mn", "fn_"):
        w[n] = 1 + f32(rng, HID, scale=0.1)
    bufs = {"tokens": ("input", ["rows"], "i32"), "positions": ("input", ["rows"], "i32"),
            "slot_ids": ("input", ["rows"], "i32"), "e": ("scratch", ["rows", HID]),
            "X": ("output", ["rows", NS * HID]), "z": ("scratch", ["rows", Z]), "pre": ("scratch", ["rows", NS]),
            "post": ("scratch", ["rows", NS]), "comb": ("scratch", ["rows", NS * NS]), "m": ("scratch", ["rows", HID]),
            "y": ("output", ["rows", HID]), "kq": ("scratch", ["rows", KW]), "kk": ("scratch", ["rows", KW]),
            "kv": ("scratch", ["rows", KW]), "kfa": ("scratch", ["rows", KD]), "kf": ("scratch", ["rows", KW]),
            "kb": ("scratch", ["rows", KH]), "ko": ("output", ["rows", KW]), "kga": ("scratch", ["rows", KD]),
            "kg": ("scratch", ["rows", KW]), "qa": ("scratch", ["rows", QR]), "q": ("scratch", ["rows", MH * MN]),
            "c": ("scratch", ["rows", KR]), "iq": ("scratch", ["rows", IH * ID]), "ik": ("scratch", ["rows", ID]),
            "igs": ("scratch", ["rows", ID]), "ihw": ("scratch", ["rows", IH]),
            "sel": ("output", ["rows", TOPK + KP - 1], "i32"), "mo": ("output", ["rows", MH * MV]),
            "fg": ("scratch", ["rows", 96]), "fu": ("scratch", ["rows", 96]), "xm": ("scratch", ["rows", HID]),
            "logits": ("output", ["rows", VOCAB]), "next_token": ("output", ["rows"], "i32"),
            "conv_q": ("state", ["slots", KC - 1, KW]), "conv_k": ("state", ["slots", KC - 1, KW]),
            "conv_v": ("state", ["slots", KC - 1, KW]), "ssm": ("state", ["slots", KH, KD, KD]),
            "dsa": ("state", ["slots", "ctx", 2 * ID]), "mla": ("state", ["slots", "ctx", KR])}
    buffers = {n: {"kind": b[0], "shape": b[1], "dtype": b[2] if len(b) > 2 else "f32"} for n, b in bufs.items()}

    def lin(x, wname, out):
        return {"op": "linear", "x": x, "weight": wname, "out": out, "format": "f32", "pre_quant_scale": False}

    def hyper(p, norm):
        return [lin("X", f"{p}_fn", "z"),
                {"op": "mhc_weights", "z": "z", "x": "X", "pre": "pre", "post": "post", "comb": "comb",
                 "base": f"{p}_base", "scale": f"{p}_scale", "n": NS, "iters": 20, "hc_eps": 1e-6, "eps": 1e-5},
                {"op": "hc_collapse", "x": "X", "w": "pre", "out": "m", "n": NS},
                {"op": "rmsnorm", "x": "m", "weight": norm, "out": "m", "eps": 1e-5, "group": HID}]

    inject = {"op": "mhc_inject", "x": "X", "y": "y", "post": "post", "comb": "comb", "out": "X", "n": NS}
    at = {"pos": "positions", "slot": "slot_ids"}

    def ops(mode):
        kda = [lin("m", f"kda_{x}", f"k{x}") for x in ("q", "k", "v")]
        kda += [{"op": "causal_conv1d", "x": f"k{x}", **at, "state": f"conv_{x}", "out": f"k{x}",
                 "weight": f"conv_{x}", "kernel": KC} for x in ("q", "k", "v")]
        kda += [lin("m", "kda_fa", "kfa"), lin("kfa", "kda_fb", "kf"), lin("m", "kda_b", "kb"),
                {"op": "kda", "q": "kq", "k": "kk", "v": "kv", "g": "kf", "b": "kb", **at, "state": "ssm", "out": "ko",
                 "A_log": "A_log", "dt_bias": "dt", "heads": KH, "head_dim": KD, "lower_bound": -5.0, "mode": mode},
                lin("m", "kda_ga", "kga"), lin("kga", "kda_gb", "kg"),
                {"op": "rmsnorm_gated", "x": "ko", "gate": "kg", "out": "ko", "weight": "kda_onorm", "eps": 1e-5,
                 "group": KD, "act": "sigmoid"},
                lin("ko", "kda_o", "y")]
        mla = [lin("m", "q_a", "qa"), {"op": "rmsnorm", "x": "qa", "weight": "q_an", "out": "qa", "eps": 1e-5, "group": QR},
               lin("qa", "q_b", "q"), lin("m", "kv_a", "c"),
               {"op": "rmsnorm", "x": "c", "weight": "kv_an", "out": "c", "eps": 1e-5, "group": KR},
               lin("qa", "idx_q", "iq"), lin("m", "idx_k", "ik"),
               {"op": "layernorm", "x": "ik", "weight": "idx_kn", "bias": "idx_kb", "out": "ik", "eps": 1e-6, "group": ID},
               lin("m", "idx_g", "igs"), lin("m", "idx_w", "ihw"),
               {"op": "dsa_index", "q": "iq", "k": "ik", "gs": "igs", "hw": "ihw", **at, "cache": "dsa", "sel": "sel",
                "ape": "ape", "heads": IH, "head_dim": ID, "topk": TOPK, "kpool": KP, "tail": True},
               {"op": "mla_attention", "q": "q", "c": "c", **at, "sel": "sel", "cache": "mla", "out": "mo",
                "kv_b": "kv_b", "heads": MH, "nope_dim": MN, "v_dim": MV, "scale": 1 / np.sqrt(MN), "mode": mode},
               lin("mo", "mla_o", "y")]
        ffn = [lin("m", "ffn_g", "fg"), lin("m", "ffn_u", "fu"),
               {"op": "swiglu", "gate": "fg", "up": "fu", "out": "fg", "limit": LIMIT}, lin("fg", "ffn_d", "y")]
        return ([{"op": "embed", "ids": "tokens", "weight": "emb", "out": "e"},
                 {"op": "hc_expand", "x": "e", "out": "X", "n": NS}]
                + hyper("a", "an") + kda + [inject] + hyper("m", "mn") + mla + [inject] + hyper("f", "fn_") + ffn
                + [inject, {"op": "hc_mean", "x": "X", "out": "xm", "n": NS},
                   {"op": "rmsnorm", "x": "xm", "weight": "norm", "out": "xm", "eps": 1e-5, "group": HID},
                   {"op": "logits", "x": "xm", "weight": "head", "out": "logits", "vocab": VOCAB},
                   {"op": "argmax", "x": "logits", "out": "next_token"}])

    plan = {"version": P.VERSION, "family": "test", "tp": 1, "rank": 0, "model": {"vocab_size": VOCAB, "context_length": 4096},
            "buffers": buffers, "programs": {"decode": {"rows": "slots", "ops": ops("decode")},
                                             "prefill": {"rows": "ubatch", "ops": ops("prefill")}}}
    P.validate(plan)
    return plan, w


def test_executor_graphs_match_numpy(monkeypatch):
    """The mini plan on the CudaExecutor (decode and prefill each captured into one CUDA graph, replayed with
    new positions / slots each step) against the NumpyExecutor: prompts on two slots (one over two chunks,
    past the indexer's budget), decode steps with an idle slot, then reset() of a slot mid-sequence.
    Band: relative L2 2e-5 per output (every op's tolerance above, through a few layers), the selections
    equal (a near-tie at the cut would show here as a selection difference: none expected at these dims),
    the greedy tokens equal."""
    monkeypatch.setenv("BLOOMERY_PREFILL_GEMM", "off")      # the GEMV kernels for the linears: float32 throughout
    plan, w = mini_plan()
    syms = {"slots": 3, "ubatch": 48, "ctx": 160}
    cu = CudaExecutor([plan], FakeArtifact(w), syms, graphs=True)
    assert set(cu.graph) == {"decode", "prefill"}, "both programs must be captured"
    cpu = NumpyExecutor([plan], [HostW(w)], syms)
    rng = np.random.default_rng(5)
    tol = 2e-5

    def step(prog, pos, slot, what):
        rows = syms["slots" if prog == "decode" else "ubatch"]
        pos, slot = np.asarray(pos, np.int32), np.asarray(slot, np.int32)
        assert pos.shape == (rows,)
        feed = {"tokens": rng.integers(0, VOCAB, rows).astype(np.int32), "positions": pos, "slot_ids": slot}
        got = cu.run(prog, feed)
        want = cpu.run(prog, feed)
        assert np.array_equal(got["sel"], want["sel"]), \
            f"dsa_index sel ({what}): rows {np.nonzero((got['sel'] != want['sel']).any(-1))[0].tolist()} differ"
        for n in ("ko", "mo", "y", "X", "logits"):
            same(n, got[n], want[n], tol, f" ({what})")
        for n in ("ko", "mo"):                  # the KDA and MLA outputs of idle rows are zeros
            assert not got[n][pos < 0].any(), f"{n} ({what}): idle rows must give zeros"
        assert np.array_equal(got["next_token"][pos >= 0], want["next_token"][pos >= 0]), f"next_token ({what})"
        for n in ("conv_q", "conv_k", "conv_v", "ssm", "dsa", "mla"):
            same(f"state {n}", cu.state[n], cpu.state[0][n], tol, f" ({what})")

    U = syms["ubatch"]
    pad = lambda p, s: (np.r_[p, [-1] * (U - len(p))], np.r_[s, [0] * (U - len(s))])   # noqa: E731
    step("prefill", *pad(np.arange(30), np.zeros(30)), "prompt slot 0")
    step("prefill", np.arange(U), np.ones(U), "prompt slot 1, chunk 1")
    step("prefill", *pad(np.arange(U, U + 40), np.ones(40)), "prompt slot 1, chunk 2 (past the budget)")
    for t in range(5):
        step("decode", [30 + t, U + 40 + t, -1], [0, 1, 2], f"decode step {t}")
    cu.reset(1)
    cpu.reset(1)
    step("decode", [35, 0, 0], [0, 1, 2], "after reset(1): slots 1 and 2 at position 0")
    step("decode", [36, 1, 1], [0, 1, 2], "one more step")


# -- the tiny glm5_next test models, end to end --------------------------------------------------------------

def _glm5_models() -> list[str]:
    from bloomery.tools import models
    return [n for n in models.SPECS if n.startswith("tiny-glm5_next/")] or ["tiny-glm5_next/bf16"]


GLM5_MODELS = _glm5_models()                 # bf16, nvfp4, fp8, mxfp8, the mixed export (tools/models.py)


@pytest.mark.models
@pytest.mark.parametrize("mode", ["bf16x2", "off"])
@pytest.mark.parametrize("name", GLM5_MODELS)
def test_glm5_next_model_cuda_matches_numpy(name, mode, monkeypatch):
    """`make models`' tiny glm5_next prepared and run on the CUDA executor and the NumPy executor: prefill
    logits (40 positions, ubatch 16: three chunks; the tensor-core GEMM or the GEMV kernels when off)
    within the CUDA executor's band (relative L2 1e-3, as tests/test_cuda_executor.py), then 64 greedy
    decode steps (positions 40 .. 103, past the indexer's topk: its selections are sparse): logits within
    the band, the same tokens. A DSA selection flipped by a near-tie at the cut (upstream rounding:
    docs/flagships.md, Surprise 6) would show here as a logits difference at that step."""
    from bloomery import runtime
    from bloomery.tools import models
    from runtime_artifacts import artifact, assert_engines_agree
    if name not in models.SPECS:
        pytest.skip(f"{name} is not a test model of tools/models.py (yet)")
    monkeypatch.setenv("BLOOMERY_PREFILL_GEMM", mode)
    art = artifact(name)
    cu = runtime.Engine(art, device="cuda", ctx=256, ubatch=16)
    cpu = runtime.Engine(art, device="cpu", ctx=256, ubatch=16)
    assert cu.device == "cuda"
    assert_engines_agree(cu, cpu, n_ids=40, steps=64)
