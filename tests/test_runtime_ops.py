"""Each NumPy op against a direct float64 reference written here (runtime/ops/)."""

import numpy as np
import pytest

from bloomery.runtime.ops import IMPL
from arrays import f32


@pytest.fixture
def rng():
    return np.random.default_rng(7)


class W:
    """A rank's weights as the ops read them (CpuWeights' interface)."""

    def __init__(self, values, pre_quant=None):
        self.values, self.pre_quant = values, pre_quant or {}

    def __getitem__(self, k):
        return self.values[k]


def close(got, want, tol=1e-5):
    err = np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30)
    assert err < tol, err


@pytest.mark.parametrize("group", [64, 16])
def test_rmsnorm(rng, group):
    x, w = f32(rng, 5, 64), f32(rng, group)
    buf = {"x": x, "out": np.zeros_like(x)}
    IMPL["rmsnorm"].run({"x": "x", "out": "out", "weight": "w", "eps": 1e-6, "group": group}, buf, W({"w": w}))
    xr = x.astype(np.float64).reshape(5, -1, group)
    want = xr / np.sqrt((xr ** 2).mean(-1, keepdims=True) + 1e-6) * w
    close(buf["out"], want.reshape(5, 64))


def rope_ref(x, pos, theta, d):
    """HF's apply_rotary_pos_emb with rotate_half, in float64."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    emb = np.concatenate([pos[:, None] * inv] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def test_rope(rng):
    heads, d = 3, 32
    x, pos = f32(rng, 6, heads * d), np.array([0, 1, 2, 17, 300, 1000], np.int32)
    buf = {"x": x.copy(), "pos": pos}
    IMPL["rope"].run({"x": "x", "pos": "pos", "out": "x", "heads": heads, "head_dim": d, "theta": 10000.0},
                     buf, W({}))
    want = rope_ref(x.astype(np.float64).reshape(6, heads, d), pos.astype(np.float64), 10000.0, d)
    close(buf["x"], want.reshape(6, -1), 1e-5)
    assert np.array_equal(buf["x"][0], x[0])            # position 0 is the identity


def attention_ref(q, k, v, heads, kv_heads, d):
    """Naive causal softmax attention over a whole sequence, K/V heads repeated as HF's repeat_kv."""
    n, g = q.shape[0], heads // kv_heads
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    Q, K, V = q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v.reshape(n, kv_heads, d)
    out = np.zeros((n, heads, d))
    for h in range(heads):
        s = Q[:, h] @ K[:, h // g].T / np.sqrt(d)
        s[np.triu(np.ones((n, n), bool), 1)] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ V[:, h // g]
    return out.reshape(n, heads * d)


def attn_op(heads, kv, d):
    return {"q": "q", "k": "k", "v": "v", "pos": "pos", "slot": "slot", "cache_k": "ck", "cache_v": "cv",
            "out": "out", "heads": heads, "kv_heads": kv, "head_dim": d, "scale": 1 / np.sqrt(d), "mode": "prefill"}


@pytest.mark.parametrize("chunk", [1, 7, 20])
def test_attention_chunks_vs_full_sequence(rng, chunk):
    """A sequence fed in chunks (padded rows inactive) through the cache equals full causal attention."""
    heads, kv, d, n, rows, slots, ctx = 6, 2, 16, 20, 8, 3, 32
    q, k, v = f32(rng, n, heads * d), f32(rng, n, kv * d), f32(rng, n, kv * d)
    want = attention_ref(q, k, v, heads, kv, d)
    ck, cv = np.zeros((slots, ctx, kv, d), np.float32), np.zeros((slots, ctx, kv, d), np.float32)
    got = []
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        size = max(rows, chunk)
        buf = {"q": np.zeros((size, heads * d), np.float32), "k": np.zeros((size, kv * d), np.float32),
               "v": np.zeros((size, kv * d), np.float32), "pos": np.full(size, -1, np.int32),
               "slot": np.full(size, 2, np.int32), "ck": ck, "cv": cv, "out": np.ones((size, heads * d), np.float32)}
        buf["q"][:m], buf["k"][:m], buf["v"][:m] = q[s:s + m], k[s:s + m], v[s:s + m]
        buf["pos"][:m] = np.arange(s, s + m)
        IMPL["attention"].run(attn_op(heads, kv, d), buf, W({}))
        assert not buf["out"][m:].any()                   # inactive rows give zeros
        got.append(buf["out"][:m].copy())
    close(np.concatenate(got), want, 1e-5)
    assert not ck[:2].any() and not cv[:2].any()          # other slots untouched
    assert np.array_equal(ck[2, :n].reshape(n, -1), k) and not ck[2, n:].any()


def test_attention_decode_slots(rng):
    """One row per slot, each at its own position over its own cache."""
    heads, kv, d, slots, ctx = 4, 1, 8, 3, 16
    lens = [5, 1, 9]
    seqs = [(f32(rng, n, heads * d), f32(rng, n, kv * d), f32(rng, n, kv * d)) for n in lens]
    ck, cv = np.zeros((slots, ctx, kv, d), np.float32), np.zeros((slots, ctx, kv, d), np.float32)
    for s, (q, k, v) in enumerate(seqs):              # fill each slot's first n-1 positions
        ck[s, :len(k) - 1] = k[:-1].reshape(-1, kv, d)
        cv[s, :len(v) - 1] = v[:-1].reshape(-1, kv, d)
    buf = {"q": np.stack([q[-1] for q, _, _ in seqs]), "k": np.stack([k[-1] for _, k, _ in seqs]),
           "v": np.stack([v[-1] for _, _, v in seqs]), "pos": np.array([n - 1 for n in lens], np.int32),
           "slot": np.arange(slots, dtype=np.int32), "ck": ck, "cv": cv, "out": np.zeros((slots, heads * d), np.float32)}
    IMPL["attention"].run({**attn_op(heads, kv, d), "mode": "decode"}, buf, W({}))
    for s, (q, k, v) in enumerate(seqs):
        close(buf["out"][s], attention_ref(q, k, v, heads, kv, d)[-1], 1e-5)


def test_moe_router_and_experts(rng):
    n, dim, inter, E, top = 9, 32, 24, 6, 2
    x, router = f32(rng, n, dim), f32(rng, E, dim)
    gate, up, down = f32(rng, E, inter, dim), f32(rng, E, inter, dim), f32(rng, E, dim, inter)
    pq = np.abs(f32(rng, E, dim)) + 0.5
    w = W({"r": router, "g": gate, "u": up, "d": down}, {"g": pq, "u": pq})
    for norm in (True, False):
        buf = {"x": x, "ids": np.zeros((n, top), np.int32), "wts": np.zeros((n, top), np.float32),
               "out": np.zeros((n, dim), np.float32)}
        IMPL["moe_router"].run({"x": "x", "weight": "r", "ids": "ids", "weights": "wts", "top_k": top, "norm": norm},
                               buf, w)
        IMPL["moe_experts"].run({"x": "x", "ids": "ids", "weights": "wts", "gate": "g", "up": "u", "down": "d",
                                 "out": "out", "experts": E, "top_k": top}, buf, w)
        want = np.zeros((n, dim))
        X = x.astype(np.float64)
        for r in range(n):                              # a loop over rows and their chosen experts
            logit = X[r] @ router.T.astype(np.float64)
            p = np.exp(logit - logit.max())
            p /= p.sum()
            chosen = np.argsort(-p)[:top]
            assert sorted(buf["ids"][r]) == sorted(chosen)
            pw = p[chosen] / (p[chosen].sum() if norm else 1.0)
            for e, pe in zip(chosen, pw):
                xe = X[r] * pq[e]
                a, b = gate[e] @ xe, up[e] @ xe
                want[r] += pe * (down[e] @ (a / (1 + np.exp(-a)) * b))
        close(buf["out"], want, 1e-5)


def test_swiglu_add_argmax_logits(rng):
    g, u = f32(rng, 3, 10), f32(rng, 3, 10)
    buf = {"g": g.copy(), "u": u, "o": np.zeros_like(g)}
    IMPL["swiglu"].run({"gate": "g", "up": "u", "out": "g"}, buf, W({}))
    close(buf["g"], g / (1 + np.exp(-g.astype(np.float64))) * u)
    IMPL["add"].run({"a": "g", "b": "u", "out": "o"}, buf, W({}))
    close(buf["o"], buf["g"].astype(np.float64) + u)
    table, x = f32(rng, 12, 10), f32(rng, 3, 10)
    b2 = {"x": x, "out": np.zeros((3, 5), np.float32), "t": np.zeros(3, np.int32)}
    IMPL["logits"].run({"x": "x", "weight": "E", "out": "out", "vocab": 5, "rows": [4, 9]}, b2, W({"E": table}))
    close(b2["out"], x.astype(np.float64) @ table[4:9].T.astype(np.float64))
    IMPL["argmax"].run({"x": "out", "out": "t"}, b2, W({}))
    assert list(b2["t"]) == list(np.argmax(b2["out"], -1))


def test_collectives(rng):
    xs = [f32(rng, 2, 3), f32(rng, 2, 3)]
    bufs = [{"x": x.copy(), "y": np.zeros((2, 6), np.float32)} for x in xs]
    IMPL["all_gather"].run_ranks([{"x": "x", "out": "y", "sizes": [3, 3]}] * 2, bufs)
    assert all(np.array_equal(b["y"], np.concatenate(xs, -1)) for b in bufs)
    IMPL["all_reduce"].run_ranks([{"x": "x", "out": "x"}] * 2, bufs)
    assert all(np.array_equal(b["x"], xs[0] + xs[1]) for b in bufs)
