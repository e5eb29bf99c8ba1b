"""The glm5_next ops (mhc_weights, hc_collapse, hc_mean, mhc_inject, kda, layernorm, dsa_index,
mla_attention, swiglu/moe_experts `limit`) against transformers' own Glm5Next modules in float32,
built from a tiny text config with random weights (what _init_weights sets to 0 or 1 included).
The linears between the ops are done here (x @ W.T), as the plan's linear op would."""

from __future__ import annotations

import numpy as np
import pytest

from bloomery.runtime.ops import IMPL
from arrays import rel

torch = pytest.importorskip("torch")
G = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402

N, D = 4, 64                                            # hc_mult, hidden size


class W:
    """A rank's weights as the ops read them (CpuWeights' interface)."""

    def __init__(self, values, pre_quant=None):
        self.values, self.pre_quant = values, pre_quant or {}

    def __getitem__(self, k):
        return self.values[k]


def run(name, buf, values=None, pre_quant=None, /, **keys):
    IMPL[name].run({"op": name, **keys}, buf, W(values or {}, pre_quant))


def npy(t):
    return t.detach().numpy().astype(np.float32)


def text_config(**kw):
    cfg = dict(vocab_size=64, pad_token_id=0, hidden_size=D, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
               mlp_layer_types=["dense", "dense"], num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
               kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, qk_rope_head_dim=0, index_n_heads=16,
               index_head_dim=16, index_kpool=4, index_topk=16, linear_num_heads=4, linear_head_dim=16,
               hc_mult=N, swiglu_limit=1.0, n_routed_experts=8, num_experts_per_tok=2)
    cfg.update(kw)
    c = Glm5NextTextConfig(**cfg)
    c._attn_implementation = c._experts_implementation = "eager"
    return c


def randomize(module, seed):
    """Every parameter random: matrices ~ N(0, 1/fan_in), 1-D weights 1 + N(0, 0.04), the rest
    (hc base/scale, A_log, dt_bias, biases, ape) N(0, 0.25): nothing left at HF's 0/1 init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(r / p.shape[-1] ** 0.5 if p.ndim >= 2 else 1 + 0.2 * r if name.endswith("weight") else 0.5 * r)
    return module.eval()


# --- manifold hyper-connections and the clamped MLP, in the decoder layer -------------------------

class _Block(torch.nn.Module):
    """Stands in for the attention block: tanh(x W^T)."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, hidden_states, **kw):
        return torch.tanh(hidden_states @ self.w.T)


def _mhc(buf, hc, norm, cfg):
    """mhc_weights + hc_collapse + the pre-block rmsnorm over the streams in buf['x']."""
    buf["z"] = buf["x"] @ npy(hc.fn).T                                     # the plan's linear, un-normalised
    run("mhc_weights", buf, {"base": npy(hc.base), "scale": npy(hc.scale)}, z="z", x="x", pre="pre", post="post",
        comb="comb", base="base", scale="scale", n=N, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        eps=cfg.rms_norm_eps)
    run("hc_collapse", buf, x="x", w="pre", out="m", n=N)
    run("rmsnorm", buf, {"norm": npy(norm.weight)}, x="m", out="h", weight="norm", eps=cfg.rms_norm_eps, group=D)


