"""The NumPy executor on artifacts of the test checkpoints: its logits against an independent
float64 forward written here from the checkpoint's own decoded weights (so the lowered plan is
checked, not only the ops); prompt chunking; TP=2 against TP=1; SmolLM2's answer."""

import numpy as np
import pytest

from bloomery import runtime
from bloomery.compiler.checkpoint import Checkpoint
from runtime_artifacts import EXPORTS, REFUSED, artifact, need

pytestmark = pytest.mark.models
TINY = [n for n in EXPORTS if n.startswith("tiny-") and (n, 1) not in REFUSED]


def reference_logits(folder, ids):
    """HF's Llama / Qwen3-MoE forward in float64 over the whole sequence (no cache)."""
    ck = Checkpoint.open(folder)
    c = ck.config
    weights = {}

    def W(name):
        if name not in weights:
            weights[name] = ck.tensors[name].decode().astype(np.float64)
        return weights[name]

    def lin(x, name):
        pq = ck.tensors[name].parts.get("pre_quant_scale")
        if pq is not None:
            x = x * np.asarray(pq, np.float64)
        return x @ W(name).T

    def norm(x, name):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + c["rms_norm_eps"]) * W(name)

    def silu(x):
        return x / (1 + np.exp(-x))

    n, H, KV = len(ids), c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // H
    theta = c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta", 10000.0))
    ang = np.arange(n)[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rope = lambda x: x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin
    h = W("model.embed_tokens.weight")[ids]
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        x = norm(h, p + "input_layernorm.weight")
        q = lin(x, p + "self_attn.q_proj.weight").reshape(n, H, d)
        k = lin(x, p + "self_attn.k_proj.weight").reshape(n, KV, d)
        v = lin(x, p + "self_attn.v_proj.weight").reshape(n, KV, d)
        if p + "self_attn.q_norm.weight" in ck.tensors:
            q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s[:, np.triu(np.ones((n, n), bool), 1)] = -np.inf
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        h = h + lin(np.einsum("hqk,khd->qhd", pr, v).reshape(n, H * d), p + "self_attn.o_proj.weight")
        x = norm(h, p + "post_attention_layernorm.weight")
        if p + "mlp.gate.weight" in ck.tensors:
            logit = x @ W(p + "mlp.gate.weight").T
            prob = np.exp(logit - logit.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            f = np.zeros_like(x)
            for r in range(n):
                top = np.argsort(-prob[r])[:c["num_experts_per_tok"]]
                wt = prob[r, top] / (prob[r, top].sum() if c.get("norm_topk_prob") else 1.0)
                for e, we in zip(top, wt):
                    ep = f"{p}mlp.experts.{e}."
                    a = silu(lin(x[r], ep + "gate_proj.weight")) * lin(x[r], ep + "up_proj.weight")
                    f[r] += we * lin(a, ep + "down_proj.weight")
        else:
            f = lin(silu(lin(x, p + "mlp.gate_proj.weight")) * lin(x, p + "mlp.up_proj.weight"),
                    p + "mlp.down_proj.weight")
        h = h + f
    x = norm(h, "model.norm.weight")
    head = "model.embed_tokens.weight" if c.get("tie_word_embeddings") else "lm_head.weight"
    return x @ W(head).T


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", TINY)
def test_logits_against_reference_forward(name):
    ids = list(np.random.default_rng(3).integers(0, 512, 40))
    got = runtime.logits(artifact(name), ids, ubatch=16)
    want = reference_logits(need(name), ids)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel(got, want) < 5e-6, rel(got, want)
    assert (np.argmax(got, -1) == np.argmax(want, -1)).mean() >= 0.95


@pytest.mark.parametrize("name", ["tiny-llama/nvfp4", "tiny-qwen3_moe/bf16"])
def test_prefill_chunks_equal_one_chunk(name):
    ids = list(np.random.default_rng(4).integers(0, 512, 64))
    eng = runtime.Engine(artifact(name), ctx=64, ubatch=64)
    one = runtime.logits(eng, ids)
    for u in (1, 7):
        got = runtime.logits(runtime.Engine(artifact(name), ctx=64, ubatch=u), ids)
        assert rel(got, one) < 1e-5, (u, rel(got, one))


def test_decode_steps_equal_prefill():
    """Decoding token by token over the cache gives the prefill's logits row for row."""
    ids = list(np.random.default_rng(5).integers(0, 512, 12))
    eng = runtime.Engine(artifact("tiny-qwen3_moe/nvfp4"), ctx=32)
    want = runtime.logits(eng, ids)
    eng.reset()
    got = np.stack([eng.decode([i])[0][0] for i in ids])
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["tiny-llama/nvfp4_awq", "tiny-qwen3_moe/nvfp4", "smollm2-135m/nvfp4"])
def test_tp2_equals_tp1(name):
    small = name.startswith("tiny")
    e1, e2 = (runtime.Engine(artifact(name, tp), ctx=96) for tp in (1, 2))
    if not small:                      # SmolLM2: 3 KV heads go 2 + 1 over the ranks
        assert [int(e2.art.metadata(r)["bloomery.tp.head_count_kv"]) for r in (0, 1)] == [2, 1]
    g1 = runtime.generate(e1, "The capital of France is", raw=True, max_tokens=12 if small else 6)
    g2 = runtime.generate(e2, "The capital of France is", raw=True, max_tokens=12 if small else 6)
    assert g1.token_ids == g2.token_ids and g1.text == g2.text
    ids = g1.prompt_ids + g1.token_ids
    a, b = runtime.logits(e1, ids), runtime.logits(e2, ids)
    assert rel(b, a) < 1e-5, rel(b, a)


def test_smollm2_knows_paris():
    g = runtime.generate(artifact("smollm2-135m/nvfp4"), "What is the capital of France?", max_tokens=12)
    assert "Paris" in g.text, g.text
    assert g.prompt_ids[:1] == [1] and g.stop in ("eos", "length")
