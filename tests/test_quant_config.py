"""Every quantization-config form ModelOpt has written (compiler/quant_config.py), as small files
in the shapes ModelOpt's own writers give them (modelopt/torch/export: quant_utils.get_quant_config
-> hf_quant_config.json, convert_hf_config.convert_hf_quant_config_format -> the flat form of
config.json's quantization_config); W4A8_NVFP4_FP8 read as stored; the named refusals."""

import json

import ml_dtypes
import numpy as np
import pytest

from bloomery.compiler import quant_config
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.planning import plan
from bloomery.compiler.prepare import prepare
from bloomery.core import errors, formats
from bloomery.core.artifact.reader import Artifact
from ckpt import bf16, e4m3, fp8_parts, nvfp4_parts, write_folder

PRODUCER = {"name": "modelopt", "version": "0.47.0"}
# (the "quantization" object of hf_quant_config.json, the flat form ModelOpt converts it to)
FORMS = {
    "fp8": ({"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
            {"config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                                           "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                           "targets": ["Linear"]}},
             "ignore": ["lm_head"], "quant_algo": "FP8",
             "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
             "producer": PRODUCER, "quant_method": "modelopt"}),
    "nvfp4": ({"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
               "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "*router*"]},
              {"config_groups": {"group_0": {
                  "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                  "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                  "targets": ["Linear"]}},
               "ignore": ["lm_head", "model.layers.*.mlp.gate", "*router*"], "quant_algo": "NVFP4",
               "producer": PRODUCER, "quant_method": "modelopt"}),
    # written lower-case by ModelOpt (quant_utils.process_layer_quant_config's fallback branch)
    "fp8_pb_wo": ({"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo": None,
                   "exclude_modules": ["lm_head", "model.layers.0.mlp*", "model.layers.10*"]},
                  {"ignore": ["lm_head", "model.layers.0.mlp*", "model.layers.10*"], "quant_algo": "fp8_pb_wo",
                   "producer": PRODUCER, "quant_method": "modelopt"}),
    "w4a8_nvfp4_fp8": ({"quant_algo": "W4A8_NVFP4_FP8", "kv_cache_quant_algo": None, "group_size": 32,
                        "exclude_modules": ["lm_head", "model.embed_tokens"]},
                       {"ignore": ["lm_head", "model.embed_tokens"], "quant_algo": "W4A8_NVFP4_FP8",
                        "producer": PRODUCER, "quant_method": "modelopt"}),
    "mixed": ({"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": {
                   "model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16},
                   "model.layers.0.mlp.experts": {"quant_algo": "W4A8_NVFP4_FP8", "group_size": 32}}},
              {"config_groups": {
                  "group_0": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                              "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                              "targets": ["model.layers.0.self_attn.q_proj"]},
                  "group_1": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                              "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 32},
                              "targets": ["model.layers.0.mlp.experts"]}},
               "quantized_layers": {
                   "model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16},
                   "model.layers.0.mlp.experts": {"quant_algo": "W4A8_NVFP4_FP8", "group_size": 32}},
               "ignore": [], "quant_algo": "MIXED_PRECISION", "producer": PRODUCER, "quant_method": "modelopt"}),
}
# per form: module -> the stored format it resolves to (None: not quantized)
MODULES = {
    "fp8": {"model.layers.0.self_attn.q_proj": "fp8_tensor", "lm_head": None},
    "nvfp4": {"model.layers.3.mlp.down_proj": "nvfp4", "model.layers.3.mlp.gate": None, "lm_head": None,
              "model.layers.0.mlp.router": None, "model.layers.0.mlp.router.linear": None,
              "model.layers.3.mlp.gate_proj": "nvfp4"},
    "fp8_pb_wo": {"model.layers.0.self_attn.q_proj": "fp8_block128", "model.layers.0.mlp.down_proj": None,
                  "model.layers.0.mlp": None, "model.layers.10.mlp.router": None,
                  "model.layers.1.mlp.down_proj": "fp8_block128", "lm_head": None},
    "w4a8_nvfp4_fp8": {"model.layers.0.mlp.down_proj": "nvfp4_g32", "model.embed_tokens": None},
    "mixed": {"model.layers.0.self_attn.q_proj": "nvfp4", "model.layers.0.self_attn.k_proj": None,
              "model.layers.0.mlp.experts.3.down_proj": "nvfp4_g32", "model.layers.0.mlp.experts": "nvfp4_g32",
              "model.layers.0.mlp.experts_shared.down_proj": None, "model.layers.0.mlp.shared_expert.up_proj": None,
              "model.layers.1.mlp.experts.3.down_proj": None},
}
KV = {"fp8": "FP8"}