@pytest.mark.parametrize("iters", [20, 2])           # 2: the step order shows (20 nearly converges)
def test_hyper_connection_and_clamped_mlp_are_the_decoder_layers(iters):
    cfg = text_config(hc_sinkhorn_iters=iters)
    rows = 7
    g = torch.Generator().manual_seed(11)
    layer = randomize(G.Glm5NextTextDecoderLayer(cfg, 0), 1)
    wb = torch.randn(D, D, generator=g) / 4
    layer.self_attn = _Block(wb)
    scale = torch.tensor([2, 1, 3, 1e-3, 2, 1, 0.5])[:, None]              # a row of rms ~ sqrt(eps): eps matters
    X = (scale * torch.randn(rows, N * D, generator=g)).numpy()
    with torch.no_grad():
        post, comb, collapsed = layer.attn_hc(torch.from_numpy(X).view(1, rows, N, D))
        ref = layer(torch.from_numpy(X).view(1, rows, N, D))[0].reshape(rows, N * D).numpy()
    shapes = {"pre": N, "post": N, "comb": N * N, "m": D, "h": D, "act": cfg.intermediate_size, "mean": D}
    buf = {"x": X.copy(), **{k: np.zeros((rows, w), np.float32) for k, w in shapes.items()}}
    _mhc(buf, layer.attn_hc, layer.input_layernorm, cfg)
    assert rel(buf["post"], post[0]) < 1e-6
    assert rel(buf["comb"], comb[0].reshape(rows, N * N)) < 1e-6
    assert rel(buf["m"], collapsed[0]) < 1e-6
    c = buf["comb"].reshape(rows, N, N)                                    # doubly stochastic, not symmetric
    assert np.allclose(c.sum(-2), 1, atol=1e-3) and np.allclose(c.sum(-1), 1, atol=0.1)
    assert np.abs(c - c.transpose(0, 2, 1)).max() > 1e-2
    buf["y"] = np.tanh(buf["h"] @ npy(wb).T)
    run("mhc_inject", buf, x="x", y="y", post="post", comb="comb", out="x", n=N)        # in place
    _mhc(buf, layer.ffn_hc, layer.post_attention_layernorm, cfg)
    mlp = layer.mlp
    buf["gate"], buf["up"] = buf["h"] @ npy(mlp.gate_proj.weight).T, buf["h"] @ npy(mlp.up_proj.weight).T
    L = cfg.swiglu_limit
    assert (buf["gate"] > L).any() and (buf["up"] > L).any() and (buf["up"] < -L).any()   # the clamp bites
    run("swiglu", buf, gate="gate", up="up", out="act", limit=L)
    buf["y"] = buf["act"] @ npy(mlp.down_proj.weight).T
    run("mhc_inject", buf, x="x", y="y", post="post", comb="comb", out="x", n=N)
    assert rel(buf["x"], ref) < 1e-5
    run("hc_mean", buf, x="x", out="mean", n=N)
    head = G.Glm5NextTextHyperHead()(torch.from_numpy(ref).view(1, rows, N, D))[0].numpy()
    assert rel(buf["mean"], head) < 1e-6


def test_swiglu_limit_is_glms_mlp_and_experts_clamp():
    cfg = text_config()
    g = torch.Generator().manual_seed(5)
    x = 3 * torch.randn(9, D, generator=g)
    mlp = randomize(G.Glm5NextTextMLP(cfg), 2)
    with torch.no_grad():
        ref = mlp(x).numpy()
    xn = x.numpy()
    buf = {"gate": xn @ npy(mlp.gate_proj.weight).T, "up": xn @ npy(mlp.up_proj.weight).T,
           "out": np.zeros((9, cfg.intermediate_size), np.float32)}
    run("swiglu", buf, gate="gate", up="up", out="out", limit=cfg.swiglu_limit)
    assert rel(buf["out"] @ npy(mlp.down_proj.weight).T, ref) < 1e-6
    run("swiglu", buf, gate="gate", up="up", out="out")                        # no limit: today's swiglu
    gn, un = buf["gate"], buf["up"]
    assert np.array_equal(buf["out"], gn / (np.float32(1) + np.exp(-gn)) * un)
    assert rel(buf["out"] @ npy(mlp.down_proj.weight).T, ref) > 0.1

    experts = randomize(G.Glm5NextTextExperts(cfg), 3)
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(9)])
    wts = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        ref = experts(x, ids, wts).numpy()
    gu = npy(experts.gate_up_proj)                                         # [E, 2I, D]: gate rows, then up rows
    weights = {"g": gu[:, :I], "u": gu[:, I:], "d": npy(experts.down_proj)}
    buf = {"x": xn, "ids": ids.numpy().astype(np.int32), "w": wts.numpy(), "out": np.zeros((9, D), np.float32)}
    keys = dict(x="x", ids="ids", weights="w", out="out", gate="g", up="u", down="d", experts=E, top_k=2)
    run("moe_experts", buf, weights, **keys, limit=cfg.swiglu_limit)
    assert rel(buf["out"], ref) < 1e-5
    run("moe_experts", buf, weights, **keys)
    assert rel(buf["out"], ref) > 0.1


