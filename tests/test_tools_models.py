"""The test-checkpoint tools (bloomery.tools.models) and the folders they make.

Folder checks skip, with the reason, when `python -m bloomery.tools.models` has not been run."""

from __future__ import annotations

import json
import stat

import pytest

from bloomery.tools import models as M

EXPECTED_ALGO = {
    "bf16": None,
    "nvfp4": "NVFP4",
    "fp8": "FP8",
    "mxfp8": "MXFP8",
    "nvfp4_fp8kv": "NVFP4",
    "nvfp4_awq": "NVFP4_AWQ",
    "fp8_channel": "FP8_PER_CHANNEL_PER_TOKEN",
    "fp8_pb_wo": "fp8_pb_wo",  # sic: ModelOpt 0.47 writes these two in lower case
    "mxfp4": "mxfp4",
    "nvfp4_w4a16": "W4A16_NVFP4",
    "w4a8_nvfp4_fp8": "W4A8_NVFP4_FP8",
    "mixed_nvfp4_fp8": "MIXED_PRECISION",
    "mixed_nvfp4_mxfp8": "MIXED_PRECISION",
}


FLAGSHIP_NON_BF16 = {"tiny-glm5_next": {"F32"}, "tiny-qwen4_exp": {"I64"}}


def _need(name: str):
    d = M.model_dir(name)
    if not M.is_built(name):
        pytest.skip(f"test model {name} not built in {d} (run `python -m bloomery.tools.models`)")
    return d


# ------------------------------------------------------------------ no torch needed


def test_layout_names():
    names = set(M.SPECS)
    for fmt in ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_awq"):
        assert f"smollm2-135m/{fmt}" in names
    for fam in ("llama", "qwen3_moe", "qwen3_next", "glm4_moe"):
        for fmt in ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv"):
            assert f"tiny-{fam}/{fmt}" in names
    for fam in ("qwen4_exp", "glm5_next"):
        assert {n for n in names if n.startswith(f"tiny-{fam}/")} == {
            f"tiny-{fam}/{fmt}" for fmt in ("bf16", "nvfp4", "fp8", "mxfp8", "mixed_nvfp4_mxfp8")}
    for fam in ("llama3-rope", "qwen3", "qwen2"):
        assert {n for n in names if n.startswith(f"tiny-{fam}/")} == {f"tiny-{fam}/{fmt}" for fmt in ("bf16", "nvfp4", "fp8")}
    for fam in ("qwen3_next", "glm4_moe"):            # with the MTP / NextN layer (tests/test_mtp_checkpoints.py)
        assert {n for n in names if n.startswith(f"tiny-{fam}-mtp/")} == {f"tiny-{fam}-mtp/{f}" for f in ("bf16", "nvfp4")}
    assert all(s.fmt in EXPECTED_ALGO for s in M.SPECS.values())


def test_models_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv(M.ENV_VAR, str(tmp_path / "env"))
    assert M.models_dir() == (tmp_path / "env").resolve()
    assert M.model_dir("tiny-llama/nvfp4") == (tmp_path / "env" / "tiny-llama" / "nvfp4").resolve()
    assert M.models_dir(tmp_path / "x") == (tmp_path / "x").resolve()
    monkeypatch.delenv(M.ENV_VAR)
    assert M.models_dir().name == "models"
    with pytest.raises(KeyError):
        M.model_dir("tiny-llama/int3")


def test_select():
    assert [s.name for s in M.select(["tiny-llama/fp8"])] == ["tiny-llama/fp8"]
    assert {s.fmt for s in M.select(["smollm2-135m"])} == {"bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_awq"}
    assert {s.family for s in M.select(["*/nvfp4"])} == {
        "smollm2-135m", "tiny-llama", "tiny-qwen3_moe", "tiny-qwen3_next", "tiny-glm4_moe",
        "tiny-qwen4_exp", "tiny-glm5_next", "tiny-llama3-rope", "tiny-qwen3", "tiny-qwen2",
        "tiny-qwen3_next-mtp", "tiny-glm4_moe-mtp"}
    assert "smollm2-135m/nvfp4_awq" not in {s.name for s in M.select(None, ["*/nvfp4_awq"])}
    with pytest.raises(SystemExit):
        M.select(["nope"])


