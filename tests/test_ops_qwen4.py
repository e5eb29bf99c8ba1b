"""qwen4_exp's NumPy ops (runtime/ops/{hc_expand,hc_gate_mix,act_scale,hc_inject,ngram_hash,
host_embed,ple_gate,qsa_index}.py, rmsnorm_gated's act, causal_conv1d's dilation, attention's
select) against their contract, transformers 5.24's modeling_qwen4_exp.py: its modules built in
float32 from a tiny Qwen4ExpTextConfig with random weights (the norm and PLE conv weights HF
initialises to 0 included), composed from the ops as the lowering composes them, torch on the CPU:
a whole gated residual, a whole PLE layer, a whole QSA attention layer, prompts fed whole, in
chunks and one token at a time through the ops' states."""

import numpy as np
import pytest

from bloomery.core import ngram
from bloomery.runtime.ops import IMPL
from bloomery.runtime.ops import qsa_index as QI
from arrays import W, f32, rel

torch = pytest.importorskip("torch")
M = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
Qwen4ExpTextConfig = M.Qwen4ExpTextConfig

TOL = 1e-5
EOS = 2


@pytest.fixture
def rng():
    return np.random.default_rng(5)


def config(**kw):
    """Tiny, with every indexer_* key set (a qwen4_exp attention cannot be built without them) and
    8 indexer heads (no score ties at the top-k cut)."""
    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, layer_types=["linear_attention"] * 3 + ["indexed_attention"],
                hc_count=4, hc_lowrank=16, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3,
                heads_per_ngram=4, ngram_vocab_size_base=4096, indexer_n_heads=8, indexer_kv_heads=1,
                indexer_head_dim=32, indexer_compress_ratio=4, indexer_budget=16, eos_token_id=EOS,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    cfg = Qwen4ExpTextConfig(**{**base, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def randomize(module, seed):
    """Every parameter random (HF initialises the Qwen4 RMSNorm weights and the PLE conv to 0):
    norm weights (stored as weight - 1) 0.3 * N(0, 1), matrices N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(0.3 * r if p.ndim == 1 else r / p.shape[-1] ** 0.5)
    return module


def weights(module):
    return W({n: p.detach().numpy().copy() for n, p in module.named_parameters()})


def op(name_, buf_, w_=None, **keys):
    """Runs op `name_` with its plan keys on buffers buf_ and weights w_."""
    IMPL[name_].run(keys, buf_, W() if w_ is None else w_)


def norm(buf, w, x, out, weight, group, eps=1e-6):
    """The Qwen4 RMSNorm: rmsnorm with offset 1 (its weight [group], or [n*group] for hc_norm and the
    PLE norms: one D-slice per stream)."""
    op("rmsnorm", buf, w, x=x, out=out, weight=weight, eps=eps, group=group, offset=1.0)


def schedule(rng, calls, slot_of, slots):
    """Each call's rows: its sequences' spans {name: (t0, t1)} merged in a random order that keeps
    every slot's order, with idle rows (position -1, random slot) between them. Yields
    (order, pos, slot); order[i] is (name, t) or None."""
    for spans in calls:
        queues = {}
        for name, (t0, t1) in spans.items():
            queues.setdefault(slot_of[name], []).extend((name, t) for t in range(t0, t1))
        order = []
        while queues:
            if rng.random() < 0.2:
                order.append(None)
            s = int(rng.choice(sorted(queues)))
            order.append(queues[s].pop(0))
            if not queues[s]:
                del queues[s]
        pos = np.array([-1 if o is None else o[1] for o in order], np.int32)
        slot = np.array([int(rng.integers(slots)) if o is None else slot_of[o[0]] for o in order], np.int32)
        yield order, pos, slot


def collect(rng, calls, slot_of, slots, step, idle):
    """Runs `step(order, pos, slot) -> out [rows, ...]` over the schedule; returns {name: out [T, ...]}
    and checks every idle row's output with `idle`."""
    got = {}
    for order, pos, slot in schedule(rng, calls, slot_of, slots):
        out = step(order, pos, slot)
        for o, r in zip(order, out):
            if o is None:
                assert idle(r)
            else:
                got.setdefault(o[0], {})[o[1]] = r.copy()
    return {n: np.stack([d[t] for t in sorted(d)]) for n, d in got.items()}


def spans(name, cuts):
    """[(t0, t1), ...] calls of one sequence cut at `cuts`."""
    return [{name: (a, b)} for a, b in zip(cuts[:-1], cuts[1:])]


def whole_and_chunks(T):
    """The calls that feed one sequence whole, in chunks (then a token at a time), a token at a time."""
    return {"whole": [0, T], "chunks": [0, 5, 6, 13, 14, *range(15, T + 1)], "tokens": list(range(T + 1))}


# -- rmsnorm_gated's act, act_scale --------------------------------------------------------------------


@pytest.mark.parametrize("act", ["silu", "sigmoid", None])
def test_rmsnorm_gated_act(rng, act):
    dv, heads = 32, 3
    x, z = f32(rng, 6, heads * dv), 3 * f32(rng, 6, heads * dv)
    m = M.Qwen4ExpTextRMSNormGated(dv, eps=1e-6, activation=act or "silu")
    randomize(m, 1)
    with torch.no_grad():
        want = m(torch.from_numpy(x).view(6, heads, dv), torch.from_numpy(z).view(6, heads, dv)).reshape(6, -1)
    buf = {"x": x, "z": z, "out": np.full_like(x, 7.0)}
    keys = dict(x="x", gate="z", out="out", weight="weight", eps=1e-6, group=dv, **({"act": act} if act else {}))
    op("rmsnorm_gated", buf, weights(m), **keys)
    assert rel(buf["out"], want.numpy()) < TOL


@pytest.mark.parametrize("act,scale,mul", [("silu", 0.25, None), ("sigmoid", 0.25, 2.0), ("sigmoid", 1.0, None)])
def test_act_scale(rng, act, scale, mul):
    x = 4 * f32(rng, 5, 24)
    x[0, :2] = -300, 300                                    # saturated, finite
    want = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}[act](torch.from_numpy(x) * scale)
    want = (mul or 1) * want.numpy()
    buf = {"x": x.copy()}
    op("act_scale", buf, x="x", out="x", act=act, scale=scale, **({"mul": mul} if mul else {}))   # in place
    assert rel(buf["x"], want) < 1e-6 and np.isfinite(buf["x"]).all()


# -- hyper-connections: hc_expand, rmsnorm, act_scale, hc_gate_mix, hc_inject -----------------------------


def gated_residual(buf, w, n, D, X, pre=""):
    """Qwen4ExpTextGatedResidual from the ops: X [rows, n*D] -> (m [rows, D], inj [rows, n] or None)."""
    rows = X.shape[0]
    buf.update(X=X, xn=np.zeros_like(X), m=np.full((rows, D), 7.0, np.float32))
    norm(buf, w, "X", "xn", pre + "hc_norm.weight", D)
    buf["lo"] = buf["xn"] @ w[pre + "input_mix_weight_down.weight"].T
    op("act_scale", buf, x="lo", out="lo", act="silu", scale=1 / n)
    buf["g"] = buf["lo"] @ w[pre + "input_mix_weight_up.weight"].T
    op("hc_gate_mix", buf, xn="xn", w="g", out="m", n=n)
    if pre + "block_inject_weight.weight" not in w:
        return buf["m"], None
    buf["inj"] = buf["xn"] @ w[pre + "block_inject_weight.weight"].T
    op("act_scale", buf, x="inj", out="inj", act="sigmoid", scale=1 / n, mul=2.0)
    return buf["m"], buf["inj"]


def test_gated_residual_and_inject(rng):
    """A whole Qwen4ExpTextGatedResidual and the decoder layer's injection of a block output y,
    and the final mixer (no inject); the streams start as hc_expand of an embedding."""
    cfg = config()
    n, D, rows = cfg.hc_count, cfg.hidden_size, 9
    emb = f32(rng, rows, D)
    buf = {"e": emb, "X0": np.full((rows, n * D), 7.0, np.float32)}
    op("hc_expand", buf, x="e", out="X0", n=n)
    assert np.array_equal(buf["X0"], torch.from_numpy(emb)[None].repeat(1, 1, n)[0].numpy())
    X = buf["X0"] + 0.5 * f32(rng, rows, n * D)                # streams that differ, as after a layer
    y = f32(rng, rows, D)
    hc = randomize(M.Qwen4ExpTextGatedResidual(cfg), 2)
    with torch.no_grad():
        mixed, hyper, inj = hc(torch.from_numpy(X)[None])
        want = hyper + (torch.from_numpy(y)[None].unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)
    m, g = gated_residual(buf, weights(hc), n, D, X)
    assert rel(m, mixed[0].numpy()) < TOL
    assert rel(g, inj[0].numpy()) < TOL
    buf.update(y=y, X1=np.full_like(X, 7.0))
    op("hc_inject", buf, x="X", y="y", w="inj", out="X1", n=n)
    assert rel(buf["X1"], want[0].numpy()) < TOL
    op("hc_inject", buf, x="X", y="y", w="inj", out="X", n=n)      # in place
    assert np.array_equal(buf["X"], buf["X1"])
    final = randomize(M.Qwen4ExpTextGatedResidual(cfg, use_combine=False), 3)
    with torch.no_grad():
        want = final(torch.from_numpy(X)[None])[0].numpy()
    m, g = gated_residual({}, weights(final), n, D, X)
    assert g is None and rel(m, want) < TOL


# -- ngram_hash, host_embed ---------------------------------------------------------------------------


def ngram_module(cfg, k, table=None):
    """Qwen4ExpTextNGramEmbedding of PLE layer index k; table None: row r of the table holds r, so
    the embedding of a head is its id."""
    m = M.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, cfg.ple_layer_ids[0] - 1, k)
    with torch.no_grad():
        wt = m.ngram_embedding.weight
        wt.copy_(torch.arange(wt.shape[0], dtype=torch.float32)[:, None].expand_as(wt) if table is None
                 else torch.from_numpy(table))
    return m


