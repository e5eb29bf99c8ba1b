"""Qwen3-Next end to end (specs/qwen3_next.yaml, compiler/lower.py _Qwen3Next): every tiny export
prepared at tp 1 and 2 with every value kept bit for bit through the cuts (the conv weight's three
segments included), the plan's ops, the gate rows against the float32 oracle, greedy decoding at
tp 2 against tp 1 and the oracle, the recurrent states reset at position 0, the MTP tensors
carried, and the refusals by name."""

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from bloomery.cli import main
from bloomery.compiler import lower, planning
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.prepare import prepare
from bloomery.core import errors, specs
from bloomery.core import plan as P
from bloomery.core.artifact.reader import Artifact
from bloomery.runtime import Engine
from bloomery.tools import gates
from ckpt import bf16, nvfp4_parts
from runtime_artifacts import artifact, need

pytestmark = pytest.mark.models

FORMATS = ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv")
NAMES = [f"tiny-qwen3_next/{f}" for f in FORMATS]
LIMIT = 32           # tokens per gate sequence here (tests/test_gates.py: 64, make gates: 256)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def ops(plan, prog="decode"):
    return plan["programs"][prog]["ops"]


def cfg_of(folder):
    return json.loads((folder / "config.json").read_text())


def rank_slice(full, name, cut, tp, rank, cfg):
    """The slice of a tensor rank holds, written out from the model's shapes (independently of
    compiler/slicing.py): tp 2 of the tiny config shares every cut into equal halves."""
    if tp == 1 or cut == "replicated":
        return full
    if cut == "segments" and name.endswith("ssm_conv1d"):        # [q | k | v] channels, each halved
        qk = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        segs = np.split(full, [qk, 2 * qk], axis=0)
        return np.concatenate([np.split(s, tp, axis=0)[rank] for s in segs], axis=0)
    axis = {"column": -2, "row": -1, "segments": 0}[cut]
    return np.split(full, tp, axis=axis)[rank]


def check_artifact_exact(folder, art_path, tp):
    """Every checkpoint tensor is in the artifact (its sources), and every rank's piece decodes to
    the checkpoint's value of that slice bit for bit."""
    ck = Checkpoint.open(folder)
    cfg = cfg_of(folder)
    art = Artifact.open(art_path)
    seen = set()
    for rank in range(tp):
        for name, t in art.tensors(rank).items():
            vals = [ck.tensors[s].decode() if s in ck.tensors else np.asarray(ck.kv_scales[s].array(), np.float32)
                    .reshape(1) for s in t.sources]
            full = np.stack(vals) if t.role.endswith("_exps") else vals[0]
            want = rank_slice(full, name, t.cut, tp, rank, cfg)
            got = art.decode(name, rank)
            assert got.shape == want.shape and np.array_equal(bits(got), bits(want)), (name, rank)
            seen.update(t.sources)
    assert seen == set(ck.tensors) | set(ck.kv_scales)
    return art