# --- KDA --------------------------------------------------------------------------------------------

class _KdaLayer:
    """One KDA layer run through the plan's ops (three causal_conv1d, kda, rmsnorm_gated with the
    sigmoid act), the linears done here."""

    def __init__(self, att, cfg, slots, seed):
        self.att, self.H, self.d, self.K = att, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        self.lb = cfg.linear_lower_bound
        Hd = self.H * self.d
        conv = npy(att.conv1d.weight)                                      # [3*Hd, 1, K]: q | k | v channels
        self.w = {f"conv_{n}": conv[i * Hd:(i + 1) * Hd] for i, n in enumerate("qkv")}
        self.w.update(A_log=npy(att.forget_gate.A_log), dt_bias=npy(att.forget_gate.dt_bias))
        rng = np.random.default_rng(seed)                                  # garbage states: reset / untouched
        self.state = {f"conv_{n}": rng.standard_normal((slots, self.K - 1, Hd)).astype(np.float32) for n in "qkv"}
        self.state["ssm"] = rng.standard_normal((slots, self.H, self.d, self.d)).astype(np.float32)

    def __call__(self, x, pos, slot, mode, chunk=None):
        att, Hd, rows = self.att, self.H * self.d, x.shape[0]
        buf = {**self.state, "pos": np.asarray(pos, np.int32), "slot": np.asarray(slot, np.int32),
               "o": np.zeros((rows, Hd), np.float32)}
        for n, proj in zip("qkv", (att.q_proj, att.k_proj, att.v_proj)):
            buf[n] = x @ npy(proj.weight).T
            run("causal_conv1d", buf, self.w, x=n, pos="pos", slot="slot", out=n, state=f"conv_{n}",
                weight=f"conv_{n}", kernel=self.K)
        buf["g"] = (x @ npy(att.forget_gate.f_a_proj.weight).T) @ npy(att.forget_gate.f_b_proj.weight).T
        buf["b"] = x @ npy(att.b_proj.weight).T
        extra = {} if chunk is None else {"chunk": chunk}
        run("kda", buf, self.w, q="q", k="k", v="v", g="g", b="b", pos="pos", slot="slot", out="o", state="ssm",
            A_log="A_log", dt_bias="dt_bias", heads=self.H, head_dim=self.d, lower_bound=self.lb, mode=mode, **extra)
        buf["gate"] = (x @ npy(att.g_a_proj.weight).T) @ npy(att.g_b_proj.weight).T
        buf["normed"] = np.zeros_like(buf["o"])
        run("rmsnorm_gated", buf, {"o_norm": npy(att.o_norm.weight)}, x="o", gate="gate", out="normed",
            weight="o_norm", eps=att.layer_norm_epsilon, group=self.d, act="sigmoid")
        return buf["normed"] @ npy(att.o_proj.weight).T, buf["o"]


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_layer_is_glms_whole_in_chunks_and_token_by_token(lower_bound):
    cfg = text_config(linear_lower_bound=lower_bound)
    att = randomize(G.Glm5NextTextLinearAttention(cfg, 0), 7)
    if lower_bound is None:                                                 # HF's own init for this form
        with torch.no_grad():
            att.forget_gate.A_log.copy_(torch.empty(cfg.linear_num_heads).uniform_(1.0, 16.0).log())
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randn(1, n, D, generator=g) for n in (37, 29)]           # slot 0 and slot 2; slot 1 idle
    with torch.no_grad():
        refs = [att(s)[0].numpy() for s in seqs]
        cache = DynamicCache(config=cfg)
        att(seqs[0], cache=cache)
        S_ref = cache.get_recurrent_state(0)[0].numpy()                    # [H, d key, d value]
    A, B = (s[0].numpy() for s in seqs)
    TA, TB = A.shape[0], B.shape[0]

    # one prefill program: A's rows, an inactive row, B's rows; blocks of 16 (several, and a partial one)
    layer = _KdaLayer(att, cfg, 3, 0)
    idle = {k: v[1].copy() for k, v in layer.state.items()}
    x = np.concatenate([A, np.ones((1, D), np.float32), B])
    pos = [*range(TA), -1, *range(TB)]
    slot = [0] * TA + [1] + [2] * TB
    out, o = layer(x, pos, slot, "prefill", chunk=16)
    assert rel(out[:TA], refs[0]) < 1e-5 and rel(out[TA + 1:], refs[1]) < 1e-5
    assert not o[TA].any() and all(np.array_equal(layer.state[k][1], v) for k, v in idle.items())
    assert rel(layer.state["ssm"][0], S_ref) < 1e-5

    # the prompt in programs of 10 rows, through the state (the default block)
    layer = _KdaLayer(att, cfg, 3, 1)
    outs = [layer(A[i:i + 10], range(i, min(i + 10, TA)), [0] * len(A[i:i + 10]), "prefill")[0]
            for i in range(0, TA, 10)]
    assert rel(np.concatenate(outs), refs[0]) < 1e-5
    assert rel(layer.state["ssm"][0], S_ref) < 1e-5

    # token by token: a decode program of 3 slots (slot 1 idle, and B's slot once B has ended)
    layer = _KdaLayer(att, cfg, 3, 2)
    idle = {k: v[1].copy() for k, v in layer.state.items()}
    outs = []
    for t in range(TA):
        x = np.stack([A[t], np.ones(D, np.float32), B[t] if t < TB else np.ones(D, np.float32)])
        out, o = layer(x, [t, -1, t if t < TB else -1], [0, 1, 2], "decode")
        assert not o[1].any() and (t < TB or not o[2].any())
        outs.append(out)
    outs = np.stack(outs)
    assert rel(outs[:, 0], refs[0]) < 1e-5 and rel(outs[:TB, 2], refs[1]) < 1e-5
    assert rel(layer.state["ssm"][0], S_ref) < 1e-5
    assert all(np.array_equal(layer.state[k][1], v) for k, v in idle.items())