def tables(cfg, k):
    return ngram.tables(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ngram_vocab_size_base, cfg.seed, k,
                        cfg.make_ngram_vocab_size_divisible_by)


def ngram_op(cfg, k):
    t = tables(cfg, k)
    return dict(tokens="tok", pos="pos", slot="slot", ids="ids", ctx="ctx", ngram_size=cfg.ngram_size,
                heads_per_ngram=cfg.heads_per_ngram, eos=EOS, multipliers=list(t.multipliers), sizes=list(t.sizes),
                offsets=list(t.offsets))


def stream(rng, T, vocab=512):
    """Tokens with EOS inside: at 0, 1 and 3 (a one-token segment), two in a row, scattered."""
    t = rng.integers(3, vocab, T).astype(np.int32)
    for i in (0, 1, 3, 9, 10, T // 2, T - 4):
        t[i] = EOS
    return t


def module_ids(m, tokens):
    with torch.no_grad():
        e = m(torch.from_numpy(tokens.astype(np.int64))[None], None)[0]
    ids = e.reshape(len(tokens), -1, m.ngram_embedding.weight.shape[1])[..., 0].numpy()
    assert np.array_equal(ids, np.round(ids)) and ids.max() < 2 ** 24       # exact in float32
    return ids.astype(np.int32)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_ngram_tables_are_the_modules_buffers(k):
    cfg = config(ple_layer_ids=[1, 2, 3, 4], layer_types=["linear_attention"] * 4)
    m = M.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, k, k)
    t = tables(cfg, k)
    assert list(t.multipliers) == m.layer_multipliers.tolist()
    assert list(t.sizes) == m.ngram_heads_vocab_sizes.tolist()
    assert list(t.offsets) == m.ngram_heads_offsets.tolist()
    assert t.rows == m.ngram_embedding.weight.shape[0]


