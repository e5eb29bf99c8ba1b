"""GLM-4.5 MoE (Glm4MoeForCausalLM, specs/glm4_moe.yaml; transformers 5.24 is the contract) end to
end: the grouped sigmoid router (moe_router_grouped) against HF's Glm4MoeTopkRouter; prepare of
every tiny export at tp 1 and 2; the plan's blocks; the gate rows against the float32 oracle on a
short slice, tp 2 against tp 1, of copies whose biases and norm weights are not HF's initial
zeros and ones (the tiny exports store those, so the stock rows of tests/test_gates.py cannot tell
a bias or a norm weight left out: these can); the NextN layer carried as stored; the named refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from bloomery.cli import main
from bloomery.compiler import lower, planning
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.prepare import prepare
from bloomery.core import errors, specs
from bloomery.core import plan as P
from bloomery.core.artifact import Artifact
from bloomery.runtime.ops import IMPL
from bloomery.tools import gates
from runtime_artifacts import artifact, need

torch = pytest.importorskip("torch")
M = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")

FORMATS = gates.TINY_GLM4_MOE
FAST_LIMIT = 48                      # tokens per sequence of the gate slices here
route = IMPL["moe_router_grouped"].route


# --------------------------------------------------------------------------- the router


def hf_router(E, G, TG, K, norm, scale, H=64, seed=0):
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(hidden_size=H, n_routed_experts=E, n_group=G, topk_group=TG, num_experts_per_tok=K,
                        norm_topk_prob=norm, routed_scaling_factor=scale)
    r = M.Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, H, generator=g) * 0.1)
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return r


def run_router(x, W, b, **attrs):
    K = attrs["top_k"]
    buf = {"x": x, "ids": np.zeros((x.shape[0], K), np.int32), "w": np.zeros((x.shape[0], K), np.float32)}
    IMPL["moe_router_grouped"].run({"op": "moe_router_grouped", "x": "x", "weight": "W", "bias": "b", "ids": "ids",
                                    "weights": "w", **attrs}, buf, {"W": W, "b": b})
    return buf["ids"], buf["w"]


def by_id(ids, w):
    o = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, o, 1), np.take_along_axis(w, o, 1)


# (experts, n_group, topk_group, top_k, norm, scale): grouped as DeepSeek-V3 / the issue asks, the
# tiny config, GLM-4.5's own (160 experts, one group, top 8), unnormalised
ROUTERS = [(16, 4, 2, 4, True, 2.5), (8, 1, 1, 2, True, 2.5), (256, 8, 4, 8, True, 2.5), (160, 1, 1, 8, True, 2.5),
           (64, 8, 3, 6, False, 1.0)]


@pytest.mark.parametrize("E,G,TG,K,norm,scale", ROUTERS)
def test_router_matches_hf(E, G, TG, K, norm, scale):
    """The same experts as HF's Glm4MoeTopkRouter on every row (random inputs, a random correction
    bias) and the same weights to float32 rounding (the sigmoid's exp and the sum order may differ
    by an ulp). The inputs exercise what they test: the bias changes the choice on some rows, and
    with n_group > 1 the group limit does."""
    r = hf_router(E, G, TG, K, norm, scale)
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hw, hi = r(x)
    W, b = r.weight.detach().numpy(), r.e_score_correction_bias.numpy()
    ids, w = run_router(x.numpy(), W, b, top_k=K, n_group=G, topk_group=TG, norm=norm, scale=scale)
    assert ids.dtype == np.int32 and w.dtype == np.float32
    hi, hw = by_id(hi.numpy(), hw.numpy())
    oi, ow = by_id(ids, w)
    assert np.array_equal(oi, hi), int((oi != hi).any(1).sum())
    np.testing.assert_allclose(ow, hw, rtol=1e-6, atol=1e-7)
    s = 1 / (1 + np.exp(-(x.numpy().astype(np.float64) @ W.T.astype(np.float64))))
    plain = np.sort(np.argsort(-s, axis=1, kind="stable")[:, :K], axis=1)
    assert (plain != hi).any(1).sum() > 0          # the bias (and the group limit) moved the choice
    if G > 1:
        ungrouped = np.sort(np.argsort(-(s + b), axis=1, kind="stable")[:, :K], axis=1)
        assert (ungrouped != hi).any(1).sum() > 0
    if norm:
        np.testing.assert_allclose(w.sum(1), scale, rtol=1e-6)
    # largest choice first
    c = np.take_along_axis(s + b, ids, 1)
    assert (np.diff(c, axis=1) <= 1e-7).all()


def test_router_ties_go_to_the_lower_index():
    """Exact ties: here the lower index wins, in the group stage and the expert stage. HF's
    torch.topk (CPU) leaves equal values in no documented order; what it picks is a top-k set of
    the same scores (so the weights agree), only the members may differ."""
    E, G, TG, K = 16, 4, 2, 4
    logits = np.zeros((2, E), np.float32)            # every expert ties
    logits[1, [3, 7, 11]] = 1.0                       # groups 0, 1, 2 tie on their top 2; then 6 experts tie
    bias = np.zeros(E, np.float32)
    ids, w = route(logits, bias, K, G, TG, True, 1.0)
    assert ids[0].tolist() == [0, 1, 2, 3]            # groups 0, 1 (all tie); then experts 0..3
    # row 1: groups 0 (expert 3) and 1 (expert 7) tie with group 2 (expert 11) on their top 2: 0, 1 win
    assert ids[1].tolist() == [3, 7, 0, 1]
    r = hf_router(E, G, TG, K, True, 1.0)
    with torch.no_grad():
        r.e_score_correction_bias.zero_()
        r.weight.zero_()
        _, hw0, hi0 = r(torch.zeros(2, 64))           # HF on row 0's input (all logits 0)
    assert len(set(hi0[0].tolist())) == K
    np.testing.assert_array_equal(np.sort(hw0.numpy()[0]), np.sort(w[0]))


def test_router_registered():
    sig = P.OPS["moe_router_grouped"]
    assert sig.weights == ("weight", "bias") and set(sig.attrs) == {"top_k", "n_group", "topk_group", "norm", "scale"}


# --------------------------------------------------------------------------- prepare and the plan


def assert_exact(ck, art):
    """Every artifact tensor, its rank slices joined along its cut (a 1-D column cut, a bias: its only
    axis), decodes bit for bit to the checkpoint's value; every checkpoint tensor is in it once."""
    seen = set()
    for name, t in art.tensors(0).items():
        pieces = [art.decode(name, r) for r in art.ranks]
        if t.cut == "replicated":
            assert all(np.array_equal(p.view(np.uint32), pieces[0].view(np.uint32)) for p in pieces), name
            got = pieces[0]
        else:
            got = np.concatenate(pieces, axis=-1 if t.cut == "row" or pieces[0].ndim == 1 else -2)
        vals = [ck.tensors[n].decode() if n in ck.tensors else np.asarray(ck.kv_scales[n].array(), np.float32)
                for n in t.sources]
        want = np.stack(vals) if t.role.endswith("_exps") else vals[0].reshape(got.shape)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
        seen.update(t.sources)
    assert seen == set(ck.tensors) | set(ck.kv_scales)


