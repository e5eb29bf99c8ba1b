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
}


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
        "smollm2-135m", "tiny-llama", "tiny-qwen3_moe", "tiny-qwen3_next", "tiny-glm4_moe"}
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
        assert "rope_theta" in cfg
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
        assert set(dtypes.values()) == {"BF16"}
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