@pytest.mark.parametrize("k", [0, 1])
def test_ngram_tables_at_the_default_shapes(k):
    """The shipped defaults (vocab 248320, base 20,000,000, 16 heads), against HF's own functions
    (the module itself would allocate an 80 GB table)."""
    cfg = Qwen4ExpTextConfig.__dataclass_fields__
    V, N, hpn, base, seed = (cfg[f].default for f in ("vocab_size", "ngram_size", "heads_per_ngram",
                                                      "ngram_vocab_size_base", "seed"))
    t = ngram.tables(V, N, hpn, base, seed, k)
    mult, sizes, offsets, rows = list(t.multipliers), list(t.sizes), list(t.offsets), t.rows
    G = (N - 1) * hpn
    assert mult == M._build_layer_multipliers(V, N, k, seed).tolist()
    assert sizes == [M._find_nth_prime_after(base - 1, k * G + h + 1) for h in range(G)]
    assert offsets == [sum(sizes[:h]) for h in range(G)] and rows == -(-sum(sizes) // 128) * 128
    if k == 0:                                  # the values docs/flagships.md quotes
        assert mult == [23703573157769, 20109073645365, 8052911324071]
        assert (sizes[0], sizes[-1], sum(sizes), rows) == (20000003, 20000171, 320001446, 320001536)


def test_ngram_hash_ids_whole_chunks_tokens(rng):
    """The module's ids (its table holds the row index) of a stream with EOS inside: fed whole, in
    chunks and a token at a time through the context state; idle rows give -1 and change nothing."""
    cfg = config()
    T = 40
    tokens = stream(rng, T)
    m = ngram_module(cfg, 1)
    want = module_ids(m, tokens)
    G = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    assert want.shape == (T, G) and len(np.unique(want)) > T              # the hash spreads
    for name, cuts in whole_and_chunks(T).items():
        buf = {"ctx": rng.integers(0, 512, (3, cfg.ngram_size - 1)).astype(np.int32)}
        idle = buf["ctx"][[0, 2]].copy()

        def step(order, pos, slot):
            buf.update(tok=np.array([tokens[o[1]] if o else int(rng.integers(512)) for o in order], np.int32),
                       pos=pos, slot=slot, ids=np.full((len(order), G), 7, np.int32))
            op("ngram_hash", buf, **ngram_op(cfg, 1))
            return buf["ids"]

        got = collect(rng, spans("A", cuts), {"A": 1}, 3, step, lambda r: (r == -1).all())["A"]
        assert np.array_equal(got, want), name
        assert np.array_equal(buf["ctx"][1], tokens[-(cfg.ngram_size - 1):]), name   # the last tokens
        assert np.array_equal(buf["ctx"][[0, 2]], idle), name


def test_ngram_hash_slots_and_restart(rng):
    """Two slots interleaved; slot 0 restarts (position 0) with a new sequence after the first one:
    every sequence's ids are the module's ids of that sequence alone."""
    cfg = config()
    toks = {"A": stream(rng, 50), "B": stream(rng, 30), "C": rng.integers(3, 512, 16).astype(np.int32)}
    slot_of = {"A": 1, "B": 0, "C": 0}
    calls = [{"A": (0, 17), "B": (0, 30)}, {"A": (17, 18), "C": (0, 5)}, {"A": (18, 40), "C": (5, 6)}] + \
            [{"A": (40 + i, 41 + i), "C": (6 + i, 7 + i)} for i in range(10)]
    m = ngram_module(cfg, 0)
    G = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    buf = {"ctx": np.zeros((2, cfg.ngram_size - 1), np.int32)}

    def step(order, pos, slot):
        buf.update(tok=np.array([toks[o[0]][o[1]] if o else EOS for o in order], np.int32), pos=pos, slot=slot,
                   ids=np.full((len(order), G), 7, np.int32))
        op("ngram_hash", buf, **ngram_op(cfg, 0))
        return buf["ids"]

    got = collect(rng, calls, slot_of, 2, step, lambda r: (r == -1).all())
    for n, t in toks.items():
        assert np.array_equal(got[n], module_ids(m, t)), n


def test_host_embed(rng):
    cfg = config()
    G, P = (cfg.ngram_size - 1) * cfg.heads_per_ngram, cfg.ple_embed_dim
    table = f32(rng, tables(cfg, 0).rows, P // G)
    m = ngram_module(cfg, 0, table)
    tokens = stream(rng, 20)
    with torch.no_grad():
        want = m(torch.from_numpy(tokens.astype(np.int64))[None], None)[0].numpy()
    buf = {"tok": tokens, "pos": np.arange(20, dtype=np.int32), "slot": np.zeros(20, np.int32),
           "ctx": np.zeros((1, cfg.ngram_size - 1), np.int32), "ids": np.zeros((20, G), np.int32)}
    op("ngram_hash", buf, **ngram_op(cfg, 0))
    buf["ids"][3] = -1                                                          # an idle row
    buf["out"] = np.full((20, P), 7.0, np.float32)
    op("host_embed", buf, W(t=table), ids="ids", out="out", table="t", heads=G)
    assert np.array_equal(buf["out"][3], np.zeros(P, np.float32))
    keep = np.arange(20) != 3
    assert np.array_equal(buf["out"][keep], want[keep])


# -- causal_conv1d's dilation, ple_gate, the whole PLE layer ----------------------------------------------


@pytest.mark.parametrize("K,dil", [(4, 3), (3, 2), (4, 1)])
def test_conv_dilation_vs_ple_short_conv(rng, K, dil):
    """Qwen4ExpTextPLELayer._short_conv (silu of the dilated depthwise conv) over a whole sequence,
    against the op fed whole, in chunks and a token at a time; the state is the last (K-1)*dil inputs."""
    cfg = config(ple_conv_kernel_size=K, ngram_size=dil) if dil > 1 else None
    if cfg is None:                          # dilation 1 through the op's default (no key): the GDN conv
        conv = torch.nn.Conv1d(8, 8, K, groups=8, bias=False)
        ref = lambda x: torch.nn.functional.silu(                               # noqa: E731
            torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (K - 1, 0)), conv.weight,
                                       groups=8)).transpose(1, 2)
    else:
        ple = randomize(M.Qwen4ExpTextPLELayer(cfg, 0, 0), 4)
        conv, ref = ple.conv1d, lambda x: ple._short_conv(x, None)         # noqa: E731
    C, T = conv.weight.shape[0], 30
    xs = f32(rng, T, C)
    with torch.no_grad():
        want = ref(torch.from_numpy(xs)[None])[0].numpy()
    wt = conv.weight.detach().numpy()
    keys = dict(x="x", pos="pos", slot="slot", state="st", out="out", weight="cw", kernel=K,
                **({"dilation": dil} if dil > 1 else {}))
    for name, cuts in whole_and_chunks(T).items():
        buf = {"st": f32(rng, 2, (K - 1) * dil, C)}
        idle = buf["st"][0].copy()

        def step(order, pos, slot):
            buf.update(x=np.stack([xs[o[1]] if o else f32(rng, C) for o in order]), pos=pos, slot=slot,
                       out=np.full((len(order), C), 7.0, np.float32))
            op("causal_conv1d", buf, W(cw=wt), **keys)
            return buf["out"]

        got = collect(rng, spans("A", cuts), {"A": 1}, 2, step, lambda r: not r.any())["A"]
        assert rel(got, want) < TOL, name
        assert np.array_equal(buf["st"][1], xs[T - (K - 1) * dil:]), name
        assert np.array_equal(buf["st"][0], idle), name


