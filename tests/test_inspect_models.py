"""`bloomery inspect` on every real ModelOpt export of `make models`: the right format for every
weight, totals that add up, the same tensors as the BF16 model they came from, and values that
decode bit for bit to the oracle's own dequantization (tools/dequant.py, which shares no code
with core/formats); the BF16 model they came from bounds the error only as a sanity check."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bloomery.cli import main
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.core import specs
from bloomery.tools import dequant, models


def _same_names(ck, ref):
    """{spec name: stored name} of both folders' tensors. glm5_next's ModelOpt export keeps the module
    names (attn_hc.fn, one fused self_attn.conv1d) where its BF16 folder has save_pretrained's
    (hc_attn_fn, q/k/v_conv1d): the spec's aliases read both; the three convs count as the fused one."""
    spec = specs.for_config(ck.config)
    def canon(names):
        out = {}
        for n in names:
            c = spec.canonical(n)
            for x in ("q", "k", "v"):
                c = c.replace(f".self_attn.{x}_conv1d.weight", ".self_attn.conv1d.weight")
            out.setdefault(c, n)
        return out
    return canon, spec

# export name -> the formats its quantized linears are in
QUANTIZED = {"nvfp4": {"nvfp4"}, "nvfp4_fp8kv": {"nvfp4"}, "nvfp4_awq": {"nvfp4"}, "nvfp4_w4a16": {"nvfp4"},
             "fp8": {"fp8_tensor"}, "fp8_channel": {"fp8_channel"}, "fp8_pb_wo": {"fp8_block128"},
             "mxfp8": {"mxfp8"}, "mxfp4": {"mxfp4"}, "mixed_nvfp4_fp8": {"nvfp4", "fp8_tensor"},
             "mixed_nvfp4_mxfp8": {"nvfp4", "mxfp8"}, "w4a8_nvfp4_fp8": {"nvfp4_g32"}}
# relative L2 error of a decoded weight against the BF16 original: a sanity bound per format
# family (the quantization error; the bit-exact check against tools/dequant.py is the real one)
ERROR = {"nvfp4": 0.2, "nvfp4_g32": 0.2, "mxfp4": 0.25, "fp8_tensor": 0.08, "fp8_channel": 0.08, "fp8_block128": 0.08, "mxfp8": 0.08}
EXPORTS = [n for n in models.SPECS if n.split("/")[1] in QUANTIZED]


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} not built in {models.models_dir()} (run: make models)")


@pytest.mark.models
@pytest.mark.parametrize("name", EXPORTS)
def test_inspect_export(name):
    need(name)
    base = name.split("/")[0] + "/bf16"
    need(base)
    r = CliRunner().invoke(main, ["inspect", "--json", str(models.model_dir(name))])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    rows = {t["name"]: t for t in obj["tensors"]}
    quantized = {t["format"] for t in rows.values() if t["scales"]}
    assert quantized == QUANTIZED[name.split("/")[1]]
    for fmt, tot in obj["totals"].items():
        mine = [t for t in rows.values() if t["format"] == fmt]
        assert tot["tensors"] == len(mine) and tot["bytes"] == sum(t["bytes"] for t in mine)
        assert tot["elements"] == sum(int(np.prod(t["shape"])) for t in mine)
    ref = Checkpoint.open(models.model_dir(base))
    tied = {"lm_head.weight"} if ref.config.get("tie_word_embeddings") else set()
    canon, _ = _same_names(Checkpoint.open(models.model_dir(name)), ref)
    mine, theirs = canon(rows), canon(set(ref.tensors) - tied)
    assert set(mine) == set(theirs)
    for c, n in mine.items():
        if not c.endswith(".conv1d.weight"):           # the fused conv: three BF16 ones in the source
            assert tuple(rows[n]["shape"]) == ref.tensors[theirs[c]].shape, n
    if name.endswith("_fp8kv"):
        assert obj["quantization"]["kv_cache_quant_algo"] == "FP8" and obj["kv_scales"]
    ck = Checkpoint.open(models.model_dir(name))
    oracle = dequant.folder_weights(models.model_dir(name))
    assert set(oracle) == set(ck.tensors) | set(ck.integers), sorted(set(oracle) ^ set(ck.tensors))[:8]
    checked = 0
    for n, t in ck.tensors.items():
        got = t.decode()
        if "pre_quant_scale" in t.sources:       # NVFP4_AWQ: the folded value, as the oracle loads it
            got = got * np.asarray(t.sources["pre_quant_scale"].array(), np.float32)[None, :]
        want = oracle[n].numpy()
        assert got.shape == want.shape, (n, got.shape, want.shape)
        assert np.array_equal((got + np.float32(0)).view(np.int32), (want + np.float32(0)).view(np.int32)), \
            (n, t.format.name, int((got != want).sum()))
        checked += 1
        if n not in rows or not rows[n]["scales"]:
            continue
        src = ref.tensors[theirs[canon([n]).popitem()[0]]].decode()
        if name.endswith("_awq") and "pre_quant_scale" not in t.sources:
            continue   # AWQ folds its smoothing into the norms too: only the folded linears track the source
        err = np.linalg.norm(got - src) / np.linalg.norm(src)
        assert err < ERROR[t.format.name], (n, t.format.name, err)
    assert checked == len(ck.tensors)

