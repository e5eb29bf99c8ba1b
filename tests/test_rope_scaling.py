"""Rope scaling (core/rope.py: Llama 3.x's llama3, YaRN) against transformers' own functions
(modeling_rope_utils.py, the rotary embedding modules and apply_rotary_pos_emb), the config forms
the specs read, the plan the lowering writes (Qwen3 dense, q/k/v/o biases), and the gate failing
a plan that leaves the scaling out."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bloomery.core import errors, rope, specs
from bloomery.core.plan import PlanInvalid
from bloomery.runtime.ops import IMPL
from runtime_artifacts import artifact, assert_engines_agree, need, rel

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# (head_dim, theta, rope_parameters): Llama 3.1 / 3.2 / the tiny exports' own, Qwen3's YaRN and variants
CASES = [
    (128, 500000.0, LLAMA3),
    (64, 500000.0, {**LLAMA3, "factor": 32.0}),
    (32, 500000.0, {**LLAMA3, "original_max_position_embeddings": 64}),
    (128, 1000000.0, YARN),
    (32, 1000000.0, {**YARN, "original_max_position_embeddings": 256}),
    (128, 10000.0, {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    (64, 1000000.0, {**YARN, "factor": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0}),
]


def hf_config(head_dim, theta, params, cls=None):
    cls = cls or tf.LlamaConfig
    ctx = int(params["original_max_position_embeddings"] * params.get("factor", 1.0))
    return cls(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
               max_position_embeddings=ctx, rope_parameters={**params, "rope_theta": theta})


LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
             "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 96, "max_position_embeddings": 131072}


def spec_metadata(extra: dict, family: str = "llama") -> dict:
    """The GGUF metadata a spec writes for LLAMA_CFG updated with `extra` (as prepare does)."""
    s = specs.all_specs()[family]
    v = s.values({**LLAMA_CFG, **extra})
    return {k: m.value(v) for k, m in s.metadata.items() if m.applies(v)}


def ours(theta, params) -> tuple[dict, float]:
    """(the rope op's scaling attr, the attention factor) for transformers' rope_parameters, through
    the llama spec and the metadata it writes: the path prepare and the lowering take."""
    return rope.from_metadata(spec_metadata({"rope_parameters": {**params, "rope_theta": theta}}), "llama")


# --------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("head_dim,theta,params", CASES)
def test_inv_freq_and_attention_factor_are_transformers(head_dim, theta, params):
    ref, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config(head_dim, theta, params), "cpu")
    ref = ref.numpy()
    s, factor = ours(theta, params)
    got = rope.inv_freq(theta, head_dim, s)
    assert got.dtype == np.float32 and got.shape == ref.shape
    # float32 pow differs by an ulp or two between NumPy and torch (the default rope's too)
    assert np.abs(got / ref - 1).max() < 4e-7
    plain = rope.inv_freq(theta, head_dim)
    moved = np.abs(ref / plain - 1) > 1e-5           # the frequencies the scaling moves, in transformers
    assert moved.sum() >= 2 and np.array_equal(np.abs(got / plain - 1) > 1e-5, moved)
    assert factor == float(np.float32(ref_factor))   # stored as f32 metadata


def test_yarn_attention_factor_forms():
    for params in ({**YARN, "attention_factor": 0.8}, {**YARN, "factor": 1.0},
                   {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, {**YARN, "mscale": 0.707, "mscale_all_dim": 0.5}):
        _, want = ROPE_INIT_FUNCTIONS["yarn"](hf_config(64, 1e6, params), "cpu")
        got = rope.yarn_attention_factor(params["factor"], params.get("attention_factor"), params.get("mscale"),
                                         params.get("mscale_all_dim"))
        assert got == want, params


@pytest.mark.parametrize("head_dim,theta,params", [CASES[2], CASES[4], CASES[6]])
def test_rope_op_times_attention_factor_is_hfs_rotary_embedding(head_dim, theta, params):
    """The NumPy rope op with the plan's scaling attr, times the attention factor the lowering folds
    into attention's scale, against transformers' rotary embedding module (its cos and sin carry the
    attention factor) and apply_rotary_pos_emb, at positions past original_max_position_embeddings."""
    cfg = hf_config(head_dim, theta, params)
    heads, rows = 3, 9
    pos = np.array([0, 1, 7, 63, 64, 200, 1000, 4095, -1], np.int32)
    x = np.random.default_rng(0).standard_normal((rows, heads * head_dim)).astype(np.float32)
    emb = modeling_llama.LlamaRotaryEmbedding(cfg)
    xt = torch.from_numpy(x).reshape(rows, heads, head_dim).transpose(0, 1)[None]
    cos, sin = emb(xt, torch.from_numpy(np.maximum(pos, 0).astype(np.int64))[None])
    q, _ = modeling_llama.apply_rotary_pos_emb(xt, xt, cos, sin)
    ref = q[0].transpose(0, 1).reshape(rows, heads * head_dim).numpy()
    s, factor = ours(theta, params)
    op = {"x": "x", "pos": "pos", "out": "out", "heads": heads, "head_dim": head_dim, "theta": theta}
    buf = {"x": x, "pos": pos, "out": np.zeros_like(x)}
    IMPL["rope"].run({**op, "scaling": s}, buf, {})
    assert rel(buf["out"] * np.float32(factor), ref) < 3e-5
    IMPL["rope"].run(op, buf, {})                     # the default rope: not what transformers computes here
    assert rel(buf["out"] * np.float32(factor), ref) > 1e-2


def test_unknown_or_incomplete_scaling_is_refused():
    with pytest.raises(PlanInvalid, match="rope scaling 'longrope' is not one bloomery computes"):
        rope.inv_freq(1e4, 32, {"type": "longrope", "factor": 2.0})
    with pytest.raises(PlanInvalid, match="lacks high_freq_factor"):
        rope.inv_freq(1e4, 32, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_context": 64})
    md = spec_metadata({"rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    del md["bloomery.rope.scaling.low_freq_factor"]
    with pytest.raises(errors.UnsupportedConfig, match="lacks low_freq_factor"):
        rope.from_metadata(md, "llama")
    assert rope.from_metadata(spec_metadata({}), "llama") == (None, 1.0)


# --------------------------------------------------------------------------- the config forms


def test_rope_parameters_and_rope_scaling_forms_agree():
    """transformers 5's rope_parameters and the rope_scaling object of older configs (Llama 3.1's own,
    beside a top-level rope_theta; `type` for rope_type) give the same metadata, in every spec that
    takes rope scaling."""
    for fam, arch in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
        for params in (LLAMA3, YARN):
            base = {"architectures": [arch], "model_type": fam}
            new = spec_metadata({**base, "rope_parameters": {**params, "rope_theta": 5e5}}, fam)
            old_params = {("type" if k == "rope_type" else k): v for k, v in params.items()}
            old = spec_metadata({**base, "rope_scaling": old_params, "rope_theta": 5e5}, fam)
            assert new == old and new[f"{fam}.rope.scaling.type"] == params["rope_type"], fam
    # Llama 3.1's numbers as they land in the metadata
    md = spec_metadata({"rope_scaling": LLAMA3, "rope_theta": 500000.0})
    assert rope.from_metadata(md, "llama") == ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_context": 8192}, 1.0)
    # YaRN with a null factor: max_position_embeddings / original_max_position_embeddings, as transformers
    md = spec_metadata({"rope_parameters": {**YARN, "factor": None, "rope_theta": 1e6}})
    assert md["llama.rope.scaling.factor"] == 4.0 and md["llama.rope.scaling.attn_factor"] == np.float32(
        0.1 * math.log(4.0) + 1.0)


@pytest.mark.parametrize("extra,error,words", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, errors.UnsupportedConfig,
     "'linear' is not implemented"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, errors.UnsupportedConfig, "'dynamic' is not implemented"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": None}}, errors.MissingConfigKey, "high_freq_factor"),
    ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "factor"}}, errors.MissingConfigKey,
     "needs rope_parameters.factor"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}}, errors.UnsupportedConfig, "high_freq_factor 1.0 <= low"),
    ({"mlp_bias": True}, errors.UnsupportedConfig, "mlp_bias is not implemented"),
])
def test_config_refusals(extra, error, words):
    with pytest.raises(error, match=words):
        spec_metadata(extra)


def test_attention_bias_and_qwen_families_are_served():
    assert "blk.{bid}.attn_output_bias" in {r.name for r in specs.all_specs()["llama"].tensors}
    spec_metadata({"attention_bias": True})           # no longer refused
    assert specs.for_config({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}).gguf_arch == "qwen3"
    assert specs.for_config({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}).gguf_arch == "qwen2"
    with pytest.raises(errors.UnsupportedConfig, match="sliding-window"):
        spec_metadata({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True},
                      "qwen2")
    with pytest.raises(errors.UnsupportedConfig, match="sliding-window"):
        spec_metadata({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                       "layer_types": ["full_attention", "sliding_attention"]}, "qwen3")


# --------------------------------------------------------------------------- the plans


def plan_ops(name, tp=1):
    from bloomery.compiler import lower, planning
    from bloomery.compiler.checkpoint import Checkpoint

    ranks = planning.plan(Checkpoint.open(need(name)), tp=tp)
    return [lower.lower_rank(r.metadata, {t.name: t for t in r.tensors})["programs"]["decode"]["ops"] for r in ranks]


@pytest.mark.models
def test_plans_carry_the_scaling_and_the_biases():
    (llama,) = plan_ops("tiny-llama3-rope/nvfp4")
    ropes = [o for o in llama if o["op"] == "rope"]
    assert len(ropes) == 4 and all(o["scaling"] == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_context": 64} for o in ropes)
    assert {o["scale"] for o in llama if o["op"] == "attention"} == {1.0 / math.sqrt(32)}
    biases = [o["bias"] for o in llama if o["op"] == "bias_add"]
    assert biases == [f"blk.{b}.attn_{n}_bias" for b in (0, 1) for n in ("q", "k", "v", "output")]
    for rank_ops in plan_ops("tiny-llama3-rope/nvfp4", tp=2):   # o_proj's bias once, after the all-reduce
        names = [o["op"] for o in rank_ops]
        i = next(i for i, o in enumerate(rank_ops) if o["op"] == "linear" and o["weight"] == "blk.0.attn_output")
        assert names[i:i + 4] == ["linear", "all_reduce", "bias_add", "add"]
    (qwen3,) = plan_ops("tiny-qwen3/fp8")
    _, factor = ROPE_INIT_FUNCTIONS["yarn"](tf.AutoConfig.from_pretrained(need("tiny-qwen3/bf16")), "cpu")
    assert {o["scale"] for o in qwen3 if o["op"] == "attention"} == {float(np.float32(factor)) ** 2 / math.sqrt(32)}
    assert {o["scaling"]["type"] for o in qwen3 if o["op"] == "rope"} == {"yarn"}
    norms = [o["weight"] for o in qwen3 if o["op"] == "rmsnorm" and o["group"] == 32]
    assert norms == [f"blk.{b}.attn_{n}_norm" for b in (0, 1) for n in ("q", "k")]
    (qwen2,) = plan_ops("tiny-qwen2/nvfp4")
    assert [o["bias"] for o in qwen2 if o["op"] == "bias_add"] == [f"blk.{b}.attn_{n}_bias" for b in (0, 1)
                                                                   for n in ("q", "k", "v")]
    assert all("scaling" not in o for o in qwen2 if o["op"] == "rope")
    (plain,) = plan_ops("tiny-llama/bf16")            # the default rope: the plan as before, no new attrs
    assert {tuple(sorted(o)) for o in plain if o["op"] == "rope"} == {
        ("head_dim", "heads", "op", "out", "pos", "theta", "x")}
    assert "bias_add" not in {o["op"] for o in plain}


@pytest.mark.models
@pytest.mark.parametrize("name,planted", [
    ("tiny-llama3-rope/nvfp4", "no scaling"),
    ("tiny-qwen3/nvfp4", "no scaling"),
    ("tiny-qwen3/nvfp4", "no attention factor"),
])
def test_gate_fails_a_plan_without_the_scaling(name, planted, monkeypatch, tmp_path):
    """The gate's executor_vs_oracle row (test_gates.py runs it as it is) fails on an artifact whose
    plan leaves out the rope scaling, or YaRN's attention factor: the tiny exports' scaling changes
    the logits within the gates' 64-token slice."""
    from bloomery.compiler import lower
    from bloomery.tools import gates

    need(name)
    real = rope.from_metadata
    cut = (lambda md, arch: (None, 1.0)) if planted == "no scaling" else (lambda md, arch: (real(md, arch)[0], 1.0))
    monkeypatch.setattr(lower.rope, "from_metadata", cut)
    monkeypatch.setenv(gates.GATES_ENV, str(tmp_path))
    row = gates.gate_row(name, gates.load_bands(), "executor", limit=64)
    assert row.verdict == "FAIL", gates.table([row])
    assert row.metrics["rel_l2_max"] > 5 * gates.load_bands()["executor_vs_oracle"].limits["rel_l2_max"]["max"]


