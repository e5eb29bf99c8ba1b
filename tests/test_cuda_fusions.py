"""Which launches the CUDA executor fuses, decided on the CPU from real plans (no GPU needed): the
linears that read one input grouped (q, k, v; gate, up), a whole-row RMSNorm folded into them only
where its output is read by nothing else, a SwiGLU folded into its gate / up pair only where their
outputs are read by nothing else, verify's rows past 8 still fused as the 1-row decode step,
and nothing fused on the paths that do not run the CUDA-core GEMV. The fused launches' values are
tests/test_cuda_kernels.py's (GPU); this checks the decisions (runtime/cuda/executor.py _group_size,
_norm_fold, _swiglu_after) on every tiny family."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from bloomery.core.artifact.reader import Artifact
from bloomery.runtime.cuda import executor as X
from bloomery.runtime.cuda import gemv as G
from bloomery.runtime.engine import read_plans

from runtime_artifacts import artifact

pytestmark = pytest.mark.models

FAMILIES = ("tiny-llama/nvfp4", "tiny-llama/fp8", "tiny-qwen3/nvfp4", "tiny-qwen3_moe/nvfp4", "tiny-qwen3_next/nvfp4",
            "tiny-glm4_moe/nvfp4", "tiny-qwen4_exp/nvfp4", "tiny-glm5_next/nvfp4")


class Weights:
    """The executor's weight view, from the artifact's table (shapes and formats; nothing uploaded)."""

    def __init__(self, art):
        self.table = art.tensors(0)

    def linear(self, name):
        t = self.table[name]
        kind = G.kernel_kind(t.format, {"scale": 1} if t.layout == "stored" else {})
        return SimpleNamespace(kind=kind, out=t.shape[-2], inn=t.shape[-1], mma=False, config=None,
                               experts=math.prod(t.shape[:-2]) if len(t.shape) > 2 else 0, wst=0, scst=0)

    def pre_quant(self, name):
        return 1 if "pre_quant_scale" in self.table[name].parts else None

    def vector(self, name, offset=0.0):
        return np.zeros(math.prod(self.table[name].shape), np.float32)


def executor(name, **modes):
    art = Artifact.open(artifact(name))
    ex = object.__new__(X.CudaExecutor)
    ex.w = Weights(art)
    ex.tc_mode, ex.group_mode, ex.fold_norm = modes.get("tc", "auto"), modes.get("group", "on"), modes.get("fold", "on")
    ex.fold_swiglu = modes.get("swiglu", "on")
    ex.fold_qk_norm = modes.get("qk_norm", "on")      # the decision as the lever on makes it
    ex.fold_moe_norm, ex.moe_decode = modes.get("moe_norm", "on"), modes.get("moe_decode", "fused")
    ex.moe_router = modes.get("moe_router", "fused")
    ex.moe_mode, ex.gemm_mode, ex.row_mode = "grouped", "bf16x2", modes.get("row", "off")
    return ex, read_plans(art)[0]


def bufs(plan, rows):
    return {n: np.empty([rows if d == "rows" else 1 if isinstance(d, str) else d for d in b["shape"]], np.float32)
            for n, b in plan["buffers"].items()}


def folds(ex, plan, prog, rows):
    ops, b = plan["programs"][prog]["ops"], bufs(plan, rows)
    return ops, {i: n for i, o in enumerate(ops) if o["op"] == "rmsnorm" and (n := ex._norm_fold(ops, i, b, rows, prog))}


def read_later(ops, j, buf):
    """An independent scan: some op from j on names `buf` other than as its output before one writes it."""
    for o in ops[j:]:
        if any(v == buf for k, v in o.items() if k != "out" and isinstance(v, str)):
            return True
        if o.get("out") == buf:
            return False
    return False


@pytest.mark.parametrize("name", FAMILIES)
def test_folds_only_norms_nothing_else_reads(name):
    ex, plan = executor(name)
    for prog, rows in (("decode", 1), ("verify", 5), ("verify", 13)):
        ops, got = folds(ex, plan, prog, rows)
        for i, n in got.items():
            norm, lins = ops[i], ops[i + 1:i + 1 + n]
            assert all(o["op"] == "linear" and o["x"] == norm["out"] for o in lins), (name, prog, i)
            assert not read_later(ops, i + 1 + n, norm["out"]), f"{name} {prog}: op {i}'s output is read after the fold"
            assert norm["x"] not in {o["out"] for o in lins}
            assert len({(ex.w.linear(o["weight"]).kind, ex.w.linear(o["weight"]).inn) for o in lins}) == 1


def test_llama_attention_and_mlp_norms_fold_into_their_linears():
    ex, plan = executor("tiny-llama/nvfp4")
    layers = sum(1 for o in plan["programs"]["decode"]["ops"] if o["op"] == "attention")
    for prog, rows in (("decode", 1), ("verify", 13)):          # verify past 8 rows: the decode step's launches
        ops, got = folds(ex, plan, prog, rows)
        assert sorted(got.values()) == [2] * layers + [3] * layers, (prog, got)
        assert all(ops[i + 1]["weight"].endswith(("attn_q", "ffn_gate")) for i in got)


def test_moe_norm_is_not_folded_its_router_and_experts_read_it():
    ex, plan = executor("tiny-qwen3_moe/nvfp4")
    ops, got = folds(ex, plan, "decode", 1)
    layers = sum(1 for o in ops if o["op"] == "attention")
    assert sorted(got.values()) == [3] * layers                  # the attention norms only
    assert all(ops[i + 1]["op"] != "moe_router" for i in got)


def test_nothing_fused_off_the_cuda_core_path():
    ex, plan = executor("tiny-llama/nvfp4", tc="off")
    ops, b = plan["programs"]["decode"]["ops"], bufs(plan, 9)
    q = next(i for i, o in enumerate(ops) if o["op"] == "linear")
    assert ex._group_size(ops, q, 9, "decode") == 0               # 9 slots: launches of 8, no group
    assert not folds(ex, plan, "decode", 9)[1]
    assert not folds(executor("tiny-llama/nvfp4", fold="off")[0], plan, "decode", 1)[1]
    assert not folds(executor("tiny-llama/nvfp4", group="off")[0], plan, "decode", 1)[1]   # k and v read it too
    assert ex._group_size(ops, q, 1, "decode") == 3


def swiglus(ex, plan, prog, rows):
    """{index of a group's first linear: the swiglu op folded into it}, as the executor's bind loop asks."""
    ops, b, got = plan["programs"][prog]["ops"], bufs(plan, rows), {}
    for i, o in enumerate(ops):
        if o["op"] == "linear" and ex.group_mode != "off" and (n := ex._group_size(ops, i, rows, prog)) > 1 \
                and (sw := ex._swiglu_after(ops, i, n)):
            got[i] = sw
    return ops, got


@pytest.mark.parametrize("name", FAMILIES)
def test_swiglu_folds_only_into_its_own_gate_and_up(name):
    ex, plan = executor(name)
    for prog, rows in (("decode", 1), ("verify", 13)):
        ops, got = swiglus(ex, plan, prog, rows)
        for i, sw in got.items():
            g, u = ops[i], ops[i + 1]
            assert ops[i + 2] is sw and g["x"] == u["x"] and (sw["gate"], sw["up"]) == (g["out"], u["out"]), (name, i)
            assert ex.w.linear(g["weight"]).out == ex.w.linear(u["weight"]).out
            for buf in (g["out"], u["out"]):
                assert buf == sw["out"] or not read_later(ops, i + 3, buf), f"{name} {prog}: {buf} is read after the fold"


def test_llama_swiglu_folds_once_a_layer_and_only_with_its_lever():
    ex, plan = executor("tiny-llama/nvfp4")
    layers = sum(1 for o in plan["programs"]["decode"]["ops"] if o["op"] == "attention")
    for prog, rows in (("decode", 1), ("verify", 13)):
        ops, got = swiglus(ex, plan, prog, rows)
        assert len(got) == layers and all(ops[i]["weight"].endswith("ffn_gate") for i in got), (prog, sorted(got))
    assert not swiglus(executor("tiny-llama/nvfp4", swiglu="off")[0], plan, "decode", 1)[1]
    assert not swiglus(executor("tiny-llama/nvfp4", group="off")[0], plan, "decode", 1)[1]


def test_swiglu_not_folded_where_gate_or_up_is_read_after():
    """A plan edited so that an op after the swiglu reads the up (or gate) output: nothing folds there."""
    ex, plan = executor("tiny-llama/nvfp4")
    ops = plan["programs"]["decode"]["ops"]
    i = next(i for i, o in enumerate(ops) if o["op"] == "linear" and o["weight"].endswith("ffn_gate"))
    assert ex._swiglu_after(ops, i, 2) is ops[i + 2]
    for k in ("up", "gate"):
        edited = ops[:i + 3] + [{"op": "add", "a": ops[i + 2][k], "b": ops[i + 2]["out"], "out": "x"}] + ops[i + 3:]
        if ops[i + 2][k] != ops[i + 2]["out"]:
            assert ex._swiglu_after(edited, i, 2) is None, f"folded though {ops[i + 2][k]} is read after"


def tc_groups(ex, plan, prog, rows):
    """{index of a tensor-core group's first linear: its size}, as the executor's bind loop takes them."""
    ops, got, i = plan["programs"][prog]["ops"], {}, 0
    while i < len(ops):
        n = ex._tc_group_size(ops, i, rows, prog) if ops[i]["op"] == "linear" and not ex._into_residual(ops, i) else 0
        if n > 1:
            got[i] = n
        i += max(n, 1)
    return ops, got


@pytest.mark.parametrize("name", FAMILIES)
def test_tensor_core_groups_share_x_and_one_kernel_shape(name):
    """Decode steps of several slots on the tensor-core GEMV (forced on): the linears of a group read one x,
    each would run on the tensor cores alone, none accumulates into a residual, their outputs distinct."""
    ex, plan = executor(name, tc="on")
    for rows in (2, 5, 16):
        ops, got = tc_groups(ex, plan, "decode", rows)
        for i, n in got.items():
            grp = ops[i:i + n]
            assert all(o["op"] == "linear" and o["x"] == grp[0]["x"] for o in grp), (name, i)
            assert len({o["out"] for o in grp}) == n and grp[0]["x"] not in {o["out"] for o in grp}
            lins = [ex.w.linear(o["weight"]) for o in grp]
            assert all(L.kind in G.TC_KINDS for L in lins) and G.TcGroup.fits(lins, rows)
            assert not any(ex._into_residual(ops, j) for j in range(i, i + n))


def test_llama_tensor_core_groups_are_qkv_and_gate_up():
    ex, plan = executor("tiny-llama/nvfp4", tc="on")
    layers = sum(1 for o in plan["programs"]["decode"]["ops"] if o["op"] == "attention")
    ops, got = tc_groups(ex, plan, "decode", 16)
    assert sorted(got.values()) == [2] * layers + [3] * layers, got
    assert {ops[i]["weight"].rsplit(".", 1)[-1] for i in got} == {"attn_q", "ffn_gate"}
    for prog, rows, modes in (("decode", 16, {"tc": "on", "group": "off"}), ("decode", 16, {"tc": "off"}),
                              ("decode", 1, {"tc": "auto"}), ("verify", 5, {"tc": "on"}), ("decode", 17, {"tc": "on"})):
        assert not tc_groups(executor("tiny-llama/nvfp4", **modes)[0], plan, prog, rows)[1], (prog, rows, modes)


@pytest.mark.parametrize("name", FAMILIES)
def test_qk_norms_fold_into_the_rope_launch(name):
    """Qwen3's per-head q and k norms join the rope + cache-write launch exactly where the plan has norm q, norm
    k (in place over one head), rope q, rope k, attention; every such site of qwen3 and qwen3_moe is taken (one
    a layer); none with the lever off or in a family without the norms."""
    ex, plan = executor(name)
    off, _ = executor(name, qk_norm="off")
    for prog in ("decode", "prefill"):
        ops = plan["programs"][prog]["ops"]
        got = [i for i, o in enumerate(ops) if o["op"] == "rmsnorm" and ex._fusable_qk_norm(ops, i)]
        assert not any(off._fusable_qk_norm(ops, i) for i in range(len(ops)))
        for i in got:
            a, b, rq, rk, at = ops[i:i + 5]
            assert [o["op"] for o in ops[i:i + 5]] == ["rmsnorm", "rmsnorm", "rope", "rope", "attention"]
            assert a["out"] == at["q"] and b["out"] == at["k"] and int(a["group"]) == int(at["head_dim"])
        layers = sum(1 for o in ops if o["op"] == "attention")
        if name.startswith(("tiny-qwen3/", "tiny-qwen3_moe/")):
            assert len(got) == layers > 0, (name, prog, got)
        if name.startswith("tiny-llama/"):
            assert got == []


def moe_norm_folds(ex, plan, prog, rows):
    ops = plan["programs"][prog]["ops"]
    return ops, {i: n for i, o in enumerate(ops) if o["op"] == "rmsnorm" and (n := ex._moe_norm_fold(ops, i, rows, prog))}


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_norm_folds_into_the_router_and_experts(name):
    """The RMSNorm before a MoE block joins its router's and experts' launches exactly where only they read it
    (Qwen3-MoE: every layer, with the residual add after; a family with a shared expert reading it: none),
    in decode and verify steps (past 8 rows too: the router in launches of 8); not in a prompt chunk the
    grouped GEMMs take, nor with the lever off or the experts unfused."""
    ex, plan = executor(name)
    for prog, rows in (("decode", 1), ("decode", 8), ("verify", 5), ("verify", 13)):
        ops, got = moe_norm_folds(ex, plan, prog, rows)
        for i, n in got.items():
            norm, r, e = ops[i:i + 3]
            assert r["op"] in ("moe_router", "moe_router_grouped") and e["op"] == "moe_experts", (name, prog, i)
            assert r["x"] == e["x"] == norm["out"] != norm["x"]
            assert not read_later(ops, i + n, norm["out"]), f"{name} {prog}: op {i}'s output is read after the fold"
            assert n == 3 or (n == 4 and ops[i + 3]["op"] == "add" and e["out"] in (ops[i + 3]["a"], ops[i + 3]["b"]))
        sites = sum(1 for o in ops if o["op"] == "moe_experts")
        if name.startswith("tiny-qwen3_moe/"):
            assert sorted(got.values()) == [4] * sites and sites > 0, (prog, rows, got)
        elif name.startswith(("tiny-llama/", "tiny-qwen3/", "tiny-qwen3_next/", "tiny-glm4_moe/")):
            assert got == {}, (name, prog, got)
    assert not moe_norm_folds(ex, plan, "prefill", 16)[1]          # a chunk of 16 rows: the grouped GEMMs
    for modes in ({"moe_norm": "off"}, {"moe_decode": "unfused"}):
        assert not moe_norm_folds(executor(name, **modes)[0], plan, "decode", 1)[1], modes


@pytest.mark.parametrize("name", FAMILIES)
def test_router_runs_in_one_launch_where_it_can(name):
    """BLOOMERY_MOE_ROUTER fused: every softmax top-k router of a decode step of up to 8 rows is one launch
    (Qwen3-MoE's and Qwen3-Next's BF16 routers, on the CUDA-core GEMV); not a verify step (each of its rows
    as the 1-row step computes it), not past 8 rows, not a grouped router (GLM's), not with the lever at two."""
    ex, plan = executor(name)
    for prog, rows, want in (("decode", 1, True), ("decode", 8, True), ("decode", 16, False), ("verify", 5, False)):
        routers = [o for o in plan["programs"][prog]["ops"] if o["op"] == "moe_router"]
        assert [ex._router_fused(o, rows, prog) for o in routers] == [want] * len(routers), (prog, rows)
        if name.startswith(("tiny-qwen3_moe/", "tiny-qwen3_next/")):
            assert routers, (name, prog)
    off = executor(name, moe_router="two")[0]
    assert not any(off._router_fused(o, 1, "decode") for o in plan["programs"]["decode"]["ops"] if o["op"] == "moe_router")


@pytest.mark.parametrize("name", FAMILIES)
def test_prefetches_name_the_next_linears(name):
    """BLOOMERY_ATTN_PREFETCH / BLOOMERY_MOE_PREFETCH (executor.prefetch_plan): each decode attention prefetches
    its layer's o projection, each layer's experts the next layer's q, k and v (the last layer's: nothing, the
    head comes next); nothing else is named, and nothing with both levers off."""
    import re
    _, plan = executor(name)
    ops = plan["programs"]["decode"]["ops"]
    got = X.prefetch_plan(ops, True, True)
    assert X.prefetch_plan(ops, False, False) == {}
    attn = [j for j, o in enumerate(ops) if o["op"] == "attention"]
    exps = [j for j, o in enumerate(ops) if o["op"] == "moe_experts"]
    assert set(got) <= set(attn) | set(exps), got
    for j in attn:
        if j in got:
            assert got[j] == [ops[j + 1]["weight"]] and got[j][0].endswith(".attn_output"), (j, got[j])
    if name.startswith(("tiny-llama/", "tiny-qwen3/", "tiny-qwen3_moe/")):
        assert attn and all(j in got for j in attn), (name, attn, got)
    if name.startswith("tiny-qwen3_moe/"):
        layer = lambda j: int(re.match(r"blk\.(\d+)\.", ops[j]["gate"]).group(1))      # noqa: E731
        assert exps and exps[-1] not in got, got
        for j in exps[:-1]:
            n = layer(j) + 1
            assert got[j] == [f"blk.{n}.attn_q", f"blk.{n}.attn_k", f"blk.{n}.attn_v"], (j, got[j])
    assert set(X.prefetch_plan(ops, True, False)) == set(got) & set(attn)
