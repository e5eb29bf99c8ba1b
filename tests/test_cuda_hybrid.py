"""GPU: the hybrid families' CUDA ops (runtime/cuda/<op>.cu + <op>.py, wired into the CUDA executor
as bind_op) against their NumPy ops (runtime/ops/<op>.py), the contract, on random inputs:
causal_conv1d, gated_delta (both modes), rmsnorm_gated, split_groups, sigmoid_mul, bias_add,
moe_router_grouped, and the new attrs of existing ops (rmsnorm `offset`, rope `rotary_dim`, also
through the fused rope + rope + attention path). Then a whole mini Qwen3-Next-style plan through
the real CudaExecutor (its CUDA graphs captured and replayed) against the NumpyExecutor.

Tolerances (relative L2 per call, float32 everywhere): gated_delta 1e-5 (the CUDA kernel is the
recurrent form in both modes; the NumPy prefill form is the chunked one: they agree to float32
rounding); causal_conv1d, rmsnorm_gated, sigmoid_mul, rmsnorm offset, rope 1e-6 (expf / sincosf
against NumPy's, an ulp or two); split_groups and bias_add bit for bit; moe_router_grouped's ids
equal, weights 1e-6 (bit for bit where the logits tie exactly). Idle rows must give exact zeros and
leave the states bit for bit unchanged. Skipped, visibly, without CuPy or a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from test_cuda_kernels import cp                          # skips, visibly, without CuPy or a GPU

from bloomery.core import plan as P                       # noqa: E402
from bloomery.runtime.cuda import gated_delta as GD       # noqa: E402
from bloomery.runtime.cuda import gemv as G               # noqa: E402
from bloomery.runtime.cuda import ops as K                # noqa: E402
from bloomery.runtime.cuda.executor import CudaExecutor   # noqa: E402
from bloomery.runtime.numpy_executor import NumpyExecutor  # noqa: E402
from bloomery.runtime.ops import IMPL                     # noqa: E402
from bloomery.runtime.ops.moe_router_grouped import route  # noqa: E402

pytestmark = pytest.mark.gpu

TOL_DELTA = 1e-5
TOL = 1e-6
QWEN = (16, 32, 128, 128)            # Qwen3-Next-80B-A3B's delta net: k heads, v heads, k dim, v dim
DIMS = [QWEN, (2, 4, 32, 32), (2, 4, 16, 32), (4, 4, 64, 64)]
DIM_IDS = ["qwen3next", "gqa-small", "dk<dv", "no-gqa"]


# -- harness ----------------------------------------------------------------------------------------


class HostW(dict):
    """CpuWeights' interface for the NumPy ops."""
    pre_quant: dict = {}


class DevW:
    """DeviceWeights' interface (vector, linear) over host arrays."""

    def __init__(self, host: dict):
        self.host, self._v, self._lin = host, {}, {}

    def vector(self, name, offset=0.0):
        key = (name, float(offset))
        if key not in self._v:
            v = np.ascontiguousarray(self.host[name], np.float32).reshape(-1)
            self._v[key] = cp.asarray(np.float32(offset) + v if offset else v)
        return self._v[key]

    def linear(self, name):
        if name not in self._lin:
            W = np.ascontiguousarray(self.host[name], np.float32)
            self._lin[name] = G.Linear("f32", W.shape, {"weight": cp.asarray(W)})
        return self._lin[name]

    def pre_quant(self, name):
        return None


def bare(host: dict) -> CudaExecutor:
    """A CudaExecutor with no artifact: enough of it to bind single ops (bind_op)."""
    ex = CudaExecutor.__new__(CudaExecutor)
    ex.k, ex.w = K.kernels(), DevW(host)
    ex.flops = {p: {"linear": 0, "attention_per_key": 0} for p in P.PROGRAMS}
    ex._read_levers()
    ex.gemm_mode, ex.mm, ex._need, ex.decode_bytes, ex._pooled = "off", None, [], 0, {}
    ex.cache_code = {}                   # the attention caches in float32
    ex.stream = cp.cuda.Stream(non_blocking=True)
    return ex


def run_both(op, host_bufs: dict, dev_bufs: dict, weights: dict, rows: int, prog: str = "decode", ex=None,
             steps=None):
    """The NumPy op on host_bufs and the CUDA op (bound through the executor) on dev_bufs, in place."""
    IMPL[op["op"]].run(op, host_bufs, HostW(weights))
    ex = ex or bare(weights)
    steps = steps if steps is not None else ex.bind_op(op, dev_bufs, rows, prog)
    with ex.stream:
        for f in steps:
            f()
    ex.stream.synchronize()
    return ex


def dev(bufs: dict) -> dict:
    return {k: cp.asarray(v) for k, v in bufs.items()}


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    n = np.linalg.norm(want)
    if n == 0:
        return 0.0 if not got.any() else float("inf")
    return float(np.linalg.norm(got - want) / n)


def same(name, got, want, tol, what=""):
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else got
    assert got.shape == want.shape, f"{name}{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all() or not np.isfinite(want).all(), f"{name}{what}: non-finite values"
    if tol == 0:
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{name}{what}: {len(bad)} values differ, first at {bad[0].tolist()}: " \
                              f"{got[tuple(bad[0])]} != {want[tuple(bad[0])]}"
    else:
        r = rel(got, want)
        assert r <= tol, f"{name}{what}: relative L2 {r:.3e} > {tol:.0e}"