# --------------------------------------------------------------------------- the GPU


from bloomery.runtime import device as devices  # noqa: E402

WHY = devices.cuda_unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"CUDA executor tests need CuPy and a GPU: {WHY}")
@pytest.mark.gpu
@pytest.mark.models
@pytest.mark.parametrize("name", ["tiny-llama3-rope/nvfp4", "tiny-qwen3/nvfp4", "tiny-qwen2/fp8"])
def test_cuda_matches_numpy_with_scaling_and_biases(name):
    """The CUDA executor takes the same scaled inv_freq (core/rope.py) in rope_k and the fused
    rope_qk_kv_k, and the bias_add ops: prompt chunks and decode steps within 1e-3 of NumPy's."""
    from bloomery import runtime

    art = artifact(name)
    assert_engines_agree(runtime.Engine(art, device="cuda", ctx=128, ubatch=16),
                         runtime.Engine(art, device="cpu", ctx=128, ubatch=16))


def _qwen3_moe_variant(tmp_path, config: dict, weights=None):
    """tiny-qwen3_moe/bf16 copied with `config` merged into config.json and `weights(cfg, tensors)`
    adding tensors; prepared. Returns (folder, artifact)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from bloomery.compiler.prepare import prepare

    folder = tmp_path / "ckpt"
    shutil.copytree(need("tiny-qwen3_moe/bf16"), folder)
    cfg = {**json.loads((folder / "config.json").read_text()), **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        st = folder / "model.safetensors"
        w = load_file(st)
        weights(cfg, w)
        save_file(w, st, metadata={"format": "pt"})
    prepare(folder, tmp_path / "art", progress=False)
    return folder, tmp_path / "art"


def _against_oracle(folder, art, n: int):
    """Teacher-forced logits of n random ids: the artifact's, the f32 oracle's of `folder`, and the
    unchanged tiny-qwen3_moe/bf16's; the first two agree (relative L2 < 1e-4, argmax equal)."""
    from bloomery import runtime
    from bloomery.tools import oracle

    ids = [int(i) for i in np.random.default_rng(2).integers(0, 512, n)]
    x, ref = runtime.logits(art, ids), oracle.logits(folder, ids, cache=False)
    assert max(rel(x[i], ref[i]) for i in range(n)) < 1e-4
    assert np.array_equal(x.argmax(1), ref.argmax(1))
    return x, runtime.logits(artifact("tiny-qwen3_moe/bf16"), ids)


