"""`bloomery inspect`: an artifact tensor by its GGUF name as well as by its base name, and a folder's
tensors of every safetensors dtype listed with their shapes; a tensor the family cannot use is refused
at prepare, by name, not at inspect."""

import json

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from bloomery.cli import main
from bloomery.compiler.prepare import prepare
from bloomery.core.errors import UnsupportedDtype
from ckpt import llama_tensors, write_folder

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "vocab_size": 96, "max_position_embeddings": 64}
OTHER = {"model.layers.0.mlp.step": np.arange(3, dtype=np.float64),
         "model.layers.0.mlp.mask": np.ones((2, 3), np.bool_),
         "model.layers.0.mlp.count": np.arange(4, dtype=np.int64),
         "model.layers.0.mlp.codes": np.zeros((5, 1), np.uint8),
         "model.layers.0.mlp.idx": np.zeros(6, np.int32),
         "model.layers.0.mlp.e5": np.zeros(7, ml_dtypes.float8_e5m2)}


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def folder(tmp_path):
    t = llama_tensors(np.random.default_rng(2), "NVFP4")
    return write_folder(tmp_path / "f", {**t, **OTHER}, {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]},
                        config=LLAMA)


def test_folder_lists_every_dtype(folder):
    r = cli("inspect", folder, "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    other = {o["name"]: o for o in obj["other_tensors"]}
    want = {"F64": "step", "BOOL": "mask", "I64": "count", "U8": "codes", "I32": "idx", "F8_E5M2": "e5"}
    assert {o["dtype"]: n.rsplit(".", 1)[-1] for n, o in other.items()} == want
    for n, a in OTHER.items():
        assert other[n]["shape"] == list(a.shape) and other[n]["bytes"] == a.nbytes, n
    assert not set(other) & {t["name"] for t in obj["tensors"]}
    text = cli("inspect", folder).output
    for dt, n in want.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"model.layers.0.mlp.{n} "))
        assert dt in line and str(list(OTHER[f"model.layers.0.mlp.{n}"].shape)) in line, line
    one = json.loads(cli("inspect", folder, "--tensor", "model.layers.0.mlp.mask", "--json").output)
    assert one == {"name": "model.layers.0.mlp.mask", "format": "BOOL", "shape": [2, 3], "bytes": 6,
                   "kind": "integer"}


def test_prepare_refuses_by_name_what_the_spec_does_not_read(tmp_path):
    t = llama_tensors(np.random.default_rng(2), "NVFP4")
    q = {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}
    bad = write_folder(tmp_path / "bad", {**t, "model.layers.0.mlp.step": np.zeros(2, np.float64)}, q, config=LLAMA)
    assert cli("inspect", bad).exit_code == 0
    r = cli("prepare", bad, tmp_path / "out")
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    assert "error: UnsupportedDtype:" in r.output and "'model.layers.0.mlp.step'" in r.output and "F64" in r.output
    assert not (tmp_path / "out").exists()
    # the spec ignores rotary_emb.inv_freq: stored as F64 it is no refusal
    ok = write_folder(tmp_path / "ok", {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(16)}, q,
                      config=LLAMA)
    prepare(ok, tmp_path / "out", progress=False)
    with pytest.raises(UnsupportedDtype, match="does not ignore it"):
        prepare(bad, tmp_path / "out2", progress=False)


def test_artifact_tensor_by_gguf_name(tmp_path):
    plain = write_folder(tmp_path / "g", llama_tensors(np.random.default_rng(2), "NVFP4"),
                         {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}, config=LLAMA)
    prepare(plain, tmp_path / "art", progress=False)
    shard = next((tmp_path / "art").glob("*.gguf"))
    names = {t.name for t in GGUFReader(shard).tensors}
    assert "blk.0.ffn_down.weight" in names and "blk.0.ffn_down.scale_2" in names
    by_base = json.loads(cli("inspect", tmp_path / "art", "--tensor", "blk.0.ffn_down", "--json").output)
    for g, parts in (("blk.0.ffn_down.weight", ["scale", "weight"]), ("blk.0.ffn_down.scale_2", ["scale_2"])):
        r = cli("inspect", tmp_path / "art", "--tensor", g, "--json", "--decode", tmp_path / "d.npy")
        assert r.exit_code == 0, r.output
        obj = json.loads(r.output)
        assert obj["gguf_tensor"] == g and obj["parts"] == parts and obj["name"] == "blk.0.ffn_down"
        assert {k: v for k, v in obj.items() if k in by_base and k != "decoded"} == by_base
        assert obj["gguf"][parts[-1]] == g
    r = cli("inspect", tmp_path / "art", "--tensor", "blk.0.ffn_down")          # no --decode: the table row
    assert r.exit_code == 0 and "layout: ggml" in r.output, r.output
    r = cli("inspect", tmp_path / "art", "--tensor", "blk.9.nope.weight")
    assert r.exit_code == 2 and "by base or GGUF name" in r.output