# ------------------------------------------------------------------ the built folders


@pytest.mark.models
@pytest.mark.parametrize("name", list(M.SPECS))
def test_folder(name):
    from safetensors import safe_open

    d = _need(name)
    fmt = M.SPECS[name].fmt
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / f).is_file(), f
    for p in d.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"]
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    q = d / "hf_quant_config.json"
    if fmt == "bf16":
        assert not q.exists()
        assert "rope_theta" in cfg or cfg["model_type"] == "glm5_next"     # GLM-5 is NoPE
    else:
        algo = json.loads(q.read_text())["quantization"]
        assert algo["quant_algo"] == EXPECTED_ALGO[fmt]
        assert algo["kv_cache_quant_algo"] == ("FP8" if fmt.endswith("fp8kv") else None)
    dtypes = {}
    for f in d.glob("*.safetensors"):
        with safe_open(f, "np") as sf:
            for k in sf.keys():
                dtypes[k] = sf.get_slice(k).get_dtype()
    assert dtypes
    if fmt == "bf16":
        # flagships: GLM-5's _keep_in_fp32_modules_strict tensors F32, qwen4's n-gram hash buffers I64
        assert set(dtypes.values()) == {"BF16"} | FLAGSHIP_NON_BF16.get(M.SPECS[name].family, set())
    else:
        assert any(v in ("U8", "F8_E4M3") for v in dtypes.values())
        if fmt.endswith("fp8kv"):
            assert any(k.endswith(".k_scale") for k in dtypes)
            assert any(k.endswith(".v_scale") for k in dtypes)


@pytest.mark.models
def test_smollm2_says_paris():
    pytest.importorskip("transformers")
    from bloomery.tools import smollm2

    d = _need("smollm2-135m/bf16")
    answer = smollm2.greedy_answer(d)
    assert "Paris" in answer, answer


def _dequantize_weights(t):
    """Test-only reference: weight-only dequantization of a ModelOpt NVFP4 / NVFP4_AWQ / FP8 /
    MXFP8 state dict to bf16 (input_scale ignored: activations stay bf16)."""
    import torch

    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])
    out = {}
    for k, v in t.items():
        p = k[: -len(".weight")]
        if k.endswith(".weight") and v.dtype == torch.uint8:  # NVFP4: low nibble first
            q = torch.stack([v & 15, v >> 4], -1).reshape(v.shape[0], -1).long()
            s = t[p + ".weight_scale"].float() * t[p + ".weight_scale_2"].float()
            w = (e2m1[q].view(v.shape[0], -1, 16) * s.unsqueeze(-1)).reshape(v.shape[0], -1)
            if p + ".pre_quant_scale" in t:  # AWQ: y = W (x * pre_quant_scale)
                w = w * t[p + ".pre_quant_scale"].float()
            out[k] = w.bfloat16()
        elif k.endswith(".weight") and v.dtype == torch.float8_e4m3fn:
            s = t[p + ".weight_scale"]
            if s.dtype == torch.uint8:  # MXFP8: E8M0 per 32
                w = v.float().view(v.shape[0], -1, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)
            else:
                w = v.float() * s.float()
            out[k] = w.reshape(v.shape).bfloat16()
        elif not k.endswith(("_scale", "_scale_2")):
            out[k] = v
    return out