@pytest.mark.models
@pytest.mark.parametrize("params", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_qwen3_moe_takes_rope_scaling(params, tmp_path):
    """Qwen3-MoE with YaRN (Qwen3-30B-A3B's long-context setting) or llama3 scaling: the tiny export
    with its config.json given the scaling (the rope fragment, specs/include/rope_scaling.yaml, is
    the one every Llama-class spec splices in) matches the f32 oracle of that folder, and differs
    from the unscaled model's logits."""
    import json
    base = json.loads((need("tiny-qwen3_moe/bf16") / "config.json").read_text()).get("rope_parameters", {})
    x, plain = _against_oracle(*_qwen3_moe_variant(tmp_path, {"rope_parameters": {**base, **params}}), 64)
    assert max(rel(x[i], plain[i]) for i in range(16, 64)) > 1e-3        # past the original context it matters


@pytest.mark.models
def test_qwen3_moe_takes_attention_bias(tmp_path):
    """Qwen3-MoE with attention_bias (q/k/v/o_proj biases, the spec fragment of the Llama-class
    specs): the tiny export given random BF16 biases matches the f32 oracle of that folder, and the
    biases change the logits."""
    import ml_dtypes

    def biases(cfg, w):
        rng = np.random.default_rng(5)
        H, KV, D, hid = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"]
        for b in range(cfg["num_hidden_layers"]):
            for proj, n in (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D), ("o_proj", hid)):
                w[f"model.layers.{b}.self_attn.{proj}.bias"] = (rng.standard_normal(n) * 0.5).astype(ml_dtypes.bfloat16)
    x, plain = _against_oracle(*_qwen3_moe_variant(tmp_path, {"attention_bias": True}, biases), 48)
    assert max(rel(x[i], plain[i]) for i in range(48)) > 1e-2