def write(folder, hf=None, config_q=None):
    """A folder holding only the config files: hf_quant_config.json (an object as given) and
    config.json (with quantization_config when given)."""
    folder.mkdir(parents=True, exist_ok=True)
    if hf is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf, indent=4))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if config_q is not None:
        cfg["quantization_config"] = config_q
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def load(folder) -> quant_config.QuantConfig:
    return quant_config.load(folder, json.loads((folder / "config.json").read_text()))


# --- the forms ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("where", ["nested", "flat", "config.json", "both"])
def test_every_form_resolves_the_same(tmp_path, form, where):
    """hf_quant_config.json nested (0.x) or flat (later releases), config.json's quantization_config
    alone, or both files as ModelOpt writes them today: one reading."""
    nested, flat = FORMS[form]
    hf = {"nested": {"producer": PRODUCER, "quantization": nested}, "flat": flat, "config.json": None,
          "both": {"producer": PRODUCER, "quantization": nested}}[where]
    q = load(write(tmp_path / where, hf, flat if where in ("config.json", "both") else None))
    assert {m: q.format_for(m) for m in MODULES[form]} == MODULES[form]
    assert q.kv_cache_quant_algo == KV.get(form)
    assert q.source.endswith("hf_quant_config.json" if hf is not None else "config.json quantization_config")


def test_algo_names_in_either_case(tmp_path):
    for algo, fmt in (("nvfp4", "nvfp4"), ("Fp8_Pb_Wo", "fp8_block128"), ("w4a8_nvfp4_fp8", "nvfp4_g32"),
                      ("mxfp8", "mxfp8"), ("fp8_per_channel_per_token", "fp8_channel")):
        q = load(write(tmp_path / algo, {"producer": PRODUCER, "quantization": {"quant_algo": algo}}))
        assert q.format_for("model.layers.0.mlp.up_proj") == fmt, algo
    layers = {"model.layers.0.mlp.up_proj": {"quant_algo": "nvfp4"}, "model.layers.0.mlp.down_proj": "fp8"}
    q = load(write(tmp_path / "m", None, {"quant_method": "MODELOPT", "quant_algo": "mixed_precision",
                                          "quantized_layers": layers}))
    assert q.format_for("model.layers.0.mlp.up_proj") == "nvfp4"
    assert q.format_for("model.layers.0.mlp.down_proj") == "fp8_tensor"


def test_w4a8_mxfp4_fp8_is_mxfp4(tmp_path):
    q = load(write(tmp_path / "x", {"producer": PRODUCER, "quantization": {"quant_algo": "W4A8_MXFP4_FP8",
                                                                            "group_size": 32}}))
    assert q.format_for("model.layers.0.mlp.up_proj") == "mxfp4"


