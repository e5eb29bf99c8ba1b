"""Check and time the hybrid families' CUDA kernels (runtime/cuda/gated_delta.cu, causal_conv1d.cu) at
Qwen3-Next-80B-A3B's delta-net dims (16 key heads, 32 value heads, k_dim = v_dim = 128, conv kernel 4,
8192 conv channels) on the GPU.

    python -m bloomery.tools.bench_hybrid [--out DIR] [--quick]
    python -m bloomery.tools.bench_hybrid --nvcc          # no GPU needed: nvcc -arch=sm_90a ptxas reports

1. Device copy bandwidth (runtime/cuda/bandwidth.py: cudaMemcpy D2D, bytes read + written).
2. Correctness first: each timed configuration against the NumPy op (runtime/ops/) on the same
   random inputs (decode at batch 8, a prompt of 256 rows): relative L2 of out and state.
3. gated_delta decode, batch 1 and 8 (every slot continuing its sequence: its state read and
   written): a CUDA graph of launches rotating among copies of the state totalling >= 4x the 60 MB
   L2, replayed 5 times, median per launch; us/call, GB/s of state bytes (read + write) and of all
   bytes (+ q/k/v/a/b read, out written), % of the copy bandwidth; every kernel instance (16 / 8 / 4
   columns per warp).
4. gated_delta prefill: 4,096 rows of one slot (from position 0: the state is written, not read;
   and continuing: read and written), us/call, us/token, GB/s of all bytes, state updates per second;
   then the token-by-token path (old) against the chunked one (new, chunked=True), alternating
   graph replays in the same run (each checked against the NumPy op first, at 512 rows).
5. causal_conv1d at the same dims: decode batch 1 / 8, prefill 4,096 rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

QWEN = {"k_heads": 16, "v_heads": 32, "k_dim": 128, "v_dim": 128}
CONV_K = 4
L2 = 60 << 20


def log(*a):
    print(*a, flush=True)


# -- nvcc (no GPU) ---------------------------------------------------------------------------------------

INSTANCES = {
    "gated_delta": [f"gated_delta_k<{ni}, {qw}>" for qw in (4, 2, 1) for ni in (1, 2, 4, 8, 16)]
                   + [f"gated_delta_run_k<{ni}, {qw}>" for qw in (4, 2, 1) for ni in (1, 2, 4, 8)]
                   + [f"gated_delta_chunk_b_k<{dk}>" for dk in (16, 32, 64, 128)],
    "causal_conv1d": [f"causal_conv1d_k<{k}>" for k in range(2, 9)],
    "rmsnorm_gated": [], "split_groups": [], "sigmoid_mul": [], "bias_add": [], "moe_router_grouped": [],
}
SIGS = {
    "gated_delta_k": "(const float *__restrict__, const float *__restrict__, const float *__restrict__, "
                     "const int *__restrict__, const int *__restrict__, const float *__restrict__, "
                     "const float *__restrict__, float *__restrict__, float *__restrict__, float *__restrict__, int, "
                     "int, int, int, int, int, float)",
    "gated_delta_run_k": "(const float *__restrict__, const float *__restrict__, const float *__restrict__, "
                         "const int *__restrict__, const int *__restrict__, float *__restrict__, float *__restrict__, "
                         "int, int, int, int, int, int, const int *__restrict__)",
    "gated_delta_chunk_b_k": "(const float *__restrict__, const float *__restrict__, const float *__restrict__, "
                             "const float *__restrict__, const int *__restrict__, float *__restrict__, "
                             "float *__restrict__, int, int, int, int)",
    "causal_conv1d_k": "(const float *, float *, const int *__restrict__, const int *__restrict__, "
                     "const float *__restrict__, float *__restrict__, float *__restrict__, int, int, int)",
}


def nvcc_report(arch: str = "sm_90a") -> int:
    """Compiles every runtime/cuda/*.cu of the hybrid ops with nvcc (explicit instantiations of the
    templates the bindings launch) and prints ptxas' registers / stack / spills per kernel."""
    from bloomery.runtime.cuda import cu
    bad = 0
    with tempfile.TemporaryDirectory() as td:
        for stem, inst in INSTANCES.items():
            src = Path(td) / f"{stem}.cu"
            text = cu.source(stem) + "".join(f"\ntemplate __global__ void {n}{SIGS[n.split('<')[0]]};" for n in inst) + "\n"
            src.write_text(text)
            cmd = ["nvcc", f"-arch={arch}", "-std=c++17", "-c", "-o", "/dev/null", "-Xptxas", "-v", str(src)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            log(f"== {stem}.cu: {' '.join(cmd[:-1])} <{stem}.cu + instantiations>  (exit {p.returncode})")
            name = None
            for line in p.stderr.splitlines():
                if "Compiling entry function" in line:
                    name = line.split("'")[1]
                elif "spill" in line or "Used" in line:
                    log(f"   {name}: {line.split(':', 1)[-1].strip()}")
                    if "spill" in line and not line.strip().startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"):
                        bad += 1
                elif "error" in line or "warning" in line:
                    log("   " + line)
            bad += p.returncode != 0
    log(f"nvcc: {bad} problem(s) (non-zero exit or spills)")
    return bad


# -- GPU ---------------------------------------------------------------------------------------------------

class DevW:
    def __init__(self, host):
        import cupy as cp
        self.v = {k: cp.asarray(np.ascontiguousarray(a, np.float32).reshape(-1)) for k, a in host.items()}

    def vector(self, name, offset=0.0):
        return self.v[name]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def time_graph(fns, reps: int = 5) -> float:
    """Median seconds of one replay of a graph holding the launches fns (captured once)."""
    import cupy as cp
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for f in fns:                        # eager once (compiles, warms)
            f()
        s.begin_capture()
        try:
            for f in fns:
                f()
        finally:
            g = s.end_capture()
    g.launch(s)
    s.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        g.launch(s)
        e1.record(s)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return float(np.median(ts))


def delta_setup(rows, slots, rng, mode):
    import cupy as cp
    Hk, Hv, dk, dv = (QWEN[k] for k in ("k_heads", "v_heads", "k_dim", "v_dim"))
    op = {"op": "gated_delta", "qkv": "qkv", "a": "a", "b": "b", "pos": "pos", "slot": "slot", "state": "st",
          "out": "out", "A_log": "A_log", "dt_bias": "dt", **QWEN, "mode": mode}
    w = {"A_log": np.log(rng.uniform(0.5, 8, Hv)).astype(np.float32),
         "dt": (-4 + 0.5 * rng.standard_normal(Hv)).astype(np.float32)}
    host = {"qkv": rng.standard_normal((rows, 2 * Hk * dk + Hv * dv)).astype(np.float32),
            "a": rng.standard_normal((rows, Hv)).astype(np.float32),
            "b": rng.standard_normal((rows, Hv)).astype(np.float32),
            "out": np.zeros((rows, Hv * dv), np.float32),
            "st": (0.1 * rng.standard_normal((slots, Hv, dk, dv))).astype(np.float32)}
    return op, w, host, {k: cp.asarray(v) for k, v in host.items()}


def check_delta(qw, pipe, rng) -> dict:
    """The kernel instance (qw, pipe) against the NumPy op: decode batch 8 (continuing), a prompt of 256 rows."""
    import cupy as cp
    from bloomery.runtime.cuda import gated_delta as GD
    from bloomery.runtime.ops import IMPL
    res = {}
    for mode, rows, pos, slot in (("decode", 8, np.arange(8) + 50, np.arange(8)),
                                  ("prefill", 256, np.arange(256) + 3, np.zeros(256))):
        op, w, host, d = delta_setup(rows, 8, rng, mode)
        host["pos"], host["slot"] = pos.astype(np.int32), slot.astype(np.int32)
        d["pos"], d["slot"] = cp.asarray(host["pos"]), cp.asarray(host["slot"])
        steps = GD.launches(op, d, rows, DevW(w), qw=qw, pipe=pipe)
        for f in steps:
            f()
        cp.cuda.Device().synchronize()
        IMPL["gated_delta"].run(op, host, w)
        res[mode] = (rel(cp.asnumpy(d["out"]), host["out"]), rel(cp.asnumpy(d["st"]), host["st"]))
    return res


def bench_delta_decode(batch, qw, bw, rng) -> dict:
    import cupy as cp
    from bloomery.runtime.cuda import gated_delta as GD
    op, w, host, d = delta_setup(batch, batch, rng, "decode")
    d["pos"] = cp.asarray(np.arange(batch, dtype=np.int32) + 100)      # continuing: state read and written
    d["slot"] = cp.asarray(np.arange(batch, dtype=np.int32))
    sbytes = host["st"].nbytes
    copies = max(2, min(400, -(-4 * L2 // sbytes)))
    states = [cp.asarray(host["st"]) for _ in range(copies)]
    dw = DevW(w)
    fns = []
    for st in states:
        fns += GD.launches(op, {**d, "st": st}, batch, dw, qw=qw, pipe=False)
    t = time_graph(fns) / len(fns)
    state_b = 2 * sbytes
    io_b = host["qkv"].nbytes + host["a"].nbytes + host["b"].nbytes + host["out"].nbytes
    del states
    cp.get_default_memory_pool().free_all_blocks()
    return {"batch": batch, "qw": qw, "cols_per_warp": 4 * qw, "us": t * 1e6, "state_GBps": state_b / t / 1e9,
            "all_GBps": (state_b + io_b) / t / 1e9, "pct_copy": 100 * (state_b + io_b) / t / bw, "copies": copies}


def bench_delta_prefill(rows, qw, bw, rng, fresh: bool) -> dict:
    import cupy as cp
    from bloomery.runtime.cuda import gated_delta as GD
    op, w, host, d = delta_setup(rows, 1, rng, "prefill")
    d["pos"] = cp.asarray(np.arange(rows, dtype=np.int32) + (0 if fresh else 10))
    d["slot"] = cp.zeros(rows, cp.int32)
    fns = GD.launches(op, d, rows, DevW(w), qw=qw, pipe=True)
    t = time_graph(fns * 3) / 3
    sb = host["st"].nbytes * (1 if fresh else 2)
    io_b = host["qkv"].nbytes + host["a"].nbytes + host["b"].nbytes + host["out"].nbytes
    upd = rows * QWEN["v_heads"] * QWEN["k_dim"] * QWEN["v_dim"]
    return {"rows": rows, "qw": qw, "from_position_0": fresh, "us": t * 1e6, "us_per_token": t * 1e6 / rows,
            "all_GBps": (sb + io_b) / t / 1e9, "pct_copy": 100 * (sb + io_b) / t / bw,
            "state_updates_per_s": upd / t}


def _capture(fns, s):
    with s:
        for f in fns:                        # eager once (compiles, warms)
            f()
        s.synchronize()
        s.begin_capture()
        try:
            for f in fns:
                f()
        finally:
            g = s.end_capture()
    return g


def bench_delta_prefill_ab(rows, rng, fresh: bool, reps: int = 7, check_rows: int = 512) -> dict:
    """gated_delta prefill, the token-by-token path (old) against the chunked one (new), `rows` rows of
    one slot: first both checked against the NumPy op on `check_rows` rows, then each captured into a
    graph (3 calls) and the two replayed alternately, reps times each; medians per call."""
    import cupy as cp
    from bloomery.runtime.cuda import gated_delta as GD
    from bloomery.runtime.ops import IMPL
    res = {"rows": rows, "from_position_0": fresh}
    for name, chunked in (("old", False), ("new", True)):
        op, w, host, d = delta_setup(check_rows, 1, rng, "prefill")
        host["pos"] = np.arange(check_rows, dtype=np.int32) + (0 if fresh else 10)
        host["slot"] = np.zeros(check_rows, np.int32)
        d["pos"], d["slot"] = cp.asarray(host["pos"]), cp.asarray(host["slot"])
        for f in GD.launches(op, d, check_rows, DevW(w), pipe=True, chunked=chunked):
            f()
        cp.cuda.Device().synchronize()
        IMPL["gated_delta"].run(op, host, w)
        res[f"rel_{name}"] = (rel(cp.asnumpy(d["out"]), host["out"]), rel(cp.asnumpy(d["st"]), host["st"]))
    op, w, host, d = delta_setup(rows, 1, rng, "prefill")
    d["pos"] = cp.asarray(np.arange(rows, dtype=np.int32) + (0 if fresh else 10))
    d["slot"] = cp.zeros(rows, cp.int32)
    dw = DevW(w)
    s = cp.cuda.Stream(non_blocking=True)
    graphs = {name: _capture(GD.launches(op, d, rows, dw, pipe=True, chunked=chunked) * 3, s)
              for name, chunked in (("old", False), ("new", True))}
    ts = {"old": [], "new": []}
    for _ in range(reps):
        for name in ("old", "new"):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            graphs[name].launch(s)
            e1.record(s)
            e1.synchronize()
            ts[name].append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 3)
    for name in ("old", "new"):
        res[f"us_{name}"] = float(np.median(ts[name])) * 1e6
    res["speedup"] = res["us_old"] / res["us_new"]
    return res


def bench_conv(rows, slots, bw, rng) -> dict:
    import cupy as cp
    from bloomery.runtime.cuda import causal_conv1d as CC
    from bloomery.runtime.ops import IMPL
    C = 2 * QWEN["k_heads"] * QWEN["k_dim"] + QWEN["v_heads"] * QWEN["v_dim"]
    op = {"op": "causal_conv1d", "x": "x", "pos": "pos", "slot": "slot", "state": "st", "out": "x", "weight": "cw",
          "kernel": CONV_K}
    w = {"cw": rng.standard_normal((C, 1, CONV_K)).astype(np.float32)}
    pos = np.arange(rows, dtype=np.int32) + 5 if slots == 1 else np.full(rows, 5, np.int32)
    slot = np.zeros(rows, np.int32) if slots == 1 else np.arange(rows, dtype=np.int32)
    host = {"x": rng.standard_normal((rows, C)).astype(np.float32), "pos": pos, "slot": slot,
            "st": rng.standard_normal((slots, CONV_K - 1, C)).astype(np.float32)}
    d = {k: cp.asarray(v) for k, v in host.items()}
    dw = DevW(w)
    for f in CC.launches(op, d, rows, dw):
        f()
    cp.cuda.Device().synchronize()
    IMPL["causal_conv1d"].run(op, host, w)
    err = (rel(cp.asnumpy(d["x"]), host["x"]), rel(cp.asnumpy(d["st"]), host["st"]))
    copies = max(2, min(400, -(-4 * L2 // (2 * host["x"].nbytes + host["st"].nbytes))))
    xs = [cp.asarray(host["x"]) for _ in range(copies)]
    fns = []
    for x in xs:
        fns += CC.launches(op, {**d, "x": x}, rows, dw)
    t = time_graph(fns) / len(fns)
    b = 2 * host["x"].nbytes + 2 * host["st"].nbytes + w["cw"].nbytes
    return {"rows": rows, "slots": slots, "us": t * 1e6, "all_GBps": b / t / 1e9, "pct_copy": 100 * b / t / bw,
            "rel_out": err[0], "rel_state": err[1]}


def prefill_ab(rows, rng, res) -> int:
    """The old-vs-chunked table (bench_delta_prefill_ab, from position 0 and continuing); failures."""
    fails = 0
    a = argparse.Namespace(rows=rows)
    log(f"\ngated_delta prefill, token by token (old) vs chunked (new), {a.rows} rows, one slot, alternating "
        "graph replays (3 calls each), medians; rel L2 (out, state) against the NumPy op at 512 rows")
    log("| from | old us | new us | speedup | rel old | rel new |\n|---|---|---|---|---|---|")
    res["prefill_ab"] = []
    for fresh in (True, False):
        r = bench_delta_prefill_ab(a.rows, rng, fresh)
        res["prefill_ab"].append(r)
        ok = all(x <= 1e-5 for x in r["rel_old"] + r["rel_new"])
        fails += not ok
        log(f"| {'position 0' if fresh else 'continuing'} | {r['us_old']:.1f} | {r['us_new']:.1f} | "
            f"{r['speedup']:.2f}x | {r['rel_old'][0]:.1e} / {r['rel_old'][1]:.1e} | "
            f"{r['rel_new'][0]:.1e} / {r['rel_new'][1]:.1e} |" + ("" if ok else "  FAIL (> 1e-5)"))
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write results.json here")
    ap.add_argument("--quick", action="store_true", help="the default configurations only, no sweep")
    ap.add_argument("--nvcc", action="store_true", help="compile the .cu files with nvcc and print ptxas reports")
    ap.add_argument("--rows", type=int, default=4096, help="prefill rows (default 4096)")
    ap.add_argument("--ab", action="store_true", help="only gated_delta prefill old vs chunked (checked, then timed)")
    a = ap.parse_args(argv)
    if a.nvcc:
        return 1 if nvcc_report() else 0
    import cupy as cp
    from bloomery.runtime.cuda import gated_delta as GD
    from bloomery.runtime.cuda.bandwidth import copy_bandwidth
    rng = np.random.default_rng(0)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    bw = copy_bandwidth()
    log(f"device {dev}; copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    qws = [GD.QW_OF_MODE["decode"]] if a.quick else [c[1] for c in GD.configs(QWEN["k_dim"], QWEN["v_dim"])]
    pqws = [GD.QW_OF_MODE["prefill"]] if a.quick else [c[1] for c in GD.configs(QWEN["k_dim"], QWEN["v_dim"], True)]
    res = {"device": dev, "copy_Bps": bw, "check": {}, "decode": [], "prefill": [], "conv": []}
    fails = 0
    if a.ab:
        fails += prefill_ab(a.rows, rng, res)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "bench_hybrid.json").write_text(json.dumps(res, indent=1, default=str))
        log(f"\n{fails} check failure(s)")
        return 1 if fails else 0
    for qw, pipe in [(q, False) for q in qws] + [(q, True) for q in pqws]:
        c = check_delta(qw, pipe, rng)
        res["check"][f"{qw}{'p' if pipe else ''}"] = c
        ok = all(o <= 1e-5 and s <= 1e-5 for o, s in c.values())
        fails += not ok
        log(f"check gated_delta {4 * qw} cols/warp{' pipelined' if pipe else ''}: "
            + ", ".join(f"{m} out {o:.2e} state {s:.2e}" for m, (o, s) in c.items()) + ("" if ok else "  FAIL (> 1e-5)"))
    log("\ngated_delta decode (Qwen3-Next dims; state 2 MiB a slot; bytes: state read + write, + q/k/v/a/b/out)")
    log("| batch | cols/warp | us | state GB/s | all GB/s | % copy |\n|---|---|---|---|---|---|")
    for batch in (1, 8):
        for qw in qws:
            r = bench_delta_decode(batch, qw, bw, rng)
            res["decode"].append(r)
            log(f"| {batch} | {r['cols_per_warp']} | {r['us']:.2f} | {r['state_GBps']:.0f} | {r['all_GBps']:.0f} | "
                f"{r['pct_copy']:.1f} |")
    log(f"\ngated_delta prefill ({a.rows} rows, one slot; the recurrent form, token by token)")
    log("| from | cols/warp | us | us/token | all GB/s | % copy | state updates/s |\n|---|---|---|---|---|---|---|")
    for fresh in (True, False):
        for qw in pqws:
            r = bench_delta_prefill(a.rows, qw, bw, rng, fresh)
            res["prefill"].append(r)
            log(f"| {'position 0' if fresh else 'continuing'} | {4 * qw} | {r['us']:.1f} | {r['us_per_token']:.3f} | "
                f"{r['all_GBps']:.0f} | {r['pct_copy']:.1f} | {r['state_updates_per_s']:.3g} |")
    fails += prefill_ab(a.rows, rng, res)
    log("\ncausal_conv1d (8192 channels, kernel 4, in place; bytes: x read + out written + state read + written)")
    log("| rows | slots | us | GB/s | % copy | rel out | rel state |\n|---|---|---|---|---|---|---|")
    for rows, slots in ((1, 1), (8, 8), (a.rows, 1)):
        r = bench_conv(rows, slots, bw, rng)
        res["conv"].append(r)
        fails += not (r["rel_out"] <= 1e-6 and r["rel_state"] == 0)
        log(f"| {rows} | {slots} | {r['us']:.2f} | {r['all_GBps']:.0f} | {r['pct_copy']:.1f} | {r['rel_out']:.1e} | "
            f"{r['rel_state']:.1e} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_hybrid.json").write_text(json.dumps(res, indent=1, default=str))
    log(f"\n{fails} check failure(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
