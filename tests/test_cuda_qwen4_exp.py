"""GPU: qwen4_exp's CUDA ops (runtime/cuda/<op>.cu + <op>.py, wired into the CUDA executor as
bind_op) against their NumPy ops (runtime/ops/<op>.py: the contract) on random inputs: hc_expand,
hc_gate_mix, act_scale, hc_inject, ple_gate, qsa_index, attention's `select` (the per-row and the
prompt-chunk kernels, and the fused rope + rope + attention path), rmsnorm_gated's `act`,
causal_conv1d's `dilation`, rmsnorm with a weight as wide as the row. Then a mini qwen4_exp-style plan
through the real CudaExecutor (its CUDA graphs captured and replayed) against the NumpyExecutor, and
the tiny qwen4_exp checkpoints (make models) on the CUDA engine against the NumPy engine.

Tolerances (relative L2 per call, float32 everywhere; EXACT is bit for bit):
- hc_expand, hc_inject: EXACT (a copy; x + w * y with the product rounded first, as NumPy).
- act_scale, hc_gate_mix, rmsnorm_gated, rmsnorm, causal_conv1d's out: TOL 1e-6 (NumPy's order of
  operations; expf, sincosf and the block-reduced sum of squares against NumPy's exp and pairwise
  sum: an ulp or two).
- ple_gate: TOL (its dot products are summed in another order than NumPy's pairwise sum).
- causal_conv1d's state, qsa_index's key cache, attention's caches: EXACT (copies of the inputs).
- qsa_index's selection: EXACT, except a row whose NumPy block scores nearly tie at the top-k cut:
  the CUDA scores agree with NumPy's to float32 rounding only (the block keys' RMS norm and the dot
  products are summed in other orders), so such a row may swap blocks whose NumPy scores lie within
  TIE (1e-5 of the row's largest score) of the cut, and nothing else. Exact ties (equal scores) pick
  the lower blocks, as NumPy's stable sort: tested with zero queries and with a single indexer head
  (many scores exactly 0 after relu).
- attention with `select`: TOL_ATT 1e-5 (as tests/test_cuda_hybrid.py's attention); a selection of
  every visible position gives EXACTLY the plain kernels' output (the same keys in the same order).
- the mini plan: TOL_PLAN 2e-5 (the GEMV kernels against NumPy's matmul, through the layers).
- the tiny checkpoints: assert_engines_agree's band (1e-3, the CUDA executor's), 64 greedy steps.
Idle rows (negative positions; slot ids outside the slots too) must give zeros or -1 and leave the
caches and states bit for bit unchanged. Skipped, visibly, without CuPy or a GPU.

On the GPU machine:  .venv/bin/python -m pytest -q tests/test_cuda_qwen4_exp.py
"""

from __future__ import annotations

import numpy as np
import pytest

from test_cuda_kernels import cp                          # skips, visibly, without CuPy or a GPU

from test_cuda_hybrid import (SLOTS, FakeArtifact, HostW, bare, conv_op, dev, f32, run_both,  # noqa: E402
                              same, scenario)

from bloomery.core import plan as P                       # noqa: E402
from bloomery.runtime.cuda.executor import CudaExecutor   # noqa: E402
from bloomery.runtime.errors import PlanMismatch          # noqa: E402
from bloomery.runtime.numpy_executor import NumpyExecutor  # noqa: E402
from bloomery.runtime.ops import IMPL                     # noqa: E402
from bloomery.runtime.ops import qsa_index as QI          # noqa: E402

pytestmark = pytest.mark.gpu

EXACT, TOL, TOL_ATT, TOL_PLAN, TIE = 0, 1e-6, 1e-5, 2e-5, 1e-5
HC = [(4, 128), (4, 2048), (3, 40)]          # (n streams, D): tiny-qwen4_exp, the default shape, odd sizes


def idle_rows_zero(name, got, pos):
    got = cp.asnumpy(got)
    assert not got[pos < 0].any(), f"{name}: idle rows (negative positions) must give zeros"


# -- the hyper-connection ops ----------------------------------------------------------------------------


