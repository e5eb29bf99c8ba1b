"""Architecture specs, the role table and the lever registry: they load, they serve the right
configs, and a broken spec (or lever value) is refused by name."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from bloomery.core import errors, levers, specs

LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
             "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


def test_specs_load_and_serve():
    all_ = specs.all_specs()
    assert set(all_) >= {"llama", "qwen3_moe"}
    assert specs.for_config(LLAMA_CFG).gguf_arch == "llama"
    assert specs.for_config({"model_type": "qwen3_moe"}).gguf_arch == "qwen3moe"
    assert specs.for_config({"architectures": ["Qwen3MoeForCausalLM"]}).family == "qwen3_moe"
    with pytest.raises(errors.UnknownArchitecture, match="GPT2LMHeadModel"):
        specs.for_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_every_role_has_a_kind_and_names_are_llama_cpp():
    roles = specs.load_roles()
    for s in specs.all_specs().values():
        for r in s.tensors:
            assert r.role in roles.roles
            assert r.name.split(".")[-1] == r.role          # artifact base name ends in its role
        assert f"{s.gguf_arch}.block_count" in s.metadata
        assert f"{s.gguf_arch}.attention.head_count_kv" in s.metadata
    moe = specs.all_specs()["qwen3_moe"]
    assert {"qwen3moe.expert_count", "qwen3moe.expert_used_count", "qwen3moe.expert_feed_forward_length",
            "qwen3moe.expert_weights_norm"} <= set(moe.metadata)
    exps = [r for r in moe.tensors if r.kind == "experts"]
    assert [r.cut for r in exps] == ["column", "column", "row"]
    assert roles.roles["token_embd"].formats == ("bf16", "f16", "f32", "q8_0")
    assert roles.roles["attn_norm"].q8 is False and roles.roles["ffn_gate_inp"].q8 is False


def test_values_from_config():
    s = specs.for_config(LLAMA_CFG)
    v = s.values(LLAMA_CFG)
    assert v["rope_theta"] == 500000.0                      # from rope_parameters
    assert v["head_dim"] == 16                              # hidden_size // heads by default
    assert v["tie_word_embeddings"] is False
    v2 = s.values({**LLAMA_CFG, "rope_theta": 10000.0, "head_dim": None, "rope_parameters": None})
    assert v2["rope_theta"] == 10000.0 and v2["head_dim"] == 16   # top-level key; null is absent
    cfg = dict(LLAMA_CFG)
    del cfg["intermediate_size"]
    with pytest.raises(errors.MissingConfigKey, match="intermediate_size"):
        s.values(cfg)
    with pytest.raises(errors.UnsupportedConfig, match="dynamic"):      # llama3 and yarn: test_rope_scaling.py
        s.values({**LLAMA_CFG, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}})


def test_metadata_types():
    s = specs.for_config(LLAMA_CFG)
    v = s.values(LLAMA_CFG)
    md = {k: m.value(v) for k, m in s.metadata.items() if m.applies(v)}
    assert not any(".rope.scaling." in k for k in md)          # written only with a scaled rope (`when`)
    assert type(md["llama.block_count"]) is np.uint32 and md["llama.block_count"] == 2
    assert type(md["llama.rope.freq_base"]) is np.float32
    assert md["bloomery.tie_word_embeddings"] is False
    from gguf import GGUFValueType
    assert specs.gguf_value_type(md["llama.block_count"]) == GGUFValueType.UINT32
    assert specs.gguf_value_type(md["llama.attention.layer_norm_rms_epsilon"]) == GGUFValueType.FLOAT32
    assert specs.gguf_value_type(True) == GGUFValueType.BOOL


def _broken(tmp_path, edit) -> Path:
    raw = yaml.safe_load((specs.SPECS_DIR / "llama.yaml").read_text())
    edit(raw)
    p = tmp_path / "llama.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def _t(i):
    return lambda raw: raw["tensors"][i]


@pytest.mark.parametrize("edit,words", [
    (lambda r: r.pop("gguf_arch"), ["missing field", "gguf_arch"]),
    (lambda r: r.update(colour="red"), ["unknown field", "colour"]),
    (lambda r: r["tensors"][1].update(role="attn_nrom"), ["tensors[1]", "attn_nrom", "roles.yaml"]),
    (lambda r: r["tensors"][2].update(cut="diagonal"), ["tensors[2]", "diagonal"]),
    (lambda r: r["tensors"][1].update(cut="row"), ["tensors[1]", "1-D"]),      # (column: a bias's rows)
    (lambda r: r["tensors"][2].update(shape=["num_heads * head_dim", "hidden_size"]), ["shape[0]", "num_heads"]),
    (lambda r: r["tensors"][2].update(shape=["__import__('os')", "hidden_size"]), ["shape[0]", "calls something other than share"]),
    (lambda r: r["tensors"][2].update(name="attn_q"), ["{bid}", "tensors[2]"]),
    (lambda r: r["tensors"][2].update(experts="4"), ["tensors[2]", "experts"]),
    (lambda r: r["tensors"][2].update(size=3), ["unknown field", "size"]),
    (lambda r: r["tp_checks"][0].update(error="NoSuchError"), ["tp_checks[0]", "NoSuchError"]),
    (lambda r: r["tp_checks"][0].update(message="{nope} heads"), ["tp_checks[0]", "nope"]),
    (lambda r: r["metadata"]["{arch}.block_count"].update(type="u7"), ["block_count", "u7"]),
    (lambda r: r["metadata"]["{arch}.vocab_size"].update(when="rope_kind != 'x'"), ["vocab_size", "rope_kind"]),
    (lambda r: r["config"].update({"@include": "nope"}), ["@include", "nope", "specs/include"]),
    (lambda r: r["config"].update(rope_theta={"keys": ["rope_theta"]}), ["config.rope_theta", "twice"]),
    (lambda r: r["checks"].append({"@include": "../levers"}), ["@include", "fragment name"]),
    (lambda r: r["config"]["head_dim"].update(default="hidden // 2"), ["config.head_dim", "hidden"]),
    (lambda r: r.update(layers="num_layers"), ["layers", "num_layers"]),
])
def test_broken_spec_refused_by_name(tmp_path, edit, words):
    with pytest.raises(errors.SpecError) as ei:
        specs.load(_broken(tmp_path, edit))
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    assert str(tmp_path) in str(ei.value)


def test_unreadable_spec_refused(tmp_path):
    p = tmp_path / "llama.yaml"
    p.write_text("family: [unclosed\n")
    with pytest.raises(errors.SpecError, match="YAML"):
        specs.load(p)


def test_expressions():
    e = specs.expr("bid not in mlp_only_layers and (bid + 1) % step == 0", "t", {"bid", "mlp_only_layers", "step"})
    assert e({"bid": 1, "mlp_only_layers": [], "step": 2}) is True
    assert e({"bid": 1, "mlp_only_layers": [1], "step": 2}) is False
    assert specs.expr("a * b if c else 0", "t", "abc")({"a": 3, "b": 4, "c": True}) == 12
    assert specs.expr("a[b] == 'x' and len(a) == 2 and not outside(a, ['x', 'y'])", "t", "ab")(
        {"a": ["y", "x"], "b": 1}) is True                       # indexing (Qwen3-Next's layer_types[bid])
    assert specs.expr("outside(a, ['x'])", "t", "a")({"a": ["y", "x", "z"]}) == ["y", "z"]
    for bad in ("a.b", "f(a)", "a[0:1]", "lambda: 1", "[x for x in a]"):
        with pytest.raises(errors.SpecError):
            specs.expr(bad, "t", {"a", "f", "x"})


# --- levers -------------------------------------------------------------------------


def test_lever_registry():
    rows = levers.levers()
    q8 = levers.get("BLOOMERY_PREPARE_Q8")
    assert q8 in rows
    assert (q8.type, q8.values, q8.default) == ("flag", ("0", "1"), "0")
    assert "KL(stored BF16 || Q8_0)" in q8.cost      # measured: tests/test_gates.py checks the figures
    assert "Q8_0" in q8.changes and "--keep-bf16" in q8.changes
    text = levers.format_levers()
    assert "BLOOMERY_PREPARE_Q8" in text and "KL(stored BF16 || Q8_0)" in text
    assert "default 0" in text


@pytest.mark.parametrize("v", ["yes", "2", "true", " 1", "on", "1.0"])
def test_lever_bad_values_refused(v):
    with pytest.raises(errors.BadLeverValue) as ei:
        levers.flag("BLOOMERY_PREPARE_Q8", {"BLOOMERY_PREPARE_Q8": v})
    assert "BLOOMERY_PREPARE_Q8" in str(ei.value) and repr(v) in str(ei.value)


def test_lever_values():
    assert levers.flag("BLOOMERY_PREPARE_Q8", {}) is False
    assert levers.flag("BLOOMERY_PREPARE_Q8", {"BLOOMERY_PREPARE_Q8": ""}) is False
    assert levers.flag("BLOOMERY_PREPARE_Q8", {"BLOOMERY_PREPARE_Q8": "0"}) is False
    assert levers.flag("BLOOMERY_PREPARE_Q8", {"BLOOMERY_PREPARE_Q8": "1"}) is True


def test_broken_lever_registry(tmp_path):
    p = tmp_path / "levers.yaml"
    p.write_text(yaml.safe_dump([{"name": "X", "type": "flag", "values": ["0", "1"], "default": "0",
                                  "changes": "x"}]))
    with pytest.raises(errors.SpecError, match="cost"):
        levers.levers(p)