# -- prepare --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_prepare_keeps_every_value(name, tp):
    folder = need(name)
    art = check_artifact_exact(folder, artifact(name, tp), tp)
    t = art.tensors(tp - 1)
    cfg = cfg_of(folder)
    Hk, Hv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    conv = t["blk.0.ssm_conv1d"]
    assert conv.cut == "segments" and conv.shape == ((2 * Hk * dk + Hv * dv) // tp, 1, 4)
    assert t["blk.0.ssm_in"].shape[0] == Hk * (2 * dk + 2 * (Hv // Hk) * dv) // tp
    assert t["blk.0.ssm_a"].shape == t["blk.0.ssm_dt"].shape == (Hv // tp,)
    assert t["blk.0.ssm_out"].cut == "row" and t["blk.0.ffn_gate_inp_shexp"].cut == "replicated"
    assert "blk.1.ffn_gate" in t and "blk.1.ffn_gate_exps" not in t          # mlp_only_layers: [1]
    assert t["blk.3.attn_q"].shape[0] == 2 * cfg["num_attention_heads"] * cfg["head_dim"] // tp
    fmt = Checkpoint.open(folder).tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].format.name
    assert t["blk.0.ssm_in"].format == fmt and t["blk.0.ssm_conv1d"].format == "bf16"


# -- the plan -------------------------------------------------------------------------------------


def lowered(name, tp):
    ranks = planning.plan(Checkpoint.open(need(name)), tp=tp, env={})
    return [lower.lower_rank(r.metadata, {t.name: t for t in r.tensors}) for r in ranks]


def test_plan_ops():
    (p,) = lowered("tiny-qwen3_next/nvfp4", 1)
    names = [o["op"] for o in ops(p)]
    assert set(names) == {"embed", "rmsnorm", "linear", "split_groups", "causal_conv1d", "gated_delta",
                          "rmsnorm_gated", "rope", "attention", "sigmoid_mul", "moe_router", "moe_experts",
                          "swiglu", "add", "logits", "argmax"}
    assert names.count("gated_delta") == names.count("causal_conv1d") == 3 and names.count("attention") == 1
    assert names.count("moe_router") == 3 and names.count("sigmoid_mul") == 3 + 1     # 3 shared experts, 1 gate
    # one delta-net layer, in order
    i = names.index("rmsnorm")
    assert names[i:i + 11] == ["rmsnorm", "linear", "split_groups", "linear", "split_groups", "causal_conv1d",
                               "gated_delta", "rmsnorm_gated", "linear", "add", "rmsnorm"]
    sg = [o for o in ops(p) if o["op"] == "split_groups"]
    assert (sg[0]["widths"], sg[0]["split"], sg[0]["groups"]) == ([32, 32, 64, 64], 3, 2)    # qkvz
    assert (sg[1]["widths"], sg[1]["split"]) == ([2, 2], 1)                                   # ba: b first
    assert (sg[-1]["widths"], sg[-1]["groups"]) == ([64, 64], 4)                              # q | gate per head
    # Qwen3NextRMSNorm is 1 + weight everywhere, the gated norm is not
    assert {o.get("offset") for o in ops(p) if o["op"] == "rmsnorm"} == {1.0}
    assert all("offset" not in o for o in ops(p) if o["op"] == "rmsnorm_gated")
    assert {o["rotary_dim"] for o in ops(p) if o["op"] == "rope"} == {16}
    # states: conv windows and delta-rule states per slot, beside the one KV cache
    bufs = p["buffers"]
    assert bufs["conv.0"] == {"shape": ["slots", 3, 256], "dtype": "f32", "kind": "state"}
    assert bufs["ssm.0"] == {"shape": ["slots", 4, 32, 32], "dtype": "f32", "kind": "state"}
    assert sorted(n for n, b in bufs.items() if b["kind"] == "state") == \
        ["conv.0", "conv.1", "conv.2", "kv.3.k", "kv.3.v", "ssm.0", "ssm.1", "ssm.2"]
    # one op list for both programs: only the mode of attention and gated_delta differs
    strip = lambda prog: [{k: v for k, v in o.items() if k != "mode"} for o in ops(p, prog)]  # noqa: E731
    assert strip("decode") == strip("prefill")
    for prog in P.PROGRAMS:
        assert {o["mode"] for o in ops(p, prog) if o["op"] in ("attention", "gated_delta")} == {prog}
    assert set(P.weights_of(p)) == {t.name for t in planning.plan(Checkpoint.open(need("tiny-qwen3_next/nvfp4")),
                                                                  tp=1, env={})[0].tensors}


def test_plan_tp2():
    p0, p1 = lowered("tiny-qwen3_next/nvfp4", 2)
    for p in (p0, p1):
        names = [o["op"] for o in ops(p)]
        assert names.count("all_reduce") == 2 * 4 and names.count("all_gather") == 1
        d = next(o for o in ops(p) if o["op"] == "gated_delta")
        assert (d["k_heads"], d["v_heads"]) == (1, 2)
        assert p["buffers"]["conv.0"]["shape"] == ["slots", 3, 128]
        assert p["buffers"]["ssm.0"]["shape"] == ["slots", 2, 32, 32]
        a = next(o for o in ops(p) if o["op"] == "attention")
        assert (a["heads"], a["kv_heads"]) == (2, 1)


# -- against the oracle ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bands():
    return gates.load_bands()


@pytest.mark.parametrize("name", NAMES)
def test_gate_rows(name, bands, tmp_path_factory, monkeypatch):
    need(name)
    monkeypatch.setenv(gates.GATES_ENV, str(tmp_path_factory.getbasetemp() / "gates"))
    memo: dict = {}
    row = gates.gate_row(name, bands, "executor", limit=LIMIT, memo=memo)
    assert row.verdict == "PASS" and row.positions >= 9 * LIMIT, gates.table([row])
    row = gates.tp2_row(name, bands, limit=LIMIT, memo=memo)
    assert row.verdict == "PASS", gates.table([row])


def greedy(eng, ids, n):
    """Prefill, then n - 1 decode steps (the recurrent path); tokens and their logits [n, vocab]."""
    eng.reset()
    x = eng.prefill(ids)[-1]
    toks, logits = [int(np.argmax(x))], [x]
    for _ in range(n - 1):
        lg, nt = eng.decode([toks[-1]])
        toks.append(int(nt[0]))
        logits.append(lg[0])
    return toks, np.stack(logits)


@pytest.mark.parametrize("name", ["tiny-qwen3_next/nvfp4", "tiny-qwen3_next/bf16"])
def test_decode_tp2_equals_tp1_and_oracle(name, bands):
    """70 prompt tokens (two prefill chunks of 64 rows), then 24 decode steps: the same greedy
    tokens at tp 2 as at tp 1, and the decode-step logits within the oracle's band (HF's chunked
    rule over the whole sequence against the recurrent steps)."""
    from bloomery.tools import oracle

    folder = need(name)
    ids = gates.sequences(folder)[0].ids[:70]
    assert len(ids) == 70
    t1, l1 = greedy(Engine(artifact(name, 1), ctx=128), ids, 24)
    t2, l2 = greedy(Engine(artifact(name, 2), ctx=128), ids, 24)
    assert t2 == t1
    assert not gates.check(gates.compare([l1], [l2]), bands["tp2_vs_tp1"])
    ref = oracle.Oracle(folder).logits(ids + t1[:-1])[len(ids) - 1:]
    m = gates.compare([ref], [l1])
    assert not gates.check(m, bands["executor_vs_oracle"]), m
    assert m["argmax_agreement"] == 1.0


def test_state_reset_at_position_0():
    """A slot that starts a second sequence at position 0, its conv windows, delta-rule states and
    KV cache still holding the first, gives a fresh engine's logits bit for bit, in a prompt chunk
    (the other slot's sequence going on untouched) and in a decode step."""
    from runtime_artifacts import rel

    name = "tiny-qwen3_next/nvfp4"
    art = artifact(name, 1)
    seqs = gates.sequences(need(name))
    a, b = seqs[0].ids[:50], seqs[1].ids[:30]
    eng = Engine(art, ctx=128, slots=2)
    eng.prefill(a, slot=0)
    eng.prefill(b[:9], slot=1)
    eng.decode([a[0], b[9]])
    fresh = Engine(art, ctx=128, slots=2)
    eng.lengths[0] = 0                                # a new sequence in slot 0: no reset() call
    assert np.array_equal(eng.prefill(b, slot=0), fresh.prefill(b, slot=0))
    # slot 1 goes on as if alone (another batch composition: float32 rounding only)
    got = eng.decode([b[0], b[10]])[0][1]
    fresh.reset()
    fresh.prefill(b[:10], slot=1)
    want = fresh.decode([b[0], b[10]], active=[False, True])[0][1]
    assert rel(got, want) < 1e-5
    # a decode step at position 0 (one slot: the same batch as a fresh engine's)
    one, fresh1 = Engine(art, ctx=128), Engine(art, ctx=128)
    one.prefill(a)
    one.decode([b[0]])
    one.lengths[0] = 0
    for t in b[:3]:
        assert np.array_equal(one.decode([t])[0], fresh1.decode([t])[0])


# -- the MTP layer ---------------------------------------------------------------------------------


def mtp_tensors(rng, cfg):
    """Qwen3-Next's MTP layer in HF naming (vLLM's qwen3_next_mtp): the fc and its norms BF16 (as in
    NVIDIA's NVFP4 exports, mtp.fc unquantized), the layer's linears NVFP4, its router BF16."""
    H, E, hd = cfg["hidden_size"], cfg["num_experts"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, shared = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    p = "mtp.layers.0"
    t = {"mtp.fc.weight": bf16(rng, H, 2 * H), "mtp.pre_fc_norm_embedding.weight": bf16(rng, H),
         "mtp.pre_fc_norm_hidden.weight": bf16(rng, H), "mtp.norm.weight": bf16(rng, H),
         f"{p}.input_layernorm.weight": bf16(rng, H), f"{p}.post_attention_layernorm.weight": bf16(rng, H),
         f"{p}.self_attn.q_norm.weight": bf16(rng, hd), f"{p}.self_attn.k_norm.weight": bf16(rng, hd),
         f"{p}.mlp.gate.weight": bf16(rng, E, H), f"{p}.mlp.shared_expert_gate.weight": bf16(rng, 1, H)}
    lin = [("self_attn.q_proj", 2 * heads * hd, H), ("self_attn.k_proj", kv * hd, H),
           ("self_attn.v_proj", kv * hd, H), ("self_attn.o_proj", H, heads * hd),
           ("mlp.shared_expert.gate_proj", shared, H), ("mlp.shared_expert.up_proj", shared, H),
           ("mlp.shared_expert.down_proj", H, shared)]
    lin += [(f"mlp.experts.{e}.{n}", o, i) for e in range(E)
            for n, o, i in (("gate_proj", inter, H), ("up_proj", inter, H), ("down_proj", H, inter))]
    for n, o, i in lin:
        t.update(nvfp4_parts(rng, o, i, f"{p}.{n}"))
    return t


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    """A copy of the tiny NVFP4 export with an MTP layer in a second shard (and an index)."""
    from safetensors import safe_open

    src = need("tiny-qwen3_next/nvfp4")
    out = tmp_path_factory.mktemp("q3n-mtp") / "nvfp4-mtp"
    shutil.copytree(src, out)
    extra = mtp_tensors(np.random.default_rng(5), cfg_of(src))
    save_file(extra, str(out / "model-mtp.safetensors"))
    with safe_open(str(src / "model.safetensors"), "np") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {**{n: "model.safetensors" for n in names},
                                            **{n: "model-mtp.safetensors" for n in extra}}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_tensors_carried(mtp_folder, tmp_path, tp):
    out = tmp_path / f"art-tp{tp}"
    prepare(mtp_folder, out, tp=tp, progress=False)
    art = check_artifact_exact(mtp_folder, out, tp)
    ck = Checkpoint.open(mtp_folder)
    t = art.tensors(0)
    mtp = {n: x for n, x in t.items() if n.startswith("mtp.")}
    assert {s for x in mtp.values() for s in x.sources} == {n for n in ck.tensors if n.startswith("mtp.")}
    assert {"mtp.nextn.eh_proj", "mtp.nextn.enorm", "mtp.nextn.hnorm", "mtp.nextn.shared_head_norm",
            "mtp.blk.0.attn_q", "mtp.blk.0.ffn_gate_exps", "mtp.blk.0.ffn_gate_inp_shexp"} <= set(mtp)
    assert mtp["mtp.nextn.eh_proj"].format == "bf16" and mtp["mtp.blk.0.attn_q"].format == "nvfp4"
    assert art.metadata(0)["qwen3next.nextn_predict_layers"] == 1
    if tp == 1:      # the stored parts themselves, byte for byte
        for n, x in mtp.items():
            if len(x.sources) == 1:
                want = ck.tensors[x.sources[0]].parts
                got = art.parts(n)
                assert set(got) == set(want), n
                for k in want:
                    assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), (n, k)
    # read by the mtp program only: the main programs are the plan's without them
    plain = Artifact.open(artifact("tiny-qwen3_next/nvfp4", tp))
    for r in range(tp):
        plan = P.loads(art.metadata(r)[P.KEY])
        mtp_prog = plan["programs"].pop("mtp")
        assert not [w for w in P.weights_of(plan) if w.startswith("mtp.")]
        assert {"mtp.nextn.eh_proj", "mtp.nextn.enorm", "mtp.nextn.hnorm", "mtp.nextn.shared_head_norm",
                "mtp.blk.0.attn_q", "mtp.blk.0.ffn_gate_exps"} <= set(P.weights_of({"programs": {"mtp": mtp_prog}}))
        assert plan["programs"] == P.loads(plain.metadata(r)[P.KEY])["programs"]
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert res.exit_code == 0 and "mtp.blk.0.ffn_down_exps" in res.output and "mtp.nextn.eh_proj" in res.output


# -- refusals --------------------------------------------------------------------------------------


def edited(tmp_path, edit, name="tiny-qwen3_next/bf16"):
    src = need(name)
    out = tmp_path / "edited"
    shutil.copytree(src, out)
    cfg = cfg_of(out)
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


REFUSALS = [
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0), errors.UnsupportedConfig, r"rope type 'yarn'"),
    (lambda c: c.update(attention_bias=True), errors.UnsupportedConfig, r"attention_bias True"),
    (lambda c: c.update(hidden_act="gelu"), errors.UnsupportedConfig, r"hidden_act 'gelu'.*only silu"),
    (lambda c: c["layer_types"].__setitem__(3, "sliding_attention"), errors.UnsupportedConfig,
     r"layer_types .*'sliding_attention'.*supported: linear_attention, full_attention"),
    (lambda c: c.update(layer_types=c["layer_types"][:3]), errors.UnsupportedConfig, r"each of the 4 layers"),
    (lambda c: c.update(linear_num_value_heads=5), errors.UnsupportedConfig, r"linear_num_value_heads 5"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.3), errors.UnsupportedConfig,
     r"partial_rotary_factor 0.3"),
    (lambda c: c.pop("linear_key_head_dim"), errors.MissingConfigKey, r"linear_key_head_dim"),
]