@pytest.mark.parametrize("n,D", HC)
def test_hc_expand(n, D):
    rng = np.random.default_rng(n * D)
    rows = 7
    op = {"op": "hc_expand", "x": "x", "out": "X", "n": n}
    hb = {"x": f32(rng, rows, D), "X": np.full((rows, n * D), 7.0, np.float32)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("hc_expand out", db["X"], hb["X"], EXACT)


@pytest.mark.parametrize("n,D", HC)
def test_hc_gate_mix(n, D):
    rng = np.random.default_rng(n + D)
    rows = 9
    xn, g = f32(rng, rows, n * D), f32(rng, rows, n * D, scale=3.0)
    g[0, :4] = [-200.0, 200.0, 0.0, 88.0]                  # saturated gates, sigmoid(0) = 0.5
    op = {"op": "hc_gate_mix", "xn": "xn", "w": "g", "out": "m", "n": n}
    hb = {"xn": xn, "g": g, "m": np.full((rows, D), 7.0, np.float32)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("hc_gate_mix out", db["m"], hb["m"], TOL)


@pytest.mark.parametrize("act,scale,mul", [("silu", 0.25, None), ("sigmoid", 0.25, 2.0), ("silu", 1.0, 1),
                                           ("sigmoid", 0.5, 3.0)])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_act_scale(act, scale, mul, inplace):
    """The gates of Qwen4ExpTextGatedResidual: silu(down / n), 2 * sigmoid(inject / n); mul 1 and absent alike."""
    rng = np.random.default_rng(int(scale * 8) + len(act))
    rows, n = 5, 320                                      # hc_lowrank at the default shape
    x = f32(rng, rows, n, scale=4.0)
    x[0, :3] = [-400.0, 400.0, 0.0]
    op = {"op": "act_scale", "x": "x", "out": "x" if inplace else "y", "act": act, "scale": scale}
    if mul is not None:
        op["mul"] = mul
    hb = {"x": x.copy(), "y": np.full_like(x, 7.0)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("act_scale out", db[op["out"]], hb[op["out"]], TOL, f" ({act}, scale {scale}, mul {mul})")


@pytest.mark.parametrize("n,D", HC)
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_hc_inject(n, D, inplace):
    rng = np.random.default_rng(3 * n + D)
    rows = 6
    op = {"op": "hc_inject", "x": "X", "y": "y", "w": "inj", "out": "X" if inplace else "Y", "n": n}
    hb = {"X": f32(rng, rows, n * D), "y": f32(rng, rows, D), "inj": 2 * rng.random((rows, n)).astype(np.float32),
          "Y": np.full((rows, n * D), 7.0, np.float32)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("hc_inject out", db[op["out"]], hb[op["out"]], EXACT)


@pytest.mark.parametrize("n,D", HC)
def test_ple_gate(n, D):
    """Random keys and queries, plus the signed square root's edges: a zero dot product (g = 0, gate
    0.5), and tiny positive / negative ones clamped to +-sqrt(1e-6)."""
    rng = np.random.default_rng(7 * n + D)
    rows = 5
    kn, qn, v = f32(rng, rows, n * D), f32(rng, rows, n * D), f32(rng, rows, D)
    kn[0, :D] = 0.0                                        # row 0 stream 0: g = 0
    kn[0, D:2 * D], qn[0, D:2 * D] = 1e-5, 1e-5            # row 0 stream 1: 0 < g < 1e-6
    kn[1, 2 * D:3 * D], qn[1, 2 * D:3 * D] = -1e-5, 1e-5   # row 1 stream 2: -1e-6 < g < 0
    op = {"op": "ple_gate", "kn": "kn", "qn": "qn", "v": "v", "out": "gv", "n": n}
    hb = {"kn": kn, "qn": qn, "v": v, "gv": np.full((rows, n * D), 7.0, np.float32)}
    db = dev(hb)
    run_both(op, hb, db, {}, rows)
    same("ple_gate out", db["gv"], hb["gv"], TOL)
    got = cp.asnumpy(db["gv"]).reshape(rows, n, D)
    assert np.array_equal(got[0, 0], np.float32(0.5) * v[0]), "ple_gate: g = 0 must give the gate 0.5 exactly"
    for r, i, sign in ((0, 1, 1), (1, 2, -1)):
        gate = np.float32(1) / (np.float32(1) + np.exp(np.float32(-sign * np.sqrt(np.float32(1e-6)))))
        assert np.allclose(got[r, i], gate * v[r], rtol=1e-6, atol=0), \
            f"ple_gate: row {r} stream {i}: a tiny dot product must be clamped to {'+' if sign > 0 else '-'}sqrt(1e-6)"


# -- rmsnorm_gated's act, rmsnorm's row-wide weight, causal_conv1d's dilation ----------------------------


@pytest.mark.parametrize("rows,heads,dv", [(5, 32, 128), (3, 4, 32)])
@pytest.mark.parametrize("act", ["silu", "sigmoid", None])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_rmsnorm_gated_act(rows, heads, dv, act, inplace):
    """qwen4_exp's output gate (output_gate_type sigmoid), silu, and the attr absent (silu)."""
    rng = np.random.default_rng(rows * dv + len(act or ""))
    w = {"nw": 1 + 0.5 * f32(rng, dv)}
    x, z = f32(rng, rows, heads * dv), f32(rng, rows, heads * dv, scale=3.0)
    z[0, :3] = [-200.0, 200.0, 0.0]
    op = {"op": "rmsnorm_gated", "x": "x", "gate": "z", "out": "x" if inplace else "y", "weight": "nw",
          "eps": 1e-6, "group": dv}
    if act is not None:
        op["act"] = act
    hb = {"x": x.copy(), "z": z, "y": np.zeros_like(x)}
    db = dev(hb)
    run_both(op, hb, db, w, rows)
    same("rmsnorm_gated", db[op["out"]], hb[op["out"]], TOL, f" (act {act})")


@pytest.mark.parametrize("n,group,offset", [(4, 128, 1.0), (4, 2048, 1.0), (3, 64, None), (1, 256, 1.0)])
def test_rmsnorm_row_wide_weight(n, group, offset):
    """Qwen4ExpTextRMSNorm with group_size (hc_norm, the PLE norms): one weight per value of the row,
    [n * group], stream i normed over its group with weight[i * group:(i + 1) * group]; the weight
    of [group] keeps working on the same rows, another width is refused by name."""
    rng = np.random.default_rng(n * group)
    rows = 4
    w = {"wide": f32(rng, n * group, scale=0.3), "one": f32(rng, group, scale=0.3), "odd": f32(rng, group + 2)}
    x = f32(rng, rows, n * group)
    for name in ("wide", "one"):
        op = {"op": "rmsnorm", "x": "x", "out": "y", "weight": name, "eps": 1e-6, "group": group}
        if offset is not None:
            op["offset"] = offset
        hb = {"x": x.copy(), "y": np.full_like(x, 7.0)}
        db = dev(hb)
        ex = run_both(op, hb, db, w, rows)
        same("rmsnorm", db["y"], hb["y"], TOL, f" (weight {name}, offset {offset})")
    with pytest.raises(PlanMismatch, match="odd"):
        ex._op_rmsnorm({**op, "weight": "odd"}, db, rows, "decode")


def conv_dil_op(K, dil, out="x"):
    op = conv_op(K, out=out)
    if dil != 1:
        op["dilation"] = dil
    return op


CONV = [(512, 4, 3), (8192, 4, 3), (40, 2, 8), (100, 3, 2), (64, 4, 1)]   # C, kernel, dilation


@pytest.mark.parametrize("C,K,dil", CONV, ids=[f"C{c}-K{k}-d{d}" for c, k, d in CONV])
@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_causal_conv1d_dilation_scenario(C, K, dil, inplace):
    """The PLE conv (kernel 4, dilation ngram_size 3 over n*D channels) and other shapes on
    test_cuda_hybrid's scenario: four slots interleaved in prompt chunks, a slot restarting at
    position 0 inside a chunk, idle rows of any slot id, decode steps; from garbage states."""
    rng = np.random.default_rng(C + 10 * K + dil)
    Wn = (K - 1) * dil
    w = {"cw": f32(rng, C, 1, K)}
    st = f32(rng, SLOTS, Wn, C)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    idle = st[3].copy()
    op = conv_dil_op(K, dil, out="x" if inplace else "y")
    for i, (mode, pos, slot) in enumerate(scenario(rng)):
        x = f32(rng, len(pos), C)
        hb.update(x=x.copy(), y=np.full_like(x, 7.0), pos=pos, slot=slot)
        db.update(x=cp.asarray(x), y=cp.full(x.shape, 7.0, cp.float32), pos=cp.asarray(pos), slot=cp.asarray(slot))
        run_both(op, hb, db, w, len(pos), mode)
        o = op["out"]
        same("causal_conv1d out", db[o], hb[o], TOL, f" (call {i}, {mode}, dilation {dil})")
        idle_rows_zero(f"causal_conv1d (call {i})", db[o], pos)
        same("causal_conv1d state", db["st"], hb["st"], EXACT, f" (call {i}, {mode}, dilation {dil})")
    assert np.array_equal(cp.asnumpy(db["st"][3]), idle), "the idle slot's window changed"


@pytest.mark.parametrize("n", [1, 3, 8, 9, 10, 40])
def test_causal_conv1d_dilation_prefill_then_decode(n):
    """The PLE conv of tiny-qwen4_exp (512 channels, kernel 4, dilation 3: a window of 9 inputs): a
    chunk of n rows from position 0 (around the window's length), then 4 decode steps."""
    rng = np.random.default_rng(100 + n)
    C, K, dil = 512, 4, 3
    w = {"cw": f32(rng, C, 1, K)}
    st = f32(rng, 2, (K - 1) * dil, C)
    hb, db = {"st": st.copy()}, {"st": cp.asarray(st)}
    feeds = [(np.arange(n, dtype=np.int32), np.ones(n, np.int32))]
    feeds += [(np.array([-1, n + t], np.int32), np.array([0, 1], np.int32)) for t in range(4)]
    for i, (pos, slot) in enumerate(feeds):
        x = f32(rng, len(pos), C)
        hb.update(x=x.copy(), pos=pos, slot=slot)
        db.update(x=cp.asarray(x), pos=cp.asarray(pos), slot=cp.asarray(slot))
        run_both(conv_dil_op(K, dil), hb, db, w, len(pos), "prefill" if i == 0 else "decode")
        same("causal_conv1d out", db["x"], hb["x"], TOL, f" (step {i})")
        same("causal_conv1d state", db["st"], hb["st"], EXACT, f" (step {i})")


# -- qsa_index ----------------------------------------------------------------------------------------------

QSA = [  # indexer heads, head_dim, ratio, budget, rotary_dim
    (8, 32, 4, 64, 8),                   # tiny-qwen4_exp (tools/tiny.py)
    (8, 32, 4, 16, 8),                   # tests/test_ops_qwen4.py's: sparse from position 19
    (16, 128, 4, 64, 32),
    (4, 64, 8, 32, None),                # 8-key blocks, the whole head roped
    (1, 32, 4, 64, 8),                   # one head: many scores exactly 0 (relu), ties at the cut
]
QSA_IDS = ["tiny", "budget16", "wide", "ratio8", "one-head"]
QSLOTS, QCTX = 4, 320


def qsa_op(H, Di, R, budget, rd):
    return {"op": "qsa_index", "q": "q", "k": "k", "pos": "pos", "slot": "slot", "cache": "cache", "sel": "sel",
            "k_norm": "kn", "heads": H, "head_dim": Di, "ratio": R, "budget": budget, "theta": 1e7,
            "rotary_dim": rd, "eps": 1e-6, "offset": 1.0}


def schedule(rng, calls, slot_of, rows=None):
    """Each call's rows: its sequences' spans {name: (t0, t1)} merged in a random order that keeps each
    slot's order, with idle rows between them (position -1, slot ids from -1 to slots + 1); padded
    with idle rows to `rows`. No call holds one slot twice at one position (rows of one call write
    their keys before any row reads: a restarted slot restarts in a later call)."""
    for spans in calls:
        queues = {}
        for name, (t0, t1) in spans.items():
            queues.setdefault(slot_of[name], []).extend(range(t0, t1))
        order = []
        while queues:
            if rng.random() < 0.15:
                order.append((int(rng.integers(-1, QSLOTS + 2)), -1))
            s = int(rng.choice(sorted(queues)))
            order.append((s, queues[s].pop(0)))
            if not queues[s]:
                del queues[s]
        while rows and len(order) < rows:
            order.append((int(rng.integers(-1, QSLOTS + 2)), -1))
        yield np.array([p for _, p in order], np.int32), np.array([s for s, _ in order], np.int32)


QSA_SEQS = {"A": 0, "B": 1, "C": 2, "D": 2}       # D restarts slot 2 at position 0; slot 3 stays idle
QSA_CALLS = [{"A": (0, 100), "B": (0, 40), "C": (0, 9)},
             {"A": (100, 230), "D": (0, 70)},
             {"A": (230, 300), "B": (40, 45)}] + \
            [{"A": (300 + t, 301 + t), "B": (45 + t, 46 + t), "D": (70 + t, 71 + t)} for t in range(3)]


def check_selection(what, got, want, q, cache, pos, slot, op, wt):
    """got == want row by row, or the row's differing blocks are a near-tie at the cut of NumPy's
    scores (TIE of the row's largest score); the kept positions are then still those blocks'
    positions plus the tail, ascending, -1 padded."""
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)
    R, top = int(op["ratio"]), int(op["budget"]) // int(op["ratio"])
    for i in np.nonzero((got != want).any(axis=1))[0]:
        p, s = int(pos[i]), int(slot[i])
        assert p >= 0 and 0 <= s < cache.shape[0], \
            f"{what}: idle row {i} (position {p}, slot {s}): sel {got[i][:8].tolist()}..., all -1 expected"
        nb = (p + 1) // R
        blocks = lambda row: set((row[(row >= 0) & (row < nb * R)] // R).tolist())   # noqa: E731
        gb, wb = blocks(got[i]), blocks(want[i])
        swapped = sorted(gb ^ wb)
        sc, cut, near = np.zeros(nb, np.float32), None, np.zeros(len(swapped), bool)
        if nb > top:                                         # a cut: the block scores decide
            sc = QI.scores(q[i:i + 1], QI.block_keys(cache[s, :p + 1], op, wt), op)[0]
            cut = np.sort(sc)[::-1][top - 1]
            near = np.abs(sc[swapped] - cut) <= TIE * np.abs(sc).max()
        assert len(gb) == len(wb) and near.all(), \
            f"{what}: row {i} (slot {s}, position {p}): blocks {sorted(gb - wb)} selected instead of " \
            f"{sorted(wb - gb)}; NumPy scores {dict(zip(swapped, sc[swapped].tolist()))} against the cut {cut}: " \
            f"not a near-tie (the selection is wrong)"
        keep = np.concatenate([(np.array(sorted(gb), np.int64)[:, None] * R + np.arange(R)).ravel(),
                               np.arange(nb * R, p + 1)]).astype(np.int32)
        assert np.array_equal(got[i][:keep.size], keep) and (got[i][keep.size:] == -1).all(), \
            f"{what}: row {i} (slot {s}, position {p}): sel {got[i].tolist()}, expected blocks {sorted(gb)} " \
            f"then the tail {p + 1 - nb * R}, ascending, -1 padded"


def qsa_weights(rng, Di):
    return {"kn": f32(rng, Di, scale=0.3)}


def qsa_call(op, hb, db, w, pos, slot, rng, zero_q=False):
    H, Di = op["heads"], op["head_dim"]
    rows = len(pos)
    q = np.zeros((rows, H * Di), np.float32) if zero_q else f32(rng, rows, H * Di)
    inp = {"q": q, "k": f32(rng, rows, Di), "pos": pos, "slot": slot,
           "sel": np.full((rows, op["budget"] + op["ratio"] - 1), 7, np.int32)}
    hb.update({k: v.copy() for k, v in inp.items()})
    db.update(dev(inp))
    return run_both(op, hb, db, w, rows, steps=None)


@pytest.mark.parametrize("cfg", QSA, ids=QSA_IDS)
def test_qsa_index_scenario(cfg):
    """Four slots: prompts in chunks interleaved with idle rows (slot ids from -1 to slots + 1), a slot
    restarted from position 0 in a later call (its keys rewritten), both regimes (nb <= budget / ratio:
    every visible position; beyond: the top blocks and the tail), then decode steps; the cache
    carried across calls, from garbage (slot 3 never active)."""
    rng = np.random.default_rng(sum(c or 0 for c in cfg))
    H, Di, R, budget, rd = cfg
    op = qsa_op(*cfg)
    w = qsa_weights(rng, Di)
    cache = f32(rng, QSLOTS, QCTX, Di)
    hb, db = {"cache": cache.copy()}, {"cache": cp.asarray(cache)}
    for i, (pos, slot) in enumerate(schedule(rng, QSA_CALLS, QSA_SEQS)):
        qsa_call(op, hb, db, w, pos, slot, rng)
        same("qsa_index cache", db["cache"], hb["cache"], EXACT, f" (call {i})")
        check_selection(f"qsa_index sel (call {i})", db["sel"], hb["sel"], hb["q"], hb["cache"], pos, slot, op, w["kn"])
    assert np.array_equal(cp.asnumpy(db["cache"][3]), cache[3]), "the idle slot's cache changed"


@pytest.mark.parametrize("cfg", QSA[:2], ids=QSA_IDS[:2])
def test_qsa_index_exact_ties_take_the_lower_blocks(cfg):
    """Zero queries: every block scores exactly 0, so the kept blocks are the lowest (NumPy's stable
    sort), bit for bit: a prompt of 150 positions on one slot, then decode steps."""
    rng = np.random.default_rng(11)
    op = qsa_op(*cfg)
    w = qsa_weights(rng, cfg[1])
    hb, db = {"cache": np.zeros((2, QCTX, cfg[1]), np.float32)}, {"cache": cp.zeros((2, QCTX, cfg[1]), cp.float32)}
    feeds = [(np.r_[np.arange(150), [-1] * 10].astype(np.int32), np.ones(160, np.int32))]
    feeds += [(np.array([-1, 150 + t], np.int32), np.array([0, 1], np.int32)) for t in range(3)]
    for i, (pos, slot) in enumerate(feeds):
        qsa_call(op, hb, db, w, pos, slot, rng, zero_q=True)
        same("qsa_index sel (zero queries)", db["sel"], hb["sel"], EXACT, f" (call {i})")


@pytest.mark.parametrize("cfg", QSA[:2], ids=QSA_IDS[:2])
def test_qsa_index_before_the_first_block(cfg):
    """Rows before their slot's first complete block (positions 0 .. ratio - 2: a short prompt, the
    first decode steps of a new sequence) keep every visible position 0..p: checked against the
    contract's formula itself, sel[row] = 0..p then -1 (the NumPy op is not run: it fails there, its
    block keys of zero blocks)."""
    rng = np.random.default_rng(12)
    op = qsa_op(*cfg)
    H, Di, R, budget, _ = cfg
    w = qsa_weights(rng, Di)
    cache = f32(rng, 3, QCTX, Di)
    db = {"cache": cp.asarray(cache)}
    feeds = [(np.array([0, -1, 1, 0, 2], np.int32), np.array([1, 1, 1, 2, 1], np.int32)),    # slots 1, 2: prompts
             (np.array([-1, R - 1, 1], np.int32), np.array([0, 1, 2], np.int32))]           # decode: slot 1's block 0
    ex = bare(w)
    for i, (pos, slot) in enumerate(feeds):
        rows = len(pos)
        k = f32(rng, rows, Di)
        db.update(dev({"q": f32(rng, rows, H * Di), "k": k, "pos": pos, "slot": slot,
                       "sel": np.full((rows, budget + R - 1), 7, np.int32)}))
        with ex.stream:
            for f in ex.bind_op(op, db, rows, "decode"):
                f()
        ex.stream.synchronize()
        want = np.where(np.arange(budget + R - 1)[None, :] <= pos[:, None], np.arange(budget + R - 1)[None, :], -1)
        same("qsa_index sel (before the first block)", db["sel"], want.astype(np.int32), EXACT, f" (call {i})")
        live = pos >= 0
        cache[slot[live], pos[live]] = k[live]
        same("qsa_index cache", db["cache"], cache, EXACT, f" (call {i})")


def test_qsa_index_refuses_wrong_shapes():
    rng = np.random.default_rng(0)
    op = qsa_op(8, 32, 4, 64, 8)
    bufs = dev({"q": f32(rng, 3, 8 * 32), "k": f32(rng, 3, 32), "pos": np.zeros(3, np.int32),
                "slot": np.zeros(3, np.int32), "cache": np.zeros((2, 64, 32), np.float32),
                "sel": np.zeros((3, 64), np.int32)})               # width 64, budget + ratio - 1 = 67 expected
    with pytest.raises(PlanMismatch, match="budget"):
        bare(qsa_weights(rng, 32)).bind_op(op, bufs, 3, "decode")


# -- attention's select ------------------------------------------------------------------------------------

ATT = [(4, 2, 32), (16, 2, 256), (8, 8, 64), (32, 1, 128), (64, 1, 256)]    # heads, kv heads, head_dim
ACTX, ASLOTS, AW = 96, 3, 24


def att_op(H, KV, D, mode, select=True):
    op = {"op": "attention", "q": "q", "k": "k", "v": "v", "pos": "pos", "slot": "slot", "cache_k": "ck",
          "cache_v": "cv", "out": "att", "heads": H, "kv_heads": KV, "head_dim": D, "scale": 1 / np.sqrt(D),
          "mode": mode}
    return {**op, "select": "sel"} if select else op


def random_select(rng, pos, W=AW):
    """Per row W entries in any order: some of its visible positions (repeats among them), -1, positions
    past the row's and past the cache; in a prompt chunk, row 3 all -1 and row 5 only positions after
    its own (both empty: zeros)."""
    sel = rng.integers(-1, ACTX + 4, (len(pos), W)).astype(np.int32)
    for r, p in enumerate(pos):
        if p >= 0:
            k = int(rng.integers(1, W))
            sel[r, :k] = rng.integers(0, p + 1, k)
            rng.shuffle(sel[r])
    if len(pos) > 8:
        sel[3] = -1
        sel[5] = max(int(pos[5]), 0) + 1 + rng.integers(0, 3, W)
    return sel


def att_feeds(rows_chunk=48):
    """Two prompt chunks on slot 1 (idle rows after them), then decode steps on slots 0 and 1 (slot 2 idle)."""
    yield "prefill", np.r_[np.arange(40), [-1] * (rows_chunk - 40)].astype(np.int32), np.ones(rows_chunk, np.int32)
    yield "prefill", np.r_[np.arange(40, 80), [-1] * (rows_chunk - 40)].astype(np.int32), np.ones(rows_chunk, np.int32)
    for t in range(3):
        yield "decode", np.array([t, 80 + t, -1], np.int32), np.array([0, 1, 2], np.int32)


def att_inputs(rng, H, KV, D, pos, slot, sel):
    rows = len(pos)
    return {"q": f32(rng, rows, H * D), "k": f32(rng, rows, KV * D), "v": f32(rng, rows, KV * D),
            "att": np.full((rows, H * D), 7.0, np.float32), "pos": pos, "slot": slot, "sel": sel}


@pytest.mark.parametrize("H,KV,D", ATT, ids=[f"H{h}-KV{k}-D{d}" for h, k, d in ATT])
@pytest.mark.parametrize("kernel", ["chunk", "row"])
def test_attention_select(H, KV, D, kernel):
    """Prompt chunks through the prompt-chunk kernel (kernel "chunk": the prefill program; the per-row
    kernel where the head shape has no chunk kernel) or the per-row kernel (kernel "row": the decode
    program's, here on prompt rows too), then decode steps; selections in any order with repeats,
    -1 and out-of-range entries, empty ones (zeros), caches carried across calls."""
    rng = np.random.default_rng(H * D + KV)
    cache = np.zeros((ASLOTS, ACTX, KV, D), np.float32)
    hb = {"ck": cache.copy(), "cv": cache.copy()}
    db = dev(hb)
    for i, (mode, pos, slot) in enumerate(att_feeds()):
        prog = mode if kernel == "chunk" else "decode"
        inp = att_inputs(rng, H, KV, D, pos, slot, random_select(rng, pos))
        hb.update({k: v.copy() for k, v in inp.items()})
        db.update(dev(inp))
        run_both(att_op(H, KV, D, mode), hb, db, {}, len(pos), prog)
        same("attention (select) out", db["att"], hb["att"], TOL_ATT, f" (call {i}, {mode}, {kernel} kernel)")
        got = cp.asnumpy(db["att"])
        empty = (pos < 0) | np.array([not ((s >= 0) & (s <= max(p, -1))).any() for s, p in zip(inp["sel"], pos)])
        assert not got[empty].any(), f"attention (select), call {i}: idle rows and empty selections must give zeros"
        for n in ("ck", "cv"):
            same(f"attention cache {n}", db[n], hb[n], EXACT, f" (call {i})")


@pytest.mark.parametrize("H,KV,D", ATT[:4], ids=[f"H{h}-KV{k}-D{d}" for h, k, d in ATT[:4]])
@pytest.mark.parametrize("prog", ["prefill", "decode"])
def test_attention_select_all_is_the_plain_kernel(H, KV, D, prog):
    """A selection listing every visible position (ascending, as qsa_index writes it below its budget)
    gives bit for bit the output of the attention kernels without select: the same keys in the same
    order through the same arithmetic (the per-row kernel for decode, the prompt-chunk one for prefill).
    Decode without select is pinned to the per-row kernel (BLOOMERY_DECODE_ATTENTION=row) and prefill to
    the CUDA-core chunk kernel (BLOOMERY_CHUNK_ATTENTION=fma): the defaults (the split kernel, the
    tensor-core chunk kernel) sum in another order (tests/test_cuda_attention_decode.py and
    tests/test_cuda_attention_chunk.py check them)."""
    rng = np.random.default_rng(D + H)
    ex = bare({})
    ex.attn_mode = "row"
    ex.chunk_mode = "fma"
    feeds = list(att_feeds())
    out = {}
    for select in (False, True):
        cache = np.zeros((ASLOTS, ACTX, KV, D), np.float32)
        db = dev({"ck": cache, "cv": cache})
        rng = np.random.default_rng(D + H)
        for i, (mode, pos, slot) in enumerate(feeds):
            sel = np.where(np.arange(ACTX)[None, :] <= pos[:, None], np.arange(ACTX)[None, :], -1).astype(np.int32)
            db.update(dev(att_inputs(rng, H, KV, D, pos, slot, sel)))
            steps = ex._op_attention(att_op(H, KV, D, mode, select), db, len(pos), prog if mode == "prefill" else mode)
            with ex.stream:
                for f in steps:
                    f()
            ex.stream.synchronize()
            out[select, i] = cp.asnumpy(db["att"])
    for i in range(len(feeds)):
        same("attention: select of every position against no select", out[True, i], out[False, i], EXACT, f" (call {i})")


def test_rope_attention_select_fused():
    """The lowering's order (rope q, rope k, attention with select): the executor fuses rope + rope +
    the cache write into one kernel, then the attention with select reads the roped cache."""
    H, KV, D, rd = 4, 2, 32, 8
    rng = np.random.default_rng(9)
    cache = np.zeros((ASLOTS, ACTX, KV, D), np.float32)
    hb = {"ck": cache.copy(), "cv": cache.copy()}
    db = dev(hb)
    for i, (mode, pos, slot) in enumerate(att_feeds()):
        ops = [{"op": "rope", "x": "q", "pos": "pos", "out": "q", "heads": H, "head_dim": D, "theta": 1e7, "rotary_dim": rd},
               {"op": "rope", "x": "k", "pos": "pos", "out": "k", "heads": KV, "head_dim": D, "theta": 1e7,
                "rotary_dim": rd},
               att_op(H, KV, D, mode)]
        assert CudaExecutor._fusable_rope(ops, 0)
        inp = att_inputs(rng, H, KV, D, pos, slot, random_select(rng, pos))
        hb.update({k: v.copy() for k, v in inp.items()})
        db.update(dev(inp))
        ex = bare({})
        steps = ex._rope_qk_kv(ops[0], ops[1], ops[2], db, len(pos)) + \
            ex._op_attention(ops[2], db, len(pos), mode, write=False)
        for o in ops:
            IMPL[o["op"]].run(o, hb, HostW())
        with ex.stream:
            for f in steps:
                f()
        ex.stream.synchronize()
        for n in ("q", "k", "ck", "cv"):
            same(n, db[n], hb[n], TOL, f" (call {i})")
        same("attention (select) out", db["att"], hb["att"], TOL_ATT, f" (call {i}, fused)")


def test_attention_select_refuses_a_wrong_buffer():
    db = dev({"q": np.zeros((3, 64), np.float32), "k": np.zeros((3, 64), np.float32), "v": np.zeros((3, 64), np.float32),
              "att": np.zeros((3, 64), np.float32), "pos": np.zeros(3, np.int32), "slot": np.zeros(3, np.int32),
              "sel": np.zeros((3, 8), np.float32), "ck": np.zeros((1, 16, 2, 32), np.float32),
              "cv": np.zeros((1, 16, 2, 32), np.float32)})
    with pytest.raises(PlanMismatch, match="sel"):
        bare({})._op_attention(att_op(2, 2, 32, "decode"), db, 3, "decode")


# -- a mini qwen4_exp-style plan through the real CudaExecutor ---------------------------------------------

VOCAB, MD, MN, LOW, PE = 50, 64, 4, 16, 32           # vocab, hidden, streams, hc_lowrank, PLE embedding width
AH, AKV, AD, ARD = 4, 2, 32, 8                       # attention heads, kv heads, head_dim, rotary_dim
IH, ID, IR, IB = 8, 32, 4, 16                        # indexer heads, head_dim, ratio, budget (sparse from 19)
KP, DIL = 4, 3                                       # the PLE conv: kernel, dilation (ngram_size)


def mini_plan() -> tuple[dict, dict]:
    """Every qwen4_exp op in the lowering's order (compiler/lower.py _Qwen4Exp): streams from the
    embedding (hc_expand), a PLE-style block (its n-gram rows taken from a second embedding: the host
    ops are not the CUDA executor's kernels) with row-wide norms, ple_gate and the dilated conv; a
    gated hyper-connection (act_scale, hc_gate_mix) around QSA attention (qsa_index, fused rope + rope
    + attention with select) with a sigmoid-gated rmsnorm_gated on its output, hc_inject; the final
    mixer into the head."""
    rng = np.random.default_rng(42)
    nD = MN * MD
    w = {"emb": f32(rng, VOCAB, MD), "ple_tab": f32(rng, VOCAB, PE), "ple_key": f32(rng, nD, PE, scale=0.2),
         "ple_value": f32(rng, MD, PE, scale=0.2), "ple_nk": f32(rng, nD, scale=0.3), "ple_nq": f32(rng, nD, scale=0.3),
         "ple_nc": f32(rng, nD, scale=0.3), "ple_conv": f32(rng, nD, 1, KP, scale=0.3),
         "hc_norm": f32(rng, nD, scale=0.3), "hc_down": f32(rng, LOW, nD, scale=0.1), "hc_up": f32(rng, nD, LOW, scale=0.3),
         "hc_inj": f32(rng, MN, nD, scale=0.1), "qg": f32(rng, 2 * AH * AD, MD, scale=0.2),
         "wk": f32(rng, AKV * AD, MD, scale=0.2), "wv": f32(rng, AKV * AD, MD, scale=0.2),
         "qn": f32(rng, AD, scale=0.1), "kn": f32(rng, AD, scale=0.1), "idx_qk": f32(rng, (IH + 1) * ID, MD, scale=0.2),
         "idx_qn": f32(rng, ID, scale=0.1), "idx_kn": f32(rng, ID, scale=0.1), "gn": 1 + f32(rng, AD, scale=0.2),
         "wo": f32(rng, MD, AH * AD, scale=0.2), "out_norm": f32(rng, nD, scale=0.3),
         "out_down": f32(rng, LOW, nD, scale=0.1), "out_up": f32(rng, nD, LOW, scale=0.3),
         "head": f32(rng, VOCAB, MD, scale=0.2)}
    bufs = {"tokens": ("input", ["rows"], "i32"), "positions": ("input", ["rows"], "i32"),
            "slot_ids": ("input", ["rows"], "i32"),
            "e": ("scratch", ["rows", MD]), "X": ("output", ["rows", nD]), "pe": ("scratch", ["rows", PE]),
            "kn": ("scratch", ["rows", nD]), "pv": ("scratch", ["rows", MD]), "qn": ("scratch", ["rows", nD]),
            "gv": ("scratch", ["rows", nD]), "gn": ("scratch", ["rows", nD]), "xn": ("scratch", ["rows", nD]),
            "low": ("scratch", ["rows", LOW]), "mix": ("scratch", ["rows", nD]), "m": ("output", ["rows", MD]),
            "inj": ("output", ["rows", MN]), "qg": ("scratch", ["rows", 2 * AH * AD]), "q": ("scratch", ["rows", AH * AD]),
            "gate": ("scratch", ["rows", AH * AD]), "k": ("scratch", ["rows", AKV * AD]),
            "v": ("scratch", ["rows", AKV * AD]), "iqk": ("scratch", ["rows", (IH + 1) * ID]),
            "iq": ("output", ["rows", IH * ID]), "ik": ("scratch", ["rows", ID]),
            "sel": ("output", ["rows", IB + IR - 1], "i32"), "att": ("output", ["rows", AH * AD]),
            "y": ("scratch", ["rows", MD]), "logits": ("output", ["rows", VOCAB]), "next_token": ("output", ["rows"], "i32"),
            "ple_conv": ("state", ["slots", (KP - 1) * DIL, nD]), "qsa": ("state", ["slots", "ctx", ID]),
            "ck": ("state", ["slots", "ctx", AKV, AD]), "cv": ("state", ["slots", "ctx", AKV, AD])}
    buffers = {n: {"kind": b[0], "shape": b[1], "dtype": b[2] if len(b) > 2 else "f32"} for n, b in bufs.items()}

    def lin(x, wname, out):
        return {"op": "linear", "x": x, "weight": wname, "out": out, "format": "f32", "pre_quant_scale": False}

    def norm(x, wname, out, group):
        return {"op": "rmsnorm", "x": x, "weight": wname, "out": out, "eps": 1e-6, "group": group, "offset": 1.0}

    def hyper(p, X, inject=True):
        ops = [norm(X, p + "_norm", "xn", MD), lin("xn", p + "_down", "low"),
               {"op": "act_scale", "x": "low", "out": "low", "act": "silu", "scale": 1.0 / MN}, lin("low", p + "_up", "mix"),
               {"op": "hc_gate_mix", "xn": "xn", "w": "mix", "out": "m", "n": MN}]
        if inject:
            ops += [lin("xn", "hc_inj", "inj"),
                    {"op": "act_scale", "x": "inj", "out": "inj", "act": "sigmoid", "scale": 1.0 / MN, "mul": 2.0}]
        return ops

    def ops(mode):
        return [
            {"op": "embed", "ids": "tokens", "weight": "emb", "out": "e"},
            {"op": "hc_expand", "x": "e", "out": "X", "n": MN},
            {"op": "embed", "ids": "tokens", "weight": "ple_tab", "out": "pe"},
            lin("pe", "ple_key", "kn"), norm("kn", "ple_nk", "kn", MD), lin("pe", "ple_value", "pv"),
            norm("X", "ple_nq", "qn", MD),
            {"op": "ple_gate", "kn": "kn", "qn": "qn", "v": "pv", "out": "gv", "n": MN},
            norm("gv", "ple_nc", "gn", MD),
            {"op": "causal_conv1d", "x": "gn", "pos": "positions", "slot": "slot_ids", "state": "ple_conv", "out": "gn",
             "weight": "ple_conv", "kernel": KP, "dilation": DIL},
            {"op": "add", "a": "gv", "b": "gn", "out": "gv"}, {"op": "add", "a": "X", "b": "gv", "out": "X"},
            *hyper("hc", "X"),
            lin("m", "qg", "qg"),
            {"op": "split_groups", "x": "qg", "out": "q", "rest": "gate", "groups": AH, "widths": [AD, AD], "split": 1},
            lin("m", "wk", "k"), lin("m", "wv", "v"), norm("q", "qn", "q", AD), norm("k", "kn", "k", AD),
            lin("m", "idx_qk", "iqk"),
            {"op": "split_groups", "x": "iqk", "out": "iq", "rest": "ik", "groups": 1, "widths": [IH * ID, ID], "split": 1},
            norm("iq", "idx_qn", "iq", ID),
            {"op": "rope", "x": "iq", "pos": "positions", "out": "iq", "heads": IH, "head_dim": ID, "theta": 1e7,
             "rotary_dim": ARD},
            {"op": "qsa_index", "q": "iq", "k": "ik", "pos": "positions", "slot": "slot_ids", "cache": "qsa", "sel": "sel",
             "k_norm": "idx_kn", "heads": IH, "head_dim": ID, "ratio": IR, "budget": IB, "theta": 1e7,
             "rotary_dim": ARD, "eps": 1e-6, "offset": 1.0},
            {"op": "rope", "x": "q", "pos": "positions", "out": "q", "heads": AH, "head_dim": AD, "theta": 1e7,
             "rotary_dim": ARD},
            {"op": "rope", "x": "k", "pos": "positions", "out": "k", "heads": AKV, "head_dim": AD, "theta": 1e7,
             "rotary_dim": ARD},
            {"op": "attention", "q": "q", "k": "k", "v": "v", "pos": "positions", "slot": "slot_ids", "cache_k": "ck",
             "cache_v": "cv", "out": "att", "heads": AH, "kv_heads": AKV, "head_dim": AD, "scale": 1 / np.sqrt(AD),
             "mode": mode, "select": "sel"},
            {"op": "rmsnorm_gated", "x": "att", "gate": "gate", "out": "att", "weight": "gn", "eps": 1e-6, "group": AD,
             "act": "sigmoid"},
            lin("att", "wo", "y"),
            {"op": "hc_inject", "x": "X", "y": "y", "w": "inj", "out": "X", "n": MN},
            *hyper("out", "X", inject=False),
            {"op": "logits", "x": "m", "weight": "head", "out": "logits", "vocab": VOCAB},
            {"op": "argmax", "x": "logits", "out": "next_token"}]

    plan = {"version": P.VERSION, "family": "test", "tp": 1, "rank": 0, "model": {"vocab_size": VOCAB, "context_length": 4096},
            "buffers": buffers, "programs": {"decode": {"rows": "slots", "ops": ops("decode")},
                                             "prefill": {"rows": "ubatch", "ops": ops("prefill")}}}
    P.validate(plan)
    return plan, w


QSA_MINI = {"ratio": IR, "budget": IB, "heads": IH, "head_dim": ID, "theta": 1e7, "rotary_dim": ARD, "eps": 1e-6,
            "offset": 1.0}


def test_executor_graphs_match_numpy(monkeypatch):
    """The mini plan on the CudaExecutor (decode and prefill each captured into one CUDA graph, replayed
    with new positions / slots each step) against the NumpyExecutor: prompts on two slots (one over two
    chunks, past the indexer's budget), decode steps with an idle slot, reset() of a slot mid-sequence."""
    monkeypatch.setenv("BLOOMERY_PREFILL_GEMM", "off")      # the GEMV kernels for the linears: float32 throughout
    plan, w = mini_plan()
    syms = {"slots": 3, "ubatch": 48, "ctx": 160}
    cu = CudaExecutor([plan], FakeArtifact(w), syms, graphs=True)
    assert set(cu.graph) == {"decode", "prefill"}, "both programs must be captured"
    assert "rope+rope+attention" in cu.tags["decode"], "attention with select must keep the fused rope path"
    cpu = NumpyExecutor([plan], [HostW(w)], syms)
    rng = np.random.default_rng(5)

    def step(prog, pos, slot, what):
        rows = syms["slots" if prog == "decode" else "ubatch"]
        pos, slot = np.asarray(pos, np.int32), np.asarray(slot, np.int32)
        assert pos.shape == (rows,)
        feed = {"tokens": rng.integers(0, VOCAB, rows).astype(np.int32), "positions": pos, "slot_ids": slot}
        got = {k: v.copy() for k, v in cu.run(prog, feed).items()}
        want = cpu.run(prog, feed)
        check_selection(f"sel ({what})", got["sel"], want["sel"], want["iq"], cpu.state[0]["qsa"], pos, slot,
                        QSA_MINI, w["idx_kn"])
        for n in ("X", "m", "inj", "iq", "att", "logits"):
            same(n, got[n], want[n], TOL_PLAN, f" ({what})")
        assert not got["att"][pos < 0].any(), f"att ({what}): idle rows must give zeros"
        assert np.array_equal(got["next_token"], want["next_token"]), f"next_token ({what})"
        for n in ("ple_conv", "qsa", "ck", "cv"):
            same(f"state {n}", cu.state[n], cpu.state[0][n], TOL_PLAN, f" ({what})")

    U = syms["ubatch"]
    pad = lambda p, s: (np.r_[p, [-1] * (U - len(p))], np.r_[s, [0] * (U - len(s))])   # noqa: E731
    step("prefill", *pad(np.arange(30), np.zeros(30)), "prompt slot 0")
    step("prefill", np.arange(U), np.ones(U), "prompt slot 1, chunk 1")
    step("prefill", *pad(np.arange(U, U + 9), np.ones(9)), "prompt slot 1, chunk 2")
    for t in range(5):
        step("decode", [30 + t, U + 9 + t, -1], [0, 1, 2], f"decode step {t}")
    cu.reset(1)
    cpu.reset(1)
    step("decode", [35, U + 14, -1], [0, 1, 2], "after reset(1): slot 1 from zero states and caches")
    step("decode", [36, U + 15, -1], [0, 1, 2], "one more step")


# -- the tiny qwen4_exp checkpoints (make models) on the CUDA engine -------------------------------------

def tiny_models() -> list[str]:
    """tools/models.py's tiny qwen4_exp exports (bf16 and the ModelOpt formats)."""
    from bloomery.tools import models
    return [n for n in models.SPECS if n.startswith("tiny-qwen4_exp/")]


@pytest.mark.models
@pytest.mark.parametrize("mode", ["bf16x2", "off"])
@pytest.mark.parametrize("name", tiny_models())
def test_tiny_qwen4_exp_cuda_matches_numpy(name, mode, monkeypatch):
    """The tiny qwen4_exp export (PLE on two linear layers, a QSA layer keeping 64 of the keys) prepared
    and run on the CUDA executor and on the NumPy executor: a prompt of 100 ids in chunks of 16 (the
    indexer sparse from position 68 on), then 64 greedy decode steps: logits within the CUDA
    executor's band (relative L2 1e-3) at every position and step, the same tokens."""
    from bloomery import runtime

    from runtime_artifacts import artifact

    monkeypatch.setenv("BLOOMERY_PREFILL_GEMM", mode)
    art = artifact(name)                                  # skips, visibly, when make models has not built it
    cu = runtime.Engine(art, device="cuda", ctx=256, ubatch=16)
    cpu = runtime.Engine(art, device="cpu", ctx=256, ubatch=16)
    assert cu.device == "cuda"
    engines_agree(cu, cpu, f"{name}, prefill GEMM {mode}", n_ids=100, steps=64)


def engines_agree(cand, ref, what, n_ids, steps, band=1e-3, seed=1):
    """runtime_artifacts.assert_engines_agree's checks (prefill logits within `band` at every position,
    greedy decode steps each fed its own token: logits within `band`, the device argmax the logits',
    the same tokens), each failure saying where; the op tests above say which op."""
    from runtime_artifacts import rel
    ids = [int(i) for i in np.random.default_rng(seed).integers(0, ref.vocab_size, n_ids)]
    xa, xb = cand.prefill(ids), ref.prefill(ids)
    worst = max(range(n_ids), key=lambda i: rel(xa[i], xb[i]))
    assert rel(xa[worst], xb[worst]) <= band, \
        f"{what}: prefill logits at position {worst}: relative L2 {rel(xa[worst], xb[worst]):.3e} > {band:.0e}"
    tok_a = tok_b = int(np.argmax(xb[-1]))
    for t in range(steps):
        la, na = cand.decode([tok_a])
        lb, nb = ref.decode([tok_b])
        r = rel(la[0], lb[0])
        assert r <= band, f"{what}: decode step {t} (position {n_ids + t}): logits relative L2 {r:.3e} > {band:.0e}"
        assert int(na[0]) == int(np.argmax(la[0])), f"{what}: decode step {t}: the device argmax is not the logits'"
        tok_a, tok_b = int(na[0]), int(nb[0])
        assert tok_a == tok_b, f"{what}: decode step {t}: token {tok_a} on CUDA, {tok_b} on NumPy"
