"""Preparing the flagships (qwen4_exp, glm5_next): the spec machinery they added (sharded tables
joined, integer constants checked, stored-name aliases, {any} ignores) and their named refusals,
on tiny bf16 checkpoints written here by transformers itself (tools/tiny.py's configs)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from bloomery.compiler import prepare
from bloomery.core import ngram
from bloomery.core.artifact import Artifact
from bloomery.core.errors import (ConstantMismatch, TensorShapeMismatch, TPNotDivisible, UnknownTensor,
                                  UnsupportedConfig)

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from bloomery.tools import tiny

    root = tmp_path_factory.mktemp("flagships")
    out = {}
    for fam in tiny.FLAGSHIPS:
        out[fam] = root / fam
        tiny.build_bf16(fam, out[fam])
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _tensors(folder):
    return safetensors_torch.load_file(str(folder / "model.safetensors"))


def _save(folder, tensors):
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_qwen4_ple_table_is_its_shards_joined(folders, tmp_path):
    art_dir = tmp_path / "art"
    prepare.prepare(folders["qwen4_exp"], art_dir)
    art = Artifact.open(art_dir)
    st = _tensors(folders["qwen4_exp"])
    cfg = json.loads((folders["qwen4_exp"] / "config.json").read_text())
    for k, layer in enumerate(cfg["ple_layer_ids"]):
        bid = layer - 1
        pre = f"model.layers.{bid}.ple.ple_embedding."
        shards = sorted((n for n in st if n.startswith(pre + "ngram_embedding.shard_")),
                        key=lambda n: int(n.split("shard_")[1].split(".")[0]))
        assert len(shards) == cfg["split_ngram_parts"]
        want = torch.cat([st[n] for n in shards]).float().numpy()
        got = art.decode(f"blk.{bid}.ple_table")
        assert got.shape == want.shape == (ngram.tables(cfg["vocab_size"], 3, 4, 4096, 1234, k).rows, 8)
        assert np.array_equal(got, want)                        # values as stored, rows in shard order
        assert art.tensors(0)[f"blk.{bid}.ple_table"].format == "bf16"


def test_qwen4_ple_table_is_streamed_not_joined(folders, tmp_path, monkeypatch):
    """The writer streams a table's pieces one after another: with the in-memory join of a joined
    table made to fail, prepare still writes the same bytes (SHA256SUMS) as before."""
    from bloomery.compiler import slicing
    prepare.prepare(folders["qwen4_exp"], tmp_path / "a")
    real, joined = slicing.producer, []

    def no_join(*a, joined=False, **k):
        if not joined:
            return real(*a, **k)

        def refuse():
            joined.append(a[-1] if a else "?")
            raise AssertionError("a joined table was concatenated in memory")
        return refuse
    monkeypatch.setattr(slicing, "producer", no_join)
    prepare.prepare(folders["qwen4_exp"], tmp_path / "b")
    assert not joined
    assert (tmp_path / "a" / "SHA256SUMS").read_bytes() == (tmp_path / "b" / "SHA256SUMS").read_bytes()


def test_qwen4_hash_buffers_are_checked(folders, tmp_path):
    bad = _copy(folders["qwen4_exp"], tmp_path / "ckpt")
    st = _tensors(bad)
    name = "model.layers.0.ple.ple_embedding.layer_multipliers"
    st[name] = st[name].clone()
    st[name][1] += 2
    _save(bad, st)
    with pytest.raises(ConstantMismatch, match=r"layer_multipliers.*spec computes"):
        prepare.prepare(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_qwen4_unknown_integer_tensor_is_named(folders, tmp_path):
    bad = _copy(folders["qwen4_exp"], tmp_path / "ckpt")
    st = _tensors(bad)
    st["model.layers.1.linear_attn.step_count"] = torch.zeros(3, dtype=torch.int64)
    _save(bad, st)
    with pytest.raises(UnknownTensor, match=r"step_count.*I64 \[3\].*integer"):
        prepare.prepare(bad, tmp_path / "out")


def test_qwen4_short_shard_is_named(folders, tmp_path):
    bad = _copy(folders["qwen4_exp"], tmp_path / "ckpt")
    st = _tensors(bad)
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_2.weight"
    st[name] = st[name][:-1].clone()
    _save(bad, st)
    with pytest.raises(TensorShapeMismatch, match=r"shard_2.*should be \[8288, 8\]"):
        prepare.prepare(bad, tmp_path / "out")


def test_qwen4_language_model_prefix_reads_the_same(folders, tmp_path):
    """Qwen4ExpForConditionalGeneration's layout (model.language_model., a vision tower) gives the
    artifact of the text-only layout, tensor for tensor."""
    cg = _copy(folders["qwen4_exp"], tmp_path / "cg")
    st = {(("model.language_model." + n[len("model."):]) if n.startswith("model.") else n): t
          for n, t in _tensors(cg).items()}
    st["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    _save(cg, st)
    prepare.prepare(folders["qwen4_exp"], tmp_path / "a")
    prepare.prepare(cg, tmp_path / "b")
    a, b = Artifact.open(tmp_path / "a"), Artifact.open(tmp_path / "b")
    assert sorted(a.tensors(0)) == sorted(b.tensors(0))
    for n in ("token_embd", "blk.0.ple_table", "blk.3.idx_qk", "hc_out_up"):
        assert np.array_equal(a.decode(n), b.decode(n))


def test_qwen4_tp2_is_refused_by_name(folders, tmp_path):
    with pytest.raises(TPNotDivisible, match="qwen4_exp.*tp 1"):
        prepare.prepare(folders["qwen4_exp"], tmp_path / "out", tp=2)


def test_glm5_shared_dsa_after_a_kda_layer_is_refused(folders, tmp_path):
    bad = _copy(folders["glm5_next"], tmp_path / "ckpt")
    cfg = json.loads((bad / "config.json").read_text())
    types = ["full"] * 8
    types[3] = "shared"                      # layer 3 (MLA) after layer 2 (KDA)
    cfg["text_config"]["indexer_types"] = types
    (bad / "config.json").write_text(json.dumps(cfg))
    st = _tensors(bad)
    for n in [n for n in st if n.startswith("model.language_model.layers.3.self_attn.indexer.")]:
        del st[n]
    _save(bad, st)
    with pytest.raises(UnsupportedConfig, match="layer 3 is a shared DSA layer"):
        prepare.prepare(bad, tmp_path / "out")


def test_glm5_vision_tower_is_left_out(folders, tmp_path):
    prepare.prepare(folders["glm5_next"], tmp_path / "art")
    names = Artifact.open(tmp_path / "art").tensors(0)
    assert not [n for n in names if "visual" in n]
    assert any(n.startswith("model.visual.") for n in _tensors(folders["glm5_next"]))


def test_glm5_modelopt_module_names_read_the_same(folders, tmp_path):
    """ModelOpt's export writes glm5_next's module names (attn_hc.fn, self_attn.forget_gate.*, one
    fused F32 self_attn.conv1d [q | k | v]); the artifact holds the same values as from the names
    save_pretrained writes, and the NumPy executor gives the same logits."""
    from bloomery.runtime import engine

    mo = _copy(folders["glm5_next"], tmp_path / "mo")
    st, out = _tensors(mo), {}
    for n, t in st.items():
        n2 = n.replace(".hc_attn_", ".attn_hc.").replace(".hc_ffn_", ".ffn_hc.")
        for p in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            n2 = n2.replace(f".self_attn.{p}", f".self_attn.forget_gate.{p}")
        if n2.endswith(".self_attn.q_conv1d.weight"):
            pre = n2[: -len("q_conv1d.weight")]
            out[pre + "conv1d.weight"] = torch.cat([st[n.replace("q_conv1d", x + "_conv1d")].float()
                                                    for x in "qkv"])
            continue
        if n2.endswith((".self_attn.k_conv1d.weight", ".self_attn.v_conv1d.weight")):
            continue
        out[n2] = t
    assert any(".attn_hc.fn" in n for n in out) and any(".forget_gate.A_log" in n for n in out)
    _save(mo, out)
    for tp in (1, 2):
        prepare.prepare(folders["glm5_next"], tmp_path / f"a{tp}", tp=tp)
        prepare.prepare(mo, tmp_path / f"b{tp}", tp=tp)
    b = Artifact.open(tmp_path / "b1")
    assert "blk.0.ssm_conv1d" in b.tensors(0) and "blk.0.ssm_conv_q" not in b.tensors(0)
    ids = list(range(3, 200))
    ref = engine.logits(tmp_path / "a1", ids)
    for art in (tmp_path / "b1", tmp_path / "b2", tmp_path / "a2"):
        got = engine.logits(art, ids)
        assert np.array_equal(got.argmax(-1), ref.argmax(-1))
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("fam", ["qwen4_exp", "glm5_next"])
def test_short_prompts_and_decode_before_the_first_block(folders, tmp_path, fam):
    """Prompts shorter than the indexer's block / pool (no complete block yet), then token-by-token
    decode: the logits of each position equal those of one longer prompt's (the indexers, caches and
    states are causal)."""
    from bloomery.runtime import Engine, engine

    prepare.prepare(folders[fam], tmp_path / "art")
    ids = [5, 7, 9, 11, 13, 17, 19]
    ref = engine.logits(tmp_path / "art", ids)
    for n in (1, 2, 3):
        assert np.allclose(engine.logits(tmp_path / "art", ids[:n]), ref[:n], rtol=0, atol=1e-5 * np.abs(ref).max())
    eng = Engine(tmp_path / "art")
    got = [eng.prefill(ids[:1], last_only=True)]
    for t in ids[1:]:
        lg, _ = eng.decode([t])
        got.append(np.asarray(lg).reshape(-1, ref.shape[-1])[0])
    assert np.allclose(np.stack(got), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