# --- MLA + DSA --------------------------------------------------------------------------------------

def _hf_pool_scores(ind, x, q_resid):
    """The indexer's pool scores [T, pools] (Glm5NextTextIndexer.forward's lines, for the tie check)."""
    T, Di = x.shape[1], ind.head_dim
    q = ind.wq_b(q_resid).view(1, T, -1, Di)
    k = ind.k_norm(ind.wk(x))
    packed = torch.cat([k, torch.nn.functional.linear(x, ind.index_kpool_compress_gate), torch.ones(1, T, 1)], -1)
    pool_keys, _, _ = ind.get_pooled_states(packed_states=packed)
    scores = torch.relu(torch.matmul(q, pool_keys.transpose(-1, -2).unsqueeze(1)) * ind.softmax_scale)
    weights = ind.weights_proj(x) * ind.n_heads ** -0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0].numpy()


class _MlaLayer:
    """One MLA + DSA layer through the plan's ops (rmsnorm, layernorm, dsa_index, mla_attention),
    the linears done here."""

    def __init__(self, attn, cfg, slots, ctx, tail):
        self.attn, self.cfg, self.tail = attn, cfg, tail
        ind = attn.indexer
        self.w = {"qa_norm": npy(attn.q_a_layernorm.weight), "kva_norm": npy(attn.kv_a_layernorm.weight),
                  "kn_w": npy(ind.k_norm.weight), "kn_b": npy(ind.k_norm.bias), "kv_b": npy(attn.kv_b_proj.weight),
                  "ape": npy(ind.index_kpool_compress_ape)}
        self.Di, self.Hi = cfg.index_head_dim, cfg.index_n_heads
        self.dsa = np.zeros((slots, ctx, 2 * self.Di), np.float32)
        self.mla = np.zeros((slots, ctx, cfg.kv_lora_rank), np.float32)

    def __call__(self, x, pos, slot, mode, selected=True, pre_quant=None):
        a, ind, cfg, rows = self.attn, self.attn.indexer, self.cfg, x.shape[0]
        W_ = dict(self.w)
        if pre_quant is not None:                                          # a stored kv_b with its input scale
            W_["kv_b"] = W_["kv_b"] / pre_quant
        H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        width = cfg.index_topk + cfg.index_kpool - 1
        buf = {"pos": np.asarray(pos, np.int32), "slot": np.asarray(slot, np.int32), "dsa": self.dsa,
               "mla": self.mla, "qa": x @ npy(a.q_a_proj.weight).T, "kva": x @ npy(a.kv_a_proj_with_mqa.weight).T,
               "wk": x @ npy(ind.wk.weight).T, "gs": x @ npy(ind.index_kpool_compress_gate).T,
               "hw": x @ npy(ind.weights_proj.weight).T, "sel": np.zeros((rows, width), np.int32),
               "o": np.zeros((rows, H * dv), np.float32)}
        for k in ("qr", "c", "ik"):
            buf[k] = np.zeros_like(buf[{"qr": "qa", "c": "kva", "ik": "wk"}[k]])
        run("rmsnorm", buf, W_, x="qa", out="qr", weight="qa_norm", eps=cfg.rms_norm_eps, group=cfg.q_lora_rank)
        run("rmsnorm", buf, W_, x="kva", out="c", weight="kva_norm", eps=cfg.rms_norm_eps, group=cfg.kv_lora_rank)
        run("layernorm", buf, W_, x="wk", out="ik", weight="kn_w", bias="kn_b", eps=1e-6, group=self.Di)
        buf["q"] = buf["qr"] @ npy(a.q_b_proj.weight).T
        buf["iq"] = buf["qr"] @ npy(ind.wq_b.weight).T
        run("dsa_index", buf, W_, q="iq", k="ik", gs="gs", hw="hw", pos="pos", slot="slot", sel="sel", cache="dsa",
            ape="ape", heads=self.Hi, head_dim=self.Di, topk=cfg.index_topk, kpool=cfg.index_kpool, tail=self.tail)
        run("mla_attention", buf, W_, {"kv_b": pre_quant} if pre_quant is not None else None, q="q", c="c",
            pos="pos", slot="slot", out="o", cache="mla", kv_b="kv_b", heads=H, nope_dim=dn, v_dim=dv,
            scale=a.scaling, mode=mode, **({"sel": "sel"} if selected else {}))
        return buf["o"] @ npy(a.o_proj.weight).T, buf


