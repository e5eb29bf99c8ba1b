"""Tensor parallelism on NVFP4's own block (16): a rank's slice whose row length is not a multiple
of GGML's super-block of 64 is kept in the stored layout (I8 nibbles, I8 E4M3 scales, scale_2)
instead of the tp being refused; it decodes, reads back through `bloomery inspect`, and runs, bit
for bit the checkpoint's values."""

import json

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from bloomery import runtime
from bloomery.cli import main
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.prepare import prepare
from bloomery.core import errors, formats
from bloomery.core.artifact.reader import Artifact
from ckpt import write_folder
from test_planning import EXCLUDE, moe_cfg, moe_tensors
from test_runtime_models import reference_logits

EXPERT_WIDTH = 64          # moe_intermediate_size: the experts' down_proj rows, 32 per rank at tp 2
STORED = {"weight": "weight", "scale": "weight_scale", "scale_2": "weight_scale_2"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Qwen3-MoE checkpoint whose linears and experts are NVFP4 (encoded from BF16 values)."""
    rng = np.random.default_rng(21)
    cfg = moe_cfg(moe_intermediate_size=EXPERT_WIDTH)
    cfg["moe_intermediate_size"] = EXPERT_WIDTH
    t = moe_tensors(rng, "BF16", cfg)
    for name in [n for n in t if n.endswith("_proj.weight")]:
        p = formats.get("nvfp4").encode(np.asarray(t.pop(name), np.float32))
        t.update({f"{name[:-len('weight')]}{STORED[k]}": v for k, v in p.items()})
    return write_folder(tmp_path_factory.mktemp("ckpt") / "moe", t,
                        {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDE}, config=cfg)


@pytest.fixture(scope="module")
def arts(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("art")
    for tp in (1, 2):
        prepare(folder, root / f"tp{tp}", tp=tp, progress=False)
    return {tp: Artifact.open(root / f"tp{tp}") for tp in (1, 2)}


def reference(w, scale, scale_2) -> np.ndarray:
    """ml_dtypes' E2M1 and E4M3 values, the float64 product rounded once."""
    codes = np.stack([w & 0xF, w >> 4], axis=-1).reshape(*w.shape[:-1], -1)
    s = np.repeat(np.asarray(scale).astype(np.float64), 16, axis=-1)
    return (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * s * np.float64(scale_2)).astype(np.float32)


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def test_expert_width_needs_the_stored_layout_at_tp2(folder, arts):
    ck = Checkpoint.open(folder)
    for tp, art in arts.items():
        for rank in range(tp):
            table = art.tensors(rank)
            down, gate = table["blk.0.ffn_down_exps"], table["blk.0.ffn_gate_exps"]
            assert down.shape == (4, 128, EXPERT_WIDTH // tp)
            assert down.layout == ("stored" if tp == 2 else "ggml"), (tp, rank)
            assert gate.layout == "ggml" and table["blk.0.attn_output"].layout == "ggml"
            if tp == 1:
                continue
            # the stored layout holds the checkpoint's own bytes: the rank's nibbles and scales
            arrays = art.gguf_arrays("blk.0.ffn_down_exps", rank)
            assert sorted(arrays) == ["scale", "scale_2", "weight"]
            half = EXPERT_WIDTH // 2
            for x in range(4):
                src = ck.tensors[f"model.layers.0.mlp.experts.{x}.down_proj.weight"].sources
                w = np.asarray(src["weight"].array())[:, rank * half // 2:(rank + 1) * half // 2]
                s = np.asarray(src["scale"].array()).view(np.uint8)[:, rank * half // 16:(rank + 1) * half // 16]
                assert arrays["weight"][x].view(np.uint8).tobytes() == w.tobytes()
                assert arrays["scale"][x].view(np.uint8).tobytes() == s.tobytes()


@pytest.mark.parametrize("base,hf,axis", [("blk.1.ffn_down_exps", "down_proj", -1),
                                          ("blk.1.ffn_up_exps", "up_proj", -2)])
def test_ranks_decode_to_the_checkpoint(folder, arts, base, hf, axis):
    """Every rank's slice, decoded from the artifact and joined, equals the reference decode of the
    checkpoint's bytes (ml_dtypes' tables), bit for bit."""
    ck = Checkpoint.open(folder)
    want = np.stack([reference(*(np.asarray(ck.tensors[f"model.layers.1.mlp.experts.{x}.{hf}.weight"]
                                            .sources[k].array()) for k in ("weight", "scale", "scale_2")))
                     for x in range(4)])
    for tp, art in arts.items():
        got = np.concatenate([art.decode(base, r) for r in range(tp)], axis=axis)
        assert np.array_equal(bits(got), bits(want)), (base, tp)


def test_inspect_decodes_a_stored_rank_bit_for_bit(folder, arts, tmp_path):
    out = tmp_path / "down.npy"
    r = CliRunner().invoke(main, ["inspect", str(arts[2].path), "--rank", "1", "--tensor", "blk.0.ffn_down_exps",
                                  "--decode", str(out)])
    assert r.exit_code == 0, r.output
    full = arts[1].decode("blk.0.ffn_down_exps", 0)
    assert np.array_equal(bits(np.load(out)), bits(full[..., EXPERT_WIDTH // 2:]))
    r = CliRunner().invoke(main, ["inspect", "--json", str(arts[2].path), "--rank", "1"])
    assert r.exit_code == 0, r.output
    rows = {t["name"]: t for t in json.loads(r.output)["tensors"]}
    assert rows["blk.0.ffn_down_exps"]["layout"] == "stored" and rows["blk.0.ffn_gate_exps"]["layout"] == "ggml"


def test_tp2_runs_as_tp1_and_the_reference(folder, arts):
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 96, 24)]
    want = reference_logits(folder, ids)
    l1, l2 = (runtime.logits(str(arts[tp].path), ids) for tp in (1, 2))
    rel = lambda a, b: float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))
    assert rel(l2, l1) < 1e-5 and rel(l2, want) < 5e-6, (rel(l2, l1), rel(l2, want))
    assert (np.argmax(l2, -1) == np.argmax(l1, -1)).all()


def test_a_slice_off_the_nvfp4_block_is_still_refused(tmp_path):
    """The cut unit is NVFP4's block of 16: 48-wide experts give ranks 24, refused by name."""
    rng = np.random.default_rng(4)
    cfg = moe_cfg(moe_intermediate_size=48)
    cfg["moe_intermediate_size"] = 48
    t = moe_tensors(rng, "BF16", cfg)
    for name in [n for n in t if n.endswith("_proj.weight")]:
        p = formats.get("nvfp4").encode(np.asarray(t.pop(name), np.float32))
        t.update({f"{name[:-len('weight')]}{STORED[k]}": v for k, v in p.items()})
    f = write_folder(tmp_path / "m", t, {"quant_algo": "NVFP4", "exclude_modules": EXCLUDE}, config=cfg)
    with pytest.raises(errors.NotOnBlockBoundary) as e:
        prepare(f, tmp_path / "out", tp=2, progress=False)
    for w in ("blk.0.ffn_down_exps", "nvfp4", "length 48", "slice 0..24", "multiple of 16"):
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "out").exists()