def f32(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# -- calls with interleaved slots, resets and idle rows ----------------------------------------------

SLOTS = 4                            # slot 3 only ever sees idle rows
SEQS = {"A": (0, 74), "B": (1, 5), "C": (1, 70), "D": (2, 4)}    # name: (slot, tokens); C restarts slot 1
CALLS = [("prefill", {"A": (0, 40), "B": (0, 5), "C": (0, 20), "D": (0, 1)}),
         ("prefill", {"A": (40, 70), "C": (20, 66)})] + \
        [("decode", {"A": (70 + i, 71 + i), "C": (66 + i, 67 + i), **({"D": (1 + i, 2 + i)} if i < 3 else {})})
         for i in range(4)]
UBATCH = 96


def scenario(rng):
    """[(mode, pos i32 [rows], slot i32 [rows])]: CALLS' rows merged in a random order that keeps each
    slot's order, idle rows (position -1, any slot id, -1 and out-of-range ones too) between them and
    up to UBATCH rows; decode calls one row per slot (idle slots idle)."""
    out = []
    for mode, spans in CALLS:
        queues = {}
        for n, (t0, t1) in spans.items():
            queues.setdefault(SEQS[n][0], []).extend(range(t0, t1))
        if mode == "decode":
            pos = [queues[s][0] if s in queues else -1 for s in range(SLOTS)]
            out.append((mode, np.array(pos, np.int32), np.arange(SLOTS, dtype=np.int32)))
            continue
        order = []
        while queues:
            if rng.random() < 0.15:
                order.append((int(rng.integers(-1, SLOTS + 2)), -1))
            s = int(rng.choice(sorted(queues)))
            order.append((s, queues[s].pop(0)))
            if not queues[s]:
                del queues[s]
        while len(order) < UBATCH:
            order.append((int(rng.integers(-1, SLOTS + 2)), -1))
        assert len(order) == UBATCH
        out.append((mode, np.array([p for _, p in order], np.int32), np.array([s for s, _ in order], np.int32)))
    return out


# -- causal_conv1d ------------------------------------------------------------------------------------


def conv_op(K, x="x", out="x"):
    return {"op": "causal_conv1d", "x": x, "pos": "pos", "slot": "slot", "state": "st", "out": out,
            "weight": "cw", "kernel": K}


@pytest.mark.parametrize("C,K", [(8192, 4), (40, 4), (24, 2), (100, 3), (64, 5)])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_causal_conv1d_scenario(C, K, inplace):
    rng = np.random.default_rng(C * 10 + K)
    w = {"cw": f32(rng, C, 1, K)}
    st = f32(rng, SLOTS, K - 1, C)                           # garbage: position 0 must ignore it
    hb = {"st": st.copy()}
    db = {"st": cp.asarray(st)}
    idle = st[3].copy()
    op = conv_op(K, out="x" if inplace else "y")
    for i, (mode, pos, slot) in enumerate(scenario(rng)):
        x = f32(rng, len(pos), C)
        hb.update(x=x.copy(), y=np.full_like(x, 7.0), pos=pos, slot=slot)
        db.update(x=cp.asarray(x), y=cp.full(x.shape, 7.0, cp.float32), pos=cp.asarray(pos), slot=cp.asarray(slot))
        run_both(op, hb, db, w, len(pos), mode)
        o = op["out"]
        same("causal_conv1d out", db[o], hb[o], TOL, f" (call {i}, {mode})")
        assert not cp.asnumpy(db[o])[pos < 0].any(), f"call {i}: idle rows must give zeros"
        same("causal_conv1d state", db["st"], hb["st"], 0, f" (call {i}, {mode})")
    assert np.array_equal(cp.asnumpy(db["st"][3]), idle), "the idle slot's window changed"


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_causal_conv1d_prefill_then_decode(n):
    """Qwen3-Next's conv (8192 channels, kernel 4): a chunk of n rows from position 0, then 3 decode steps."""
    rng = np.random.default_rng(n)
    C, Kw = 8192, 4
    w = {"cw": f32(rng, C, 1, Kw)}
    st = f32(rng, 2, Kw - 1, C)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    feeds = [(np.arange(n, dtype=np.int32), np.ones(n, np.int32))]
    feeds += [(np.array([-1, n + t], np.int32), np.array([0, 1], np.int32)) for t in range(3)]
    for i, (pos, slot) in enumerate(feeds):
        x = f32(rng, len(pos), C)
        hb.update(x=x.copy(), pos=pos, slot=slot)
        db.update(x=cp.asarray(x), pos=cp.asarray(pos), slot=cp.asarray(slot))
        run_both(conv_op(Kw), hb, db, w, len(pos), "prefill" if i == 0 else "decode")
        same("causal_conv1d out", db["x"], hb["x"], TOL, f" (step {i})")
        same("causal_conv1d state", db["st"], hb["st"], 0, f" (step {i})")


# -- gated_delta ----------------------------------------------------------------------------------------


def delta_op(dims, mode, **kw):
    Hk, Hv, dk, dv = dims
    return {"op": "gated_delta", "qkv": "qkv", "a": "a", "b": "b", "pos": "pos", "slot": "slot", "state": "st",
            "out": "out", "A_log": "A_log", "dt_bias": "dt", "k_heads": Hk, "v_heads": Hv, "k_dim": dk, "v_dim": dv,
            "mode": mode, **kw}


def delta_weights(rng, dims):
    """Decays about -0.01 .. -0.3 a token (as tests/test_ops_gated_delta.py): the state carries over."""
    Hv = dims[1]
    return {"A_log": np.log(rng.uniform(0.5, 8, Hv)).astype(np.float32),
            "dt": (-4 + 0.5 * rng.standard_normal(Hv)).astype(np.float32)}


def delta_inputs(rng, dims, rows):
    Hk, Hv, dk, dv = dims
    return {"qkv": f32(rng, rows, 2 * Hk * dk + Hv * dv), "a": f32(rng, rows, Hv), "b": f32(rng, rows, Hv),
            "out": np.full((rows, Hv * dv), 7.0, np.float32)}


def delta_call(op, hb, db, w, pos, slot, rng, ex=None, steps=None, qw=None, pipe=None, chunked=None):
    """One call of both; returns the chunked path's plan ({one run?, n, slot, p0}) when it ran, else None."""
    dims = (op["k_heads"], op["v_heads"], op["k_dim"], op["v_dim"])
    inp = delta_inputs(rng, dims, len(pos))
    hb.update(inp, pos=pos, slot=slot)
    hb["out"] = inp["out"].copy()
    db.update(dev(inp), pos=cp.asarray(pos), slot=cp.asarray(slot))
    if qw is not None:
        ex = bare(w)
        steps = GD.launches(op, db, len(pos), ex.w, qw=qw, pipe=pipe)
    elif chunked is not None and op["mode"] == "prefill":
        ex = bare(w)
        steps = GD.launches(op, db, len(pos), ex.w, pipe=True, chunked=chunked)
    run_both(op, hb, db, w, len(pos), op["mode"], ex=ex, steps=steps)
    metas = [f.meta for f in steps or () if hasattr(f, "meta")]
    return cp.asnumpy(metas[0]).tolist() if metas else None


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_gated_delta_scenario(dims):
    """Four slots interleaved in prompt chunks (the prefill form), slot 1 restarting at position 0
    inside a chunk, prompts continued over two chunks, then decode steps; from garbage states."""
    rng = np.random.default_rng(sum(dims))
    Hk, Hv, dk, dv = dims
    w = delta_weights(rng, dims)
    st = f32(rng, SLOTS, Hv, dk, dv, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    idle = st[3].copy()
    for i, (mode, pos, slot) in enumerate(scenario(rng)):
        delta_call(delta_op(dims, mode), hb, db, w, pos, slot, rng)
        same("gated_delta out", db["out"], hb["out"], TOL_DELTA, f" (call {i}, {mode})")
        assert not cp.asnumpy(db["out"])[pos < 0].any(), f"call {i}: idle rows must give zeros"
        for s in range(SLOTS):
            same("gated_delta state", db["st"][s], hb["st"][s], TOL_DELTA, f" (call {i}, {mode}, slot {s})")
    assert np.array_equal(cp.asnumpy(db["st"][3]), idle), "the idle slot's state changed"


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_gated_delta_prefill_then_decode(dims, n):
    """A chunk of n rows from position 0 on slot 1 (slot 0 idle, garbage states), a second chunk of
    7 rows continuing it, then 3 decode steps; out and state compared after every call."""
    rng = np.random.default_rng(n + 1000 * dims[2])
    Hk, Hv, dk, dv = dims
    w = delta_weights(rng, dims)
    st = f32(rng, 2, Hv, dk, dv, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    s0 = st[0].copy()
    feeds = [("prefill", np.arange(n, dtype=np.int32), np.ones(n, np.int32)),
             ("prefill", np.r_[np.arange(n, n + 7), [-1] * 3].astype(np.int32), np.ones(10, np.int32))]
    feeds += [("decode", np.array([-1, n + 7 + t], np.int32), np.array([0, 1], np.int32)) for t in range(3)]
    for i, (mode, pos, slot) in enumerate(feeds):
        delta_call(delta_op(dims, mode), hb, db, w, pos, slot, rng)
        same("gated_delta out", db["out"], hb["out"], TOL_DELTA, f" (call {i}, {mode}, n={n})")
        same("gated_delta state", db["st"][1], hb["st"][1], TOL_DELTA, f" (call {i}, {mode}, n={n})")
    assert np.array_equal(cp.asnumpy(db["st"][0]), s0), "the idle slot's state changed"


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_gated_delta_chunked_scenario(dims):
    """The chunked prefill path (chunked=True) on the interleaved scenario: its rows are never one run
    (slots interleaved, idle rows between them, a reset inside a chunk), so the device-side plan must
    send every prompt call to the token-by-token kernel; results as the NumPy op."""
    rng = np.random.default_rng(sum(dims) + 1)
    Hk, Hv, dk, dv = dims
    assert GD.chunk_fits(dk, dv)
    w = delta_weights(rng, dims)
    st = f32(rng, SLOTS, Hv, dk, dv, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    idle = st[3].copy()
    for i, (mode, pos, slot) in enumerate(scenario(rng)):
        meta = delta_call(delta_op(dims, mode), hb, db, w, pos, slot, rng, chunked=True)
        if mode == "prefill":
            assert meta is not None and meta[0] == 0, f"call {i}: interleaved rows taken as one run: {meta}"
        same("gated_delta out", db["out"], hb["out"], TOL_DELTA, f" (call {i}, {mode}, chunked)")
        assert not cp.asnumpy(db["out"])[pos < 0].any(), f"call {i}: idle rows must give zeros"
        for s in range(SLOTS):
            same("gated_delta state", db["st"][s], hb["st"][s], TOL_DELTA, f" (call {i}, {mode}, slot {s}, chunked)")
    assert np.array_equal(cp.asnumpy(db["st"][3]), idle), "the idle slot's state changed"


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_gated_delta_chunked_prefill_then_decode(dims, n):
    """test_gated_delta_prefill_then_decode through the chunked prefill path: a chunk of n rows from
    position 0 on slot 1 (one run: the chunkwise kernels take it), a second chunk of 7 rows continuing
    it with 3 idle rows after them (one run: taken, the idle rows zeroed), then 3 decode steps."""
    rng = np.random.default_rng(n + 1000 * dims[2])
    Hk, Hv, dk, dv = dims
    w = delta_weights(rng, dims)
    st = f32(rng, 2, Hv, dk, dv, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    s0 = st[0].copy()
    feeds = [("prefill", np.arange(n, dtype=np.int32), np.ones(n, np.int32)),
             ("prefill", np.r_[np.arange(n, n + 7), [-1] * 3].astype(np.int32), np.ones(10, np.int32))]
    feeds += [("decode", np.array([-1, n + 7 + t], np.int32), np.array([0, 1], np.int32)) for t in range(3)]
    for i, (mode, pos, slot) in enumerate(feeds):
        meta = delta_call(delta_op(dims, mode), hb, db, w, pos, slot, rng, chunked=True)
        if mode == "prefill":
            want = [1, n if i == 0 else 7, 1, 0 if i == 0 else n]
            assert meta == want, f"call {i}: plan {meta}, expected {want}"
        same("gated_delta out", db["out"], hb["out"], TOL_DELTA, f" (call {i}, {mode}, n={n}, chunked)")
        same("gated_delta state", db["st"][1], hb["st"][1], TOL_DELTA, f" (call {i}, {mode}, n={n}, chunked)")
        assert not cp.asnumpy(db["out"])[pos < 0].any(), f"call {i}: idle rows must give zeros"
    assert np.array_equal(cp.asnumpy(db["st"][0]), s0), "the idle slot's state changed"


def test_gated_delta_chunked_graph_replay():
    """The chunked path captured once into a CUDA graph (Qwen3-Next dims, 96 rows) and replayed with new
    positions / slots / inputs written into the same buffers: one run from position 0 (chunked), an
    interleaved two-slot call with a reset (the recurrence), one run continuing slot 0 (chunked)."""
    dims, rows = QWEN, 96
    rng = np.random.default_rng(77)
    Hk, Hv, dk, dv = dims
    w = delta_weights(rng, dims)
    st = f32(rng, 2, Hv, dk, dv, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    op = delta_op(dims, "prefill")
    db.update(dev(delta_inputs(rng, dims, rows)), pos=cp.zeros(rows, cp.int32), slot=cp.zeros(rows, cp.int32))
    ex = bare(w)
    steps = GD.launches(op, db, rows, ex.w, pipe=True, chunked=True)
    meta = [f.meta for f in steps if hasattr(f, "meta")][0]
    snap = db["st"].copy()
    with ex.stream:                                          # eager once (compiles), then capture
        for f in steps:
            f()
        ex.stream.synchronize()
        ex.stream.begin_capture()
        for f in steps:
            f()
        graph = ex.stream.end_capture()
    ex.stream.synchronize()
    db["st"][...] = snap
    feeds = [(np.r_[np.arange(80), [-1] * 16], np.r_[np.zeros(80), np.ones(16)], 1),
             (np.r_[[0, 80, 1, 81, 2, -1], np.arange(82, 120), [-1] * 52], np.r_[[1, 0, 1, 0, 1, 0], np.zeros(38),
                                                                                  np.zeros(52)], 0),
             (np.r_[np.arange(120, 210), [-1] * 6], np.zeros(96), 1)]
    for i, (pos, slot, chunk) in enumerate(feeds):
        pos, slot = pos.astype(np.int32), slot.astype(np.int32)
        assert len(pos) == rows
        inp = delta_inputs(rng, dims, rows)
        hb.update(inp, pos=pos, slot=slot)
        hb["out"] = inp["out"].copy()
        for k, v in inp.items():
            db[k][...] = cp.asarray(v)
        db["pos"][...], db["slot"][...] = cp.asarray(pos), cp.asarray(slot)
        IMPL["gated_delta"].run(op, hb, HostW(w))
        cp.cuda.Device().synchronize()                       # the copies above ran on the null stream
        graph.launch(ex.stream)
        ex.stream.synchronize()
        assert int(meta[0]) == chunk, f"replay {i}: plan {cp.asnumpy(meta).tolist()}, one run expected: {bool(chunk)}"
        same("gated_delta out", db["out"], hb["out"], TOL_DELTA, f" (replay {i})")
        same("gated_delta state", db["st"], hb["st"], TOL_DELTA, f" (replay {i})")
        assert not cp.asnumpy(db["out"])[pos < 0].any(), f"replay {i}: idle rows must give zeros"


@pytest.mark.parametrize("dims", [QWEN, (2, 4, 32, 32)], ids=["qwen3next", "gqa-small"])
@pytest.mark.parametrize("qw", [4, 2, 1])
@pytest.mark.parametrize("pipe", [False, True], ids=["plain", "pipelined"])
def test_gated_delta_every_config(dims, qw, pipe):
    """Every kernel instance (columns per warp 16 / 8 / 4; the plain row loop and the software-
    pipelined one) on a prompt of 70 rows, then decode steps with 3 slots (one idle), and several
    rows of one slot in one call."""
    if all(c[1] != qw for c in GD.configs(dims[2], dims[3], pipe)):
        pytest.skip(f"no {'pipelined ' if pipe else ''}instance with {4 * qw} columns per warp for k_dim {dims[2]}")
    rng = np.random.default_rng(qw)
    Hv, dk, dv = dims[1:]
    w = delta_weights(rng, dims)
    st = f32(rng, 3, Hv, dk, dv, scale=0.1)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    feeds = [("prefill", np.arange(70, dtype=np.int32), np.full(70, 2, np.int32)),
             ("decode", np.array([5, -1, 70], np.int32), np.array([0, 1, 2], np.int32)),
             ("decode", np.array([6, 7, 71, 8], np.int32), np.array([0, 0, 2, 0], np.int32))]
    for i, (mode, pos, slot) in enumerate(feeds):
        delta_call(delta_op(dims, mode), hb, db, w, pos, slot, rng, qw=qw, pipe=pipe)
        same("gated_delta out", db["out"], hb["out"], TOL_DELTA, f" (call {i}, qw {qw})")
        same("gated_delta state", db["st"], hb["st"], TOL_DELTA, f" (call {i}, qw {qw})")


# -- rmsnorm_gated, split_groups, sigmoid_mul, bias_add -------------------------------------------------


@pytest.mark.parametrize("rows,heads,dv", [(5, 32, 128), (3, 4, 32), (8, 2, 48)])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_rmsnorm_gated(rows, heads, dv, inplace):
    rng = np.random.default_rng(rows * dv)
    w = {"nw": (1 + 0.5 * f32(rng, dv))}
    x, z = f32(rng, rows, heads * dv), f32(rng, rows, heads * dv, scale=3.0)
    z[0, :3] = [-200.0, 200.0, 0.0]
    op = {"op": "rmsnorm_gated", "x": "x", "gate": "z", "out": "x" if inplace else "y", "weight": "nw",
          "eps": 1e-6, "group": dv}
    hb = {"x": x.copy(), "z": z, "y": np.zeros_like(x)}
    db = dev(hb)
    run_both(op, hb, db, w, rows)
    same("rmsnorm_gated", db[op["out"]], hb[op["out"]], TOL)


@pytest.mark.parametrize("groups,widths,split", [
    (16, [128, 128, 256, 256], 3),      # Qwen3-Next's in_proj_qkvz: [q | k | v | z] per key head -> qkv, z
    (16, [2, 2], 1),                    # in_proj_ba: [b | a] -> b, a
    (16, [256, 256], 1),                # the gated attention's q_proj: [q | gate] per head
    (3, [2, 1, 4], 2), (4, [3, 5], 1)])
def test_split_groups(groups, widths, split):
    rng = np.random.default_rng(groups * sum(widths))
    rows = 5
    x = f32(rng, rows, groups * sum(widths))
    nout = groups * sum(widths[:split])
    op = {"op": "split_groups", "x": "x", "out": "o", "rest": "r", "groups": groups, "widths": widths, "split": split}
    hb = {"x": x, "o": np.zeros((rows, nout), np.float32), "r": np.zeros((rows, x.shape[1] - nout), np.float32)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("split_groups out", db["o"], hb["o"], 0)
    same("split_groups rest", db["r"], hb["r"], 0)


@pytest.mark.parametrize("gcols", ["full", "one"])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_sigmoid_mul(gcols, inplace):
    rng = np.random.default_rng(3)
    rows, n = 6, 4096
    x, g = f32(rng, rows, n), f32(rng, rows, n if gcols == "full" else 1, scale=5.0)
    g[0, 0] = -200.0
    g[1, 0] = 200.0
    op = {"op": "sigmoid_mul", "x": "x", "gate": "g", "out": "x" if inplace else "y"}
    hb = {"x": x.copy(), "g": g, "y": np.zeros_like(x)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("sigmoid_mul", db[op["out"]], hb[op["out"]], TOL)


@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_bias_add(inplace):
    rng = np.random.default_rng(4)
    rows, n = 7, 4096 + 512
    w = {"bias": f32(rng, n)}
    op = {"op": "bias_add", "x": "x", "bias": "bias", "out": "x" if inplace else "y"}
    hb = {"x": f32(rng, rows, n), "y": np.zeros((rows, n), np.float32)}
    db = dev(hb)
    run_both(op, hb, db, w, rows)
    same("bias_add", db[op["out"]], hb[op["out"]], 0)


# -- rmsnorm offset, rope rotary_dim (also fused with attention) -----------------------------------------


@pytest.mark.parametrize("offset", [None, 1.0, 0.5])
@pytest.mark.parametrize("group", [2048, 256, 64])
def test_rmsnorm_offset(offset, group):
    rng = np.random.default_rng(group)
    rows = 4
    w = {"nw": f32(rng, group, scale=0.1)}
    op = {"op": "rmsnorm", "x": "x", "out": "y", "weight": "nw", "eps": 1e-6, "group": group}
    if offset is not None:
        op["offset"] = offset
    hb = {"x": f32(rng, rows, 2 * group), "y": np.zeros((rows, 2 * group), np.float32)}
    db = dev(hb)
    run_both(op, hb, db, w, rows)
    same("rmsnorm", db["y"], hb["y"], TOL, f" (offset {offset})")


ROPE = [(256, 64), (128, 64), (64, 64), (128, 32), (64, None)]      # head_dim, rotary_dim


@pytest.mark.parametrize("hd,rd", ROPE)
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_rope_rotary_dim(hd, rd, inplace):
    rng = np.random.default_rng(hd + (rd or 0))
    heads = 3
    pos = np.array([0, 1, 2, 5, 100, 4095, -1, 70000], np.int32)
    op = {"op": "rope", "x": "x", "pos": "pos", "out": "x" if inplace else "y", "heads": heads, "head_dim": hd,
          "theta": 1e7}
    if rd is not None:
        op["rotary_dim"] = rd
    x = f32(rng, len(pos), heads * hd)
    hb = {"x": x.copy(), "pos": pos, "y": np.full_like(x, 7.0)}
    db = dev(hb)
    run_both(op, hb, db, {}, len(pos))
    same("rope", db[op["out"]], hb[op["out"]], TOL, f" (head_dim {hd}, rotary_dim {rd})")
    if rd is not None and rd < hd:                           # the pass-through part, bit for bit
        got = cp.asnumpy(db[op["out"]]).reshape(len(pos), heads, hd)[..., rd:]
        assert np.array_equal(got, x.reshape(len(pos), heads, hd)[..., rd:])


def rope_attention_ops(H, KV, D, rd, mode):
    extra = {} if rd is None else {"rotary_dim": rd}
    return [{"op": "rope", "x": "q", "pos": "pos", "out": "q", "heads": H, "head_dim": D, "theta": 1e6, **extra},
            {"op": "rope", "x": "k", "pos": "pos", "out": "k", "heads": KV, "head_dim": D, "theta": 1e6, **extra},
            {"op": "attention", "q": "q", "k": "k", "v": "v", "pos": "pos", "slot": "slot", "cache_k": "ck",
             "cache_v": "cv", "out": "att", "heads": H, "kv_heads": KV, "head_dim": D, "scale": 1 / np.sqrt(D),
             "mode": mode}]


@pytest.mark.parametrize("H,KV,D,rd", [(16, 2, 256, 64), (8, 2, 128, 64), (4, 4, 64, None)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_rope_attention_partial_rotary(H, KV, D, rd, fused):
    """rope q, rope k, attention as the executor binds them: fused (rope_qk_kv_k + attention) or op by
    op; a prompt chunk of 40 rows on slot 1 then a decode step on slots 0 and 1."""
    rng = np.random.default_rng(D + H)
    ctx, slots = 64, 2
    ops = rope_attention_ops(H, KV, D, rd, "prefill")
    assert CudaExecutor._fusable_rope(ops, 0)
    cache = np.zeros((slots, ctx, KV, D), np.float32)
    hb = {"ck": cache.copy(), "cv": cache.copy()}
    db = dev(hb)
    feeds = [("prefill", np.r_[np.arange(40), [-1] * 8].astype(np.int32), np.ones(48, np.int32)),
             ("decode", np.array([0, 40], np.int32), np.array([0, 1], np.int32))]
    for i, (mode, pos, slot) in enumerate(feeds):
        rows = len(pos)
        inp = {"q": f32(rng, rows, H * D), "k": f32(rng, rows, KV * D), "v": f32(rng, rows, KV * D),
               "att": np.zeros((rows, H * D), np.float32), "pos": pos, "slot": slot}
        hb.update({k: v.copy() for k, v in inp.items()})
        db.update(dev(inp))
        ops = rope_attention_ops(H, KV, D, rd, mode)
        ex = bare({})
        if fused:
            steps = ex._rope_qk_kv(ops[0], ops[1], ops[2], db, rows) + \
                ex._op_attention(ops[2], db, rows, mode, write=False)
        else:
            steps = [f for o in ops for f in ex.bind_op(o, db, rows, mode)]
        for o in ops:
            IMPL[o["op"]].run(o, hb, HostW())
        with ex.stream:
            for f in steps:
                f()
        ex.stream.synchronize()
        for name in ("q", "k", "ck", "cv"):
            same(name, db[name], hb[name], TOL, f" (call {i}, {'fused' if fused else 'separate'})")
        same("attention out", db["att"], hb["att"], 1e-5, f" (call {i})")


# -- moe_router_grouped ---------------------------------------------------------------------------------

ROUTERS = [  # experts, n_group, topk_group, top_k, norm, scale
    (160, 1, 1, 8, True, 2.5),           # GLM-4.5
    (128, 1, 1, 8, True, 1.0),           # GLM-4.5-Air
    (256, 8, 4, 8, True, 2.5),           # DeepSeek-V3-style groups
    (16, 4, 2, 4, False, 1.0),
    (12, 3, 1, 5, True, 1.5)]            # top_k beyond the kept group's 4 experts: -inf ones, lower index


def router_choice(logits, bias, cfg):
    E, ng, kg, k, norm, scale = cfg
    op = {"top_k": k, "n_group": ng, "topk_group": kg, "norm": norm, "scale": scale, "bias": "bias"}
    from bloomery.runtime.cuda import moe_router_grouped as MRG
    rows = logits.shape[0]
    ids, wts = cp.zeros((rows, k), cp.int32), cp.zeros((rows, k), cp.float32)
    for f in MRG.launches(op, cp.asarray(logits), cp.asarray(bias), ids, wts, rows):
        f()
    cp.cuda.Device().synchronize()
    return cp.asnumpy(ids), cp.asnumpy(wts)


@pytest.mark.parametrize("cfg", ROUTERS, ids=[f"E{c[0]}-g{c[1]}-kg{c[2]}-k{c[3]}" for c in ROUTERS])
def test_moe_router_grouped_choice(cfg):
    """The choice kernel on given logits: random ones (ids equal, weights 1e-6) and exactly tying ones
    (integer logits, zero bias: every tie goes to the lower index, as the NumPy op's stable sort)."""
    E, ng, kg, k, norm, scale = cfg
    rng = np.random.default_rng(E + k)
    logits = f32(rng, 33, E, scale=2.0)
    bias = f32(rng, E, scale=0.1)
    ids, wts = router_choice(logits, bias, cfg)
    want_ids, want_w = route(logits, bias, k, ng, kg, norm, scale)
    assert np.array_equal(ids, want_ids), f"ids differ in rows {np.nonzero((ids != want_ids).any(-1))[0].tolist()}"
    same("router weights", wts, want_w, TOL)
    ties = rng.integers(-2, 3, (33, E)).astype(np.float32)
    zero = np.zeros(E, np.float32)
    ids, wts = router_choice(ties, zero, cfg)
    want_ids, want_w = route(ties, zero, k, ng, kg, norm, scale)
    assert np.array_equal(ids, want_ids), f"tie order: ids differ in rows {np.nonzero((ids != want_ids).any(-1))[0].tolist()}"
    same("router weights (ties)", wts, want_w, 1e-6)


def test_moe_router_grouped_through_executor():
    """The op as the executor binds it: the router GEMV (float32) then the choice."""
    rng = np.random.default_rng(7)
    E, hidden, rows = 160, 256, 5
    w = {"gate": f32(rng, E, hidden, scale=0.05), "bias": f32(rng, E, scale=0.01)}
    op = {"op": "moe_router_grouped", "x": "x", "weight": "gate", "bias": "bias", "ids": "ids", "weights": "wts",
          "top_k": 8, "n_group": 1, "topk_group": 1, "norm": True, "scale": 2.5}
    hb = {"x": f32(rng, rows, hidden), "ids": np.zeros((rows, 8), np.int32), "wts": np.zeros((rows, 8), np.float32)}
    db = dev(hb)
    run_both(op, hb, db, w, rows)
    assert np.array_equal(cp.asnumpy(db["ids"]), hb["ids"])
    same("router weights", db["wts"], hb["wts"], 1e-5)


# -- a mini Qwen3-Next-style plan through the real CudaExecutor (graphs captured and replayed) -----------

HID, HK, HV, DK, DV, KC, VOCAB = 64, 2, 4, 16, 16, 4, 50
AH, AKV, AD, ARD = 4, 2, 32, 8                       # attention heads, kv heads, head_dim, rotary_dim


def mini_plan() -> tuple[dict, dict]:
    """One delta-net block and one gated-attention block in the op order of compiler/lower.py's
    _Qwen3Next (rmsnorm offset, split_groups, causal_conv1d in place, gated_delta, rmsnorm_gated,
    partial rope + attention, sigmoid_mul), plus bias_add and a shared-expert-style [rows, 1] gate."""
    r = HV // HK
    C = HK * (2 * DK + r * DV)
    rng = np.random.default_rng(42)
    w = {"emb": f32(rng, VOCAB, HID), "norm": f32(rng, HID, scale=0.1), "qkvz": f32(rng, HK * (2 * DK + 2 * r * DV), HID,
         scale=0.2), "ba": f32(rng, HK * 2 * r, HID, scale=0.3), "cw": f32(rng, C, 1, KC, scale=0.5),
         "bias": f32(rng, C, scale=0.1), "A_log": np.log(rng.uniform(0.5, 8, HV)).astype(np.float32),
         "dt": (-4 + 0.5 * rng.standard_normal(HV)).astype(np.float32), "gn": 1 + f32(rng, DV, scale=0.2),
         "sg": f32(rng, 1, HID, scale=0.3), "out": f32(rng, HID, HV * DV, scale=0.2),
         "qg": f32(rng, 2 * AH * AD, HID, scale=0.2), "wk": f32(rng, AKV * AD, HID, scale=0.2),
         "wv": f32(rng, AKV * AD, HID, scale=0.2), "qn": f32(rng, AD, scale=0.1), "kn": f32(rng, AD, scale=0.1),
         "head": f32(rng, VOCAB, HID, scale=0.2)}
    bufs = {"tokens": ("input", ["rows"], "i32"), "positions": ("input", ["rows"], "i32"),
            "slot_ids": ("input", ["rows"], "i32"),
            "h": ("scratch", ["rows", HID]), "xn": ("scratch", ["rows", HID]),
            "qkvz": ("scratch", ["rows", HK * (2 * DK + 2 * r * DV)]), "qkv": ("scratch", ["rows", C]),
            "z": ("scratch", ["rows", HV * DV]), "ba": ("scratch", ["rows", HK * 2 * r]),
            "bb": ("scratch", ["rows", HV]), "aa": ("scratch", ["rows", HV]), "o": ("output", ["rows", HV * DV]),
            "sg": ("scratch", ["rows", 1]), "y": ("output", ["rows", HID]),
            "qg": ("scratch", ["rows", 2 * AH * AD]), "q": ("scratch", ["rows", AH * AD]),
            "gate": ("scratch", ["rows", AH * AD]), "k": ("scratch", ["rows", AKV * AD]),
            "v": ("scratch", ["rows", AKV * AD]), "att": ("output", ["rows", AH * AD]),
            "logits": ("output", ["rows", VOCAB]), "next_token": ("output", ["rows"], "i32"),
            "conv": ("state", ["slots", KC - 1, C]), "ssm": ("state", ["slots", HV, DK, DV]),
            "ck": ("state", ["slots", "ctx", AKV, AD]), "cv": ("state", ["slots", "ctx", AKV, AD])}
    buffers = {n: {"kind": b[0], "shape": b[1], "dtype": b[2] if len(b) > 2 else "f32"} for n, b in bufs.items()}

    def lin(x, wname, out):
        return {"op": "linear", "x": x, "weight": wname, "out": out, "format": "f32", "pre_quant_scale": False}

    def ops(mode):
        return [
            {"op": "embed", "ids": "tokens", "weight": "emb", "out": "h"},
            {"op": "rmsnorm", "x": "h", "weight": "norm", "out": "xn", "eps": 1e-6, "group": HID, "offset": 1.0},
            lin("xn", "qkvz", "qkvz"),
            {"op": "split_groups", "x": "qkvz", "out": "qkv", "rest": "z", "groups": HK,
             "widths": [DK, DK, r * DV, r * DV], "split": 3},
            lin("xn", "ba", "ba"),
            {"op": "split_groups", "x": "ba", "out": "bb", "rest": "aa", "groups": HK, "widths": [r, r], "split": 1},
            {"op": "bias_add", "x": "qkv", "bias": "bias", "out": "qkv"},
            {"op": "causal_conv1d", "x": "qkv", "pos": "positions", "slot": "slot_ids", "state": "conv", "out": "qkv",
             "weight": "cw", "kernel": KC},
            {"op": "gated_delta", "qkv": "qkv", "a": "aa", "b": "bb", "pos": "positions", "slot": "slot_ids",
             "state": "ssm", "out": "o", "A_log": "A_log", "dt_bias": "dt", "k_heads": HK, "v_heads": HV,
             "k_dim": DK, "v_dim": DV, "mode": mode},
            {"op": "rmsnorm_gated", "x": "o", "gate": "z", "out": "o", "weight": "gn", "eps": 1e-6, "group": DV},
            lin("xn", "sg", "sg"),
            {"op": "sigmoid_mul", "x": "o", "gate": "sg", "out": "o"},
            lin("o", "out", "y"),
            {"op": "add", "a": "h", "b": "y", "out": "h"},
            {"op": "rmsnorm", "x": "h", "weight": "norm", "out": "xn", "eps": 1e-6, "group": HID, "offset": 1.0},
            lin("xn", "qg", "qg"),
            {"op": "split_groups", "x": "qg", "out": "q", "rest": "gate", "groups": AH, "widths": [AD, AD], "split": 1},
            lin("xn", "wk", "k"), lin("xn", "wv", "v"),
            {"op": "rmsnorm", "x": "q", "weight": "qn", "out": "q", "eps": 1e-6, "group": AD, "offset": 1.0},
            {"op": "rmsnorm", "x": "k", "weight": "kn", "out": "k", "eps": 1e-6, "group": AD, "offset": 1.0},
            {"op": "rope", "x": "q", "pos": "positions", "out": "q", "heads": AH, "head_dim": AD, "theta": 1e7,
             "rotary_dim": ARD},
            {"op": "rope", "x": "k", "pos": "positions", "out": "k", "heads": AKV, "head_dim": AD, "theta": 1e7,
             "rotary_dim": ARD},
            {"op": "attention", "q": "q", "k": "k", "v": "v", "pos": "positions", "slot": "slot_ids", "cache_k": "ck",
             "cache_v": "cv", "out": "att", "heads": AH, "kv_heads": AKV, "head_dim": AD, "scale": 1 / np.sqrt(AD),
             "mode": mode},
            {"op": "sigmoid_mul", "x": "att", "gate": "gate", "out": "att"},
            {"op": "logits", "x": "xn", "weight": "head", "out": "logits", "vocab": VOCAB},
            {"op": "argmax", "x": "logits", "out": "next_token"}]

    plan = {"version": P.VERSION, "family": "test", "tp": 1, "rank": 0, "model": {"vocab_size": VOCAB, "context_length": 4096},
            "buffers": buffers, "programs": {"decode": {"rows": "slots", "ops": ops("decode")},
                                             "prefill": {"rows": "ubatch", "ops": ops("prefill")}}}
    P.validate(plan)
    return plan, w


class FakeArtifact:
    """An artifact's reading interface over float32 host arrays (every tensor stored as F32)."""

    path = "<test_cuda_hybrid>"

    def __init__(self, w):
        self.w = w

    def tensors(self, rank=0):
        return {n: SimpleNamespace(format="f32", shape=tuple(a.shape), optional=(), cut="replicated",
                                   nbytes=a.nbytes)
                for n, a in self.w.items()}

    def gguf_arrays(self, name, rank=0):
        return {"weight": np.ascontiguousarray(self.w[name], np.float32)}

    def decode(self, name, rank=0):
        return np.ascontiguousarray(self.w[name], np.float32)

    def metadata(self, rank=0):
        return {}                         # no ahead-of-time kernels (core/artifact/kernels.py): the NVRTC ones


def test_executor_graphs_match_numpy(monkeypatch):
    """The mini plan on the CudaExecutor (decode and prefill each captured into one CUDA graph,
    replayed with new positions / slots each step) against the NumpyExecutor: prompts on two slots
    (one over two chunks), decode steps with an idle slot, then reset() of a slot mid-sequence."""
    monkeypatch.setenv("BLOOMERY_PREFILL_GEMM", "off")      # the GEMV kernels for the linears: float32 throughout
    plan, w = mini_plan()
    syms = {"slots": 3, "ubatch": 48, "ctx": 128}
    cu = CudaExecutor([plan], FakeArtifact(w), syms, graphs=True)
    assert set(cu.graph) == {"decode", "prefill"}, "both programs must be captured"
    assert "rope+rope+attention" in cu.tags["decode"], "partial rotary must keep the fused rope path"
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
        for n in ("o", "att", "logits"):
            same(n, got[n], want[n], tol, f" ({what})")
        for n in ("o", "att"):                  # the delta rule's and the attention's idle rows are zeros
            assert not got[n][pos < 0].any(), f"{n} ({what}): idle rows must give zeros"
        for n in ("conv", "ssm", "ck", "cv"):
            same(f"state {n}", cu.state[n], cpu.state[0][n], tol, f" ({what})")

    U = syms["ubatch"]
    pad = lambda p, s: (np.r_[p, [-1] * (U - len(p))], np.r_[s, [0] * (U - len(s))])   # noqa: E731
    step("prefill", *pad(np.arange(30), np.zeros(30)), "prompt slot 0")
    step("prefill", np.arange(U), np.ones(U), "prompt slot 1, chunk 1")
    step("prefill", *pad(np.arange(U, U + 9), np.ones(9)), "prompt slot 1, chunk 2")
    for t in range(5):
        step("decode", [30 + t, U + 9 + t, -1], [0, 1, 2], f"decode step {t}")
    cu.reset(1)
    cpu.reset(1)
    step("decode", [35, U + 14, 0], [0, 1, 2], "after reset(1): slot 1 from zero states, slot 2 at position 0")
    step("decode", [36, U + 15, 1], [0, 1, 2], "one more step")