def test_exclude_patterns_match_modelopts_summary():
    """ModelOpt summarizes the unquantized modules into prefix wildcards that match none of the
    quantized ones (quant_utils._prefix_wildcard_summarize_exclude_modules): read with fnmatch,
    every unquantized module is excluded and no quantized one."""
    pytest.importorskip("torch", reason="torch not installed: ModelOpt comparison skipped")
    qu = pytest.importorskip("modelopt.torch.export.quant_utils", reason="nvidia-modelopt not installed")
    quantized = [f"model.layers.{b}.{m}" for b in (0, 1, 2, 10, 11) for m in
                 ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts.0.down_proj", "mlp.experts.1.up_proj")]
    unquantized = ["lm_head", "model.layers.1.mlp.gate", "model.layers.10.mlp.gate", "model.layers.2.mlp.router",
                   "model.layers.2.self_attn.k_proj", "model.layers.12.self_attn.q_proj", "mtp.0.eh_proj",
                   "model.layers.11.mlp.experts.1.gate_proj"]
    pats = sorted(qu._prefix_wildcard_summarize_exclude_modules(unquantized, quantized))
    q = quant_config.QuantConfig(quant_algo="NVFP4", exclude=pats)
    assert [m for m in unquantized if q.format_for(m) is not None] == []
    assert [m for m in quantized if q.format_for(m) is None] == []


def test_forms_are_modelopts_own():
    """The forms above are what ModelOpt's writers give: process_layer_quant_config for the
    "quantization" object, convert_hf_quant_config_format for the flat one."""
    pytest.importorskip("torch", reason="torch not installed: ModelOpt comparison skipped")
    qu = pytest.importorskip("modelopt.torch.export.quant_utils", reason="nvidia-modelopt not installed")
    conv = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    layers = {"mixed": {"model.layers.0.self_attn.q_proj": ("nvfp4", 16), "model.layers.0.mlp.experts":
                        ("w4a8_nvfp4_fp8", 32), "model.layers.0.self_attn.k_proj": (None, 0)},
              "w4a8_nvfp4_fp8": {"model.layers.0.mlp.down_proj": ("w4a8_nvfp4_fp8", 32), "lm_head": (None, 0),
                                 "model.embed_tokens": (None, 0)},
              "fp8_pb_wo": {"model.layers.0.self_attn.q_proj": ("fp8_pb_wo", 128), "lm_head": (None, 0),
                            "model.layers.0.mlp.down_proj": (None, 0), "model.layers.0.mlp.up_proj": (None, 0),
                            "model.layers.10.mlp.router": (None, 0), "model.layers.1.mlp.up_proj": ("fp8_pb_wo", 128)}}
    for form, mods in layers.items():
        d = {}
        for m, (fmt, block) in mods.items():
            d[m + ".quantization"] = fmt
            d[m + ".awq_block_size"] = block
        nested = {"quant_algo": None, "kv_cache_quant_algo": None, **qu.process_layer_quant_config(d)}
        assert nested == FORMS[form][0], form
        assert conv.convert_hf_quant_config_format({"producer": PRODUCER, "quantization": nested}) == FORMS[form][1]
    for form in ("fp8", "nvfp4"):
        assert conv.convert_hf_quant_config_format({"producer": PRODUCER, "quantization": FORMS[form][0]}) == \
            FORMS[form][1]


def test_mixed_precision_parent_entry_covers_the_experts(tmp_path):
    """MIXED_PRECISION's quantized_layers entry `model.layers.0.mlp.experts` (ModelOpt's one entry for
    the per-expert weights below it) covers every expert's linear, in a real folder."""
    rng = np.random.default_rng(3)
    t = {"model.embed_tokens.weight": bf16(rng, 32, 64)}
    for x in range(2):
        t.update(nvfp4_parts(rng, 32, 64, f"model.layers.0.mlp.experts.{x}.down_proj"))
    t.update(fp8_parts(rng, 32, 64, "model.layers.0.self_attn.q_proj"))
    t["model.layers.0.mlp.shared_expert.up_proj.weight"] = bf16(rng, 32, 64)
    layers = {"model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
              "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}}
    ck = Checkpoint.open(write_folder(tmp_path / "m", t, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}))
    assert {n: q.format.name for n, q in ck.tensors.items()} == {
        "model.embed_tokens.weight": "bf16", "model.layers.0.mlp.experts.0.down_proj.weight": "nvfp4",
        "model.layers.0.mlp.experts.1.down_proj.weight": "nvfp4",
        "model.layers.0.self_attn.q_proj.weight": "fp8_tensor", "model.layers.0.mlp.shared_expert.up_proj.weight": "bf16"}


# --- W4A8_NVFP4_FP8: NVFP4 weights with an E4M3 scale per 32 ---------------------------------


def w4a8_parts(rng, out, inn, prefix):
    """As ModelOpt's export writes a W4A8_NVFP4_FP8 linear: scale_2 = amax / 448, block scales per 32."""
    return {f"{prefix}.weight": rng.integers(0, 256, (out, inn // 2), dtype=np.uint8),
            f"{prefix}.weight_scale": e4m3(rng.uniform(0.01, 70, (out, inn // 32))),
            f"{prefix}.weight_scale_2": np.array(rng.uniform(1e-4, 1e-2), np.float32),
            f"{prefix}.input_scale": np.array(rng.uniform(1e-3, 1), np.float32)}


def reference(w, scale, scale_2) -> np.ndarray:
    """ml_dtypes' E2M1 and E4M3 values, the float64 product rounded once: e2m1 * e4m3 * scale_2."""
    codes = np.stack([w & 0xF, w >> 4], axis=-1).reshape(*w.shape[:-1], -1)
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = np.repeat(np.asarray(scale).astype(np.float64), 32, axis=-1)
    return (e2m1 * s * np.float64(scale_2)).astype(np.float32)


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
         "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "vocab_size": 96, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False}
LINEARS = (("self_attn.q_proj", 128, 128), ("self_attn.k_proj", 64, 128), ("self_attn.v_proj", 64, 128),
           ("self_attn.o_proj", 128, 128), ("mlp.gate_proj", 192, 128), ("mlp.up_proj", 192, 128),
           ("mlp.down_proj", 128, 192))


@pytest.mark.parametrize("tp", [1, 2])
def test_w4a8_read_as_stored_and_prepared(tmp_path, tp):
    """A W4A8_NVFP4_FP8 folder (config.json's form alone) is read as nvfp4_g32, decodes to the
    reference values, and is prepared (held as nvfp4; tp 2 cuts its rows on the block of 32):
    every rank's artifact tensor decodes to the checkpoint's value bit for bit, input_scale kept."""
    rng = np.random.default_rng(5)
    t = {"model.embed_tokens.weight": bf16(rng, 96, 128), "model.norm.weight": bf16(rng, 128),
         "lm_head.weight": bf16(rng, 96, 128)}
    for b in range(2):
        t[f"model.layers.{b}.input_layernorm.weight"] = bf16(rng, 128)
        t[f"model.layers.{b}.post_attention_layernorm.weight"] = bf16(rng, 128)
        for name, o, n in LINEARS:
            t.update(w4a8_parts(rng, o, n, f"model.layers.{b}.{name}"))
    folder = write_folder(tmp_path / "w4a8", t, FORMS["w4a8_nvfp4_fp8"][1], config=LLAMA, quant_in_config=True)
    ck = Checkpoint.open(folder)
    down = ck.tensors["model.layers.1.mlp.down_proj.weight"]
    assert down.format.name == "nvfp4_g32" and sorted(down.sources) == ["input_scale", "scale", "scale_2", "weight"]
    p = "model.layers.1.mlp.down_proj"
    assert np.array_equal(bits(down.decode()), bits(reference(t[p + ".weight"], t[p + ".weight_scale"],
                                                              t[p + ".weight_scale_2"])))
    ranks = plan(ck, tp=tp, env={})
    assert {t.format for t in ranks[0].tensors if t.role.startswith(("attn_", "ffn_")) and "norm" not in t.role} \
        == {"nvfp4"}
    prepare(folder, tmp_path / "art", tp=tp, progress=False)
    art = Artifact.open(tmp_path / "art")
    for b in range(2):
        for base, hf, axis in ((f"blk.{b}.ffn_down", f"model.layers.{b}.mlp.down_proj", -1),
                               (f"blk.{b}.attn_q", f"model.layers.{b}.self_attn.q_proj", -2)):
            ref = reference(t[hf + ".weight"], t[hf + ".weight_scale"], t[hf + ".weight_scale_2"])
            got = np.concatenate([art.decode(base, r) for r in range(tp)], axis=axis)
            assert np.array_equal(bits(got), bits(ref)), base
            assert art.parts(base, tp - 1)["input_scale"] == t[hf + ".input_scale"]


def test_w4a8_decodes_as_modelopt_does():
    """ModelOpt's NVFP4QTensor.dequantize with blocks of 32 (its W4A8_NVFP4_FP8 export), a
    power-of-two scale_2 (where its two roundings are exact): the same values bit for bit, held as
    nvfp4 too."""
    torch = pytest.importorskip("torch", reason="torch not installed: ModelOpt comparison skipped")
    qt = pytest.importorskip("modelopt.torch.quantization.qtensor", reason="nvidia-modelopt not installed")
    rng = np.random.default_rng(9)
    p = {"weight": rng.integers(0, 256, (48, 64), dtype=np.uint8),
         "scale": e4m3(rng.uniform(0.01, 70, (48, 4))), "scale_2": np.array(2.0 ** -7, np.float32)}
    mo = qt.NVFP4QTensor(torch.Size((48, 128)), torch.float32, torch.from_numpy(p["weight"].copy())).dequantize(
        dtype=torch.float32, scale=torch.from_numpy(p["scale"].view(np.uint8).copy()).view(torch.float8_e4m3fn),
        double_scale=torch.tensor(p["scale_2"]), block_sizes={-1: 32}).numpy()
    g32 = formats.get("nvfp4_g32")
    held = g32.held(p)
    for got in (g32.decode(p), formats.get("nvfp4").decode(held)):
        assert np.array_equal(bits(got + np.float32(0)), bits(mo + np.float32(0)))   # ModelOpt's code 8 is +0


def test_w4a8_real_export(tmp_path):
    """The tiny Llama's real ModelOpt W4A8_NVFP4_FP8 export: every linear nvfp4_g32, prepared."""
    from bloomery.tools import models
    name = "tiny-llama/w4a8_nvfp4_fp8"
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    ck = Checkpoint.open(models.model_dir(name))
    assert {q.format.name for q in ck.tensors.values()} == {"nvfp4_g32", "bf16"}
    prepare(models.model_dir(name), tmp_path / "a", progress=False)
    assert {t.format for t in Artifact.open(tmp_path / "a").tensors(0).values()} == {"nvfp4", "bf16"}


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hf,config_q,cls,words", [
    ({"producer": PRODUCER, "quantization": [1]}, None, errors.UnreadableJSON,
     ["hf_quant_config.json", "quantization"]),
    ({"format": "something else"}, None, errors.UnreadableJSON, ["hf_quant_config.json", "flat ModelOpt"]),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "FP8", "exclude_modules": "lm_head"}}, None,
     errors.UnreadableJSON, ["'exclude_modules'", "list"]),
    (None, {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", 3]}, errors.UnreadableJSON,
     ["config.json quantization_config", "'ignore'"]),
    (None, {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": ["a"]},
     errors.UnreadableJSON, ["'quantized_layers'", "object"]),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "NVFP4", "group_size": "16"}}, None,
     errors.UnreadableJSON, ["'group_size'", "integer"]),
    (None, {"quant_method": "fp8", "weight_block_size": 128}, errors.UnknownQuantAlgo, ["weight_block_size 128"]),
    (None, {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": "NVFP4"}, errors.UnknownQuantAlgo,
     ["kv_cache_quant_algo", "NVFP4"]),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "NVFP4_SVD"}}, None, errors.UnknownQuantAlgo,
     ["NVFP4_SVD", "hf_quant_config.json"]),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.mlp": {"quant_algo": "W8A16"}}}}, None, errors.UnknownQuantAlgo,
     ["quantized_layers['model.layers.0.mlp']", "W8A16"]),
])
def test_refused_by_name(tmp_path, hf, config_q, cls, words):
    with pytest.raises(cls) as e:
        load(write(tmp_path / "r", hf, config_q))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
