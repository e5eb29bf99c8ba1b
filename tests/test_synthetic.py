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

DTYPES = {"BF16": "torch.bfloat16", "F32": "torch.float32", "I64": "torch.int64"}


def hf_config(shape):
    """transformers' config from the shape's config.json (glm5_next: its text_config inside), validated."""
    transformers = pytest.importorskip("transformers")
    cfg = synthetic.config(shape)
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    c = transformers.CONFIG_MAPPING[cfg["model_type"]](**kw)
    c.architectures = cfg["architectures"]
    return c


def hf_state(shape):
    """{saved name: (shape, dtype)} of transformers' model built on the meta device from the shape's
    config.json (nothing allocated), names as save_pretrained writes them (per-expert experts,
    qwen4_exp's n-gram table in torch.chunk shards, glm5_next's hc_* / q_conv1d ...); the vision
    tower of glm5_next's ForConditionalGeneration left out (the shape writes none)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.core_model_loading import revert_weight_conversion
    c = hf_config(shape)
    with torch.device("meta"):
        model = getattr(transformers, c.architectures[0])._from_config(c, dtype=torch.bfloat16)
    sd = revert_weight_conversion(model, model.state_dict())
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items() if not k.startswith("model.visual.")}


@pytest.mark.parametrize("name,layers,kw", [("qwen3-next-80b-a3b", 4, {}), ("qwen3-next-80b-a3b", 8, {}),
                                            ("glm-4.5-air", 3, {}),
                                            ("qwen4-exp", 8, {"experts": 4, "ple_rows": 65536}), ("qwen4-exp", None, {}),
                                            ("glm5-next", 8, {"experts": 4}), ("glm5-next", None, {})])
def test_hybrid_shapes_are_transformers_state_dicts(name, layers, kw):
    """Names, shapes and dtypes (the flagships' I64 hash buffers and F32 kept modules too) are those
    of transformers' own model of the config.json written, the flagships at full size as well."""
    shape = synthetic.shape_of(name, layers, **kw)
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


def test_qwen4_exp_shape_is_transformers_default():
    """qwen4-exp is Qwen4ExpTextConfig's defaults but for what they leave unset (the QSA indexer,
    ple_layer_ids, eos_token_id) and the rotary factor the indexer needs: transformers refuses the
    default 1.0 with a 128-wide index head."""
    transformers = pytest.importorskip("transformers")
    cfg = synthetic.config(synthetic.SHAPES["qwen4-exp"])
    chosen = {"indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
              "indexer_compress_ratio": 4, "ple_layer_ids": [2], "eos_token_id": 2}
    d = transformers.Qwen4ExpTextConfig(**chosen, rope_parameters=cfg["rope_parameters"])
    same = [k for k in cfg if k not in ("architectures", "model_type", "rope_parameters", "dtype", "transformers_version",
                                        "bos_token_id", *chosen)]
    assert len(same) >= 40 and {k: cfg[k] for k in same} == {k: getattr(d, k) for k in same}
    assert {k: cfg[k] for k in chosen} == chosen and cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert cfg["rope_parameters"]["rope_theta"] == transformers.Qwen4ExpTextConfig().rope_parameters["rope_theta"]
    with pytest.raises(Exception, match="rotary_dim=256, indexer_head_dim=128"):
        transformers.Qwen4ExpTextConfig(**chosen)


def test_glm5_next_shape_is_transformers_default():
    """glm5-next's text_config is Glm5NextTextConfig's defaults (bos / eos set for the tokenizer);
    the layer patterns are the defaults' at fewer layers too."""
    transformers = pytest.importorskip("transformers")
    for layers in (None, 4, 9):
        s = synthetic.shape_of("glm5-next", layers)
        text = synthetic.config(s)["text_config"]
        d = transformers.Glm5NextTextConfig(num_hidden_layers=s["layers"], n_routed_experts=s["experts"])
        same = [k for k in text if k not in ("model_type", "dtype", "bos_token_id", "eos_token_id")]
        assert len(same) > 45 and {k: text[k] for k in same} == {k: getattr(d, k) for k in same}
    assert synthetic.config(synthetic.SHAPES["glm5-next"])["architectures"] == ["Glm5NextForConditionalGeneration"]


def test_flagship_layer_counts_keep_the_pattern(monkeypatch):
    for bad in (1, 2, 3, 6, 41):
        with pytest.raises(ValueError, match="multiple of 4"):
            synthetic.shape_of("qwen4-exp", bad)
    for bad in (1, 2, 3):
        with pytest.raises(ValueError, match="no MLA layer"):
            synthetic.shape_of("glm5-next", bad)
    q = synthetic.shape_of("qwen4-exp", 4)
    assert synthetic.layer_types(q) == ["linear_attention"] * 3 + ["indexed_attention"] and q["ple_layers"] == [2]
    g = synthetic.shape_of("glm5-next", 4)
    assert synthetic.layer_types(g) == ["linear_attention"] * 3 + ["indexed_attention"]
    assert [synthetic.sparse(g, b) for b in range(4)] == [False] * 3 + [True]
    full = synthetic.layer_types(synthetic.SHAPES["glm5-next"])
    assert full.count("indexed_attention") == 11 and full[3::4] == ["indexed_attention"] * 11
    with pytest.raises(ValueError, match="no n-gram tables"):
        synthetic.shape_of("glm5-next", ple_rows=1000)
    monkeypatch.setitem(synthetic.SHAPES, "qwen4-exp", {**synthetic.SHAPES["qwen4-exp"], "ple_layers": [2, 7]})
    assert synthetic.shape_of("qwen4-exp", 4)["ple_layers"] == [2]          # a later PLE layer goes with its layer
    monkeypatch.setitem(synthetic.SHAPES, "qwen4-exp", {**synthetic.SHAPES["qwen4-exp"], "ple_layers": [6]})
    with pytest.raises(ValueError, match="drops every PLE layer"):
        synthetic.shape_of("qwen4-exp", 4)


def test_ple_rows_lower_the_hash_base_consistently():
    """--ple-rows gives tables of about that many rows with a config whose primes, I64 buffers and
    torch.chunk shards agree (core/ngram.py computes them all from the config, as prepare does); the
    real row count stays the default: 320,001,536 rows x 128 BF16 a PLE layer."""
    from bloomery.core import ngram
    full = synthetic.shape_of("qwen4-exp")
    (t,) = synthetic.ple_tables(full).values()
    assert (t.rows, t.sizes[:2], synthetic.ngram_heads(full)) == (320_001_536, (20_000_003, 20_000_023), 16)
    table = [x for x in synthetic.tensors(full, "nvfp4") if ".ngram_embedding." in x[0]]
    assert len(table) == 512 and synthetic.nbytes(table) == 81_920_393_216
    assert "320,001,536 rows = 81,920,393,216 bytes" in synthetic.size_report("qwen4-exp", full, "nvfp4")
    for want in (4096, 65536, 1 << 20):
        s = synthetic.shape_of("qwen4-exp", 8, ple_rows=want)
        cfg = synthetic.config(s)
        (b, t), = synthetic.ple_tables(s).items()
        assert b == 1 and 0.9 * want <= t.rows <= 1.1 * want
        assert t == ngram.tables(cfg["vocab_size"], cfg["ngram_size"], cfg["heads_per_ngram"],
                                 cfg["ngram_vocab_size_base"], cfg["seed"], 0, cfg["make_ngram_vocab_size_divisible_by"])
        shards = [shp for n, _, shp in synthetic.tensors(s, "nvfp4") if ".ngram_embedding." in n]
        assert [r for r, _ in shards] == ngram.chunks(t.rows, cfg["split_ngram_parts"]) and shards[0][1] == 128
        e = "model.layers.1.ple.ple_embedding."
        assert synthetic.constant(s, e + "layer_multipliers").tolist() == list(t.multipliers)
        assert synthetic.constant(s, e + "ngram_heads_vocab_sizes").tolist() == list(t.sizes)
        assert synthetic.constant(s, e + "ngram_heads_offsets").tolist() == list(t.offsets)


def test_flagship_traffic_counts_every_stored_byte_once():
    """bench_decode's traffic model of the flagships: every stored byte in exactly one part (the I64
    hash constants in none), the n-gram rows a token gathers (G x d BF16 a PLE layer on the host,
    f32 on the device), the indexers' attended positions capped by their budget / top-k."""
    from bloomery.tools import bench_decode as B
    for name in ("qwen4-exp", "glm5-next"):
        s = synthetic.shape_of(name)
        items = synthetic.tensors(s, "nvfp4")
        t = B.decode_traffic(s, "nvfp4", 100.0)
        stored = synthetic.nbytes([x for x in items if x[1] != "I64"])
        parts = (t["dense"] + t["embed_row"] * s["vocab"] + t["head"] + t["routers"] + t["experts_stored"]
                 + t["shared"] + t["ple_table_stored"])
        assert parts == stored
        assert t["experts_active"] == pytest.approx(t["experts_stored"] * s["top_k"] / s["experts"])
        assert t["total"] == sum(v for k, v in t.items() if k not in ("total",) + B.STORED + B.HOST)
        far = B.decode_traffic(s, "nvfp4", 100_000.0)
        cap = s["idx_budget"] + s["idx_ratio"] - 1 if name == "qwen4-exp" else s["idx_topk"] + s["kpool"] - 1
        assert far["kv_read"] == t["kv_read"] / 100.0 * cap and far["index_read"] == t["index_read"] * 1000
    q = B.decode_traffic(synthetic.shape_of("qwen4-exp"), "nvfp4", 100.0)
    assert (q["ple_gather"], q["ple_copy"], q["ple_table_stored"]) == (16 * 128 * 2, 16 * 128 * 4, 81_920_393_216)
    assert B.decode_traffic(synthetic.shape_of("glm5-next"), "nvfp4")["ple_gather"] == 0


# smaller variants of the flagships (tools/tiny.py's sizes), to prepare and run on the CPU in a test
QWEN4_SMALL = dict(hidden=128, vocab=512, layers=4, heads=4, kv=2, head_dim=32, experts=4, top_k=2, moe_inter=64,
                   shared_inter=64, lin_k_heads=2, lin_v_heads=4, lin_k_dim=32, lin_v_dim=32, hc_rank=32,
                   ple_layers=[1, 3], ple_dim=64, ngram_heads=4, ngram_base=4096, ngram_parts=4, idx_heads=8,
                   idx_dim=32, idx_budget=64, max_pos=2048)
GLM5_SMALL = dict(hidden=128, inter=256, layers=8, heads=4, vocab=512, experts=8, top_k=2, moe_inter=64,
                  first_dense=1, q_rank=64, kv_rank=32, nope=32, v_dim=32, idx_heads=8, idx_dim=32, idx_topk=64,
                  kpool=4, lin_heads=4, lin_dim=32, max_pos=2048)


@pytest.mark.parametrize("name,fmt", [("qwen4-exp", "nvfp4"), ("qwen4-exp", "mxfp8"), ("glm5-next", "nvfp4"),
                                      ("glm5-next", "fp8")])
def test_flagship_checkpoints_prepare_and_run(tmp_path, name, fmt):
    """A small variant of each flagship shape, written in the real layout, is accepted by prepare (its
    hash buffers, sharded table, stored names and formats), runs on the NumPy executor with finite
    logits, and bench_decode's state counts are its plan's."""
    import json

    from bloomery.compiler.prepare import prepare
    from bloomery.core.artifact import Artifact
    from bloomery.runtime import Engine
    from bloomery.tools import bench_decode as B
    shape = {**synthetic.SHAPES[name], **(QWEN4_SMALL if name == "qwen4-exp" else GLM5_SMALL)}
    ck = synthetic.write_shape(shape, tmp_path / "ck", fmt)
    assert json.loads((ck / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == \
        synthetic.excluded(shape)
    art = tmp_path / "art"
    prepare(ck, art, progress=False)
    names = Artifact.open(art).tensors(0)
    if name == "qwen4-exp":
        assert names["blk.0.ple_table"].format == "bf16" and names["blk.0.ssm_qkv"].format == fmt
    else:
        assert names["blk.3.attn_kv_b"].format == ("nvfp4" if fmt == "nvfp4" else "fp8_tensor")
    eng = Engine(art, device="cpu", ctx=96)
    ids = [1, 87, 85, 266, 2, 201, 1, 67] * 9                     # EOS inside: the n-gram context resets
    x = eng.prefill(ids)
    assert x.shape == (len(ids), shape["vocab"]) and np.isfinite(x).all() and x.std() > 0
    tok = int(np.argmax(x[-1]))
    for _ in range(3):
        lg, nxt = eng.decode([tok])
        assert np.isfinite(lg).all() and int(nxt[0]) == int(np.argmax(lg[0]))
        tok = int(nxt[0])
    ps = B.plan_states(eng.plans[0], {"slots": 1, "ubatch": 8, "ctx": 96})
    t = B.decode_traffic(shape, fmt, 1.0, ps["itemsize"], ps["itemsize"])
    assert B.traffic_states(t) == (ps["recurrent_bytes"], ps["kv_row_bytes"])


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


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "glm-4.5-air", "qwen4-exp", "glm5-next"])
def test_hybrid_values_are_sane(name, monkeypatch):
    """The values that steer a forward are drawn in their ranges: A_log = log U(1, 16) (GLM-5's near
    0), norms that multiply by their weight near 1, GLM's F32 router random (no ties), every scale
    finite; qwen4_exp's I64 buffers are core/ngram.py's tables."""
    from bloomery.core import ngram
    monkeypatch.setattr(synthetic, "CHUNK", 1 << 12)
    shape = synthetic.shape_of(name, 4, ple_rows=4096 if name == "qwen4-exp" else None)
    rng = np.random.default_rng(0)
    seen = set()
    for n, dt, shp in synthetic.tensors(shape, "nvfp4"):
        kind = synthetic.value_kind(shape, n)
        if dt == "I64":
            t = ngram.tables(shape["vocab"], 3, 8, shape["ngram_base"], 1234, 0)
            want = {"layer_multipliers": t.multipliers, "ngram_heads_vocab_sizes": t.sizes,
                    "ngram_heads_offsets": t.offsets}[n.rsplit(".", 1)[1]]
            assert synthetic.constant(shape, n).tolist() == list(want) and len(want) == shp[0]
            seen.add(("ngram", dt))
            continue
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
    want = {"qwen3-next-80b-a3b": {"a_log", "dt_bias", "one", None}, "glm-4.5-air": {"one", "f32_small", "f32_bias", None},
            "qwen4-exp": {"a_log", "dt_bias", "one", "ngram", None},
            "glm5-next": {"one", "f32_small", "f32_bias", "dt_bias", None}}[name]
    assert kinds >= want


def flagship_shape_from_config(cfg: dict) -> dict:
    """A synthetic flagship shape with a (tiny) export's config."""
    if "text_config" in cfg:
        t = cfg["text_config"]
        return dict(synthetic.SHAPES["glm5-next"], hidden=t["hidden_size"], inter=t["intermediate_size"],
                    layers=t["num_hidden_layers"], heads=t["num_attention_heads"], vocab=t["vocab_size"],
                    experts=t["n_routed_experts"], top_k=t["num_experts_per_tok"], moe_inter=t["moe_intermediate_size"],
                    n_shared=t["n_shared_experts"], first_dense=t["mlp_layer_types"].count("dense"),
                    q_rank=t["q_lora_rank"], kv_rank=t["kv_lora_rank"], nope=t["qk_nope_head_dim"],
                    v_dim=t["v_head_dim"], idx_heads=t["index_n_heads"], idx_dim=t["index_head_dim"],
                    idx_topk=t["index_topk"], kpool=t["index_kpool"], lin_heads=t["linear_num_heads"],
                    lin_dim=t["linear_head_dim"], conv_kernel=t["linear_conv_kernel_dim"], hc=t["hc_mult"])
    return dict(synthetic.SHAPES["qwen4-exp"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                heads=cfg["num_attention_heads"], kv=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                vocab=cfg["vocab_size"], experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                moe_inter=cfg["moe_intermediate_size"], shared_inter=cfg["shared_expert_intermediate_size"],
                lin_k_heads=cfg["linear_num_key_heads"], lin_v_heads=cfg["linear_num_value_heads"],
                lin_k_dim=cfg["linear_key_head_dim"], lin_v_dim=cfg["linear_value_head_dim"],
                conv_kernel=cfg["linear_conv_kernel_dim"], hc=cfg["hc_count"], hc_rank=cfg["hc_lowrank"],
                ple_layers=cfg["ple_layer_ids"], ple_dim=cfg["ple_embed_dim"], ple_kernel=cfg["ple_conv_kernel_size"],
                ngram_heads=cfg["heads_per_ngram"], ngram_base=cfg["ngram_vocab_size_base"],
                ngram_parts=cfg["split_ngram_parts"], idx_heads=cfg["indexer_n_heads"], idx_dim=cfg["indexer_head_dim"],
                idx_ratio=cfg["indexer_compress_ratio"], idx_budget=cfg["indexer_budget"])


def canonical(tensors: dict) -> dict:
    """{name: (dtype, shape)} with the flagships' tensors that nvidia-modelopt 0.47's export names
    after the modules and not as save_pretrained does under one name each, joined along axis 0:
    qwen4_exp's n-gram table (ModelOpt: whole, ple.ple_embedding.shard_.weight; save_pretrained and
    a repaired export: ngram_embedding.shard_{i}.weight), glm5_next's attn_hc.{fn,base,scale} /
    forget_gate.{f_a_proj,f_b_proj,A_log,dt_bias} / one fused self_attn.conv1d.weight [3 H d, 1, K]
    (save_pretrained: hc_attn_*, no forget_gate., q/k/v_conv1d)."""
    import re
    out: dict = {}
    for n, (dt, shp) in tensors.items():
        m = re.sub(r"\.ple_embedding\.(ngram_embedding\.shard_\d+|shard_)\.weight$", ".ple_embedding.table", n)
        m = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", m)
        m = m.replace("self_attn.forget_gate.", "self_attn.")
        m = re.sub(r"self_attn\.[qkv]_conv1d\.weight$", "self_attn.conv1d.weight", m)
        if m in out:
            shp = [out[m][1][0] + shp[0], *shp[1:]]
        out[m] = (dt, list(shp))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_flagship_tensors_are_modelopt_exports(tmp_path, family):
    """A real NVFP4 export of tools/tiny.py's flagship model (nvidia-modelopt on the CPU, ~1 minute)
    holds the synthetic list's tensors (what ModelOpt quantizes and what it leaves BF16 / F32, the
    I64 buffers) under its own names, and the same exclude_modules."""
    import json
    import struct

    pytest.importorskip("modelopt")
    from bloomery.tools import tiny
    tiny.build_bf16(family, tmp_path / "bf16")
    tiny.build_quant("nvfp4", tmp_path / "nvfp4", tmp_path / "bf16")
    folder = tmp_path / "nvfp4"
    cfg = json.loads((folder / "config.json").read_text())
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    theirs = {n: (v["dtype"], v["shape"]) for n, v in header.items()
              if n != "__metadata__" and not n.startswith("model.visual.")}
    shape = flagship_shape_from_config(cfg)
    assert synthetic.layer_types(shape) == (cfg.get("text_config") or cfg)["layer_types"]
    assert canonical({n: (dt, shp) for n, dt, shp in synthetic.tensors(shape, "nvfp4")}) == canonical(theirs)
    assert synthetic.excluded(shape) == json.loads((folder / "hf_quant_config.json").read_text())[
        "quantization"]["exclude_modules"]
