"""The gated delta net's NumPy ops (runtime/ops/causal_conv1d.py, gated_delta.py, rmsnorm_gated.py)
against their contract, transformers 5.24's modeling_qwen3_next.py: its own torch functions
(causal_conv1d_update, causal_conv1d_fn, torch_recurrent_gated_delta_rule,
torch_chunk_gated_delta_rule, Qwen3NextRMSNormGated) and a whole Qwen3NextGatedDeltaNet layer,
on random float32 inputs, torch on the CPU."""

import numpy as np
import pytest

from bloomery.runtime.ops import IMPL
from arrays import W, f32, rel

torch = pytest.importorskip("torch")
M = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
F = torch.nn.functional


@pytest.fixture
def rng():
    return np.random.default_rng(11)


TOL = 1e-5          # float32 rounding: measured 4e-8 .. 4e-7 here, at most 2.4e-6 (1024 tokens, strong decay)


# -- references ------------------------------------------------------------------------------------


def conv_ref(x, wt):
    """HF's causal_conv1d_fn over one whole sequence: x [T, C], wt [C, K] -> out [T, C], window."""
    K = wt.shape[1]
    out = M.causal_conv1d_fn(torch.from_numpy(x).T[None], torch.from_numpy(wt), None, activation="silu")
    u = np.concatenate([np.zeros((K - 1, x.shape[1]), np.float32), x])
    return out[0].T.numpy(), u[u.shape[0] - (K - 1):]


def split_qkv(qkv, Hk, Hv, dk, dv):
    t = torch.from_numpy(qkv)[None]
    return (t[..., :Hk * dk].unflatten(-1, (Hk, dk)), t[..., Hk * dk:2 * Hk * dk].unflatten(-1, (Hk, dk)),
            t[..., 2 * Hk * dk:].unflatten(-1, (Hv, dv)))


def delta_ref(p, qkv, a, b, fn=None, S0=None):
    """HF's gated delta rule over one whole sequence, g and beta as Qwen3NextGatedDeltaNet.forward
    computes them: out [T, Hv*dv], final state [Hv, dk, dv]."""
    fn = fn or M.torch_recurrent_gated_delta_rule
    q, k, v = split_qkv(qkv, p["Hk"], p["Hv"], p["dk"], p["dv"])
    beta = torch.from_numpy(b)[None].sigmoid()
    g = -torch.from_numpy(p["A_log"]).float().exp() * F.softplus(torch.from_numpy(a)[None] + torch.from_numpy(p["dt"]))
    S0 = None if S0 is None else torch.from_numpy(S0)[None]
    o, S = fn(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].reshape(qkv.shape[0], -1).numpy(), S[0].numpy()


# -- the ops as a plan calls them --------------------------------------------------------------------


def conv_op(K):
    return {"x": "x", "pos": "pos", "slot": "slot", "state": "st", "out": "out", "weight": "cw", "kernel": K}


def delta_op(p, mode, **kw):
    return {"qkv": "x", "a": "a", "b": "b", "pos": "pos", "slot": "slot", "state": "st", "out": "out",
            "A_log": "A_log", "dt_bias": "dt", "k_heads": p["Hk"], "v_heads": p["Hv"], "k_dim": p["dk"],
            "v_dim": p["dv"], "mode": mode, **kw}


def delta_params(rng, Hk=2, Hv=4, dk=32, dv=32):
    """Decays mild enough that the state carries over a few chunks (g about -0.01 .. -0.3)."""
    return {"Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv, "C": 2 * Hk * dk + Hv * dv,
            "A_log": np.log(rng.uniform(0.5, 8, Hv)).astype(np.float32),
            "dt": (-4 + 0.5 * rng.standard_normal(Hv)).astype(np.float32)}


def call(op, buf, w, x, pos, slot, a=None, b=None):
    """Runs one op on rows x (out prefilled with garbage: the op must write every row)."""
    delta = "qkv" in op
    width = op["v_heads"] * op["v_dim"] if delta else x.shape[1]
    buf.update(x=x, pos=np.asarray(pos, np.int32), slot=np.asarray(slot, np.int32), a=a, b=b,
               out=np.full((len(pos), width), 7.0, np.float32))
    IMPL["gated_delta" if delta else "causal_conv1d"].run(op, buf, w)
    return buf["out"]


