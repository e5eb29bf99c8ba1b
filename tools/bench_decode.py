"""Batch-1 decode on the GPU: synthetic checkpoints of real shapes, made and prepared here, run by
the CUDA executor (one CUDA graph per step), against the device copy bandwidth measured in the
same run and against Hugging Face transformers (torch, bf16) on the same shape.

    python -m bloomery.tools.bench_decode [--shapes smollm2-135m llama3-8b] [--steps 256]
        [--peer] [--work DIR] [--ckpt-dir DIR] [--out DIR] [--layers shape=N ...] [--prepare-only]
    python -m bloomery.tools.bench_decode --traffic --shapes qwen3-next-80b-a3b glm-4.5-air   # no GPU
    python -m bloomery.tools.bench_decode --shapes qwen3-30b-a3b --layers qwen3-30b-a3b=16 --steps 64 --prefill \
        --ab BLOOMERY_MOE_PREFETCH=off,on BLOOMERY_MOE_ROUTER=two,fused     # a lever's values, alternating
    python -m bloomery.tools.bench_decode --shapes qwen4-exp glm5-next --layers qwen4-exp=8 glm5-next=8 \
        --ple-rows 1048576 --ckpt-dir /dev/shm        # the flagships: n-gram tables capped (synthetic.py)

Per shape: load time (and upload GB/s), decode tok/s through Engine.decode (the host feeds the
token, reads back the next id: one sync per token), ms/token, and the bytes a decode step moves,
counted two ways: the executor's weight count (the linears', the head's, the top-k experts', the
embedding row: what its kernels read) and the model's whole traffic (tools/synthetic.py's tensor
list: every dense weight, the embedding row, the head, only the top-k routed experts plus the shared
expert(s); the recurrent states of the gated delta nets read and written whole each token; the KV
cache read over the mean attended length of the timed steps and one position written; for the
flagships also the hyper-connection streams, the KDA states, the indexers' key caches and, on the
host, the PLE's n-gram rows: decode_traffic says how each is counted): achieved
GB/s, % of the copy bandwidth, and the copy roofline in tok/s. Also the graph replayed back to back
(no host in the loop) for the device-side time, and the device time per op kind (the gated delta
net's causal_conv1d / gated_delta / rmsnorm_gated / split_groups, the gated attention's
sigmoid_mul, GLM's bias_add and grouped router among them). Prefill: one chunk per length, against
the bf16 tensor-core rate (the delta rule's 6 x v_heads x k_dim x v_dim FLOPs a row counted beside
the linears' and the causal attention's).
--peer: HF transformers in bf16 (random init, same config): eager (DynamicCache) and a
StaticCache decode loop under torch.compile(mode="reduce-overhead", fullgraph=True), then the same
compiled loop with the decoder linears in gpt-fast's int4 (tools/peer_int4.py: torch's
_weight_int4pack_mm, groups of 128, about the weight bytes of NVFP4; --no-int4 skips it); skipped, with
the reason, where its bf16 weights do not fit in the GPU's free memory (Qwen3-Next-80B's 159 GB and
GLM-4.5-Air's 214 GB at full depth: give --layers).
--ab LEVER=A,B ...: after the shape's run, the 1-slot decode step again at each value of each lever (the
others as the environment sets them), alternating A B then B A for --ab-rounds rounds, on the same artifact in
the same process: a table of the graph (replayed alone) and tok/s per value, and the first value's graph over
each one's (the comparison of a change with the code before it, in one device call).
Disk: the checkpoint and the artifact are about the same size and coexist during prepare; the run
refuses before writing when --work (and --ckpt-dir) lack the room, naming the most layers that fit.
--ckpt-dir /dev/shm puts the checkpoint in memory (a tmpfs), leaving the disk to the artifact. The
checkpoint's shards are deleted as soon as prepare is done (config.json stays, for the peer).
--prepare-only writes and prepares, then stops (a later call finds the artifact in --work).
--traffic prints the bytes-per-token model of the shapes (at --layers) and exits: no GPU needed.
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from bloomery.runtime.cuda.bandwidth import bf16_gemm_rate, copy_bandwidth


def log(*a):
    print(*a, flush=True)


PROMPT_LEN, WARM = 16, 8          # bench_cuda's prompt and warm-up steps


def mean_context(steps: int, prompt_len: int = PROMPT_LEN, warm: int = WARM) -> float:
    """Keys a timed decode step attends to, on average (the prompt, the steps before it, itself)."""
    return float(np.mean([prompt_len + i + 1 for i in range(warm, steps)]))


STORED = ("experts_stored", "ple_table_stored")   # what is stored but not moved per token
HOST = ("ple_gather", "ple_copy")                 # what the host moves per token (not device memory traffic)


def decode_traffic(shape: dict, fmt: str = "nvfp4", ctx: float = 1.0, state_bytes: int = 4,
                   kv_bytes: int = 4) -> dict:
    """Bytes one batch-1 decode step moves at `ctx` attended keys, by part, from the checkpoint's
    stored tensors (tools/synthetic.py's list: the stored formats' bytes, scales included): every
    dense weight (attention, delta net, KDA, MLA, indexers, hyper-connections, dense MLPs, norms),
    the embedding row, the head, the routers, top_k / experts of the routed experts' bytes, the
    shared expert(s); the recurrent states (delta-rule / KDA state, conv windows; qwen4_exp's PLE
    conv window and n-gram context), read and written whole; the KV cache (glm5_next: MLA's latent
    cache) read over the positions attended (the indexed layers: at most the indexer's budget /
    top-k plus its tail) and one position written; the indexer caches (QSA raw keys, DSA keys and
    gate scores) read over all ctx positions, one written; the hyper-connection streams [n x D]
    f32, counted as a fused step must move them: read twice and written once per
    hyper-connection (collapse; injection), read once by the final collapse and, qwen4_exp, read and
    written once per PLE layer. `total` sums the device parts; the stored-only parts (STORED: all
    routed experts, the n-gram tables) and the host's (HOST: per PLE layer the G table rows of d
    BF16 values gathered from the mmap, and their f32 copy to the device, G x d x 4) are not in it."""
    from bloomery.tools import synthetic as S
    s, mt = shape, shape["model_type"]
    p = dict.fromkeys(("dense", "embed_row", "head", "routers", "experts_active", "shared", "recurrent_state",
                       "conv_state", "ple_state", "hc_streams", "kv_read", "kv_write", "index_read", "index_write")
                      + STORED + HOST, 0.0)
    for n, dt, shp in S.tensors(s, fmt):
        nb = float(math.prod(shp) * S.ITEMSIZE[dt])
        if n.endswith("embed_tokens.weight"):
            p["embed_row"] += nb / s["vocab"]
            if s["tied"]:
                p["head"] += nb
        elif n == "lm_head.weight":
            p["head"] += nb
        elif ".mlp.experts." in n:
            p["experts_stored"] += nb
            p["experts_active"] += nb * s["top_k"] / s["experts"]
        elif ".mlp.shared_expert." in n or ".mlp.shared_experts." in n:
            p["shared"] += nb
        elif ".mlp.gate." in n or n.endswith("shared_expert_gate.weight"):
            p["routers"] += nb
        elif ".ngram_embedding." in n:
            p["ple_table_stored"] += nb
        elif dt != "I64":                     # the n-gram hash constants are the plan's attrs: read by no kernel
            p["dense"] += nb
    kinds = S.layer_types(s) if "full_interval" in s or "mla_interval" in s else ["full_attention"] * s["layers"]
    n_lin, n_att = kinds.count("linear_attention"), s["layers"] - kinds.count("linear_attention")
    attended = ctx
    if mt in ("qwen3_next", "qwen4_exp_text"):
        conv = 2 * s["lin_k_heads"] * s["lin_k_dim"] + s["lin_v_heads"] * s["lin_v_dim"]
        p["recurrent_state"] = 2.0 * n_lin * s["lin_v_heads"] * s["lin_k_dim"] * s["lin_v_dim"] * state_bytes
        p["conv_state"] = 2.0 * n_lin * (s["conv_kernel"] - 1) * conv * state_bytes
    if mt == "qwen4_exp_text":
        nd, G, n_ple = s["hc"] * s["hidden"], S.ngram_heads(s), len(s["ple_layers"])
        d = s["ple_dim"] // G
        p["ple_state"] = 2.0 * n_ple * ((s["ple_kernel"] - 1) * s["ngram_size"] * nd * state_bytes
                                        + (s["ngram_size"] - 1) * 4)          # the i32 n-gram context
        p["ple_gather"], p["ple_copy"] = float(n_ple * G * d * 2), float(n_ple * G * d * 4)
        p["hc_streams"] = (3.0 * 2 * s["layers"] + 1 + 2 * n_ple) * nd * 4
        attended = min(ctx, s["idx_budget"] + s["idx_ratio"] - 1)
        p["index_read"], p["index_write"] = n_att * ctx * s["idx_dim"] * state_bytes, float(n_att * s["idx_dim"] * state_bytes)
    if mt == "glm5_next":
        H, d, nd = s["lin_heads"], s["lin_dim"], s["hc"] * s["hidden"]
        p["recurrent_state"] = 2.0 * n_lin * H * d * d * state_bytes
        p["conv_state"] = 2.0 * n_lin * 3 * (s["conv_kernel"] - 1) * H * d * state_bytes
        p["hc_streams"] = (3.0 * 2 * s["layers"] + 1) * nd * 4
        attended = min(ctx, s["idx_topk"] + s["kpool"] - 1)
        row = n_att * s["kv_rank"] * kv_bytes                       # the latent c of one position, every MLA layer
        p["index_read"] = n_att * ctx * 2 * s["idx_dim"] * state_bytes       # every layer's indexer is "full"
        p["index_write"] = float(n_att * 2 * s["idx_dim"] * state_bytes)
    else:
        row = n_att * s["kv"] * s["head_dim"] * 2 * kv_bytes      # K and V of one position, every attention layer
    p["kv_read"], p["kv_write"] = attended * row, float(row)
    p["total"] = sum(v for k, v in p.items() if k not in STORED + HOST)
    return p


def plan_states(plan: dict, symbols: dict) -> dict:
    """From the artifact's plan, per slot: the bytes of its recurrent states (every `state` buffer
    without a ctx axis: read and written whole each step), of one cached position of every cache
    over ctx (the KV caches, MLA's latent cache, the indexers' key caches), and the states'
    itemsize (the plan's dtype)."""
    from bloomery.core import plan as P
    rec = kv = 0
    items = set()
    for n, b in plan["buffers"].items():
        if b["kind"] != "state":
            continue
        size = 4 if b["dtype"] in ("f32", "i32") else 2
        items.add(size)
        nb = int(np.prod(P.shape(b, symbols))) * size // int(symbols["slots"])
        if "ctx" in b["shape"]:
            kv += nb // int(symbols["ctx"])
        else:
            rec += nb
    return {"recurrent_bytes": rec, "kv_row_bytes": kv, "itemsize": max(items) if items else 4}


def traffic_states(t: dict) -> tuple[float, float]:
    """decode_traffic's counterpart of plan_states: (recurrent bytes a slot holds, cached bytes of
    one position)."""
    return (t["recurrent_state"] + t["conv_state"] + t["ple_state"]) / 2, t["kv_write"] + t["index_write"]


def delta_flops(plan: dict, prog: str = "prefill") -> int:
    """Useful FLOPs a row of the program's gated delta rules does (recurrent form: k^T S, the rank-1
    update, q^T S: 2 x k_dim x v_dim each, per value head)."""
    return sum(6 * int(o["v_heads"]) * int(o["k_dim"]) * int(o["v_dim"])
               for o in plan["programs"][prog]["ops"] if o["op"] == "gated_delta")


# the per-op-kind profile's tags (the executor's op names, fused launches joined by +) in groups
OP_GROUPS = {
    "linear": "linears", "linear+add": "linears", "logits": "head",     # the executor's fused launches' tags too
    "rmsnorm+linear": "linears", "rmsnorm+linear+swiglu": "linears", "linear+swiglu": "linears",
    "rope": "attention", "attention": "attention", "rope+rope+attention": "attention",
    "sigmoid_mul": "attention", "bias_add": "attention",
    "causal_conv1d": "delta net", "gated_delta": "delta net", "rmsnorm_gated": "delta net",
    "split_groups": "delta net", "rmsnorm": "rmsnorm",
    "moe_router": "MoE router", "moe_router_grouped": "MoE router",
    "moe_experts": "MoE experts", "moe_experts+add": "MoE experts",
    "hc_expand": "hyper-connections", "act_scale": "hyper-connections", "hc_gate_mix": "hyper-connections",
    "hc_inject": "hyper-connections", "mhc_weights": "hyper-connections", "hc_collapse": "hyper-connections",
    "hc_mean": "hyper-connections", "mhc_inject": "hyper-connections",
    "ngram_hash": "PLE", "host_embed": "PLE", "ple_gate": "PLE",
    "qsa_index": "indexer", "dsa_index": "indexer", "layernorm": "indexer",
    "kda": "KDA", "mla_attention": "attention",
}


def grouped(profile: dict) -> dict:
    out: dict = {}
    for tag, (ms, n) in profile.items():
        g = OP_GROUPS.get(tag, "other")
        a = out.setdefault(g, [0.0, 0])
        a[0] += ms
        a[1] += n
    return out


def fit_layers(name: str, fmt: str, room: float, both: bool, ple_rows: int | None = None) -> int | None:
    """The most layers of the shape (in steps that keep its layer pattern) whose checkpoint (and, when
    `both`, an artifact of about the same size beside it) fit in `room` bytes."""
    from bloomery.tools import synthetic as S
    step = S.SHAPES[name].get("full_interval", 1)
    best = None
    for n in range(step, S.SHAPES[name]["layers"] + 1, step):
        try:
            need = S.nbytes(S.tensors(S.shape_of(name, n, ple_rows=ple_rows), fmt)) * (2 if both else 1)
        except ValueError:
            continue
        if need <= room:
            best = n
    return best


def check_room(name: str, fmt: str, layers: int | None, work: Path, ckdir: Path, ple_rows: int | None = None) -> None:
    """Refuses, before anything is written, a checkpoint + artifact that would not fit on the disk(s)."""
    import shutil

    from bloomery.tools import synthetic as S
    size = S.nbytes(S.tensors(S.shape_of(name, layers, ple_rows=ple_rows), fmt))
    margin = 1 << 30
    for d in (work, ckdir):
        d.mkdir(parents=True, exist_ok=True)
    same = os.stat(work).st_dev == os.stat(ckdir).st_dev
    free_w, free_c = shutil.disk_usage(work).free, shutil.disk_usage(ckdir).free
    if same and 2 * size + margin > free_w:
        n = fit_layers(name, fmt, free_w - margin, True, ple_rows)
        raise OSError(f"{name} ({fmt}, {layers or S.SHAPES[name]['layers']} layers): checkpoint + artifact need "
                      f"~{2 * size / 1e9:.1f} GB, {work} has {free_w / 1e9:.1f} GB free: --layers {name}={n} fits, "
                      f"or put the checkpoint elsewhere (--ckpt-dir /dev/shm)")
    if not same and (size + margin > free_c or size + margin > free_w):
        n = min(x or 0 for x in (fit_layers(name, fmt, free_c - margin, False, ple_rows),
                                 fit_layers(name, fmt, free_w - margin, False, ple_rows)))
        raise OSError(f"{name} ({fmt}, {layers or S.SHAPES[name]['layers']} layers): ~{size / 1e9:.1f} GB each for "
                      f"the checkpoint ({ckdir}: {free_c / 1e9:.1f} GB free) and the artifact ({work}: "
                      f"{free_w / 1e9:.1f} GB free): --layers {name}={n} fits")


def print_traffic(name: str, shape: dict, fmt: str, ctx: float, bw: float | None = None) -> dict:
    t = decode_traffic(shape, fmt, ctx)
    roof = f"; copy roofline {bw / t['total']:.1f} tok/s at {bw / 1e12:.3f} TB/s" if bw else ""
    ple = (f"; the host gathers {t['ple_gather'] / 1e3:.1f} kB of n-gram rows a token and copies "
           f"{t['ple_copy'] / 1e3:.1f} kB (f32) to the device; n-gram tables stored: "
           f"{t['ple_table_stored'] / 1e9:.2f} GB") if t["ple_gather"] else ""
    log(f"{name} ({fmt}, {shape['layers']} layers, {ctx:.1f} keys attended): {t['total'] / 1e6:.1f} MB/token "
        f"[{device_parts(t)}] (all routed experts stored: {t['experts_stored'] / 1e9:.2f} GB){roof}{ple}")
    return t


def device_parts(t: dict) -> str:
    """decode_traffic's device parts, MB."""
    return ", ".join(f"{k} {v / 1e6:.1f}" for k, v in t.items() if k not in ("total",) + STORED + HOST and v)


def bench_cuda(art: Path, steps: int, prompt_len: int = PROMPT_LEN) -> dict:
    import cupy as cp

    from bloomery.runtime import Engine
    t0 = time.perf_counter()
    eng = Engine(art, device="cuda", ctx=prompt_len + steps + 64, ubatch=64)
    load_s = time.perf_counter() - t0
    ex = eng.exec
    rng = np.random.default_rng(0)
    prompt = [int(i) for i in rng.integers(0, eng.vocab_size, prompt_len)]
    t1 = time.perf_counter()
    row = eng.prefill(prompt, last_only=True)
    prefill_s = time.perf_counter() - t1
    tok = int(np.argmax(row))
    for _ in range(WARM):                         # warm
        _, nxt = eng.decode([tok], logits=False)
        tok = int(nxt[0])
    warm_tables_s = None
    if getattr(ex, "host", None):         # the host ops' tables (the PLE's) read into the page cache first
        tw = time.perf_counter()
        for a in ex.tables.opened():
            int(np.asarray(a).reshape(-1).view(np.uint8)[::4096].sum())
        warm_tables_s = time.perf_counter() - tw
    host0 = ex.host_stats().get("decode", {"runs": 0, "seconds": 0.0, "h2d_bytes": 0})
    t2 = time.perf_counter()
    n = steps - WARM
    for _ in range(n):
        _, nxt = eng.decode([tok], logits=False)
        tok = int(nxt[0])
    dt = (time.perf_counter() - t2) / n
    host1 = ex.host_stats().get("decode", {"runs": 0, "seconds": 0.0, "h2d_bytes": 0})
    runs = max(1, host1["runs"] - host0["runs"])
    # the host ops (the PLE's n-gram ids and table rows, gathered from the mmapped artifact) per token
    host = {"s_per_tok": (host1["seconds"] - host0["seconds"]) / runs,
            "h2d_bytes_per_tok": (host1["h2d_bytes"] - host0["h2d_bytes"]) / runs,
            "warm_tables_s": warm_tables_s} if host1["runs"] else None
    # the graph alone, replayed back to back (positions stay: the same attention length)
    g = ex.graph.get("decode")
    replay = None
    if g is not None:
        s = ex.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(50):
            g.launch(s)
        e1.record(s)
        e1.synchronize()
        replay = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 50
    prof = ex.profile("decode", reps=20) if g is not None else {}
    return {"profile": {k: [round(v[0], 4), v[1]] for k, v in prof.items()}, "load_s": load_s,
            "upload_gb": ex.w.nbytes / 1e9, "upload_s": ex.w.upload_s,
            "warm_s": ex.warm_s, "prefill_s": prefill_s, "s_per_tok": dt, "replay_s": replay,
            "bytes_per_tok": ex.decode_bytes, "kernels": len(ex.steps["decode"]), "host": host,
            "plan_states": plan_states(ex.plan, ex.symbols)}


def parse_ab(specs) -> dict:
    """--ab's LEVER=A,B,... into {lever: [values]}, each lever of specs/levers.yaml and each value one it takes."""
    from bloomery.core import levers
    out = {}
    for spec in specs:
        name, _, vals = spec.partition("=")
        values = [v for v in vals.split(",") if v]
        if not name or len(values) < 2:
            raise ValueError(f"--ab {spec!r}: LEVER=A,B (two values at least)")
        try:
            levers.get(name)
        except KeyError:
            raise ValueError(f"--ab {spec!r}: no lever {name} (bloomery levers lists them)") from None
        for v in values:
            try:
                levers.value(name, {name: v})
            except Exception as e:                 # BadLeverValue: names the lever's values
                raise ValueError(f"--ab {spec!r}: {e}") from None
        out[name] = values
    return out


def run_ab(art: Path, steps: int, ab: dict, rounds: int, free) -> dict:
    """bench_cuda at each value of each lever, alternating (round i: the values in order, reversed when i is
    odd), the environment put back after: {lever: {value: [bench_cuda's result, a round each]}}."""
    import os
    out = {}
    for lever, values in ab.items():
        before = os.environ.get(lever)
        runs = {v: [] for v in values}
        try:
            for i in range(rounds):
                for v in (values if i % 2 == 0 else values[::-1]):
                    os.environ[lever] = v
                    q = bench_cuda(art, steps)
                    runs[v].append({k: q[k] for k in ("replay_s", "s_per_tok", "kernels", "bytes_per_tok")})
                    log(f"  {lever}={v} round {i + 1}: graph {1e3 * (q['replay_s'] or 0):.3f} ms, "
                        f"{1 / q['s_per_tok']:.1f} tok/s, {q['kernels']} launches")
                    free()
        finally:
            if before is None:
                os.environ.pop(lever, None)
            else:
                os.environ[lever] = before
        out[lever] = runs
    return out


def bench_slots(art: Path, slots: int, context: int, steps: int = 32, cache: str = "f32") -> dict:
    """Decode steps of `slots` rows, every slot holding `context` keys first (random ids prefilled):
    aggregate tok/s over `steps` greedy steps (the host's round trip included), the decode graph
    replayed alone, the device time per op kind, and the bytes a step must move (the weights once,
    each row's cached keys and values in the cache's type, its recurrent states read and written)."""
    import cupy as cp

    from bloomery.runtime import Engine
    from bloomery.runtime.kv_cache import BYTES_PER_VALUE
    eng = Engine(art, device="cuda", ctx=context + steps + WARM + 8, slots=slots, ubatch=min(512, context),
                 cache_type_k=cache, cache_type_v=cache, draft_max=0)
    ex = eng.exec
    rng = np.random.default_rng(0)
    toks = []
    for s in range(slots):
        row = eng.prefill([int(i) for i in rng.integers(0, eng.vocab_size, context)], slot=s, last_only=True)
        toks.append(int(np.argmax(row)))
    for _ in range(WARM):
        _, nxt = eng.decode(toks, logits=False)
        toks = [int(t) for t in nxt]
    t0 = time.perf_counter()
    for _ in range(steps):
        _, nxt = eng.decode(toks, logits=False)
        toks = [int(t) for t in nxt]
    dt = (time.perf_counter() - t0) / steps
    s = ex.stream
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(s)
    for _ in range(20):
        ex.graph["decode"].launch(s)
    e1.record(s)
    e1.synchronize()
    prof = ex.profile("decode", reps=10)
    ps = plan_states(ex.plan, ex.symbols)
    keys = context + WARM + steps / 2                   # the mean number of cached positions a row attends
    kv_row = ps["kv_row_bytes"] * BYTES_PER_VALUE[cache] / 4      # plan_states counts the float32 cache
    traffic = ex.decode_bytes + slots * (keys * kv_row + 2 * ps["recurrent_bytes"])
    return {"slots": slots, "context": context, "cache": cache, "s_per_step": dt, "tok_s": slots / dt, "traffic_per_step": traffic,
            "replay_s": cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 20, "tc_mode": ex.tc_mode,
            "groups": {k: round(v[0], 4) for k, v in grouped(prof).items()},
            "profile": {k: [round(v[0], 4), v[1]] for k, v in prof.items()}}


def bench_verify(art: Path, k_max: int = 4, context: int = 512, rounds: int = 3, reps: int = 30) -> dict:
    """The verify program's cost (speculative decoding): the graph of r = k + 1 rows of one slot
    (k drafted tokens, k = 0..k_max) against the 1-row decode graph, both replayed `reps` times
    back to back at a slot holding `context` keys, in `rounds` alternating rounds (the median); and
    the host's view: Engine.verify + accept of k + 1 tokens against Engine.decode of one."""
    import cupy as cp

    from bloomery.runtime import Engine
    eng = Engine(art, device="cuda", ctx=context + 64, draft_max=k_max, ubatch=min(512, context))
    ex = eng.exec
    rng = np.random.default_rng(0)
    row = eng.prefill([int(i) for i in rng.integers(0, eng.vocab_size, context)], last_only=True)
    tok = int(np.argmax(row))
    s = ex.stream

    def timed(key) -> float:
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(reps):
            ex.graph[key].launch(s)
        e1.record(s)
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps

    def host(r: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            if r == 0:
                eng.decode([tok], logits=False)
                eng.lengths[0] -= 1          # stay at the same position: the same attention length
            else:
                eng.verify([tok] * r, logits=False)
                eng.accept(1)
                eng.lengths[0] -= 1
        return (time.perf_counter() - t0) / reps

    keys = ["decode"] + [("verify", r) for r in range(1, k_max + 2)]
    dev = {str(k): [] for k in keys}
    hst = {str(k): [] for k in keys}
    for _ in range(rounds):
        for k in keys:
            r = 0 if k == "decode" else k[1]
            hst[str(k)].append(host(r))           # also sets the graph's inputs (positions) for the replay
            dev[str(k)].append(timed(k))
    med = {k: float(np.median(v)) for k, v in dev.items()}
    medh = {k: float(np.median(v)) for k, v in hst.items()}
    one = med["decode"]
    return {"context": context, "graph_s": med, "host_s": medh,
            "x_decode": {k: round(v / one, 3) for k, v in med.items()},
            "host_x_decode": {k: round(v / medh["decode"], 3) for k, v in medh.items()}}


def bench_prefill(art: Path, n: int, mode: str | None = None) -> dict:
    """One prompt of n tokens in one chunk (ubatch n): the prefill program's graph replayed (device
    time), the end-to-end Engine.prefill (host included), the useful FLOPs (linears, experts, head,
    causal attention) and the per-op-kind split."""
    import cupy as cp

    from bloomery.runtime import Engine
    old = os.environ.get("BLOOMERY_PREFILL_GEMM")
    if mode:
        os.environ["BLOOMERY_PREFILL_GEMM"] = mode              # the lever, read by the executor
    try:
        eng = Engine(art, device="cuda", ctx=n + 8, ubatch=n)
    finally:
        if old is None:
            os.environ.pop("BLOOMERY_PREFILL_GEMM", None)
        else:
            os.environ["BLOOMERY_PREFILL_GEMM"] = old
    ex = eng.exec
    rng = np.random.default_rng(1)
    prompt = [int(i) for i in rng.integers(0, eng.vocab_size, n)]
    t0 = time.perf_counter()
    eng.prefill(prompt, last_only=True)
    wall = time.perf_counter() - t0
    s, g = ex.stream, ex.graph["prefill"]
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    g.launch(s)
    e0.record(s)
    for _ in range(3):
        g.launch(s)                              # same inputs: the same cache rows rewritten
    e1.record(s)
    e1.synchronize()
    dev = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 3
    f = ex.flops["prefill"]
    fd = delta_flops(ex.plan) * n                # the executor counts the linears and attention only
    flops = f["linear"] + f["attention_per_key"] * n * (n + 1) // 2 + fd
    prof = ex.profile("prefill", reps=2)
    res = {"n": n, "wall_s": wall, "device_s": dev, "flops": flops, "linear_flops": f["linear"], "delta_flops": fd,
           "profile": {k: [round(v[0], 3), v[1]] for k, v in prof.items()}, "gemm_mode": ex.gemm_mode}
    del eng, ex, g
    cp.get_default_memory_pool().free_all_blocks()
    return res


def peer_fits(shape: dict) -> tuple[bool, str]:
    """Whether HF's bf16 model of the shape (weights as transformers holds them: tools/synthetic.py's
    bf16 list) fits in the GPU's free memory with 6 GiB to spare for activations and cache."""
    import torch

    from bloomery.tools import synthetic as S
    need = S.nbytes(S.tensors(shape, "bf16"))
    free = torch.cuda.mem_get_info()[0]
    if need + (6 << 30) > free:
        return False, (f"HF bf16 weights {need / 1e9:.1f} GB + 6 GiB > {free / 1e9:.1f} GB free on the GPU "
                       f"({shape['layers']} layers; fewer with --layers)")
    return True, f"HF bf16 weights {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"


def bench_peer(ckpt: Path, steps: int, prompt_len: int = PROMPT_LEN, compiled: bool = True,
               device: str = "cuda", int4: bool = True) -> dict:
    """HF transformers on the checkpoint's config (random bf16 weights): eager (DynamicCache), the
    compiled StaticCache loop, and (int4) the same compiled loop with every decoder linear quantized to
    gpt-fast's int4 groups of 128 (torch's int4 kernels; the head and embedding stay bf16)."""
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    import transformers
    from transformers import AutoConfig, StaticCache
    cfg = AutoConfig.from_pretrained(ckpt)
    cfg.torch_dtype = torch.bfloat16
    cls = getattr(transformers, cfg.architectures[0])       # glm5_next is no AutoModelForCausalLM
    with torch.device(device):
        model = cls._from_config(cfg, torch_dtype=torch.bfloat16).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, cfg.get_text_config().vocab_size, (1, prompt_len), device=device)
    res = {"peer_bytes": nbytes}
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)          # eager, DynamicCache
        pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            if i == WARM:
                sync()
                t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=pkv, use_cache=True)
            pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync()
        res["eager_s_per_tok"] = (time.perf_counter() - t0) / (steps - WARM)
        del pkv, out
        def run_compiled(model, compile_it: bool = True):
            """(seconds a token, compile seconds) of the StaticCache loop under torch.compile (eager when
            not compile_it: what a CPU test can afford)."""
            t0 = time.perf_counter()
            cache = StaticCache(config=model.config, max_cache_len=prompt_len + steps + 16)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(prompt_len, device=device))
            tok = out.logits[:, -1:].argmax(-1)

            def step(t, pos):
                return model(input_ids=t, past_key_values=cache, use_cache=True, cache_position=pos).logits

            cstep = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile_it else step
            for i in range(steps):
                if i == 8:
                    sync()
                    compile_s = time.perf_counter() - t0
                    t1 = time.perf_counter()
                torch.compiler.cudagraph_mark_step_begin()
                lg = cstep(tok, torch.tensor([prompt_len + i], device=device))
                tok = lg[:, -1:].argmax(-1)
            sync()
            return (time.perf_counter() - t1) / (steps - 8), compile_s

        if compiled:
            res["compiled_s_per_tok"], res["compile_s"] = run_compiled(model)
        if int4:                             # the same model, its decoder linears int4 (tools/peer_int4.py)
            from bloomery.tools import peer_int4
            torch.compiler.reset()
            res["int4_linears"] = peer_int4.quantize_model(model)
            if device == "cuda":
                torch.cuda.empty_cache()
            res["int4_bytes"] = peer_int4.nbytes(model)
            res["int4_s_per_tok"], res["int4_compile_s"] = run_compiled(model, compile_it=compiled)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["smollm2-135m", "llama3-8b"])
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--layers", nargs="*", default=[],
                    help="shape=N: fewer layers than the real model (qwen3-next-80b-a3b: a multiple of 4, its "
                         "3 linear : 1 full attention pattern; glm-4.5-air: >= 2, its first layer dense)")
    ap.add_argument("--ple-rows", type=int, default=None,
                    help="qwen4-exp: n-gram tables of about this many rows (tools/synthetic.py; the real 320 M rows, "
                         "81.9 GB a table, fit no single-GPU machine's disk)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--peer-shapes", nargs="*", default=None, help="run the peer on these only (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="peer: eager only (no compiled and no int4 peer)")
    ap.add_argument("--no-int4", action="store_true", help="peer: skip the int4 weight-only peer")
    ap.add_argument("--prefill", nargs="*", type=int, default=[512, 4096], help="prompt lengths timed in one chunk")
    ap.add_argument("--prefill-modes", nargs="*", default=[None],
                    help="BLOOMERY_PREFILL_GEMM settings to time prefill in (default: the lever's setting)")
    ap.add_argument("--prefill-shapes", nargs="*", default=None, help="time prefill on these only (default: all)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bloomery-bench"), help="where the artifacts stay")
    ap.add_argument("--ckpt-dir", type=Path, default=None,
                    help="where the synthetic checkpoints are written (default: --work; /dev/shm: in memory)")
    ap.add_argument("--prepare-only", action="store_true", help="write and prepare the shapes, then stop")
    ap.add_argument("--traffic", action="store_true", help="print the bytes-per-token model and exit (no GPU)")
    ap.add_argument("--bw", type=float, default=4.26, help="--traffic: copy bandwidth in TB/s for its roofline")
    ap.add_argument("--slots", nargs="*", type=int, default=[],
                    help="also time decode steps of these many slots (rows), each holding --slot-context keys")
    ap.add_argument("--slot-context", type=int, default=512)
    ap.add_argument("--cache-types", nargs="+", default=["f32"], metavar="TYPE",
                    help="--slots runs: the KV cache's types (f32 f16 bf16), each timed in turn")
    ap.add_argument("--batches", default=None, metavar="1,2,4,8",
                    help="the GEMV kernels' row-count buckets (runtime/cuda/gemv.py BATCHES; to compare with another set)")
    ap.add_argument("--upload", choices=["staged", "plain"], default=None,
                    help="how the weights reach the GPU (lever BLOOMERY_UPLOAD; to compare the two)")
    ap.add_argument("--verify", type=int, default=0, metavar="K",
                    help="also time the verify graphs of 1..K+1 rows against the 1-row decode step (speculative decoding)")
    ap.add_argument("--ab", nargs="*", default=[], metavar="LEVER=A,B",
                    help="also time the 1-slot decode step at each of a lever's values, alternating (A B B A ...), "
                         "in this process on the same artifact: e.g. BLOOMERY_MOE_PREFETCH=off,on; a table last")
    ap.add_argument("--ab-rounds", type=int, default=2, help="--ab: rounds of every value (the order reversed each round)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        ab = parse_ab(a.ab)
    except ValueError as e:
        ap.error(str(e))
    if a.upload:
        import os
        os.environ["BLOOMERY_UPLOAD"] = a.upload
        log(f"weights uploaded: {a.upload}")
    if a.batches:
        from bloomery.runtime.cuda import gemv as G
        G.BATCHES = tuple(int(b) for b in a.batches.split(","))
        log(f"GEMV row buckets: {G.BATCHES}")
    from bloomery.tools import synthetic
    layers = {k: int(v) for k, v in (x.split("=") for x in a.layers)}
    ple = {s: a.ple_rows if "ngram_base" in synthetic.SHAPES.get(s, {}) else None for s in a.shapes}
    try:
        shapes = {s: synthetic.shape_of(s, layers.get(s), ple_rows=ple[s]) for s in a.shapes}
    except (KeyError, ValueError) as e:
        ap.error(f"{e} (shapes: {', '.join(sorted(synthetic.SHAPES))})")
    ctx = mean_context(a.steps)
    if a.traffic:
        for s, sh in shapes.items():
            print_traffic(s, sh, a.format, ctx, a.bw * 1e12)
            t0, t1 = decode_traffic(sh, a.format, ctx), decode_traffic(sh, a.format, ctx + 1000)
            t1k = t1["kv_read"] + t1["index_read"] - t0["kv_read"] - t0["index_read"]
            log(f"  each 1,000 more keys attended: +{t1k / 1e6:.1f} MB/token")
        return 0
    import gc
    import shutil

    from bloomery.compiler.prepare import prepare
    ckdir = a.ckpt_dir or a.work
    bw = tc = 0.0
    if not a.prepare_only:
        bw = copy_bandwidth()
        log(f"copy bandwidth (D2D 2 GiB, read + write, median of 10): {bw / 1e12:.3f} TB/s")
        tc = bf16_gemm_rate() if a.prefill else 0.0
        if tc:
            log(f"bf16 tensor-core rate (cuBLAS 8192^3, bf16 in, f32 accumulate and out, median of 10): {tc / 1e12:.1f} TFLOP/s")
    rows = []

    def free_gpu():
        gc.collect()                         # the executors' launch closures hold cycles
        try:
            import cupy as cp
            cp.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass

    for shape, sh in shapes.items():
        r = {"shape": shape, "format": a.format, "layers": sh["layers"]}
        tag = f"{shape}-{a.format}-{sh['layers']}l"            # a run at other --layers never reuses this one
        ck, art = ckdir / f"{tag}-ckpt", a.work / tag
        r["artifact"] = str(art)
        try:
            if not art.exists():
                shutil.rmtree(ck, ignore_errors=True)              # a leftover of an interrupted run
                check_room(shape, a.format, layers.get(shape), a.work, ckdir, ple[shape])
                t0 = time.perf_counter()
                synthetic.write(shape, ck, a.format, layers=layers.get(shape), ple_rows=ple[shape])
                r["synthetic_s"] = time.perf_counter() - t0
                r["ckpt_gb"] = sum(f.stat().st_size for f in ck.glob("*.safetensors")) / 1e9
                t0 = time.perf_counter()
                prepare(ck, art, progress=False)
                r["prepare_s"] = time.perf_counter() - t0
                for f in ck.glob("*.safetensors"):                 # config.json stays for the peer
                    f.unlink()
                log(f"{shape}: synthetic {r['ckpt_gb']:.2f} GB in {r['synthetic_s']:.1f} s, prepare "
                    f"{r['prepare_s']:.1f} s ({r['ckpt_gb'] / r['prepare_s']:.2f} GB/s)")
            if a.prepare_only:
                rows.append(r)
                continue
            r.update(bench_cuda(art, a.steps))
            if ab:
                free_gpu()
                r["ab"] = run_ab(art, a.steps, ab, a.ab_rounds, free_gpu)
            if a.verify:
                free_gpu()
                r["verify"] = bench_verify(art, a.verify, a.slot_context)
                log(json.dumps(r["verify"]))
                v = r["verify"]
                log(f"{shape}: verify graph / 1-row decode graph: " + ", ".join(
                    f"{k} {x:.3f}x" for k, x in v["x_decode"].items()) + f" (decode {v['graph_s']['decode'] * 1e3:.3f} ms)")
            if a.slots:
                free_gpu()
                r["slot_runs"] = []
                for n, ct in ((n, ct) for ct in a.cache_types for n in a.slots):
                    r["slot_runs"].append(bench_slots(art, n, a.slot_context, cache=ct))
                    log(json.dumps(r["slot_runs"][-1]))
                    free_gpu()
            ps = r["plan_states"]
            t = decode_traffic(sh, a.format, ctx, ps["itemsize"], ps["itemsize"])
            mine = traffic_states(t)
            if mine != (ps["recurrent_bytes"], ps["kv_row_bytes"]):
                log(f"{shape}: WARNING the traffic model's states ({mine[0]:.0f} B recurrent, {mine[1]:.0f} B a KV "
                    f"position) are not the plan's ({ps['recurrent_bytes']} B, {ps['kv_row_bytes']} B)")
            r.update(traffic=t, ctx=ctx, traffic_per_tok=t["total"], roofline_tok_s=bw / t["total"],
                     pct_copy_traffic=100 * t["total"] / r["s_per_tok"] / bw)
            r["gb_s"] = r["bytes_per_tok"] / r["s_per_tok"] / 1e9
            r["pct_copy"] = 100 * r["bytes_per_tok"] / r["s_per_tok"] / bw
            log(json.dumps(r))
            free_gpu()
            if a.prefill_shapes is None or shape in a.prefill_shapes:
                r["prefill"] = []
                for n, mode in ((n, m) for m in a.prefill_modes for n in a.prefill):
                    try:
                        p = bench_prefill(art, n, mode)
                        p["pct_tc"] = 100 * p["flops"] / p["device_s"] / tc
                    except Exception as e:
                        import traceback
                        traceback.print_exc()
                        p = {"n": n, "error": f"{type(e).__name__}: {e}"}
                    free_gpu()
                    r["prefill"].append(p)
                    log(json.dumps(p))
            if a.peer and (a.peer_shapes is None or shape in a.peer_shapes):
                import torch        # the peer needs torch; bloomery does not
                free_gpu()
                ok, why = peer_fits(sh)
                log(f"{shape}: peer {'runs' if ok else 'skipped'}: {why}")
                if ok:
                    if not (ck / "config.json").exists():
                        synthetic.write_config(sh, ck, a.format)
                    r.update(bench_peer(ck, a.steps, compiled=not a.no_compile, int4=not (a.no_int4 or a.no_compile)))
                else:
                    r["peer_skipped"] = why
                torch.cuda.empty_cache()             # the peer's model is gone with bench_peer's frame
                log(json.dumps(r, default=str))
        except Exception as e:
            import traceback
            traceback.print_exc()
            r["error"] = f"{type(e).__name__}: {e}"
        rows.append(r)
        if not a.prepare_only:
            shutil.rmtree(ck, ignore_errors=True)
        free_gpu()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_decode.json").write_text(json.dumps({"copy_bw": bw, "bf16_tc": tc, "rows": rows}, indent=1,
                                                            default=str))
    if a.prepare_only:
        for r in rows:
            log(f"{r['shape']}: {r.get('error') or 'artifact in ' + r['artifact']}")
        return 0
    log()
    log("decode device time per op kind (each kind's launches replayed alone from a graph; ms per token, launches):")
    for r in rows:
        if r.get("profile"):
            tot = sum(v[0] for v in r["profile"].values())
            parts = ", ".join(f"{k} {v[0]:.3f} ({v[1]})" for k, v in sorted(r["profile"].items(), key=lambda kv: -kv[1][0]))
            log(f"  {r['shape']}: sum {tot:.3f} ms over {r['kernels']} launches: {parts}")
            g = grouped(r["profile"])
            log("    by group: " + ", ".join(f"{k} {v[0]:.3f} ({v[1]})"
                                          for k, v in sorted(g.items(), key=lambda kv: -kv[1][0])))
    for r in rows:
        if r.get("slot_runs"):
            base = r["slot_runs"][0]
            log(f"  {r['shape']}: decode steps of several slots ({base['context']} keys each; BLOOMERY_DECODE_TC="
                f"{base['tc_mode']}):")
            log("  | slots | KV cache | tok/s (all slots) | x first | step ms | graph ms | linears+head ms | attention ms "
                "| other ms | MB a step | % copy roofline |")
            log("  |---|---|---|---|---|---|---|---|---|---|---|")
            for q in r["slot_runs"]:
                g = q["groups"]
                lin = g.get("linears", 0) + g.get("head", 0)
                log(f"  | {q['slots']} | {q.get('cache', 'f32')} | {q['tok_s']:.1f} | {q['tok_s'] / base['tok_s']:.2f} | "
                    f"{1e3 * q['s_per_step']:.2f} | "
                    f"{1e3 * q['replay_s']:.2f} | {lin:.2f} | {g.get('attention', 0):.2f} | "
                    f"{sum(g.values()) - lin - g.get('attention', 0):.2f} | {q['traffic_per_step'] / 1e6:.0f} | "
                    f"{100 * q['traffic_per_step'] / q['s_per_step'] / bw:.1f} |")
            for q in r["slot_runs"]:
                log(f"    {q['slots']} slots, per op kind (ms a step, launches): " + ", ".join(
                    f"{k} {v[0]:.3f} ({v[1]})" for k, v in sorted(q["profile"].items(), key=lambda kv: -kv[1][0])))
    for r in rows:
        if r.get("host"):
            h = r["host"]
            log(f"  {r['shape']}: host ops (the PLE's n-gram ids and table rows, from the mmapped artifact) "
                f"{1e6 * h['s_per_tok']:.1f} us a token ({100 * h['s_per_tok'] / r['s_per_tok']:.1f}% of the step), "
                f"{h['h2d_bytes_per_tok'] / 1e3:.1f} KB copied to the device a token (tables read into the page "
                f"cache first, {h['warm_tables_s']:.1f} s)")
    for r in rows:
        if r.get("ab"):
            log(f"  {r['shape']}: levers alternated in this process (1 slot; graph: the decode graph replayed alone, "
                f"ms a token; x: the first value's median graph over this one's):")
            log("  | lever | value | graph ms (each round) | median graph ms | tok/s (median) | launches | x graph |")
            log("  |---|---|---|---|---|---|---|")
            for lever, runs in r["ab"].items():
                first = None
                for value, rs in runs.items():
                    gs = [q["replay_s"] or q["s_per_tok"] for q in rs]       # no graph: the step's wall time
                    g = float(np.median(gs))
                    first = first or g
                    each = " / ".join(f"{1e3 * x:.3f}" for x in gs)
                    tok_s = float(np.median([1 / q["s_per_tok"] for q in rs]))
                    log(f"  | {lever} | {value} | {each} | {1e3 * g:.3f} | {tok_s:.1f} | {rs[0]['kernels']} | "
                        f"{first / g:.3f} |")
    log()
    log("bytes a decode step moves (the model's count, MB: tools/bench_decode.decode_traffic):")
    for r in rows:
        if "traffic" in r:
            t = r["traffic"]
            log(f"  {r['shape']} ({r['layers']} layers, {r['ctx']:.1f} keys): total {t['total'] / 1e6:.1f} = " +
                device_parts(t) +
                f"; the executor's weight count {r['bytes_per_tok'] / 1e6:.1f}")
    log()
    if tc:
        log(f"prefill (one chunk; device time of the prefill graph; bf16 tensor-core rate {tc / 1e12:.1f} TFLOP/s):")
        log("| shape | tokens | mode | ms (device) | tok/s | TFLOP/s | % tc | wall ms | top op kinds (ms) |")
        log("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            for p in r.get("prefill", []):
                if "error" in p:
                    log(f"| {r['shape']} | {p['n']} | ERROR {p['error'][:80]} |")
                    continue
                top = ", ".join(f"{k} {v[0]:.1f}" for k, v in sorted(p["profile"].items(), key=lambda kv: -kv[1][0])[:3])
                log(f"| {r['shape']} | {p['n']} | {p['gemm_mode']} | {1e3 * p['device_s']:.1f} | {p['n'] / p['device_s']:.0f} | "
                    f"{p['flops'] / p['device_s'] / 1e12:.1f} | {p['pct_tc']:.1f} | {1e3 * p['wall_s']:.1f} | {top} |")
        log()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s; MB/tok: the executor's weight count | the model's whole traffic "
        f"(states and KV included), whose copy roofline the last columns compare with")
    log("| shape | fmt | layers | load s (upload GB/s) | tok/s | ms/tok | graph ms/tok | MB/tok | GB/s | % copy "
        "| MB/tok all | roofline tok/s | % roofline | peer eager tok/s | peer compiled tok/s | x compiled peer "
        "| peer int4 tok/s | x int4 peer |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "s_per_tok" not in r:
            log(f"| {r['shape']} | {r['format']} | {r['layers']} | ERROR {r.get('error', '')[:90]} |")
            continue
        pe = f"{1 / r['eager_s_per_tok']:.1f}" if "eager_s_per_tok" in r else "skipped" if "peer_skipped" in r else "-"
        pc = f"{1 / r['compiled_s_per_tok']:.1f}" if "compiled_s_per_tok" in r else "-"
        ratio = f"{r['compiled_s_per_tok'] / r['s_per_tok']:.2f}" if "compiled_s_per_tok" in r else "-"
        p4 = f"{1 / r['int4_s_per_tok']:.1f}" if "int4_s_per_tok" in r else "-"
        r4 = f"{r['int4_s_per_tok'] / r['s_per_tok']:.2f}" if "int4_s_per_tok" in r else "-"
        rp = f"{1e3 * r['replay_s']:.3f}" if r.get("replay_s") else "-"
        up = r["upload_gb"] / r["upload_s"] if r["upload_s"] else 0
        log(f"| {r['shape']} | {r['format']} | {r['layers']} | {r['load_s']:.2f} ({up:.1f}) | {1 / r['s_per_tok']:.1f} | "
            f"{1e3 * r['s_per_tok']:.3f} | {rp} | {r['bytes_per_tok'] / 1e6:.1f} | {r['gb_s']:.0f} | "
            f"{r['pct_copy']:.1f} | {r['traffic_per_tok'] / 1e6:.1f} | {r['roofline_tok_s']:.1f} | "
            f"{r['pct_copy_traffic']:.1f} | {pe} | {pc} | {ratio} | {p4} | {r4} |")
    for r in rows:
        if "peer_skipped" in r:
            log(f"peer skipped on {r['shape']}: {r['peer_skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