def ple_layer(cfg, buf, w, tokens, X, pos, slot):
    """Qwen4ExpTextPLELayer from the ops, for rows X [rows, n*D] with their tokens: the output
    `gv + silu(conv(norm_conv(gv)))` [rows, n*D] (the layer adds it to X)."""
    n, D, G = cfg.hc_count, cfg.hidden_size, (cfg.ngram_size - 1) * cfg.heads_per_ngram
    rows = len(pos)
    full = lambda: np.full((rows, n * D), 7.0, np.float32)                     # noqa: E731
    buf.update(tok=tokens, pos=pos, slot=slot, X=X, ids=np.zeros((rows, G), np.int32),
               e=np.zeros((rows, cfg.ple_embed_dim), np.float32), kn=full(), qn=full(), gv=full(), gvn=full(),
               c=full(), out=full())
    op("ngram_hash", buf, **ngram_op(cfg, 0))
    op("host_embed", buf, w, ids="ids", out="e", table="ple_embedding.ngram_embedding.weight", heads=G)
    buf["k"] = buf["e"] @ w["key_proj.weight"].T
    buf["v"] = buf["e"] @ w["value_proj.weight"].T
    norm(buf, w, "k", "kn", "norm_key.weight", D)
    norm(buf, w, "X", "qn", "norm_query.weight", D)
    op("ple_gate", buf, kn="kn", qn="qn", v="v", out="gv", n=n)
    norm(buf, w, "gv", "gvn", "norm_conv.weight", D)
    op("causal_conv1d", buf, w, x="gvn", pos="pos", slot="slot", state="conv", out="c", weight="conv1d.weight",
       kernel=cfg.ple_conv_kernel_size, dilation=cfg.ngram_size)
    op("add", buf, a="gv", b="c", out="out")
    return buf["out"]


