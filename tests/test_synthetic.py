"""Synthetic checkpoints (tools/synthetic.py) read back as real ModelOpt folders with sane values."""

import numpy as np
import pytest

from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.planning import plan
from bloomery.tools import synthetic


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp8"])
def test_synthetic_smollm2_shape(tmp_path, fmt):
    ck = Checkpoint.open(synthetic.write("smollm2-135m", tmp_path / fmt, fmt, layers=1))
    norm = np.abs(ck.tensors["model.layers.0.input_layernorm.weight"].decode())
    assert norm.min() >= 2.0 ** -6 and norm.max() < 2.0 ** -5       # BF16 values are not degenerate
    q = ck.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.format.name == {"nvfp4": "nvfp4", "fp8": "fp8_tensor", "mxfp8": "mxfp8"}[fmt]
    w = q.decode()
    assert np.isfinite(w).all() and np.abs(w).max() > 0
    assert len(plan(ck, tp=2, env={})) == 2


# -- the hybrid shapes: their tensor lists are transformers 5.24's state dicts and ModelOpt's exports ------

DTYPES = {"BF16": "torch.bfloat16", "F32": "torch.float32"}


def hf_state(shape):
    """{saved name: (shape, dtype)} of transformers' model built on the meta device from the shape's
    config.json (nothing allocated), per-expert names as save_pretrained writes them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.core_model_loading import revert_weight_conversion
    cfg = synthetic.config(shape)
    c = transformers.CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16)
    assert type(model).__name__ == cfg["architectures"][0]
    sd = revert_weight_conversion(model, model.state_dict())
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items()}


@pytest.mark.parametrize("name,layers", [("qwen3-next-80b-a3b", 4), ("qwen3-next-80b-a3b", 8), ("glm-4.5-air", 3)])
def test_hybrid_shapes_are_transformers_state_dicts(name, layers):
    shape = synthetic.shape_of(name, layers)
    ours = {n: (tuple(s), DTYPES[d]) for n, d, s in synthetic.tensors(shape, "bf16")}
    hf = hf_state(shape)
    assert sorted(set(hf) - set(ours)) == [] and sorted(set(ours) - set(hf)) == []
    assert {k: v for k, v in ours.items() if hf[k] != v} == {}


def test_hybrid_layer_counts_keep_the_pattern():
    for bad in (1, 2, 3, 6, 47):
        with pytest.raises(ValueError, match="multiple of 4"):
            synthetic.shape_of("qwen3-next-80b-a3b", bad)
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        synthetic.shape_of("glm-4.5-air", 1)
    assert synthetic.layer_types(synthetic.shape_of("qwen3-next-80b-a3b", 8)) == \
        (["linear_attention"] * 3 + ["full_attention"]) * 2
    full = synthetic.SHAPES["qwen3-next-80b-a3b"]
    assert synthetic.layer_types(full).count("full_attention") == 12


def test_qwen3_next_shape_is_transformers_default():
    """The 80B values are Qwen3NextConfig's defaults (transformers 5.24), but intermediate_size and
    max_position_embeddings, which the release sets (no layer is dense: intermediate_size is unused)."""
    transformers = pytest.importorskip("transformers")
    d = transformers.Qwen3NextConfig()
    cfg = synthetic.config(synthetic.SHAPES["qwen3-next-80b-a3b"])
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "rms_norm_eps", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "tie_word_embeddings",
            "layer_types", "mlp_only_layers", "decoder_sparse_step")
    assert {k: cfg[k] for k in same} == {k: getattr(d, k) for k in same}
    assert cfg["rope_parameters"]["partial_rotary_factor"] == d.rope_parameters["partial_rotary_factor"] == 0.25


def test_glm_air_shape_is_transformers_default():
    """GLM-4.5-Air's sizes are Glm4MoeConfig's defaults; head_dim 128, attention_bias and rope_theta
    1e6 are the release's (the defaults would give head_dim 4096 // 96)."""
    transformers = pytest.importorskip("transformers")
    d = transformers.Glm4MoeConfig()
    cfg = synthetic.config(synthetic.SHAPES["glm-4.5-air"])
    same = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
            "n_routed_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
            "norm_topk_prob", "use_qk_norm", "tie_word_embeddings", "max_position_embeddings")
    assert {k: cfg[k] for k in same} == {k: getattr(d, k) for k in same}
    assert cfg["rope_parameters"]["partial_rotary_factor"] == d.rope_parameters["partial_rotary_factor"] == 0.5
    assert (cfg["head_dim"], cfg["attention_bias"]) == (128, True)