@pytest.mark.models
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prepare_every_export(fmt, tp):
    """Every export prepares at tp 1 and 2, every tensor exact (assert_exact); the router and its
    correction bias replicated in their stored dtype (F32 in the ModelOpt exports, BF16 in the BF16
    one), the q/k/v biases cut with their linears' rows (the exports' biases are zeros: the
    perturbed copies below check the join on real values), experts and shared experts in the
    stored format, the first layer dense."""
    name = f"tiny-glm4_moe/{fmt}"
    ck = Checkpoint.open(need(name))
    art = Artifact.open(artifact(name, tp), verify=True)
    assert art.tp == tp
    assert_exact(ck, art)
    quant = "bf16" if fmt == "bf16" else {"nvfp4": "nvfp4", "nvfp4_fp8kv": "nvfp4", "fp8": "fp8_tensor",
                                          "mxfp8": "mxfp8"}[fmt]
    router = "bf16" if fmt == "bf16" else "f32"
    for r in range(tp):
        t = art.tensors(r)
        assert "blk.0.ffn_gate" in t and "blk.0.ffn_gate_inp" not in t and "blk.0.ffn_gate_exps" not in t
        for L in (1, 2):
            b = f"blk.{L}."
            assert f"blk.{L}.ffn_gate" not in t
            assert t[b + "ffn_gate_inp"].format == t[b + "exp_probs_b"].format == router
            assert t[b + "ffn_gate_inp"].cut == t[b + "exp_probs_b"].cut == "replicated"
            assert tuple(t[b + "ffn_gate_inp"].shape) == (8, 128) and tuple(t[b + "exp_probs_b"].shape) == (8,)
            assert {t[b + n].format for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                                               "ffn_up_shexp", "ffn_down_shexp", "attn_q")} == {quant}
            assert tuple(t[b + "ffn_gate_exps"].shape) == (8, 128 // tp, 128)
            assert tuple(t[b + "ffn_down_shexp"].shape) == (128, 128 // tp)
            assert tuple(t[b + "post_attention_norm"].shape) == (128,)
        for L in range(3):
            for n, rows in (("attn_q", 128), ("attn_k", 64), ("attn_v", 64)):
                bias = t[f"blk.{L}.{n}_bias"]
                assert bias.format == "bf16" and bias.cut == "column" and tuple(bias.shape) == (rows // tp,)
    for L in range(3):
        for n, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            joined = np.concatenate([art.decode(f"blk.{L}.{n}_bias", r) for r in range(tp)])
            assert np.array_equal(joined, ck.tensors[f"model.layers.{L}.self_attn.{hf}.bias"].decode())
    for L in (1, 2):
        for n, hf in (("ffn_gate_inp", "gate.weight"), ("exp_probs_b", "gate.e_score_correction_bias")):
            assert np.array_equal(art.decode(f"blk.{L}.{n}", tp - 1), ck.tensors[f"model.layers.{L}.mlp.{hf}"].decode())
    art.close()


def plans(name, tp):
    ranks = planning.plan(Checkpoint.open(need(name)), tp=tp)
    return ranks, [lower.lower_rank(r.metadata, {t.name: t for t in r.tensors}) for r in ranks]


def ops(plan, prog="decode"):
    return plan["programs"][prog]["ops"]


@pytest.mark.models
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_blocks(tp):
    """Layer 0 a dense SwiGLU, layers 1-2 the grouped router, routed experts and the shared expert
    added before the residual; q/k/v biases before the per-head q/k norms; partial rope (16 of 32);
    at tp 2 one all_reduce after attention and one after the FFN (routed + shared summed first)."""
    ranks, lowered = plans("tiny-glm4_moe/nvfp4", tp)
    for rank, p in zip(ranks, lowered):
        o = ops(p)
        names = [x["op"] for x in o]
        assert names.count("moe_router_grouped") == names.count("moe_experts") == 2 and "moe_router" not in names
        routers = [x for x in o if x["op"] == "moe_router_grouped"]
        assert [x["weight"] for x in routers] == ["blk.1.ffn_gate_inp", "blk.2.ffn_gate_inp"]
        assert [x["bias"] for x in routers] == ["blk.1.exp_probs_b", "blk.2.exp_probs_b"]
        assert {(x["top_k"], x["n_group"], x["topk_group"], x["norm"], x["scale"]) for x in routers} == \
            {(2, 1, 1, True, 2.5)}
        linears = [x["weight"] for x in o if x["op"] == "linear"]
        assert [w for w in linears if w.startswith("blk.0.ffn")] == ["blk.0.ffn_gate", "blk.0.ffn_up", "blk.0.ffn_down"]
        for L in (1, 2):
            assert [w for w in linears if w.startswith(f"blk.{L}.ffn")] == \
                [f"blk.{L}.ffn_gate_shexp", f"blk.{L}.ffn_up_shexp", f"blk.{L}.ffn_down_shexp"]
        biases = [x["bias"] for x in o if x["op"] == "bias_add"]
        assert biases == [f"blk.{L}.{n}_bias" for L in range(3) for n in ("attn_q", "attn_k", "attn_v")]
        assert {x["rotary_dim"] for x in o if x["op"] == "rope"} == {16} and sum(x["op"] == "rope" for x in o) == 6
        norms = [x["weight"] for x in o if x["op"] == "rmsnorm"]
        assert norms[:4] == ["blk.0.attn_norm", "blk.0.attn_q_norm", "blk.0.attn_k_norm", "blk.0.post_attention_norm"]
        # per layer, in order: the three linears and their biases, then the q/k norms, then rope
        i = names.index("bias_add")
        assert names[i - 3:i + 6] == ["linear"] * 3 + ["bias_add"] * 3 + ["rmsnorm"] * 2 + ["rope"]
        # a sparse layer's FFN: router, experts, shared gate/up/swiglu/down, routed + shared, (reduce), residual
        j = names.index("moe_router_grouped")
        tail = ["all_reduce", "add"] if tp > 1 else ["add"]
        assert names[j:j + 7 + len(tail)] == ["moe_router_grouped", "moe_experts", "linear", "linear", "swiglu",
                                              "linear", "add"] + tail
        shared_add = o[j + 6]
        assert shared_add["a"] == o[j + 1]["out"] == shared_add["out"] and shared_add["b"] == o[j + 5]["out"]
        assert names.count("all_reduce") == (6 if tp > 1 else 0)
        att = [x for x in o if x["op"] == "attention"]
        assert {(x["heads"], x["kv_heads"], x["head_dim"]) for x in att} == {(4 // tp, 2 // tp, 32)}
        assert set(P.weights_of(p)) == {t.name for t in rank.tensors if not t.name.endswith(("_k_scale", "_v_scale"))}
        # one op list for every step: decode and prefill differ only in the attention's mode
        strip = lambda prog: [{k: v for k, v in x.items() if k != "mode"} for x in ops(p, prog)]   # noqa: E731
        assert strip("decode") == strip("prefill")


@pytest.mark.models
def test_decode_steps_and_chunks_equal_one_prefill():
    """Decoding token by token over the cache, and prefill in chunks of 1 and 7 rows, give the
    one-chunk prefill's logits (the decode program is the prefill's op list; the router runs per row)."""
    from bloomery import runtime
    from runtime_artifacts import rel

    ids = list(np.random.default_rng(5).integers(0, 512, 24))
    eng = runtime.Engine(artifact("tiny-glm4_moe/nvfp4", 2), ctx=32, ubatch=32)
    want = runtime.logits(eng, ids)
    eng.reset()
    got = np.stack([eng.decode([i])[0][0] for i in ids])
    assert rel(got, want) < 1e-5, rel(got, want)
    for u in (1, 7):
        got = runtime.logits(runtime.Engine(artifact("tiny-glm4_moe/nvfp4", 2), ctx=32, ubatch=u), ids)
        assert rel(got, want) < 1e-5, (u, rel(got, want))


# --------------------------------------------------------------------------- gates on perturbed copies


def perturbed_copy(name, dst, seed=0):
    """A copy of a tiny export whose zeros and ones (HF's initial values, as exported) are random, in
    their stored dtypes: the e_score_correction_bias (std 0.05, against sigmoid scores of 0.5 +- 0.05:
    it moves the routing), the q/k/v biases (std 0.2, the size of x @ W.T here) and every norm weight
    (1 +- 0.2: input, post-attention, q, k and the final norm)."""
    from ckpt import overwrite_tensor

    shutil.copytree(need(name), dst)
    ck = Checkpoint.open(dst)
    rng = np.random.default_rng(seed)
    for n, qt in sorted(ck.tensors.items()):
        if n.endswith("e_score_correction_bias"):
            vals = rng.normal(0, 0.05, qt.shape)
        elif n.endswith("_proj.bias"):
            vals = rng.normal(0, 0.2, qt.shape)
        elif n.endswith(("norm.weight", "layernorm.weight")):
            vals = 1 + rng.normal(0, 0.2, qt.shape)
        else:
            continue
        t = qt.sources["weight"]
        overwrite_tensor(t.shard.path, t.name, vals.astype(t.array().dtype))
    return dst


def gate_rows(folder, tmp, limit=FAST_LIMIT):
    """(executor tp 1 vs the oracle, executor tp 2 vs tp 1) metrics over the prompt set's slice."""
    from bloomery.tools import oracle

    seqs = gates.sequences(folder, limit)
    a1, a2 = tmp / "tp1", tmp / "tp2"
    prepare(folder, a1, tp=1, progress=False)
    prepare(folder, a2, tp=2, progress=False)
    ref = oracle.Oracle(folder, cache=False)
    e1, e2 = gates.executor(a1, seqs), gates.executor(a2, seqs)
    refs = [ref.logits(s.ids) for s in seqs]
    c1 = [gates.executor_logits(e1, s.ids) for s in seqs]
    c2 = [gates.executor_logits(e2, s.ids) for s in seqs]
    return gates.compare(refs, c1), gates.compare(c1, c2), (seqs, refs, e1)


@pytest.mark.models
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_gate_on_a_perturbed_copy(fmt, tmp_path, monkeypatch):
    """The executor passes the executor_vs_oracle bands, tp 2 the tp2_vs_tp1 ones, on a copy whose
    correction bias moves the experts of many rows and whose q/k/v biases and norms are not zeros and
    ones; a router that forgets the correction bias fails them, so does bias_add left out."""
    bands = gates.load_bands()
    folder = perturbed_copy(f"tiny-glm4_moe/{fmt}", tmp_path / "ckpt")
    m, m2, (seqs, refs, _) = gate_rows(folder, tmp_path)
    assert m["positions"] >= 9 * 32
    assert not gates.check(m, bands["executor_vs_oracle"]), m
    assert not gates.check(m2, bands["tp2_vs_tp1"]), m2
    ck, a2 = Checkpoint.open(folder), Artifact.open(tmp_path / "tp2")
    for L in range(3):                  # the biases' rank slices, joined: the stored (non-zero) bias
        for n, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            want = ck.tensors[f"model.layers.{L}.self_attn.{hf}.bias"].decode()
            assert np.abs(want).min() > 0
            assert np.array_equal(np.concatenate([a2.decode(f"blk.{L}.{n}_bias", r) for r in range(2)]), want)
    a2.close()
    mod = IMPL["moe_router_grouped"]
    real = mod.route
    moved = []

    def unbiased(logits, bias, *a):
        ids, w = real(logits, np.zeros_like(bias), *a)
        moved.append(float((np.sort(ids, 1) != np.sort(real(logits, bias, *a)[0], 1)).any(1).mean()))
        return ids, w
    monkeypatch.setattr(mod, "route", unbiased)
    e = gates.executor(tmp_path / "tp1", seqs)
    bad = gates.compare(refs, [gates.executor_logits(e, s.ids) for s in seqs])
    assert np.mean(moved) > 0.2, moved                          # the bias changes the experts of many rows
    assert gates.check(bad, bands["executor_vs_oracle"]), bad
    monkeypatch.setattr(mod, "route", real)
    monkeypatch.setattr(IMPL["bias_add"], "run", lambda op, buf, w: None)
    e = gates.executor(tmp_path / "tp1", seqs)
    bad = gates.compare(refs, [gates.executor_logits(e, s.ids) for s in seqs])
    assert gates.check(bad, bands["executor_vs_oracle"]), bad


@pytest.mark.models
def test_gate_catches_planted_defects(tmp_path, monkeypatch):
    """The executor_vs_oracle bands on the stock nvfp4 export catch a routed_scaling_factor left out,
    the shared expert left out, and rope over the whole head (partial rotary ignored)."""
    from bloomery.runtime.ops import add, rope

    bands = gates.load_bands()
    folder = need("tiny-glm4_moe/nvfp4")
    m, _, (seqs, refs, _) = gate_rows(folder, tmp_path)
    assert not gates.check(m, bands["executor_vs_oracle"]), m
    mod = IMPL["moe_router_grouped"]
    real_route, real_add, real_rope = mod.route, add.run, rope.run

    def fails():
        e = gates.executor(tmp_path / "tp1", seqs)
        bad = gates.compare(refs, [gates.executor_logits(e, s.ids) for s in seqs])
        return gates.check(bad, bands["executor_vs_oracle"])

    monkeypatch.setattr(mod, "route", lambda lg, b, k, g, tg, n, s: real_route(lg, b, k, g, tg, n, 1.0))
    assert fails()
    monkeypatch.setattr(mod, "route", real_route)
    monkeypatch.setattr(IMPL["add"], "run",
                        lambda op, buf, w: None if op["b"].startswith("shexp") else real_add(op, buf, w))
    assert fails()
    monkeypatch.setattr(IMPL["add"], "run", real_add)
    monkeypatch.setattr(IMPL["rope"], "run",
                        lambda op, buf, w: real_rope({k: v for k, v in op.items() if k != "rotary_dim"}, buf, w))
    assert fails()


# --------------------------------------------------------------------------- the NextN layer


NEXTN_HF = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight")
NEXTN_ART = {"eh_proj.weight": "nextn.eh_proj", "enorm.weight": "nextn.enorm", "hnorm.weight": "nextn.hnorm",
             "shared_head.norm.weight": "nextn.shared_head_norm", "shared_head.head.weight": "nextn.shared_head_head",
             "embed_tokens.weight": "nextn.embed_tokens"}


def with_nextn(name, dst, optional=True, drop=()):
    """A copy of a tiny export with one NextN layer, model.layers.3, as a GLM-4.5 checkpoint holds it:
    a decoder block (layer 2's stored tensors under the new index: the MoE block, in the export's
    formats) plus eh_proj (in the export's quantized format, as ModelOpt stores a linear; BF16 in
    the BF16 export), enorm, hnorm, shared_head.norm and, when `optional`, shared_head.head and
    embed_tokens (BF16). Written into a second shard with an index, as a real release splits its
    files. Returns {HF name: stored arrays by suffix} of the new tensors."""
    import ckpt
    from safetensors.numpy import save_file

    src = need(name)
    shutil.copytree(src, dst)
    ck = Checkpoint.open(dst)
    cfg = json.loads((dst / "config.json").read_text())
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    shard = next(iter(ck.shards.values()))
    new = {}
    for n, t in shard.tensors.items():
        if n.startswith(f"model.layers.{L - 1}."):
            new[n.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.", 1)] = t.array()
    rng = np.random.default_rng(7)
    p = f"model.layers.{L}."
    algo = {"nvfp4": "NVFP4", "fp8": "FP8", "mxfp8": "MXFP8", "nvfp4_fp8kv": "NVFP4"}.get(name.split("/")[1])
    if algo:
        new.update(ckpt.PARTS[algo](rng, H, 2 * H, p + "eh_proj"))
    else:
        new[p + "eh_proj.weight"] = ckpt.bf16(rng, H, 2 * H)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        new[f"{p}{n}.weight"] = ckpt.bf16(rng, H)
    if optional:
        new[p + "shared_head.head.weight"] = ckpt.bf16(rng, V, H)
        new[p + "embed_tokens.weight"] = ckpt.bf16(rng, V, H)
    for d in drop:
        new.pop(p + d)
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(new.items())}, str(dst / "model-nextn.safetensors"))
    weight_map = {n: "model.safetensors" for n in shard.tensors}
    weight_map.update({n: "model-nextn.safetensors" for n in new})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return new


def _same_bits(a, b) -> bool:
    a, b = (np.ascontiguousarray(x).reshape(-1) for x in (a, b))
    return a.size == b.size and a.dtype.itemsize == b.dtype.itemsize and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.models
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8"])
def test_nextn_layer_carried_as_stored(fmt, tmp_path):
    """The NextN layer's tensors travel into the artifact under llama.cpp's names (blk.3.nextn.*, and
    blk.3.* for its decoder block), each part bit for bit as stored (the head's rank slices at tp 2
    joined), `bloomery inspect` lists them, and the main programs read none of them (the plan's
    mtp program does): they are the programs of the export without them, and give the same logits."""
    name = f"tiny-glm4_moe/{fmt}"
    new = with_nextn(name, tmp_path / "ckpt")
    ck = Checkpoint.open(tmp_path / "ckpt")
    for tp in (1, 2):
        out = tmp_path / f"art{tp}"
        prepare(tmp_path / "ckpt", out, tp=tp, progress=False)
        art = Artifact.open(out, verify=True)
        base = Artifact.open(artifact(name, tp))
        for r in range(tp):
            t = art.tensors(r)
            carried = {b: i for b, i in t.items() if b.startswith("blk.3.")}
            assert {f"blk.3.{v}" for v in NEXTN_ART.values()} <= set(carried)
            assert {"blk.3.attn_q", "blk.3.ffn_gate_exps", "blk.3.exp_probs_b", "blk.3.ffn_up_shexp"} <= set(carried)
            assert sorted(s for i in carried.values() for s in i.sources) == sorted(
                n for n in ck.tensors if n.startswith("model.layers.3."))
            eh = t["blk.3.nextn.eh_proj"]
            assert eh.format == ck.tensors["model.layers.3.eh_proj.weight"].format.name == \
                ("bf16" if fmt == "bf16" else {"nvfp4": "nvfp4", "fp8": "fp8_tensor"}[fmt]) and eh.cut == "replicated"
            # the main programs: the same as without the NextN layer, reading nothing of it; the mtp
            # program reads it
            plan = json.loads(art.metadata(r)[P.KEY])
            mtp_prog = plan["programs"].pop("mtp")
            assert not [w for w in P.weights_of(plan) if w.startswith("blk.3.")]
            assert {f"blk.3.{v}" for v in ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm",
                                           "attn_q", "ffn_gate_exps")} <= set(P.weights_of({"programs": {"mtp": mtp_prog}}))
            assert plan["programs"] == json.loads(base.metadata(r)[P.KEY])["programs"]
            assert int(art.metadata(r)["glm4moe.block_count"]) == 4
            assert int(art.metadata(r)["glm4moe.nextn_predict_layers"]) == 1
        for hf, suffix in NEXTN_ART.items():
            qt = ck.tensors[f"model.layers.3.{hf}"]
            b = f"blk.3.{suffix}"
            if art.tensors(0)[b].cut == "column" and tp > 1:       # the NextN head: vocab-parallel, like `output`
                got = {k: np.concatenate([np.asarray(art.parts(b, r)[k]) for r in range(tp)]) for k in qt.parts}
            else:
                got = art.parts(b, tp - 1)
            assert set(got) == set(qt.parts), (b, set(got), set(qt.parts))
            for k, v in qt.parts.items():
                assert _same_bits(got[k], v), (b, k)
        # the decoder block's weights likewise (the stacked experts: expert by expert)
        for b, hf in (("blk.3.ffn_gate_inp", "model.layers.3.mlp.gate.weight"),
                      ("blk.3.exp_probs_b", "model.layers.3.mlp.gate.e_score_correction_bias")):
            assert _same_bits(art.parts(b, 0)["weight"], ck.tensors[hf].parts["weight"])
        if tp == 1:
            e3 = art.parts("blk.3.ffn_down_exps", 0)
            for x in range(8):
                qt = ck.tensors[f"model.layers.3.mlp.experts.{x}.down_proj.weight"]
                assert _same_bits(e3["weight"][x], qt.parts["weight"])
            r = CliRunner().invoke(main, ["inspect", str(out)])
            assert r.exit_code == 0, r.output
            for suffix in NEXTN_ART.values():
                assert f"blk.3.{suffix} " in r.output
            r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
            listed = {x["name"] for x in json.loads(r.output)["tensors"]}
            assert {f"blk.3.{s}" for s in NEXTN_ART.values()} <= listed
            from bloomery import runtime
            ids = list(range(3, 40))
            assert np.array_equal(runtime.logits(str(out), ids, device="cpu"),
                                  runtime.logits(str(artifact(name, 1)), ids, device="cpu"))
        art.close()
        base.close()
    assert {n for n in ck.tensors if n.startswith("model.layers.3.")} == \
        {n for n in new if not n.endswith(("input_scale", "weight_scale", "weight_scale_2"))}


@pytest.mark.models
def test_nextn_optional_and_required_tensors(tmp_path):
    """shared_head.head and embed_tokens may be left out (GLM-4.6 drops them); eh_proj may not
    (MissingTensor names it); the oracle builds the model of a NextN checkpoint (the layer left out,
    as transformers does) and gives the export's logits."""
    from bloomery.tools import oracle

    with_nextn("tiny-glm4_moe/bf16", tmp_path / "lean", optional=False)
    prepare(tmp_path / "lean", tmp_path / "art", progress=False)
    t = Artifact.open(tmp_path / "art").tensors(0)
    assert "blk.3.nextn.eh_proj" in t
    assert "blk.3.nextn.shared_head_head" not in t and "blk.3.nextn.embed_tokens" not in t
    ids = list(range(3, 30))
    assert np.array_equal(oracle.Oracle(tmp_path / "lean", cache=False).logits(ids),
                          oracle.Oracle(need("tiny-glm4_moe/bf16"), cache=False).logits(ids))
    with_nextn("tiny-glm4_moe/bf16", tmp_path / "broken", drop=("eh_proj.weight",))
    with pytest.raises(errors.MissingTensor, match=r"model\.layers\.3\.eh_proj\.weight.*blk\.3\.nextn\.eh_proj"):
        planning.plan(Checkpoint.open(tmp_path / "broken"))


# --------------------------------------------------------------------------- refusals


def _cfg(**edit):
    cfg = json.loads((need("tiny-glm4_moe/bf16") / "config.json").read_text())
    for k, v in edit.items():
        if k == "rope_type":
            cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": v, "factor": 4.0}
        else:
            cfg[k] = v
    return cfg


@pytest.mark.models
@pytest.mark.parametrize("edit,words", [
    ({"rope_type": "yarn"}, ["rope_type", "'yarn'", "only 'default'"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "'gelu'", "only 'silu'"]),
    ({"n_group": 3}, ["n_group 3", "n_routed_experts 8", "groups of 2 or more"]),
    ({"n_group": 8}, ["n_group 8", "groups of 2 or more"]),
    ({"n_group": 2, "topk_group": 3}, ["topk_group 3", "n_group 2"]),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, ["num_experts_per_tok 3", "topk_group 1"]),
    ({"n_shared_experts": 0}, ["n_shared_experts 0", "1 or more"]),
    ({"partial_rotary_factor": 0.3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                       "partial_rotary_factor": 0.3}}, ["partial_rotary_factor 0.3", "9"]),
    ({"num_key_value_heads": 3}, ["4 attention heads", "3 KV heads"]),
])
def test_config_refusals(edit, words):
    spec = specs.for_config(_cfg(**edit))
    assert spec.family == "glm4_moe"
    with pytest.raises(errors.UnsupportedConfig) as ei:
        spec.values(_cfg(**edit), "cfg.json")
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


@pytest.mark.models
def test_refusals_through_prepare(tmp_path):
    """The command refuses by name before writing: rope scaling, and tp 3 over 2 KV heads."""
    folder = tmp_path / "yarn"
    shutil.copytree(need("tiny-glm4_moe/nvfp4"), folder)
    (folder / "config.json").write_text(json.dumps(_cfg(rope_type="yarn")))
    r = CliRunner().invoke(main, ["prepare", str(folder), str(tmp_path / "out")])
    assert r.exit_code != 0 and "UnsupportedConfig" in r.output and "'yarn'" in r.output, r.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(errors.TPNotDivisible, match="2 KV heads cannot be shared out over tp 3"):
        planning.plan(Checkpoint.open(need("tiny-glm4_moe/nvfp4")), tp=3)