def test_ple_layer_whole_and_chunks(rng):
    """A whole Qwen4ExpTextPLELayer (n-gram hash with EOS inside, gather, key/value projections, the
    three norms, the signed-sqrt gate, the dilated conv) on one sequence, against the ops fed whole,
    in chunks and a token at a time through the n-gram context and the conv state."""
    cfg = config()
    n, D, T = cfg.hc_count, cfg.hidden_size, 36
    ple = randomize(M.Qwen4ExpTextPLELayer(cfg, 0, 0), 6)
    tokens, X = stream(rng, T), f32(rng, T, n * D)
    with torch.no_grad():
        want = ple(torch.from_numpy(X)[None], torch.from_numpy(tokens.astype(np.int64))[None], None)[0].numpy()
        # the gate's inputs: a spread of |g| around 1, so the signed sqrt matters
        kn = ple.norm_key(ple.key_proj(ple.ple_embedding(torch.from_numpy(tokens.astype(np.int64))[None], None)))
        qn = ple.norm_query(torch.from_numpy(X)[None])
        g = (kn.unflatten(-1, (n, D)) * qn.unflatten(-1, (n, D))).sum(-1) / D ** .5
    assert 0.05 < float(g.abs().median()) < 5
    w = weights(ple)
    Wc = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
    for name, cuts in whole_and_chunks(T).items():
        buf = {"ctx": np.zeros((2, cfg.ngram_size - 1), np.int32), "conv": np.zeros((2, Wc, n * D), np.float32)}
        step = lambda order, pos, slot: ple_layer(                               # noqa: E731
            cfg, buf, w, np.array([tokens[o[1]] if o else 7 for o in order], np.int32),
            np.stack([X[o[1]] if o else f32(rng, n * D) for o in order]), pos, slot)
        got = collect(rng, spans("A", cuts), {"A": 1}, 2, step, lambda r: not r.any())["A"]
        assert rel(got, want) < TOL, name


