"""The lowering (compiler/lower.py) and the plan schema (core/plan.py): what each rank's plan
holds, that it is static (one op list serves every step) and deterministic, how it travels in
the artifact and prints, and the refusals."""

import json

import pytest
from click.testing import CliRunner

from bloomery.cli import main
from bloomery.compiler import lower, planning, publish
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.core import plan as P
from bloomery.core.errors import UnsupportedConfig
from bloomery.runtime import Engine, NoPlan
from runtime_artifacts import artifact, need

pytestmark = pytest.mark.models


def plans(name, tp):
    ranks = planning.plan(Checkpoint.open(need(name)), tp=tp)
    return ranks, [lower.lower_rank(r.metadata, {t.name: t for t in r.tensors}) for r in ranks]


def ops(plan, prog="decode"):
    return plan["programs"][prog]["ops"]


def test_smollm2_tp2_uneven_heads_and_collectives():
    ranks, (p0, p1) = plans("smollm2-135m/nvfp4", 2)
    layers = 30
    for p, heads, kv in ((p0, 6, 2), (p1, 3, 1)):          # 3 KV heads shared 2 + 1
        att = [o for o in ops(p) if o["op"] == "attention"]
        assert len(att) == layers and {(o["heads"], o["kv_heads"], o["head_dim"]) for o in att} == {(heads, kv, 64)}
        assert p["buffers"]["kv.0.k"] == {"shape": ["slots", "ctx", kv, 64], "dtype": "f32", "kind": "state"}
        assert p["buffers"]["q"]["shape"] == ["rows", heads * 64]
        names = [o["op"] for o in ops(p)]
        assert names.count("all_reduce") == 2 * layers and names.count("all_gather") == 1
        assert names[-3:] == ["logits", "all_gather", "argmax"]
    # tied head: each rank takes half of the replicated embedding's rows, gathered in rank order
    heads = [next(o for o in ops(p) if o["op"] == "logits") for p in (p0, p1)]
    assert [h["weight"] for h in heads] == ["token_embd"] * 2
    assert [h["rows"] for h in heads] == [[0, 24576], [24576, 49152]]
    assert next(o for o in ops(p0) if o["op"] == "all_gather")["sizes"] == [24576, 24576]
    assert p0["buffers"]["logits"] == {"shape": ["rows", 49152], "dtype": "f32", "kind": "output"}
    # every linear names its artifact tensor and stored format
    table = {t.name: t for t in ranks[1].tensors}
    for o in ops(p1):
        if o["op"] == "linear":
            assert o["format"] == table[o["weight"]].format == "nvfp4" and o["pre_quant_scale"] is False


def test_qwen3_moe_tp1_ops_and_static_programs():
    ranks, (p,) = plans("tiny-qwen3_moe/nvfp4", 1)
    names = [o["op"] for o in ops(p)]
    assert "all_reduce" not in names and "all_gather" not in names
    assert names.count("moe_router") == names.count("moe_experts") == 2
    norms = [o for o in ops(p) if o["op"] == "rmsnorm" and o["group"] == 32]      # per-head q/k norms
    assert [o["weight"] for o in norms[:2]] == ["blk.0.attn_q_norm", "blk.0.attn_k_norm"]
    router = next(o for o in ops(p) if o["op"] == "moe_router")
    assert router["top_k"] == 2 and router["norm"] is True
    assert next(o for o in ops(p) if o["op"] == "logits")["weight"] == "output"
    # one op list for every step: decode and prefill differ only in the attention kernel's mode
    strip = lambda prog: [{k: v for k, v in o.items() if k != "mode"} for o in ops(p, prog)]
    assert strip("decode") == strip("prefill")
    for prog in P.PROGRAMS:
        assert {o["mode"] for o in ops(p, prog) if o["op"] == "attention"} == {prog}
    assert p["programs"]["decode"]["rows"] == "slots" and p["programs"]["prefill"]["rows"] == "ubatch"
    assert {b["kind"] for n, b in p["buffers"].items() if n in ("tokens", "positions", "slot_ids")} == {"input"}
    # every buffer an op names is declared; shapes are ints or the load-time symbols
    for o in ops(p):
        assert all(b in p["buffers"] for b in P.buffers_of(o))
    assert all(isinstance(d, int) or d in P.SYMBOLS for b in p["buffers"].values() for d in b["shape"])
    assert set(P.weights_of(p)) == {t.name for t in ranks[0].tensors}          # every tensor is read