# -- causal_conv1d ---------------------------------------------------------------------------------


def test_conv_decode_steps_vs_hf_update(rng):
    """One row per step, as a decode program: against HF's causal_conv1d_update on its [C, K] state.
    Row 1 is an idle slot (negative position): zeros out, its window untouched."""
    C, K, T = 24, 4, 9
    wt, xs = f32(rng, C, 1, K), f32(rng, T, C)
    st = f32(rng, 2, K - 1, C)
    idle = st[1].copy()
    buf, w = {"st": st}, W(cw=wt)
    hf_state = torch.zeros(1, C, K)
    for t in range(T):
        want = M.causal_conv1d_update(torch.from_numpy(xs[t])[None, :, None], hf_state,
                                      torch.from_numpy(wt[:, 0]), None, "silu")[0, :, 0].numpy()
        x = np.stack([xs[t], f32(rng, C)])
        got = call(conv_op(K), buf, w, x, [t, -1], [0, 1])
        assert rel(got[0], want) < TOL, t
        assert np.array_equal(got[1], np.zeros(C, np.float32))
        assert np.array_equal(st[0], hf_state[0, :, 1:].T.numpy())       # the last K-1 inputs
    assert np.array_equal(st[1], idle)


@pytest.mark.parametrize("T", [1, 2, 17])
def test_conv_chunks_vs_full_sequence(rng, T):
    """One prompt chunk, or a chunk of 1..T-1 rows, a second chunk and decode steps, against one
    causal conv over the whole sequence; the state before a position-0 row is ignored."""
    C, K = 40, 4
    wt, xs = f32(rng, C, 1, K), f32(rng, T + 3, C)
    want, win = conv_ref(xs, wt[:, 0])
    for cut in sorted({T, max(T // 2, 1)}):
        buf, w = {"st": f32(rng, 1, K - 1, C)}, W(cw=wt)
        got = [call(conv_op(K), buf, w, xs[:cut], range(cut), [0] * cut)]
        if cut < T:
            got.append(call(conv_op(K), buf, w, xs[cut:T], range(cut, T), [0] * (T - cut)))
        for t in range(T, T + 3):
            got.append(call(conv_op(K), buf, w, xs[t:t + 1], [t], [0]))
        assert rel(np.concatenate(got), want) < TOL
        assert np.array_equal(buf["st"][0], win)


# -- slots interleaved, resets and idle rows: one scenario for both stateful ops ------------------------


SEQS = {"A": (0, 74), "B": (1, 5), "C": (1, 70), "D": (2, 4)}   # name: (slot, tokens); C follows B on slot 1
CALLS = [("prefill", {"A": (0, 40), "B": (0, 5), "C": (0, 20), "D": (0, 1)}),
         ("prefill", {"A": (40, 70), "C": (20, 66)})] + \
        [("decode", {"A": (70 + i, 71 + i), "C": (66 + i, 67 + i), **({"D": (1 + i, 2 + i)} if i < 3 else {})})
         for i in range(4)]
SLOTS = 4           # slot 3 only ever sees idle rows


def scenario(rng, inputs, step):
    """Runs CALLS: each call's rows are its sequences' tokens merged in a random order that keeps
    every slot's order, with idle rows (position -1, random slot and values) between them.
    step(mode, rows, pos, slot) -> out; returns {name: out [T, ...]} per sequence."""
    got = {n: [None] * t for n, (_, t) in SEQS.items()}
    for mode, spans in CALLS:
        queues = {}
        for n, (t0, t1) in spans.items():
            queues.setdefault(SEQS[n][0], []).extend((n, t) for t in range(t0, t1))
        order = []
        while queues:
            if rng.random() < 0.15:
                order.append(None)
            s = rng.choice(sorted(queues))
            order.append(queues[s].pop(0))
            if not queues[s]:
                del queues[s]
        if mode == "decode":                                # one row per slot, idle slots idle
            by_slot = {SEQS[o[0]][0]: o for o in order if o}
            order = [by_slot.get(s) for s in range(SLOTS)]
        pos = [-1 if o is None else o[1] for o in order]
        slot = [int(rng.integers(SLOTS)) if o is None else SEQS[o[0]][0] for o in order]
        if mode == "decode":
            slot = list(range(SLOTS))
        rows = [None if o is None else {k: v[o[1]] for k, v in inputs[o[0]].items()} for o in order]
        out = step(mode, rows, pos, slot)
        for o, r in zip(order, out):
            if o is None:
                assert not r.any()                           # idle rows give zeros
            else:
                got[o[0]][o[1]] = r
    return {n: np.stack(v) for n, v in got.items()}


def rows_of(rows, key, width, rng):
    return np.stack([rng.standard_normal(width).astype(np.float32) if r is None else r[key] for r in rows])


def test_conv_slots_resets_idle(rng):
    C, K = 16, 4
    wt = f32(rng, C, 1, K)
    inputs = {n: {"x": f32(rng, t, C)} for n, (_, t) in SEQS.items()}
    buf, w = {"st": f32(rng, SLOTS, K - 1, C)}, W(cw=wt)
    idle = buf["st"][3].copy()
    got = scenario(rng, inputs, lambda mode, rows, pos, slot:
                   call(conv_op(K), buf, w, rows_of(rows, "x", C, rng), pos, slot).copy())
    for n in SEQS:
        want, win = conv_ref(inputs[n]["x"], wt[:, 0])
        assert rel(got[n], want) < TOL, n
    for n in "ACD":
        assert np.array_equal(buf["st"][SEQS[n][0]], conv_ref(inputs[n]["x"], wt[:, 0])[1]), n
    assert np.array_equal(buf["st"][3], idle)


@pytest.mark.parametrize("prefill_mode", ["prefill", "decode"])
def test_delta_slots_resets_idle(rng, prefill_mode):
    """The prompt calls through the chunked form (and once through the recurrent form): runs of
    four slots interleaved, slot 1 restarting at position 0 in the middle of a chunk, a prompt
    continued over two chunks then decoded, all from garbage states, against HF per sequence."""
    p = delta_params(rng)
    inputs = {n: {"x": f32(rng, t, p["C"]), "a": f32(rng, t, p["Hv"]), "b": f32(rng, t, p["Hv"])}
              for n, (_, t) in SEQS.items()}
    buf, w = {"st": f32(rng, SLOTS, p["Hv"], p["dk"], p["dv"])}, W(A_log=p["A_log"], dt=p["dt"])
    idle = buf["st"][3].copy()

    def step(mode, rows, pos, slot):
        mode = prefill_mode if mode == "prefill" else mode
        return call(delta_op(p, mode), buf, w, rows_of(rows, "x", p["C"], rng), pos, slot,
                    rows_of(rows, "a", p["Hv"], rng), rows_of(rows, "b", p["Hv"], rng)).copy()

    got = scenario(rng, inputs, step)
    for n, s in SEQS.items():
        want, S = delta_ref(p, inputs[n]["x"], inputs[n]["a"], inputs[n]["b"])
        assert rel(got[n], want) < TOL, n
        if n != "B":
            assert rel(buf["st"][s[0]], S) < TOL, n
    assert np.array_equal(buf["st"][3], idle)


# -- gated_delta -----------------------------------------------------------------------------------


DIMS = [(2, 4, 32, 32), (2, 4, 16, 32)]          # k heads, v heads, k dim, v dim


@pytest.mark.parametrize("dims", DIMS, ids=["dk=dv", "dk!=dv"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_delta_vs_hf(rng, T, dims):
    """One run of T rows from position 0, both forms, against HF's recurrent and chunked functions;
    the chunked form also with blocks of 16 (several blocks and a ragged last one)."""
    p = delta_params(rng, *dims)
    x, a, b = f32(rng, T, p["C"]), f32(rng, T, p["Hv"]), f32(rng, T, p["Hv"])
    want = [delta_ref(p, x, a, b, fn) for fn in (M.torch_recurrent_gated_delta_rule, M.torch_chunk_gated_delta_rule)]
    for op in (delta_op(p, "decode"), delta_op(p, "prefill"), delta_op(p, "prefill", chunk=16)):
        buf = {"st": f32(rng, 2, p["Hv"], p["dk"], p["dv"])}
        got = call(op, buf, W(A_log=p["A_log"], dt=p["dt"]), x, range(T), [1] * T, a, b)
        for o, S in want:
            assert rel(got, o) < TOL, op
            assert rel(buf["st"][1], S) < TOL, op


@pytest.mark.parametrize("n", [1, 63, 64, 65])
def test_delta_prefill_then_decode(rng, n):
    """A prompt chunk of n rows (chunked form), then 5 decode steps (recurrent form) carrying the
    state, against HF over the whole sequence; and HF's chunked form from our state after the chunk."""
    p = delta_params(rng)
    T = n + 5
    x, a, b = f32(rng, T, p["C"]), f32(rng, T, p["Hv"]), f32(rng, T, p["Hv"])
    buf, w = {"st": np.zeros((1, p["Hv"], p["dk"], p["dv"]), np.float32)}, W(A_log=p["A_log"], dt=p["dt"])
    got = [call(delta_op(p, "prefill"), buf, w, x[:n], range(n), [0] * n, a[:n], b[:n]).copy()]
    S_n = buf["st"][0].copy()
    for t in range(n, T):
        got.append(call(delta_op(p, "decode"), buf, w, x[t:t + 1], [t], [0], a[t:t + 1], b[t:t + 1]).copy())
    want, S = delta_ref(p, x, a, b)
    assert rel(np.concatenate(got), want) < TOL
    assert rel(buf["st"][0], S) < TOL
    tail, S2 = delta_ref(p, x[n:], a[n:], b[n:], M.torch_chunk_gated_delta_rule, S0=S_n)
    assert rel(np.concatenate(got[1:]), tail) < TOL and rel(S2, S) < TOL


# -- rmsnorm_gated ---------------------------------------------------------------------------------


def test_rmsnorm_gated_vs_hf(rng):
    heads, dv = 4, 32
    x, z, wt = f32(rng, 7, heads * dv), f32(rng, 7, heads * dv), (1 + 0.5 * f32(rng, dv))
    norm = M.Qwen3NextRMSNormGated(dv, eps=1e-6)
    norm.weight.data = torch.from_numpy(wt)
    want = norm(torch.from_numpy(x).reshape(-1, dv), torch.from_numpy(z).reshape(-1, dv)).detach().numpy()
    buf = {"x": x.copy(), "z": z}
    IMPL["rmsnorm_gated"].run({"x": "x", "gate": "z", "out": "x", "weight": "w", "eps": 1e-6, "group": dv},
                              buf, W(w=wt))
    assert rel(buf["x"], want.reshape(7, -1)) < TOL


# -- a whole Qwen3NextGatedDeltaNet layer -----------------------------------------------------------


def qkvz_rows(Hk, Hv, dk, dv):
    """Rows of in_proj_qkvz that give HF's mixed_qkv (the conv's channels) and z, in that order."""
    r = Hv // Hk
    g = np.arange(Hk)[:, None] * (2 * dk + 2 * r * dv)
    q, k = (g + np.arange(dk)).ravel(), (g + dk + np.arange(dk)).ravel()
    v, z = (g + 2 * dk + np.arange(r * dv)).ravel(), (g + 2 * dk + r * dv + np.arange(r * dv)).ravel()
    return np.concatenate([q, k, v]), z


def ba_rows(Hk, Hv):
    """Rows of in_proj_ba that give b and a, each [Hv] in v-head order."""
    r = Hv // Hk
    g = np.arange(Hk)[:, None] * 2 * r
    return (g + np.arange(r)).ravel(), (g + r + np.arange(r)).ravel()


def test_layer_vs_hf(rng):
    """Qwen3NextGatedDeltaNet's forward, reproduced with the three ops and NumPy matmuls.

    The split the compiler needs (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering):
    in_proj_qkvz's output rows come in Hk groups, one per k head g, each
    [q_g (dk) | k_g (dk) | v of v heads g*r .. g*r+r-1 (r*dv) | z of the same heads (r*dv)], r = Hv/Hk;
    in_proj_ba's in Hk groups of [b of the group's r v heads | a of them] (b first).
    The conv runs over HF's mixed_qkv = [q of every k head | k of every k head | v of every v head]
    (conv1d.weight [C, 1, K] is in that channel order), so its input is in_proj_qkvz's rows
    gathered by qkvz_rows (a row permutation, values kept); z is the rest; b and a are in_proj_ba's
    rows gathered by ba_rows. v head h reads k head h // r (repeat_interleave). The gated norm's
    weight is used as stored (not 1 + weight), per v head; out_proj reads the heads in order.

    Without a cache (one prompt, HF's chunked path), then with a DynamicCache: a prompt of 67
    tokens and three decode steps (HF's conv update and recurrent paths), the states carried."""
    from transformers import DynamicCache, Qwen3NextConfig

    Hk, Hv, dk, dv, K, hidden = 2, 4, 32, 32, 4, 128
    cfg = Qwen3NextConfig(hidden_size=hidden, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                          linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=K,
                          num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = M.Qwen3NextGatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        layer.A_log.copy_(torch.log(torch.empty(Hv).uniform_(0.5, 8)))
        layer.dt_bias.copy_(-4 + 0.5 * torch.randn(Hv))
        layer.norm.weight.copy_(1 + 0.5 * torch.randn(dv))
    P = {n: t.detach().numpy().copy() for n, t in layer.named_parameters()}
    qkv_r, z_r = qkvz_rows(Hk, Hv, dk, dv)
    b_r, a_r = ba_rows(Hk, Hv)
    w = W(cw=P["conv1d.weight"], A_log=P["A_log"], dt=P["dt_bias"], nw=P["norm.weight"])
    p = {"Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv}
    state = {"conv": np.zeros((1, K - 1, 2 * Hk * dk + Hv * dv), np.float32),
             "ssm": np.zeros((1, Hv, dk, dv), np.float32)}

    def ours(x, t0, mode):
        n = x.shape[0]
        pos, slot = np.arange(t0, t0 + n, dtype=np.int32), np.zeros(n, np.int32)
        buf = {"qkv": x @ P["in_proj_qkvz.weight"][qkv_r].T, "z": x @ P["in_proj_qkvz.weight"][z_r].T,
               "a": x @ P["in_proj_ba.weight"][a_r].T, "b": x @ P["in_proj_ba.weight"][b_r].T,
               "pos": pos, "slot": slot, "conv": state["conv"], "ssm": state["ssm"],
               "o": np.zeros((n, Hv * dv), np.float32)}
        IMPL["causal_conv1d"].run({**conv_op(K), "x": "qkv", "out": "qkv", "state": "conv"}, buf, w)
        IMPL["gated_delta"].run({**delta_op(p, mode), "qkv": "qkv", "state": "ssm", "out": "o"}, buf, w)
        IMPL["rmsnorm_gated"].run({"x": "o", "gate": "z", "out": "o", "weight": "nw", "eps": cfg.rms_norm_eps,
                                   "group": dv}, buf, w)
        return buf["o"] @ P["out_proj.weight"].T

    h = f32(rng, 70, hidden)
    with torch.no_grad():
        want = layer(torch.from_numpy(h)[None])[0].numpy()
    assert rel(ours(h, 0, "prefill"), want) < TOL

    state["conv"][...], state["ssm"][...] = 1.0, 1.0         # garbage: position 0 resets them
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        want = layer(torch.from_numpy(h[:67])[None], cache=cache)[0].numpy()
        assert rel(ours(h[:67], 0, "prefill"), want) < TOL
        for t in range(67, 70):
            want = layer(torch.from_numpy(h[t:t + 1])[None], cache=cache)[0].numpy()
            assert rel(ours(h[t:t + 1], t, "decode"), want) < TOL, t
    assert rel(state["ssm"][0], cache.layers[0].recurrent_states[0][0].numpy()) < TOL
    assert rel(state["conv"][0], cache.layers[0].conv_states[0][0, :, 1:].T.numpy()) < TOL   # matmul rounding