def test_ple_gate_signed_sqrt(rng):
    """The gate's constants on chosen dot products: g = 0 (sign 0), |g| below 1e-6 (clamped),
    negative, large: out_i = sigmoid(sign(g)*sqrt(max(|g|, 1e-6))) * v, g = kn_i.qn_i / sqrt(D)."""
    n, D = 4, 16
    kn, qn, v = np.zeros((1, n * D), np.float32), np.zeros((1, n * D), np.float32), f32(rng, 1, D)
    qn[0, :] = 1
    s = np.float32(np.sqrt(D))
    for i, gi in enumerate([0.0, 1e-8, -9.0, 2.25]):
        kn[0, i * D] = gi * s                      # one nonzero product per stream
    buf = {"kn": kn, "qn": qn, "v": v, "out": np.full((1, n * D), 7.0, np.float32)}
    op("ple_gate", buf, kn="kn", qn="qn", v="v", out="out", n=n)
    gate = torch.tensor([0.0, 1e-8, -9.0, 2.25])
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    want = (torch.sigmoid(gate)[:, None] * torch.from_numpy(v)).reshape(1, -1).numpy()
    assert rel(buf["out"], want) < 1e-6
    assert np.allclose(buf["out"][0, :D], 0.5 * v[0])                 # g = 0: sigmoid(0)
    assert np.allclose(buf["out"][0, 2 * D:3 * D], v[0] / (1 + np.exp(3.0)), rtol=1e-6)   # -sqrt(9)


# -- qsa_index + attention's select: one QSA attention layer ------------------------------------------------


def OPQ(cfg):
    """qsa_index's attrs for the config."""
    return dict(heads=cfg.indexer_n_heads, head_dim=cfg.indexer_head_dim, ratio=cfg.indexer_compress_ratio,
                budget=cfg.indexer_budget, theta=cfg.rope_parameters["rope_theta"], eps=cfg.rms_norm_eps, offset=1.0,
                rotary_dim=int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))