def shape_from_config(cfg: dict) -> dict:
    """A synthetic shape with a (tiny) export's config: to compare its tensor list with the export's."""
    rope = cfg["rope_parameters"]
    s = dict(arch=cfg["architectures"][0], model_type=cfg["model_type"], hidden=cfg["hidden_size"],
             inter=cfg["intermediate_size"], layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
             kv=cfg["num_key_value_heads"], vocab=cfg["vocab_size"],
             head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
             tied=cfg["tie_word_embeddings"], top_k=cfg["num_experts_per_tok"], moe_inter=cfg["moe_intermediate_size"],
             rotary=rope["partial_rotary_factor"], theta=rope["rope_theta"], eps=cfg["rms_norm_eps"],
             max_pos=cfg["max_position_embeddings"])
    if cfg["model_type"] == "qwen3_next":
        assert cfg["layer_types"] == synthetic.layer_types({"layers": s["layers"], "full_interval": 4})
        s.update(experts=cfg["num_experts"], shared_inter=cfg["shared_expert_intermediate_size"],
                 lin_k_heads=cfg["linear_num_key_heads"], lin_v_heads=cfg["linear_num_value_heads"],
                 lin_k_dim=cfg["linear_key_head_dim"], lin_v_dim=cfg["linear_value_head_dim"],
                 conv_kernel=cfg["linear_conv_kernel_dim"], full_interval=4, mlp_only=cfg["mlp_only_layers"])
    else:
        s.update(experts=cfg["n_routed_experts"], n_shared=cfg["n_shared_experts"],
                 first_dense=cfg["first_k_dense_replace"], n_group=cfg["n_group"], topk_group=cfg["topk_group"],
                 routed_scale=cfg["routed_scaling_factor"], attention_bias=cfg["attention_bias"],
                 qk_norm=cfg["use_qk_norm"])
    return s


@pytest.mark.models
@pytest.mark.parametrize("family", ["qwen3_next", "glm4_moe"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp8", "bf16"])
def test_hybrid_tensors_are_modelopt_exports(family, fmt):
    """Given the tiny ModelOpt export's config, the synthetic tensor list is that export's: the same
    names, dtypes and shapes (what ModelOpt quantizes, what it leaves BF16 / F32), and the same
    exclude_modules."""
    import json
    import struct

    from runtime_artifacts import need
    folder = need(f"tiny-{family}/{fmt}")
    cfg = json.loads((folder / "config.json").read_text())
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    shape = shape_from_config(cfg)
    ours = {n: (d, list(s)) for n, d, s in synthetic.tensors(shape, fmt)}
    theirs = {n: (v["dtype"], v["shape"]) for n, v in header.items()}
    if fmt == "bf16":     # tools/tiny.py cast the whole model to BF16; transformers and ModelOpt keep GLM's router F32
        theirs = {n: ("F32" if ".mlp.gate." in n and family == "glm4_moe" else d, s) for n, (d, s) in theirs.items()}
    assert ours == theirs
    if fmt != "bf16":
        q = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
        assert synthetic.excluded(shape) == q["exclude_modules"]


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "glm-4.5-air"])
def test_hybrid_values_are_sane(name, monkeypatch):
    """The values that steer a forward are drawn in their ranges: A_log = log U(1, 16), norms that
    multiply by their weight near 1, GLM's F32 router random (no ties), every scale finite."""
    monkeypatch.setattr(synthetic, "CHUNK", 1 << 12)
    shape = synthetic.shape_of(name, 4)
    rng = np.random.default_rng(0)
    seen = set()
    for n, dt, shp in synthetic.tensors(shape, "nvfp4"):
        kind = synthetic.value_kind(shape, n)
        if (kind, dt) in seen or int(np.prod(shp)) > 1 << 20:
            continue
        seen.add((kind, dt))
        raw = b"".join(synthetic.fill(rng, n, dt, shp, kind))
        assert len(raw) == int(np.prod(shp)) * synthetic.ITEMSIZE[dt]
        if dt == "BF16":
            v = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dt == "F32":
            v = np.frombuffer(raw, np.float32)
        else:
            continue
        assert np.isfinite(v).all()
        if kind == "a_log":
            assert v.min() >= 0 and v.max() <= np.log(16.0)
        elif kind == "one":
            assert 0.85 < v.min() and v.max() < 1.15
        elif kind in ("f32_small", "f32_bias"):
            assert len(np.unique(v)) > len(v) // 2
        elif kind == "dt_bias":
            assert np.abs(v).max() <= 0.5
    kinds = {k for k, _ in seen}
    want = {"a_log", "dt_bias", "one", None} if name.startswith("qwen3") else {"one", "f32_small", "f32_bias", None}
    assert kinds >= want