def _same_selection(sel, hf):
    """Our rows (ascending, -1 padded) hold exactly HF's selected positions (in HF's order)."""
    for ours, theirs in zip(sel, hf):
        got = ours[ours >= 0]
        assert np.array_equal(got, np.sort(theirs[theirs >= 0])) and (ours[got.size:] == -1).all()


@pytest.mark.parametrize("tail", [True, False])
def test_mla_dsa_layer_is_glms_whole_and_token_by_token(tail):
    cfg = text_config(index_kpool_always_select_tail=tail)
    attn = randomize(G.Glm5NextTextAttention(cfg, 1), 9)
    T, kp, top = 40, cfg.index_kpool, cfg.index_topk // cfg.index_kpool
    g = torch.Generator().manual_seed(4)
    xt = torch.randn(1, T, D, generator=g)
    mask = torch.ones(1, T, dtype=torch.bool)
    with torch.no_grad():
        ref = attn(xt, attention_mask=mask)[0][0].numpy()
        q_resid = attn.q_a_layernorm(attn.q_a_proj(xt))
        hf_sel = attn.indexer(hidden_states=xt, q_resid=q_resid, attention_mask=mask, cache=None)[0].numpy()
        ik_ref = attn.indexer.k_norm(attn.indexer.wk(xt))[0].numpy()
        scores = _hf_pool_scores(attn.indexer, xt, q_resid)
        # the dense causal oracle: HF's expand_kv + eager attention with a causal mask
        k_pass = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(xt)).view(1, 1, T, -1)
        ks, vs = attn.expand_kv(k_pass, torch.empty(1, 1, T, 0))
        qs = attn.q_b_proj(q_resid).view(1, T, -1, attn.qk_head_dim).transpose(1, 2)
        causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        dense = G.eager_attention_forward(attn, qs, ks, vs, causal, scaling=attn.scaling)[0].reshape(T, -1).numpy()
    # a well-posed oracle: sparse rows exist, and no tie at the top-k cut (docs/flagships.md, Surprise 6)
    sparse = [t for t in range(T) if (t + 1) // kp > top]
    assert len(sparse) >= 10
    for t in sparse:
        s = np.sort(scores[t, :(t + 1) // kp])[::-1]
        assert s[top - 1] - s[top] > 1e-4 * np.abs(s).max(), (t, s)
    first = 0 if tail else kp - 1                  # tail off: rows before the first pool select nothing
    x = xt[0].numpy()

    # whole: one prefill program, an inactive row in the middle
    layer = _MlaLayer(attn, cfg, 2, 64, tail)
    xs = np.concatenate([x[:20], np.ones((1, D), np.float32), x[20:]])
    pos, slot = [*range(20), -1, *range(20, T)], [0] * 20 + [1] + [0] * (T - 20)
    out, buf = layer(xs, pos, slot, "prefill")
    keep = np.r_[0:20, 21:T + 1]
    assert rel(buf["ik"][keep], ik_ref) < 1e-6
    _same_selection(buf["sel"][keep], hf_sel)
    assert (buf["sel"][20] == -1).all() and not buf["o"][20].any() and not layer.dsa[1].any()
    assert rel(out[keep][first:], ref[first:]) < 1e-5
    if not tail:
        assert (buf["sel"][:kp - 1] == -1).all() and not buf["o"][:kp - 1].any()
    assert np.array_equal(layer.mla[0, :T], buf["c"][keep]) and not layer.mla[1].any()

    # without sel: dense causal attention; a pre_quant_scale on kv_b gives the same result
    layer = _MlaLayer(attn, cfg, 1, 64, tail)
    _, buf = layer(x, range(T), [0] * T, "prefill", selected=False)
    assert rel(buf["o"], dense) < 1e-5
    pq = np.random.default_rng(0).uniform(0.5, 2.0, cfg.kv_lora_rank).astype(np.float32)
    layer = _MlaLayer(attn, cfg, 1, 64, tail)
    assert rel(layer(x, range(T), [0] * T, "prefill", pre_quant=pq)[0][first:], ref[first:]) < 1e-5

    # token by token: a decode program of 2 slots, slot 1 idle
    layer = _MlaLayer(attn, cfg, 2, 64, tail)
    outs, sels = [], []
    for t in range(T):
        out, buf = layer(np.stack([x[t], np.ones(D, np.float32)]), [t, -1], [0, 1], "decode")
        assert (buf["sel"][1] == -1).all() and not buf["o"][1].any()
        outs.append(out[0])
        sels.append(buf["sel"][0])
    _same_selection(np.stack(sels), hf_sel)
    assert rel(np.stack(outs)[first:], ref[first:]) < 1e-5
    assert not layer.dsa[1].any() and not layer.mla[1].any()