def qsa_attention(cfg, buf, w, x, pos, slot):
    """Qwen4ExpTextAttention from the ops for rows x [rows, D]: the gated attention over the QSA
    selection. Returns (out [rows, D], sel [rows, budget + ratio - 1])."""
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Hi, Di, R = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    rd, theta = int(hd * cfg.rope_parameters["partial_rotary_factor"]), cfg.rope_parameters["rope_theta"]
    rows = len(pos)
    buf.update(x=x, pos=pos, slot=slot, q=np.zeros((rows, H * hd), np.float32),
               gate=np.zeros((rows, H * hd), np.float32), o=np.full((rows, H * hd), 7.0, np.float32),
               sel=np.full((rows, cfg.indexer_budget + R - 1), 7, np.int32))
    # the indexer
    qk = x @ w["indexer.index_qk_proj.weight"].T
    buf.update(iq=qk[:, :Hi * Di].copy(), ik=qk[:, Hi * Di:].copy())
    norm(buf, w, "iq", "iq", "indexer.q_layernorm.weight", Di, cfg.rms_norm_eps)
    op("rope", buf, x="iq", pos="pos", out="iq", heads=Hi, head_dim=Di, theta=theta, rotary_dim=rd)
    op("qsa_index", buf, w, q="iq", k="ik", pos="pos", slot="slot", sel="sel", cache="qsa",
       k_norm="indexer.k_layernorm.weight", **OPQ(cfg))
    # the gated attention
    buf.update(qg=x @ w["q_proj.weight"].T, k=x @ w["k_proj.weight"].T, v=x @ w["v_proj.weight"].T)
    op("split_groups", buf, x="qg", out="q", rest="gate", groups=H, widths=[hd, hd], split=1)
    norm(buf, w, "q", "q", "q_norm.weight", hd, cfg.rms_norm_eps)
    norm(buf, w, "k", "k", "k_norm.weight", hd, cfg.rms_norm_eps)
    op("rope", buf, x="q", pos="pos", out="q", heads=H, head_dim=hd, theta=theta, rotary_dim=rd)
    op("rope", buf, x="k", pos="pos", out="k", heads=KV, head_dim=hd, theta=theta, rotary_dim=rd)
    op("attention", buf, q="q", k="k", v="v", pos="pos", slot="slot", out="o", cache_k="ck", cache_v="cv",
       select="sel", heads=H, kv_heads=KV, head_dim=hd, scale=hd ** -0.5, mode="prefill")
    op("sigmoid_mul", buf, x="o", gate="gate", out="o")
    return buf["o"] @ w["o_proj.weight"].T, buf["sel"]


def hf_attention(cfg, attn, rot, x):
    """The module's whole-sequence forward (causal mask, no cache): out [T, D] and the indexer's
    selection mask [T, T]."""
    T = x.shape[0]
    h = torch.from_numpy(x)[None]
    pe = rot(h, torch.arange(T)[None, None].expand(3, 1, T))
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        sel = attn.indexer(h, pe, mask, None)[0, 0].numpy()
        out = attn(h, pe, attention_mask=mask)[0][0].numpy()
    return out, sel


