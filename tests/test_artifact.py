"""compiler/writer.py + core/artifact/reader.py: real files through gguf-py's GGUFReader."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import GGUFValueType as VT

from artifact_driver import plans as synthetic_plans
from bloomery.compiler import writer
from bloomery.compiler.planned import PlannedTensor, RankPlan
from bloomery.compiler.publish import publish
from bloomery.core import formats
from bloomery.core.artifact import Artifact
from bloomery.core.errors import (ArtifactChecksumMismatch, ArtifactMalformed, ArtifactMissingShard,
                                  MetadataTypeError)
from test_artifact_layout import NAMES, with_optional     # the formats with an artifact layout
from test_formats import make, same_bits

SHAPES = {"nvfp4": [(64, 128), (3, 16, 48)], "mxfp4": [(33, 64), (2, 8, 96)], "mxfp8": [(9, 64), (2, 5, 32)],
          "fp8_tensor": [(7, 13), (3, 5, 40)], "fp8_channel": [(7, 13), (3, 5, 40)],
          "fp8_block128": [(130, 300), (2, 129, 257)], "fp8_block32": [(33, 70), (3, 40, 33)],
          "bf16": [(17,), (7, 13)], "f16": [(7, 13)], "f32": [(5,), (3, 5, 8)], "q8_0": [(7, 64), (3, 5, 128)]}


def all_format_plans(tp=2):
    """Every format, plain and stacked, with optional parts; each rank different values."""
    res, parts = [], {}
    for r in range(tp):
        ts = []
        for name in NAMES:
            for j, shape in enumerate(SHAPES[name]):
                base = f"blk.{r}.{name}_{j}"
                rng = np.random.default_rng(zlib.crc32(base.encode()))
                p, opt = with_optional(name, make(name, shape, rng, 1 if name in ("nvfp4", "fp8_block128") else 0),
                                       shape, rng, 2 if j else 1)
                parts[(r, base)] = p
                ts.append(PlannedTensor(base, "attn_q", name, tuple(shape), opt, (f"model.{base}",), "column",
                                        (lambda p=p: p)))
        res.append(RankPlan(r, tp, ts, {"general.architecture": "llama", "llama.block_count": 2,
                                        "llama.attention.layer_norm_rms_epsilon": 1e-5,
                                        "llama.some_signed": -3, "llama.big": 2**40,
                                        "llama.flags": [True, False], "llama.heads": [8, 8, 4],
                                        "llama.names": ["a", "b"], "llama.mixed": [1, 2.5]}))
    return res, parts


def test_write_read_every_format(tmp_path):
    plans, parts = all_format_plans()
    out = tmp_path / "art"
    tok = json.dumps({"model": {"type": "BPE"}, "added_tokens": ["é"]})
    publish(out, plans, {"general.name": "t"}, tokenizer_json=tok, chat_template="{% for m in messages %}",
            max_shard_bytes=20_000)
    a = Artifact.open(out, verify=True)
    assert a.tp == 2 and a.ranks == [0, 1]
    assert len(a.shards[0]) > 2
    assert a.tokenizer_json == tok and a.chat_template == "{% for m in messages %}"
    for (r, base), p in parts.items():
        info = a.tensors(r)[base]
        fmt = formats.get(info.format)
        same_bits(a.decode(base, r), fmt.decode(p))
        assert info.shape == fmt.shape(p)
    # every shard opens in gguf-py's reader, split keys typed as llama.cpp's gguf-split writes them
    for r in (0, 1):
        n = len(a.shards[r])
        total = 0
        for i, path in enumerate(a.shards[r]):
            assert path.name == f"rank{r}-{i + 1:05d}-of-{n:05d}.gguf"
            g = GGUFReader(path)
            f = g.fields
            assert f["split.no"].contents() == i and f["split.no"].types == [VT.UINT16]
            assert f["split.count"].contents() == n and f["split.count"].types == [VT.UINT16]
            assert f["split.tensors.count"].types == [VT.INT32]
            assert f["general.architecture"].contents() == "llama"
            assert ("bloomery.tensors" in f) == (i == 0)
            total += len(g.tensors)
        assert total == GGUFReader(a.shards[r][0]).fields["split.tensors.count"].contents()


def test_metadata_types(tmp_path):
    plans, _ = all_format_plans(tp=1)
    publish(tmp_path / "a", plans)
    f = GGUFReader(Artifact.open(tmp_path / "a").shards[0][0]).fields
    want = {"llama.block_count": [VT.UINT32], "llama.attention.layer_norm_rms_epsilon": [VT.FLOAT32],
            "llama.some_signed": [VT.INT32], "llama.big": [VT.UINT64], "llama.flags": [VT.ARRAY, VT.BOOL],
            "llama.heads": [VT.ARRAY, VT.UINT32], "llama.names": [VT.ARRAY, VT.STRING],
            "llama.mixed": [VT.ARRAY, VT.FLOAT32], "bloomery.tensors": [VT.STRING],
            "bloomery.rank": [VT.UINT32], "bloomery.tp": [VT.UINT32]}
    for k, t in want.items():
        assert f[k].types == t, k
    assert f["llama.heads"].contents() == [8, 8, 4] and f["llama.mixed"].contents() == [1.0, 2.5]
    table = json.loads(f["bloomery.tensors"].contents())
    assert list(table) == sorted(table)
    e = table["blk.0.nvfp4_0"]
    assert e["parts"] == {"input_scale": "blk.0.nvfp4_0.input_scale", "pre_quant_scale": "blk.0.nvfp4_0.pre_quant_scale",
                          "scale": "blk.0.nvfp4_0.weight", "scale_2": "blk.0.nvfp4_0.scale_2",
                          "weight": "blk.0.nvfp4_0.weight"}
    assert e["layout"] == "ggml" and e["format"] == "nvfp4" and e["shape"] == [64, 128]
    assert table["blk.0.nvfp4_1"]["layout"] == "stored"          # row of 48: not a multiple of 64
    for bad in (None, {"a": 1}, [], [1, "a"]):
        with pytest.raises(MetadataTypeError):
            writer.gguf_value("k", bad)


def test_split_by_size(tmp_path):
    plans = synthetic_plans(7, 0.05, tp=1, fmts=("bf16",))
    shards = writer.plan_shards(plans[0], max_shard_bytes=120_000)
    assert [s.name for s in shards] == [f"rank0-{i:05d}-of-{len(shards):05d}.gguf" for i in range(1, len(shards) + 1)]
    assert all(s.nbytes <= 120_000 or len(s.tensors) == 1 for s in shards)
    assert sum(len(s.tensors) for s in shards) == 7 and len(shards) > 1
    one = writer.plan_shards(plans[0])
    assert [s.name for s in one] == ["rank0-00001-of-00001.gguf"]


def test_deterministic(tmp_path):
    for k in ("a", "b"):
        publish(tmp_path / k, all_format_plans()[0], tokenizer_json="{}", max_shard_bytes=30_000)
    fa = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert fa == sorted(p.name for p in (tmp_path / "b").iterdir())
    for n in fa:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n


def test_reader_refuses_damage(tmp_path):
    out = tmp_path / "a"
    publish(out, synthetic_plans(4, 0.05, tp=2), max_shard_bytes=60_000)
    Artifact.open(out, verify=True)
    files = sorted(out.glob("rank1-*.gguf"))
    # flipped byte: checksum mismatch, by name
    data = bytearray(files[-1].read_bytes())
    data[-100] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    Artifact.open(out)                                        # structure still fine
    with pytest.raises(ArtifactChecksumMismatch, match=files[-1].name):
        Artifact.open(out, verify=True)
    files[-1].unlink()
    with pytest.raises(ArtifactMissingShard, match=files[-1].name):
        Artifact.open(out)
    (out / "SHA256SUMS").unlink()
    with pytest.raises(ArtifactMissingShard, match="SHA256SUMS"):
        Artifact.open(out)


def test_reader_refuses_missing_rank(tmp_path):
    out = tmp_path / "a"
    publish(out, synthetic_plans(2, 0.05, tp=2))
    sums = (out / "SHA256SUMS").read_text().splitlines()
    (out / "SHA256SUMS").write_text("".join(line + "\n" for line in sums if "rank1-" not in line))
    for p in out.glob("rank1-*"):
        p.unlink()
    with pytest.raises(ArtifactMissingShard, match="missing rank 1"):
        Artifact.open(out)


def test_produce_mismatch_refused(tmp_path):
    p = make("bf16", (4, 8), np.random.default_rng(0))
    t = PlannedTensor("x", "attn_q", "bf16", (4, 9), (), ("x",), "column", lambda: p)
    with pytest.raises(ArtifactMalformed, match="produce"):
        publish(tmp_path / "a", [RankPlan(0, 1, [t])])
    assert not (tmp_path / "a").exists()
    assert not [q for q in tmp_path.iterdir() if "tmp" in q.name]
