"""The numerical gates (tools/gates.py): metrics, bands, the prompt set, and the fast subset of
`make gates` (the tiny models, all formats, and SmolLM2 NVFP4 on a shorter slice of the
prompts, with the same bands)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import yaml

from bloomery.core import levers
from bloomery.tools import gates, models

FAST_LIMIT = 64     # tokens per sequence in the fast subset (make gates: 256)
FAST = [n for n in gates.GATED if n.startswith("tiny-")] + ["smollm2-135m/nvfp4"]
FAST_TP2 = ["tiny-llama/nvfp4", "tiny-llama/mxfp4", "tiny-qwen3_moe/nvfp4", "tiny-qwen3_moe/fp8"]


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    return models.model_dir(name)


# --------------------------------------------------------------------------- metrics


def test_metrics_identical_and_known_values():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 11)).astype(np.float32)
    m = gates.compare([a], [a.copy()])
    assert m == {"positions": 5, "argmax_agreement": 1.0, "kl_mean": 0.0, "kl_max": 0.0,
                 "rel_l2_mean": 0.0, "rel_l2_max": 0.0}
    # a shift of every logit of a row changes neither softmax nor argmax, but is an L2 error
    b = a.copy()
    b[2] += 3.0
    m = gates.compare([a], [b])
    assert m["argmax_agreement"] == 1.0 and m["kl_max"] < 1e-12
    assert m["rel_l2_max"] == pytest.approx(3.0 * np.sqrt(11) / np.linalg.norm(a[2].astype(np.float64)))
    # KL against the closed form, in float64
    c = a.copy()
    c[1, 0] += 1.5
    p = np.exp(a[1].astype(np.float64))
    p /= p.sum()
    q = np.exp(c[1].astype(np.float64))
    q /= q.sum()
    per = gates.position_metrics(a, c)
    assert per["kl"][1] == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-12)
    assert per["kl"][0] == 0.0


def test_argmax_agreement_counts_flips_over_all_sequences():
    a = np.zeros((4, 3), np.float32)
    a[:, 0] = 1.0
    b = a.copy()
    b[3, 2] = 2.0                       # one flip in 4 + 6 positions
    m = gates.compare([a, np.tile(a[:1], (6, 1))], [b, np.tile(a[:1], (6, 1))])
    assert m["positions"] == 10 and m["argmax_agreement"] == pytest.approx(0.9)


def test_metrics_refuse_bad_candidates():
    a = np.zeros((3, 4), np.float32)
    with pytest.raises(gates.GateError, match="cannot be compared"):
        gates.compare([a], [a[:2]])
    b = a.copy()
    b[1, 2] = np.nan
    with pytest.raises(gates.GateError, match="NaN/Inf at 1 of 3"):
        gates.compare([a], [b])
    with pytest.raises(gates.GateError, match="2 reference sequences"):
        gates.compare([a, a], [a])


# --------------------------------------------------------------------------- bands


def test_bands_file_holds_the_issue_bands():
    b = gates.load_bands()
    ex = b["executor_vs_oracle"].limits
    assert ex["argmax_agreement"]["min"] >= 0.995
    assert ex["kl_mean"]["max"] <= 1e-4
    assert b["tp2_vs_tp1"].limits["argmax_agreement"]["min"] == 1.0
    for kind in b.values():
        for metric, lim in kind.limits.items():
            assert lim.get("measured"), f"{kind.kind}.{metric}: no measured value beside the band"


def test_check_against_a_band():
    band = gates.Band("k", "", {"argmax_agreement": {"min": 0.995}, "kl_mean": {"max": 1e-4}})
    ok = {"argmax_agreement": 0.996, "kl_mean": 1e-5}
    assert gates.check(ok, band) == []
    bad = gates.check({"argmax_agreement": 0.99, "kl_mean": 2e-4}, band)
    assert len(bad) == 2 and "argmax_agreement 0.99 < 0.995" in bad[0] and "kl_mean" in bad[1]
    assert gates.check({"argmax_agreement": float("nan"), "kl_mean": 0.0}, band)   # NaN fails


def test_band_file_errors(tmp_path):
    p = tmp_path / "bands.yaml"
    p.write_text(yaml.safe_dump({"x": {"compares": "", "bands": {"kl_avg": {"max": 1}}}}))
    with pytest.raises(gates.GateError, match="unknown metric 'kl_avg'"):
        gates.load_bands(p)
    p.write_text(yaml.safe_dump({"x": {"compares": "", "bands": {"kl_max": {"max": 1, "min": 0}}}}))
    with pytest.raises(gates.GateError, match="exactly one of min / max"):
        gates.load_bands(p)


# --------------------------------------------------------------------------- the prompt set


@pytest.mark.models
@pytest.mark.parametrize("name", ["smollm2-135m/bf16", "tiny-llama/bf16", "tiny-qwen3_moe/bf16"])
def test_prompt_set_covers_1024_positions(name):
    import json

    folder = need(name)
    seqs = gates.sequences(folder)
    ctx = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    assert sum(len(s.ids) for s in seqs) >= 1024
    assert all(0 < len(s.ids) <= min(ctx, 256) for s in seqs)
    by_kind = {}
    for s in seqs:
        by_kind[s.kind] = by_kind.get(s.kind, 0) + len(s.ids)
    assert {"prose", "code", "korean"} <= set(by_kind)
    assert all(by_kind[k] >= 200 for k in ("prose", "code", "korean")), by_kind
    assert all(len(s.ids) <= 16 for s in gates.sequences(folder, limit=16))


def test_gated_list_is_the_test_models():
    for n in gates.GATED + gates.TP2:
        assert n in models.SPECS, n
    assert set(gates.SKIP) <= set(gates.GATED)
    assert {"smollm2-135m/bf16", "smollm2-135m/nvfp4", "smollm2-135m/fp8", "smollm2-135m/mxfp8"} <= set(gates.GATED)
    assert {n for n in models.SPECS if n.startswith(("tiny-llama/", "tiny-qwen3_moe/"))} <= set(gates.GATED)


# --------------------------------------------------------------------------- the fast subset


@pytest.fixture(scope="module")
def bands():
    return gates.load_bands()


def _candidate():
    return "executor" if gates.executor_available() else "artifact-oracle"


@pytest.mark.models
@pytest.mark.parametrize("name", FAST)
def test_gate_fast(name, bands, tmp_path_factory, monkeypatch):
    need(name)
    monkeypatch.setenv(gates.GATES_ENV, str(tmp_path_factory.getbasetemp() / "gates"))
    row = gates.gate_row(name, bands, _candidate(), limit=FAST_LIMIT)
    if name in gates.SKIP:
        assert row.verdict == "SKIP"
        return
    assert row.verdict == "PASS", gates.table([row])
    assert row.positions >= 9 * 32


@pytest.mark.models
@pytest.mark.parametrize("name", FAST_TP2)
def test_gate_tp2_fast(name, bands, tmp_path_factory, monkeypatch):
    need(name)
    if not gates.executor_available():
        pytest.skip("the NumPy executor (bloomery.runtime.logits) is not built")
    monkeypatch.setenv(gates.GATES_ENV, str(tmp_path_factory.getbasetemp() / "gates"))
    row = gates.tp2_row(name, bands, limit=FAST_LIMIT)
    assert row.verdict == "PASS", gates.table([row])


@pytest.mark.models
def test_gate_fails_a_planted_defect(bands):
    """A candidate that forgets NVFP4_AWQ's pre_quant_scale (the weights otherwise exact) is
    caught by the executor_vs_oracle band; so is one with a single flipped weight sign."""
    from bloomery.tools import oracle

    folder = need("tiny-llama/nvfp4_awq")
    seqs = gates.sequences(folder, limit=FAST_LIMIT)
    ref = oracle.Oracle(folder)
    refs = [ref.logits(s.ids) for s in seqs]

    from bloomery.compiler.checkpoint import Checkpoint

    ck = Checkpoint.open(folder)
    unfolded = {n: qt.decode() for n, qt in ck.tensors.items()}
    model = oracle.build_model(folder, unfolded)
    m = gates.compare(refs, [oracle.forward_logits(model, s.ids) for s in seqs])
    assert gates.check(m, bands["executor_vs_oracle"]), m

    flipped = oracle.checkpoint_weights(folder)
    flipped["model.layers.1.mlp.down_proj.weight"] = -flipped["model.layers.1.mlp.down_proj.weight"]
    model = oracle.build_model(folder, flipped)
    m = gates.compare(refs, [oracle.forward_logits(model, s.ids) for s in seqs])
    assert gates.check(m, bands["executor_vs_oracle"]), m


# --------------------------------------------------------------------------- the Q8 lever


def test_q8_lever_cost_is_measured():
    cost = levers.get("BLOOMERY_PREPARE_Q8").cost
    assert "not measured" not in cost
    assert re.search(r"KL.*mean [0-9.e+-]+.*max [0-9.e+-]+", cost), cost
    assert re.search(r"argmax agreement [0-9.]+", cost), cost
    assert re.search(r"20\d\d-\d\d-\d\d", cost) and "BLOOMERY_PREPARE_Q8" in cost, cost


# --------------------------------------------------------------------------- the GPU gates' oracle row


def test_cuda_oracle_band_is_issue_5s():
    lim = gates.load_bands()["cuda_vs_oracle"].limits
    assert lim["argmax_agreement"]["min"] >= 0.995 and lim["kl_mean"]["max"] <= 1e-3


@pytest.mark.models
def test_oracle_gate_flow_on_the_cpu(tmp_path, monkeypatch):
    """tools/gpu_gates.oracle_gate (run on the GPU with device cuda) here with the NumPy executor:
    a folder holding only the checkpoint's config and tokenizer files suffices, the row passes;
    with a planted executor defect (swiglu's gate and up swapped) it fails both issue bands."""
    import shutil

    from bloomery.tools import gpu_gates
    from runtime_artifacts import artifact

    folder = need("tiny-llama/nvfp4")
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    for f in folder.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, cfg / f.name)
    art = artifact("tiny-llama/nvfp4")
    r = gpu_gates.oracle_gate(cfg, art, device="cpu", limit=FAST_LIMIT)
    assert r["pass"] and r["argmax_agreement"] == 1.0 and r["kl_mean"] < 1e-10, r

    from bloomery.runtime.ops import IMPL, swiglu

    def swapped(op, buf, w):
        buf[op["out"]][...] = swiglu.silu(buf[op["up"]]) * buf[op["gate"]]
    monkeypatch.setattr(IMPL["swiglu"], "run", swapped)
    bad = gpu_gates.oracle_gate(cfg, art, device="cpu", limit=FAST_LIMIT)
    assert not bad["pass"] and len(bad["fails"]) == 2, bad