def test_qsa_attention_layer(rng):
    """One QSA attention layer on two sequences long enough that the selection is sparse (nb >
    budget/ratio), in two slots: prompt chunks with the sequences' rows interleaved and idle rows,
    then decode steps of one row per slot, through the KV and the raw-key caches; equal to the
    module's whole-sequence forward, and the selection exactly the indexer's mask."""
    cfg = config()
    R, top, ctx = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio, 96
    attn = randomize(M.Qwen4ExpTextAttention(cfg, 3), 7)
    rot = M.Qwen4ExpTextRotaryEmbedding(cfg)
    w = weights(attn)
    xs = {"A": f32(rng, 72, cfg.hidden_size), "B": f32(rng, 45, cfg.hidden_size)}
    want = {n: hf_attention(cfg, attn, rot, x) for n, x in xs.items()}
    slot_of = {"A": 2, "B": 0}
    calls = [{"A": (0, 30), "B": (0, 19)}, {"A": (30, 52), "B": (19, 33)}] + \
            [{"A": (52 + i, 53 + i), **({"B": (33 + i, 34 + i)} if 33 + i < 45 else {})} for i in range(20)]
    buf = {"ck": np.zeros((3, ctx, cfg.num_key_value_heads, cfg.head_dim), np.float32),
           "cv": np.zeros((3, ctx, cfg.num_key_value_heads, cfg.head_dim), np.float32),
           "qsa": np.zeros((3, ctx, cfg.indexer_head_dim), np.float32)}
    sels, margins = {}, []

    def step(order, pos, slot):
        x = np.stack([xs[o[0]][o[1]] if o else f32(rng, cfg.hidden_size) for o in order])
        out, sel = qsa_attention(cfg, buf, w, x, pos, slot)
        for i, (o, s) in enumerate(zip(order, sel)):
            if o:
                sels[o] = s.copy()
                nb = (o[1] + 1) // R
                if nb > top:      # the gap at the top-k cut: the selection must not hang on rounding
                    kb = QI.block_keys(buf["qsa"][slot_of[o[0]], :o[1] + 1], OPQ(cfg), w["indexer.k_layernorm.weight"])
                    sc = np.sort(QI.scores(buf["iq"][i:i + 1], kb, OPQ(cfg))[0])[::-1]
                    margins.append((sc[top - 1] - sc[top]) / sc[0])
            else:
                assert (s == -1).all()
        return out

    got = collect(rng, calls, slot_of, 3, step, lambda r: not r.any())
    assert min(margins) > 1e-4 and len(margins) > 60
    assert not buf["qsa"][1].any() and not buf["ck"][1].any()              # idle rows wrote nothing
    for n, (out, mask) in want.items():
        T = len(xs[n])
        for t in range(T):
            s = sels[(n, t)]
            assert list(s[s >= 0]) == sorted(np.nonzero(mask[t])[0].tolist()), (n, t)
            assert (s[len(s[s >= 0]):] == -1).all()
        counts = mask.sum(-1)
        assert counts[-1] < T and counts.max() <= cfg.indexer_budget + R - 1    # sparse
        assert rel(got[n], out) < TOL, n


def test_qsa_index_ties_prefer_the_lower_block(rng):
    """q = 0: every block scores exactly 0 (the relu tie of docs/flagships.md Surprise 6); the
    lowest budget/ratio blocks are kept, then the tail."""
    o = OPQ(config())
    Di, R, top = o["head_dim"], o["ratio"], o["budget"] // o["ratio"]
    p = 8 * R + 2                                                    # 8 blocks, a tail of 3
    buf = {"q": np.zeros((1, o["heads"] * Di), np.float32), "k": f32(rng, 1, Di), "pos": np.array([p], np.int32),
           "slot": np.array([0], np.int32), "cache": f32(rng, 1, 64, Di),
           "sel": np.zeros((1, o["budget"] + R - 1), np.int32)}
    op("qsa_index", buf, W(kn=f32(rng, Di)), q="q", k="k", pos="pos", slot="slot", sel="sel", cache="cache",
       k_norm="kn", **o)
    want = [*range(top * R), *range(8 * R, p + 1)]
    assert buf["sel"][0].tolist() == want + [-1] * (buf["sel"].shape[1] - len(want))
    assert np.array_equal(buf["cache"][0, p], buf["k"][0])


def test_attention_select_all_is_plain_attention(rng):
    """select listing every position (and -1s) is the causal attention without select."""
    H, KV, D, T = 4, 2, 16, 11
    q, k, v = f32(rng, T, H * D), f32(rng, T, KV * D), f32(rng, T, KV * D)
    keys = dict(q="q", k="k", v="v", pos="pos", slot="slot", out="out", cache_k="ck", cache_v="cv", heads=H,
                kv_heads=KV, head_dim=D, scale=D ** -0.5, mode="prefill")
    outs = []
    for sel in (None, np.concatenate([np.tile(np.arange(T), (T, 1)), -np.ones((T, 3), np.int64)], 1)):
        buf = {"q": q, "k": k, "v": v, "pos": np.arange(T, dtype=np.int32), "slot": np.zeros(T, np.int32),
               "out": np.zeros((T, H * D), np.float32), "ck": np.zeros((1, T, KV, D), np.float32),
               "cv": np.zeros((1, T, KV, D), np.float32)}
        if sel is not None:
            buf["sel"] = sel.astype(np.int32)
        op("attention", buf, **keys, **({"select": "sel"} if sel is not None else {}))
        outs.append(buf["out"])
    assert np.array_equal(outs[0], outs[1])
