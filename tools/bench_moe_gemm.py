"""The routed experts of a prompt chunk on the GPU: the grouped GEMM (runtime/cuda/moe_gemm.cu) against the
per-pair expert GEMV it replaces in prefill, on a MoE shape's stacked matrices (random GGML NVFP4 blocks made
on the device), checked against each other and timed in the same run (alternating rounds, medians).

    python -m bloomery.tools.bench_moe_gemm [--tokens 512 4096] [--rounds 3] [--parts 2 1] [--bms 64 128]
(each with one or two shared-memory stages; the activations split into their bf16 parts by moe_gemm.split, timed)

Default shape: Qwen3-30B-A3B's experts (128 experts, top 8, hidden 2048, expert intermediate 768): gate / up
[128, 768, 2048] read per token (xdiv 8), down [128, 2048, 768] per pair. TFLOP/s counts the useful work
(2 x pairs x out x in); "% bf16" is against cuBLAS's BF16 GEMM rate measured in the same run."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SHAPES = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768)}


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[512, 4096])
    ap.add_argument("--parts", nargs="+", type=int, default=[2, 1], help="activation bf16 parts (2: bf16x2, 1: bf16)")
    ap.add_argument("--bms", nargs="+", type=int, default=[64, 128], help="pairs a row tile (moe_gemm.BMS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    from bloomery.runtime.cuda.bandwidth import bf16_gemm_rate
    tc = bf16_gemm_rate()
    print(f"bf16 tensor-core rate (cuBLAS 8192^3, median of 10): {tc / 1e12:.1f} TFLOP/s", flush=True)
    out = []
    for shape in a.shapes:
        for n in a.tokens:
            rs = bench(shape, n, a.parts, a.bms, a.rounds)
            for r in rs:
                print(json.dumps(r), flush=True)
            out += rs
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