@pytest.mark.models
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp8", "nvfp4_awq"])
def test_smollm2_export_weights_say_paris(fmt):
    """The export's weights, dequantized into the bf16 model, still answer Paris."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from bloomery.tools import smollm2

    base = _need("smollm2-135m/bf16")
    d = _need(f"smollm2-135m/{fmt}")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(
        _dequantize_weights(load_file(d / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    answer = smollm2.greedy_answer(base, smollm2.ROBUST_PROMPT, model=model)
    assert "Paris" in answer, answer


# ------------------------------------------------------------------ the CPU block-quant shim


def test_shim_matches_modelopt_qtensors():
    torch = pytest.importorskip("torch")
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor

    from bloomery.tools import modelopt_export as X

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 3).to(torch.bfloat16)
    w[3, :16] = 0  # an all-zero block
    amax = w.float().abs().amax()
    qt, s, s2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=amax / (6 * 448))
    ref = qt.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
    assert torch.equal(X.nvfp4_fake_quant(w.float(), 16, amax), ref)

    qt, s = MXFP8QTensor.quantize(w)  # block 32
    ref = qt.dequantize(dtype=torch.float32, scale=s)
    assert torch.equal(X.mxfp8_fake_quant(w.float(), 32), ref)


def _same_build(a, b, files, where):
    """Folders `a` and `b` hold the same tensors (every tensor of model.safetensors: names, dtypes,
    shapes and bytes) and byte-identical `files`."""
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta and sorted(ta) == sorted(tb), f"{where}: tensor names differ"
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, \
            f"{where}: {k}: {ta[k].dtype} {list(ta[k].shape)} against {tb[k].dtype} {list(tb[k].shape)}"
        assert torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)), \
            f"{where}: tensor {k} differs"
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{where}: {f} differs"


def test_tiny_build_is_deterministic(tmp_path):
    """tiny-llama/nvfp4 (and the bf16 folder it is quantized from) built twice from nothing, into two
    folders: every tensor and every other file the same, byte for byte; and the same as the cached
    build of `make models` where that one is current (its stamp is this recipe's)."""
    pytest.importorskip("torch")
    pytest.importorskip("modelopt")

    name = "tiny-llama/nvfp4"
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        assert M.main(["--out", str(root), "--only", name]) == 0
        assert M._read_stamp(root / name) == M.stamp_of(M.SPECS[name])
        assert not [p for p in (root / "tiny-llama").iterdir() if p.name.startswith(".")]   # no temp folders left
    for built in (name, "tiny-llama/bf16"):
        a, b = (root / built for root in roots)
        files = sorted(p.name for p in a.iterdir())
        assert files == sorted(p.name for p in b.iterdir()), built
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(files), files
        _same_build(a, b, files, f"{built} built twice")
    cached = M.model_dir(name)
    if M.is_built(name) and M._read_stamp(cached) == M.stamp_of(M.SPECS[name]):
        _same_build(roots[0] / name, cached, ("tokenizer.json", "hf_quant_config.json", "config.json"),
                    f"{name} against the cached build in {cached}")


# ------------------------------------------------------------------ the flagship models


def test_repair_ple_table(tmp_path):
    """ModelOpt's misnamed PLE table is written back as transformers' own save does: shards
    `ngram_embedding.shard_{i}.weight`, torch.chunk of the table, in order; nothing else changes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from bloomery.tools import modelopt_export as X

    table = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3).to(torch.bfloat16)
    other = torch.ones(2, 2)
    f = tmp_path / "model.safetensors"
    save_file({"model.layers.0.ple.ple_embedding.shard_.weight": table, "model.norm.weight": other}, str(f),
              metadata={"format": "pt"})
    cfg = SimpleNamespace(split_ngram_parts=4, get_text_config=lambda: cfg)
    assert X.repair_ple_table(tmp_path, cfg) == ["model.layers.0.ple.ple_embedding.shard_.weight"]
    got = load_file(str(f))
    p = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_"
    assert sorted(got) == sorted(["model.norm.weight"] + [f"{p}{i}.weight" for i in range(4)])
    for i, want in enumerate(torch.chunk(table, 4)):          # rows 3, 3, 3, 1
        assert torch.equal(got[f"{p}{i}.weight"], want)
    assert torch.equal(torch.cat([got[f"{p}{i}.weight"] for i in range(4)]), table)
    assert torch.equal(got["model.norm.weight"], other)
    with safe_open(str(f), "pt") as sf:
        assert sf.metadata() == {"format": "pt"}
    assert X.repair_ple_table(tmp_path, cfg) == []            # nothing left to repair


def _tensors(folder):
    from safetensors import safe_open

    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.mark.models
@pytest.mark.parametrize("fam", ["qwen4_exp", "glm5_next"])
def test_flagship_bf16_has_no_constant_tensor(fam):
    """Every float tensor transformers initialises to a constant (norm weights, PLE conv, mHC base and
    scale, A_log, ape, ...) is randomised, so that every path of the forward does something."""
    pytest.importorskip("torch")
    d = _need(f"tiny-{fam}/bf16")
    const = [k for k, t in _tensors(d).items()
             if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all())]
    assert not const, const


@pytest.mark.models
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp8", "mixed_nvfp4_mxfp8"])
def test_qwen4_exports_store_the_ple_table_as_transformers_does(fmt):
    """The ModelOpt exports hold the PLE shards under the names and with the bytes of the bf16 folder
    (transformers' save), the I64 hash buffers as they are."""
    torch = pytest.importorskip("torch")
    base, q = _tensors(_need("tiny-qwen4_exp/bf16")), _tensors(_need(f"tiny-qwen4_exp/{fmt}"))
    ple = [k for k in base if ".ple.ple_embedding." in k]
    assert len(ple) == 2 * (4 + 3)                    # 2 PLE layers: 4 shards + 3 I64 buffers
    assert not [k for k in q if k.endswith(".ple_embedding.shard_.weight")]
    for k in ple:
        assert q[k].dtype == base[k].dtype and torch.equal(q[k], base[k]), k


@pytest.mark.models
@pytest.mark.parametrize("fam", ["qwen4_exp", "glm5_next"])
def test_flagship_mixed_export(fam):
    """mixed_nvfp4_mxfp8: NVFP4 routed experts; MXFP8 attention, indexer, shared expert; BF16 (or the
    F32 GLM keeps) hyper-connections, routers and convs; the config lists exactly what is quantized."""
    d = _need(f"tiny-{fam}/mixed_nvfp4_mxfp8")
    layers = json.loads((d / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    t = _tensors(d)
    dtype = {k: str(v.dtype) for k, v in t.items()}
    pre = "model.language_model.layers." if fam == "glm5_next" else "model.layers."
    assert layers[pre + "3.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert dtype[pre + "3.mlp.experts.5.up_proj.weight"] == "torch.uint8"
    assert dtype[pre + "3.mlp.experts.5.up_proj.weight_scale"] == "torch.float8_e4m3fn"
    shared = "shared_experts" if fam == "glm5_next" else "shared_expert"
    mxfp8 = [f"3.mlp.{shared}.down_proj", "3.self_attn.o_proj"] + (
        ["3.self_attn.indexer.wq_b", "3.self_attn.kv_b_proj", "1.self_attn.q_proj"] if fam == "glm5_next"
        else ["3.self_attn.indexer.index_qk_proj", "1.linear_attn.in_proj_qkv"])
    for m in mxfp8:
        assert layers[pre + m] == {"quant_algo": "MXFP8", "group_size": 32}, m
        assert dtype[pre + m + ".weight"] == "torch.float8_e4m3fn" and dtype[pre + m + ".weight_scale"] == "torch.uint8"
    for k, v in layers.items():
        assert v["quant_algo"] == ("NVFP4" if k.endswith(".mlp.experts") else "MXFP8"), (k, v)
    assert not [k for k in layers
                if k.endswith(".mlp.gate") or any(s in k for s in ("hyper_connection", "conv1d", "_hc"))]
    for k, v in dtype.items():
        if any(s in k for s in ("hyper_connection", "_hc", "hc_", "mlp.gate.", "conv1d")):
            assert v in ("torch.bfloat16", "torch.float32"), (k, v)
    quantized = {k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale")}
    listed = {m for m in quantized if m in layers or m.rsplit(".", 2)[0] in layers}   # experts: by their module
    assert quantized == listed


@pytest.mark.models
def test_flagship_bf16_builds_are_deterministic(tmp_path):
    """The flagship bf16 folders built from nothing equal, tensor for tensor, the cached build."""
    pytest.importorskip("torch")
    for name in ("tiny-qwen4_exp/bf16", "tiny-glm5_next/bf16"):
        assert M.main(["--out", str(tmp_path), "--only", name]) == 0
        cached = M.model_dir(name)
        if not (M.is_built(name) and M._read_stamp(cached) == M.stamp_of(M.SPECS[name])):
            pytest.skip(f"{name} is not built from this recipe (make models)")
        _same_build(tmp_path / name, cached, ("config.json", "tokenizer.json"), f"{name} against {cached}")