def test_plan_in_artifact_is_deterministic():
    ranks, lowered = plans("tiny-llama/nvfp4_awq", 2)
    art = Engine(artifact("tiny-llama/nvfp4_awq", 2)).art
    for r, p in enumerate(lowered):
        text = art.metadata(r)[P.KEY]
        assert text == P.dumps(p) == json.dumps(p, sort_keys=True, separators=(",", ":"))
    again = [lower.lower_rank(r.metadata, {t.name: t for t in r.tensors}) for r in ranks]
    assert [P.dumps(p) for p in again] == [P.dumps(p) for p in lowered]
    assert any(o["op"] == "linear" and o["pre_quant_scale"] for o in ops(lowered[0]))    # AWQ's input scale


def test_refusals():
    ranks, (p,) = plans("tiny-llama/bf16", 1)
    md = dict(ranks[0].metadata, **{"bloomery.spec": "mamba"})
    with pytest.raises(UnsupportedConfig, match="mamba"):
        lower.lower_rank(md, {t.name: t for t in ranks[0].tensors})
    bad = json.loads(P.dumps(p))
    bad["programs"]["decode"]["ops"][3]["op"] = "conv1d"
    with pytest.raises(P.PlanInvalid, match="decode op 3.*unknown op"):
        P.validate(bad)
    bad = json.loads(P.dumps(p))
    bad["programs"]["prefill"]["ops"][1]["x"] = "nowhere"
    with pytest.raises(P.PlanInvalid, match="'nowhere' is not declared"):
        P.validate(bad)
    bad = json.loads(P.dumps(p))
    del bad["programs"]["decode"]["ops"][0]["weight"]
    with pytest.raises(P.PlanInvalid, match=r"missing keys \['weight'\]"):
        P.validate(bad)
    with pytest.raises(P.PlanInvalid, match="version"):
        P.validate({**p, "version": 99})


def test_artifact_without_plan_is_refused(tmp_path):
    ranks = planning.plan(Checkpoint.open(need("tiny-llama/bf16")), tp=1)      # no lowering: an older artifact
    publish.publish(tmp_path / "old", ranks, {})
    with pytest.raises(NoPlan, match="re-prepare"):
        Engine(tmp_path / "old")
    r = CliRunner().invoke(main, ["run", str(tmp_path / "old"), "-p", "hi"])
    assert r.exit_code != 0 and "NoPlan" in r.output and "re-prepare" in r.output


def test_inspect_plan():
    art = artifact("tiny-qwen3_moe/nvfp4", 2)
    r = CliRunner().invoke(main, ["inspect", str(art), "--plan", "--rank", "1"])
    assert r.exit_code == 0, r.output
    assert "rank 1 of tp 2" in r.output and "kv.0.k" in r.output and "[slots, ctx, 1, 32]" in r.output
    assert "decode (rows = slots)" in r.output and "prefill (rows = ubatch)" in r.output
    assert "all_gather  logits.local -> logits" in r.output
    r = CliRunner().invoke(main, ["inspect", str(art), "--plan", "--json"])
    plan = json.loads(r.output)
    assert plan["rank"] == 0 and plan["tp"] == 2 and P.validate(plan) is None
    r = CliRunner().invoke(main, ["inspect", str(need("tiny-llama/bf16")), "--plan"])
    assert r.exit_code != 0 and "applies to an artifact" in r.output
