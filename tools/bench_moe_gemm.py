"""The routed experts of a prompt chunk on the GPU: the grouped GEMM (runtime/cuda/moe_gemm.cu) against the
per-pair expert GEMV it replaces in prefill, on a MoE shape's stacked matrices (random GGML NVFP4 blocks made
on the device), checked against each other and timed in the same run (alternating rounds, medians).

    python -m bloomery.tools.bench_moe_gemm [--tokens 512 4096] [--rounds 3] [--parts 2 1] [--bms 64 128]
(each with one or two shared-memory stages; the activations split into their bf16 parts by moe_gemm.split, timed)

    python -m bloomery.tools.bench_moe_gemm --decode [--tokens 1 4] [--rounds 3] [--sweep]

--decode times a decode step's routed experts instead: the five unfused launches (gate, up, swiglu, down,
combine with the residual add) against the two fused ones (gemv_nvfp4_ggml_pair_e, gemv_nvfp4_ggml_ec) in
their launch shapes, alternating, each launch reading its 8 experts from a different random choice (so
from HBM, not the L2); checks the fused gate / up / SwiGLU bit for bit against the unfused and the fused
output against float64 (the experts decoded by table lookups). GB/s counts the chosen experts' bytes.

Default shape: Qwen3-30B-A3B's experts (128 experts, top 8, hidden 2048, expert intermediate 768): gate / up
[128, 768, 2048] read per token (xdiv 8), down [128, 2048, 768] per pair. TFLOP/s counts the useful work
(2 x pairs x out x in); "% bf16" is against cuBLAS's BF16 GEMM rate measured in the same run."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SHAPES = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768),
          "glm-4.5-air": dict(experts=128, top_k=8, hidden=4096, inter=1408),
          "qwen3-next-80b-a3b": dict(experts=512, top_k=10, hidden=2048, inter=512)}


def random_nvfp4(E: int, out: int, inn: int, rng):
    """Stacked GGML NVFP4 arrays on the device: random nibbles, E4M3 scales within 2^-4 .. 2^2, scale_2 > 0."""
    import cupy as cp
    nblk = inn // 64
    w = rng.integers(0, 256, size=(E, out, nblk, 36), dtype=cp.int32).astype(cp.uint8)
    w[..., :4] = rng.integers(0x18, 0x48, size=(E, out, nblk, 4), dtype=cp.int32).astype(cp.uint8)
    s2 = (rng.random(E, dtype=cp.float32) * 0.01 + 0.001).astype(cp.float32)
    return {"weight": w.reshape(E, out, nblk * 36), "scale_2": s2}


def bench(shape: str, tokens: int, parts_list, bms, rounds: int, reps: int = 5,
          stages=(1, 2)) -> list:
    """stages: the shared-memory stages of each grouped variant timed."""
    import cupy as cp

    from bloomery.runtime.cuda import gemv as G
    from bloomery.runtime.cuda import moe_gemm as MG
    sh = SHAPES[shape]
    E, k, hid, inter = sh["experts"], sh["top_k"], sh["hidden"], sh["inter"]
    rng = cp.random.default_rng(tokens)
    pairs = tokens * k
    ids = cp.asarray(np.stack([np.random.default_rng(tokens + i).permutation(E)[:k] for i in range(tokens)])
                     .astype(np.int32).reshape(-1))
    rows = []
    for name, out, inn, xdiv in (("gate/up", inter, hid, k), ("down", hid, inter, 1)):
        lin = G.Linear("nvfp4", (E, out, inn), random_nvfp4(E, out, inn, rng))
        x = rng.standard_normal((pairs // xdiv, inn), dtype=cp.float32)
        steps, ys = {}, {}
        ys["gemv"] = cp.zeros((pairs, out), cp.float32)
        steps["gemv"] = (lambda lin=lin, x=x, y=ys["gemv"], xdiv=xdiv: lin.launch_experts(x, y, ids, pairs, xdiv))
        for p in parts_list:
            xs = cp.zeros((p, *x.shape), cp.uint16)
            sp = MG.split(x, xs)
            for bm in bms:
                for st in stages:
                    f = f"grouped x{p} bm{bm} st{st}" + (" (executor)" if bm == MG.BM and st == MG.STAGES else "")
                    route = MG.Route(pairs, E, bm=bm)
                    ys[f] = cp.zeros((pairs, out), cp.float32)
                    r, g = route.bind(ids), MG.bind(lin, xs, ys[f], route, xdiv, p, stages=st)
                    steps[f] = (lambda r=r, g=g, sp=sp: (r(), sp(), g()))
        for f in steps:
            steps[f]()
        names = list(steps)
        s = cp.cuda.get_current_stream()
        ts = {f: [] for f in names}
        for rnd in range(rounds):
            for f in (names if rnd % 2 == 0 else names[::-1]):
                n = 1 if f == "gemv" else reps
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(s)
                for _ in range(n):
                    steps[f]()
                e1.record(s)
                e1.synchronize()
                ts[f].append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / n)
        ref = ys["gemv"]
        flops = 2.0 * pairs * out * inn
        for f in names:
            t = float(np.median(ts[f]))
            err = None if f == "gemv" else float(cp.linalg.norm(ys[f] - ref) / cp.linalg.norm(ref))
            rows.append({"shape": shape, "matrix": name, "out": out, "in": inn, "tokens": tokens, "pairs": pairs,
                         "form": f, "ms": t * 1e3, "tflops": flops / t / 1e12, "rel_vs_gemv": err,
                         "rounds_ms": [v * 1e3 for v in ts[f]]})
        del lin, x, ys, steps
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def bench_decode(shape: str, tokens: int, rounds: int, sweep: bool = False) -> list:
    """A decode step's routed experts of `tokens` rows: unfused against the fused forms (module docstring)."""
    import cupy as cp

    from bloomery.runtime.cuda import gemv as G
    from bloomery.runtime.cuda import ops as K
    from bloomery.tools.bench_kernels import ref_decode, time_calls
    sh = SHAPES[shape]
    E, k, hid, inter = sh["experts"], sh["top_k"], sh["hidden"], sh["inter"]
    rng = cp.random.default_rng(7)
    pairs = tokens * k
    gate, up = (G.Linear("nvfp4", (E, inter, hid), random_nvfp4(E, inter, hid, rng)) for _ in range(2))
    down = G.Linear("nvfp4", (E, hid, inter), random_nvfp4(E, hid, inter, rng))
    x = rng.standard_normal((tokens, hid), dtype=cp.float32)
    res = rng.standard_normal((tokens, hid), dtype=cp.float32)
    nsets = 64
    hrng = np.random.default_rng(tokens)
    idsets = [cp.asarray(np.stack([hrng.permutation(E)[:k] for _ in range(tokens)]).astype(np.int32).reshape(-1))
              for _ in range(nsets)]
    w = hrng.random((tokens, k)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    wts = cp.asarray(w)
    kk = K.kernels()
    g, u = cp.zeros((pairs, inter), cp.float32), cp.zeros((pairs, inter), cp.float32)
    d, y = cp.zeros((pairs, hid), cp.float32), cp.zeros((tokens, hid), cp.float32)

    def unfused(ids):
        sw, cb = kk["swiglu_k"], kk["moe_combine_k"]
        sg, cg = K.grid1d(g.size), K.grid1d(tokens * hid)
        sargs = (g, u, g, np.int32(g.size))
        cargs = (d, wts, y, np.int32(tokens), np.int32(k), np.int32(hid), np.int32(1))

        def run():
            gate.launch_experts(x, g, ids, pairs, k)
            up.launch_experts(x, u, ids, pairs, k)
            sw(sg, (256,), sargs)
            down.launch_experts(g, d, ids, pairs, 1)
            cb(cg, (256,), cargs)
        return run

    def fused(ids, R, cfg, pf=False):
        a = gate.bind_pair_experts(up, x, g, ids, pairs, k, R=R, prefetch=down if pf else None)
        b = down.bind_combine_experts(g, wts, y, ids, tokens, k, add=True, cfg=cfg)
        return lambda: (a(), b())

    pair_rs = (2, 4, 8) if sweep else (G.PAIR_E_R,)
    ec_cfgs = [G.EC_CONFIG] + ([G.Config(R, T, U, 1) for R, T, U in
                                ((2, 256, 2), (4, 128, 2), (8, 256, 1), (4, 256, 2), (4, 256, 4), (2, 128, 4))
                                if (R, T, U) != (G.EC_CONFIG.R, G.EC_CONFIG.T, G.EC_CONFIG.U)] if sweep else [])
    forms = {"unfused": lambda ids: unfused(ids)}
    for R in pair_rs:
        for c in ec_cfgs:
            tag = f"fused pair R{R}, ec R{c.R} T{c.T} U{c.U}"
            if R == G.PAIR_E_R and c == G.EC_CONFIG:
                tag += " (executor)"
            forms[tag] = (lambda ids, R=R, c=c: fused(ids, R, c))
    # the executor's forms with the down matrices brought into the L2 by the pair launch (BLOOMERY_MOE_PREFETCH)
    forms[f"fused pair R{G.PAIR_E_R}, ec R{G.EC_CONFIG.R} T{G.EC_CONFIG.T} U{G.EC_CONFIG.U}, down prefetched"] = \
        lambda ids: fused(ids, G.PAIR_E_R, G.EC_CONFIG, pf=True)
    # checks on the first id set: the pair bit for bit, the output against float64
    ids0 = idsets[0]
    y[...] = res
    unfused(ids0)()
    g_ref, y_unf = g.copy(), y.copy()
    hid_ids = cp.asnumpy(ids0)
    x64 = x.astype(cp.float64)
    ref = res.astype(cp.float64)
    for p in range(pairs):
        e, t = int(hid_ids[p]), p // k
        sl = lambda lin, e=e: {"weight": lin.w[e], "scale_2": lin.sc[e:e + 1]}     # noqa: E731
        gg = ref_decode("nvfp4", sl(gate), inter, hid) @ x64[t]
        uu = ref_decode("nvfp4", sl(up), inter, hid) @ x64[t]
        h = gg / (1 + cp.exp(-gg)) * uu
        ref[t] += float(w[t, p % k]) * (ref_decode("nvfp4", sl(down), hid, inter) @ h)
    scale = float(cp.linalg.norm(ref - res.astype(cp.float64)))
    checks = {"unfused": float(cp.linalg.norm(y_unf - ref)) / scale}
    if checks["unfused"] > 1e-5:
        raise SystemExit(f"{shape} {tokens} rows, unfused: relative L2 {checks['unfused']:.2e} against float64 "
                         "(the reference or the unfused launches are wrong)")
    for tag, mk in forms.items():
        if tag == "unfused":
            continue
        y[...] = res
        mk(ids0)()
        if not bool((g == g_ref).all()):
            raise SystemExit(f"{shape} {tokens} rows, {tag}: the fused gate / up / SwiGLU differs from the unfused")
        checks[tag] = float(cp.linalg.norm(y - ref)) / scale
        if checks[tag] > 1e-5:
            raise SystemExit(f"{shape} {tokens} rows, {tag}: relative L2 {checks[tag]:.2e} against float64")
    calls = {tag: [mk(ids) for ids in idsets] for tag, mk in forms.items()}
    nbytes = pairs * (gate.expert_nbytes + up.expert_nbytes + down.expert_nbytes)
    ts = {tag: [] for tag in forms}
    names = list(forms)
    for rnd in range(rounds):
        for tag in (names if rnd % 2 == 0 else names[::-1]):
            ts[tag].append(time_calls(calls[tag], nbytes / 2e12 + 10e-6, n=256, reps=5)[0])
    rows = []
    for tag in names:
        t = float(np.median(ts[tag]))
        rows.append({"shape": shape, "tokens": tokens, "form": tag, "us": t * 1e6, "gb_s": nbytes / t / 1e9,
                     "rel_l2_vs_f64": checks[tag], "rounds_us": [v * 1e6 for v in ts[tag]], "bytes": nbytes})
    del gate, up, down, calls
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def collect(a, fn, tokens) -> list:
    """fn(shape, rows) over --shapes and --tokens (default `tokens`), each row printed as JSON as it comes."""
    out = []
    for shape in a.shapes:
        for n in a.tokens or tokens:
            rs = fn(shape, n)
            for r in rs:
                print(json.dumps(r), flush=True)
            out += rs
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help="rows (default 512 4096; with --decode 1 4)")
    ap.add_argument("--parts", nargs="+", type=int, default=[2, 1], help="activation bf16 parts (2: bf16x2, 1: bf16)")
    ap.add_argument("--bms", nargs="+", type=int, default=[64, 128], help="pairs a row tile (moe_gemm.BMS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--decode", action="store_true", help="time a decode step's routed experts (--tokens: rows)")
    ap.add_argument("--sweep", action="store_true", help="--decode: also the other launch shapes of the two kernels")
    a = ap.parse_args(argv)
    if a.decode:
        from bloomery.runtime.cuda.bandwidth import copy_bandwidth
        bw = copy_bandwidth()
        print(f"copy bandwidth (D2D): {bw / 1e12:.3f} TB/s", flush=True)
        out = collect(a, lambda shape, n: bench_decode(shape, n, a.rounds, a.sweep), [1, 4])
        print("\n| shape | rows | form | us | GB/s | % copy | x unfused | rel L2 vs float64 |")
        print("|---|---|---|---|---|---|---|---|")
        for r in out:
            base = next(x["us"] for x in out if x["form"] == "unfused" and x["tokens"] == r["tokens"]
                        and x["shape"] == r["shape"])
            print(f"| {r['shape']} | {r['tokens']} | {r['form']} | {r['us']:.2f} | {r['gb_s']:.0f} | "
                  f"{100 * r['gb_s'] * 1e9 / bw:.1f} | {base / r['us']:.2f} | {r['rel_l2_vs_f64']:.1e} |")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"copy_bw": bw, "rows": out}, f, indent=1)
        return 0
    from bloomery.runtime.cuda.bandwidth import bf16_gemm_rate
    tc = bf16_gemm_rate()
    print(f"bf16 tensor-core rate (cuBLAS 8192^3, median of 10): {tc / 1e12:.1f} TFLOP/s", flush=True)
    out = collect(a, lambda shape, n: bench(shape, n, a.parts, a.bms, a.rounds), [512, 4096])
    print("\n| shape | matrix (experts x out x in) | tokens | form | ms | TFLOP/s | % bf16 | x gemv | rel L2 vs gemv |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        base = next(x["ms"] for x in out if x["form"] == "gemv" and x["matrix"] == r["matrix"]
                    and x["tokens"] == r["tokens"] and x["shape"] == r["shape"])
        e = f"{r['rel_vs_gemv']:.1e}" if r["rel_vs_gemv"] is not None else "-"
        print(f"| {r['shape']} | {r['matrix']} ({r['out']}x{r['in']}) | {r['tokens']} | {r['form']} | {r['ms']:.3f} | "
              f"{r['tflops']:.1f} | {100 * r['tflops'] * 1e12 / tc:.1f} | {base / r['ms']:.1f} | {e} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bf16_tflops": tc / 1e12, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