@pytest.mark.parametrize("edit,error,words", REFUSALS, ids=[w.split()[0] for _, _, w in REFUSALS])
def test_config_refused_by_name(tmp_path, edit, error, words):
    folder = edited(tmp_path, edit)
    with pytest.raises(error, match=words):
        prepare(folder, tmp_path / "art", progress=False)
    assert not (tmp_path / "art").exists()


def test_tp_refused_by_name(tmp_path):
    """The gated delta net is cut by whole key-head groups: 3 key heads do not go over tp 2
    (refused from config.json, before any tensor is matched); 2 KV heads do not go over tp 4."""
    folder = edited(tmp_path, lambda c: c.update(linear_num_key_heads=3, linear_num_value_heads=6))
    with pytest.raises(errors.TPNotDivisible, match=r"linear_num_key_heads 3 does not divide over tp 2"):
        prepare(folder, tmp_path / "art", tp=2, progress=False)
    with pytest.raises(errors.TPNotDivisible, match=r"2 KV heads cannot be shared out over tp 4"):
        prepare(need("tiny-qwen3_next/bf16"), tmp_path / "art4", tp=4, progress=False)


def test_layer_pattern_from_full_attention_interval():
    """Without layer_types, every full_attention_interval-th layer is full attention (HF's rule)."""
    cfg = cfg_of(need("tiny-qwen3_next/bf16"))
    s = specs.for_config(cfg)
    del cfg["layer_types"]
    v = s.values({**cfg, "full_attention_interval": 2})
    assert [s.layer_values(v, b)["full"] for b in range(4)] == [False, True, False, True]
    v = s.values(cfg)
    assert [s.layer_values(v, b)["full"] for b in range(4)] == [False, False, False, True]


def test_oracle_reads_past_the_mtp_layer(mtp_folder):
    """The oracle builds the model of a checkpoint that stores its MTP layer (transformers ignores
    mtp.* on load): the same logits as the export without it, bit for bit."""
    from bloomery.tools import oracle

    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a = oracle.Oracle(mtp_folder, cache=False).logits(ids)
    b = oracle.Oracle(need("tiny-qwen3_next/nvfp4"), cache=False).logits(ids)
    assert np.array_equal(a, b)
