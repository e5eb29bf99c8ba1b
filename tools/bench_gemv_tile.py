"""Check and time the NVFP4 tile GEMV (runtime/cuda/gemv_tile.cu: GGML NVFP4 repacked at load into a
tensor-core layout, 1..16 activation rows a launch) against the kernels the executor launches today on
the GPU: the CUDA-core GEMV (launches of up to 8 rows) and the tensor-core GEMV over GGML blocks
(gemv_tc.cu).

    python -m bloomery.tools.bench_gemv_tile [--out DIR] [--rows 1 2 4 8 16] [--variants] [--rounds 3]

Checks first, every one must pass before a time is printed: the GPU repack equals the NumPy twin
(gemv_tile.repack) byte for byte; every Llama-3-8B shape against float64 (y poisoned; 16, 9, 3 rows
accumulating, 1 row); each batch row of a 16-row launch bitwise equal to that row launched alone (what
the verify program relies on); q/k/v in one launch with the RMSNorm folded in, and gate/up with the
norm and SwiGLU, against float64.

Timing as tools/bench_kernels.py (a CUDA graph of launches rotating over copies of the weight that
cannot sit in L2, median of 5 replays), the kernels alternating within each of --rounds rounds, the
median round kept. GB/s counts the weight bytes once per launch of all rows; % copy is against the
copy bandwidth measured in the same run. Last, the Llama-3-8B decode step's linears (32 layers of
q,k,v,o,gate,up,down + the head) in ms by rows: today's kernels one matrix a launch (the faster of
CUDA cores and gemv_tc per shape), the tile kernel one matrix a launch, and the tile kernel as a layer
launches it (q/k/v with the norm, o, gate/up with the norm and SwiGLU, down).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

from bloomery.runtime.cuda import gemv as G
from bloomery.runtime.cuda import gemv_tile as T
from bloomery.runtime.cuda.bandwidth import copy_bandwidth
from bloomery.tools.bench_gemv_tc import STACK, Cores
from bloomery.tools.bench_kernels import LLAMA, copies, log, make_arrays, ref_decode, time_calls

VARIANTS = [T.TileConfig(P=16), T.TileConfig(min_steps=16), T.TileConfig(P=16, min_steps=32),
            T.TileConfig(warps=1056), T.TileConfig(W=8), T.TileConfig(max_steps=32)]


class Scratch:
    """One part / sem pair for every launch of the run (launches follow each other on one stream)."""
    def __init__(self):
        self.part = cp.zeros(48 << 20, cp.float32)
        self.sem = cp.zeros(1 << 16, cp.int32)

    def bind(self, lins, x, ys, nb, cfg=T.TileConfig(), **kw):
        pf, si = T.need(lins, nb, kw.get("pair", False), cfg)
        assert pf <= self.part.size and si <= self.sem.size, (pf, si)
        return T.bind(lins, x, ys, nb, part=self.part, sem=self.sem, pdl=True, cfg=cfg, **kw)


def alternate(variants: dict, est_s, rounds: int) -> dict:
    """{name: median over rounds of time_calls}, the variants in a rotated order each round."""
    names, got = list(variants), {k: [] for k in variants}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            got[k].append(time_calls(variants[k], est_s)[0])
    return {k: float(np.median(v)) for k, v in got.items()}


def rel_err(y, ref, bound):
    err = cp.abs(y.astype(cp.float64) - ref)
    rel = float(cp.linalg.norm(err) / max(float(cp.linalg.norm(ref)), 1e-300))
    worst = float((err / (bound + 1e-300)).max())
    return rel, worst, bool(cp.isfinite(y).all())


def check_repack(failures):
    for out, inn in ((100, 192), (200, 512), (1024, 4096)):
        a = make_arrays("nvfp4", out, inn)
        lin = G.Linear("nvfp4", (out, inn), a)
        wt, st = T.layout(lin)
        w_np, s_np = T.repack(cp.asnumpy(a["weight"]), out, inn)
        ok = cp.asnumpy(wt).tobytes() == w_np.tobytes() and cp.asnumpy(st).tobytes() == s_np.tobytes()
        log(f"repack {out}x{inn}: GPU == NumPy twin: {ok}")
        if not ok:
            failures.append(f"repack {out}x{inn}: the GPU layout differs from gemv_tile.repack")


def check_single(lin, W64, sc, failures, tol=2e-5):
    for nb, acc in ((16, False), (9, False), (3, True), (1, False)):
        x = cp.random.standard_normal((nb, lin.inn), dtype=cp.float32)
        y0 = cp.random.standard_normal((nb, lin.out), dtype=cp.float32)
        y = y0.copy() if acc else cp.full((nb, lin.out), cp.nan, cp.float32)
        sc.bind([lin], x, [y], nb, accumulate=acc)()
        cp.cuda.runtime.deviceSynchronize()
        x64 = x.astype(cp.float64)
        ref = x64 @ W64.T + (y0.astype(cp.float64) if acc else 0)
        bound = cp.abs(x64) @ cp.abs(W64).T + (cp.abs(y0.astype(cp.float64)) if acc else 0)
        rel, worst, fin = rel_err(y, ref, bound)
        if not (fin and rel <= tol and worst <= tol):
            failures.append(f"{lin.out}x{lin.inn} nb={nb} acc={acc}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
    # a row of a 16-row launch is that row launched alone, bit for bit
    x = cp.random.standard_normal((16, lin.inn), dtype=cp.float32)
    y = cp.zeros((16, lin.out), cp.float32)
    sc.bind([lin], x, [y], 16)()
    for b in (0, 5, 8, 15):
        y1 = cp.zeros((1, lin.out), cp.float32)
        sc.bind([lin], x[b:b + 1], [y1], 1)()
        if not bool((y1[0].view(cp.uint32) == y[b].view(cp.uint32)).all()):
            failures.append(f"{lin.out}x{lin.inn}: row {b} of a 16-row launch differs from the row alone")


def check_groups(failures, tol=2e-5, sc=None, rows=(16, 5, 1)):
    """q/k/v with the norm; gate/up with the norm and SwiGLU; float64 references. sc: whose bind(lins, x, ys,
    nb, **kw) launches them (this tool's Scratch by default; tools/bench_gemv_row.py passes its own)."""
    sc = sc or Scratch()
    inn, eps = 4096, 1e-5
    nw = cp.random.uniform(0.5, 1.5, inn).astype(cp.float32)
    for shapes, pair in (([4096, 1024, 1024], False), ([14336, 14336], True)):
        arrs = [make_arrays("nvfp4", o, inn) for o in shapes]
        lins = [G.Linear("nvfp4", (o, inn), a) for o, a in zip(shapes, arrs)]
        W64 = [ref_decode("nvfp4", a, o, inn) for o, a in zip(shapes, arrs)]
        for nb in rows:
            x = (3.0 * cp.random.standard_normal((nb, inn))).astype(cp.float32)
            ys = [cp.full((nb, shapes[0]), cp.nan, cp.float32)] if pair else \
                [cp.full((nb, o), cp.nan, cp.float32) for o in shapes]
            sc.bind(lins, x, ys, nb, norm_weight=nw, eps=eps, pair=pair)()
            cp.cuda.runtime.deviceSynchronize()
            x64 = x.astype(cp.float64)
            xn = x64 / cp.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * nw.astype(cp.float64)
            outs = [xn @ W.T for W in W64]
            bounds = [cp.abs(xn) @ cp.abs(W).T for W in W64]
            if pair:
                g, u = outs
                ref = g / (1 + cp.exp(-g)) * u
                # the error of silu(g) u from g's and u's: |d(silu g)/dg| <= 1.1
                bound = 1.1 * bounds[0] * cp.abs(u) + cp.abs(g / (1 + cp.exp(-g))) * bounds[1]
                checks = [(ys[0], ref, bound)]
            else:
                checks = list(zip(ys, outs, bounds))
            for m, (y, ref, bound) in enumerate(checks):
                rel, worst, fin = rel_err(y, ref, bound)
                if not (fin and rel <= tol and worst <= tol):
                    failures.append(f"{'pair' if pair else 'qkv'} norm member {m} nb={nb}: rel {rel:.2e} "
                                    f"worst {worst:.2e} finite {fin}")
        del W64
        cp.get_default_memory_pool().free_all_blocks()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--variants", action="store_true", help="also time the TileConfig variants (VARIANTS)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    failures: list = []
    check_repack(failures)
    check_groups(failures)
    sc = Scratch()
    tcp, tcs = cp.zeros(64 << 20, cp.float32), cp.zeros(1 << 16, cp.int32)
    cfgs = [T.TileConfig()] + (VARIANTS if args.variants else [])
    res = []
    for out, inn in LLAMA:
        a = make_arrays("nvfp4", out, inn)
        lin = G.Linear("nvfp4", (out, inn), a, pdl=True)
        W64 = ref_decode("nvfp4", a, out, inn)
        check_single(lin, W64, sc, failures)
        del W64
        cp.get_default_memory_pool().free_all_blocks()
        log(f"{out}x{inn}: checked ({len(failures)} failures so far)")
        bufs = copies(a, lin.nbytes)
        lins = [G.Linear("nvfp4", (out, inn), b, pdl=True) for b in bufs]
        for L in lins:
            T.layout(L)
        for nb in args.rows:
            x = cp.random.standard_normal((nb, inn), dtype=cp.float32)
            y = cp.zeros((nb, out), cp.float32)
            var = {"cores": [lambda L=L: Cores(L).launch(x, y, nb) for L in lins],
                   "tc": [lambda L=L: L.launch_tc(x, y, nb, False, tcp, tcs) for L in lins]}
            for c in cfgs:
                var[repr(c)] = [sc.bind([L], x, [y], nb, cfg=c) for L in lins]
            t = alternate(var, lin.nbytes / 3.5e12 + 3e-6, args.rounds)
            rec = {"out": out, "in": inn, "rows": nb, "bytes": lin.nbytes, "us": {k: v * 1e6 for k, v in t.items()}}
            res.append(rec)
            best = min((v, k) for k, v in rec["us"].items() if k not in ("cores", "tc"))
            log(f"{out:6d}x{inn:<6d} rows {nb:2d}: cores {rec['us']['cores']:8.2f}  tc {rec['us']['tc']:8.2f}  "
                f"tile {rec['us'][repr(cfgs[0])]:8.2f}  best tile {best[0]:8.2f} {best[1]}")
        del bufs, lins
        cp.get_default_memory_pool().free_all_blocks()
    fused = time_layer(sc, args.rows, args.rounds)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gemv_tile.json").write_text(json.dumps(
        {"copy_bw": bw, "results": res, "layer": fused, "failures": failures}, indent=1))
    log(f"\nchecks: {len(failures)} failures")
    for f in failures:
        log("  FAIL", f)
    d = repr(cfgs[0])
    log(f"\n## GGML NVFP4 GEMV by rows a launch (copy {bw / 1e12:.2f} TB/s; GB/s = weight bytes once / time)")
    log("| out x in | rows | CUDA cores us | gemv_tc us | tile us | tile GB/s | tile % copy | x today's best |")
    log("|---|---|---|---|---|---|---|---|")
    for r in res:
        u = r["us"]
        today = min(u["cores"], u["tc"])
        log(f"| {r['out']}x{r['in']} | {r['rows']} | {u['cores']:.2f} | {u['tc']:.2f} | {u[d]:.2f} | "
            f"{r['bytes'] / u[d] / 1e3:.0f} | {100 * r['bytes'] / (u[d] * 1e-6) / bw:.1f} | {today / u[d]:.2f}x |")
    if args.variants:
        log("\n## tile variants, us (median of rounds)")
        log("| out x in | rows | " + " | ".join(repr(c).replace("TileConfig", "") for c in cfgs) + " |")
        log("|---|---|" + "---|" * len(cfgs))
        for r in res:
            log(f"| {r['out']}x{r['in']} | {r['rows']} | " + " | ".join(f"{r['us'][repr(c)]:.2f}" for c in cfgs) + " |")
    log("\n## Llama-3-8B decode step, linears only (ms), by rows (slots)")
    log("| rows | today (best of cores / tc a matrix) | tile a matrix | tile as a layer launches it | "
        "today / tile layer | tile layer / 1 row |")
    log("|---|---|---|---|---|---|")
    base = None
    for nb in args.rows:
        rs = [r for r in res if r["rows"] == nb]
        today = sum(STACK[(r["out"], r["in"])] * min(r["us"]["cores"], r["us"]["tc"]) for r in rs) / 1e3
        tile = sum(STACK[(r["out"], r["in"])] * r["us"][d] for r in rs) / 1e3
        head = [r for r in rs if r["out"] == 128256][0]["us"][d]
        lay = (32 * fused[str(nb)] * 1e6 + head) / 1e3
        base = base or lay
        log(f"| {nb} | {today:.3f} | {tile:.3f} | {lay:.3f} | {today / lay:.2f}x | {lay / base:.2f} |")
    return 1 if failures else 0


def time_layer(sc, rows, rounds) -> dict:
    """Seconds of one Llama-3-8B layer's linears as the tile kernel launches them: q/k/v + norm, o (+= the
    residual), gate/up + norm + SwiGLU, down (+= the residual); copies of the layer rotating."""
    inn, ff = 4096, 14336
    shapes = [(4096, inn), (1024, inn), (1024, inn), (4096, inn), (ff, inn), (ff, inn), (4096, ff)]
    nbytes = sum(o * i // 64 * 36 for o, i in shapes)
    ncopy = max(2, int(np.ceil(4 * 60e6 / nbytes)))
    layers = []
    for _ in range(ncopy):
        ls = [G.Linear("nvfp4", s, make_arrays("nvfp4", *s), pdl=True) for s in shapes]
        for L in ls:
            T.layout(L)
        layers.append(ls)
    nw = cp.random.uniform(0.5, 1.5, inn).astype(cp.float32)
    out = {}
    for nb in rows:
        x = cp.random.standard_normal((nb, inn), dtype=cp.float32)
        q, k, v, h = (cp.zeros((nb, o), cp.float32) for o in (4096, 1024, 1024, 4096))
        act = cp.zeros((nb, ff), cp.float32)
        calls = []
        for ls in layers:
            steps = [sc.bind(ls[:3], x, [q, k, v], nb, norm_weight=nw, eps=1e-5),
                     sc.bind([ls[3]], q, [h], nb, accumulate=True),
                     sc.bind(ls[4:6], x, [act], nb, norm_weight=nw, eps=1e-5, pair=True),
                     sc.bind([ls[6]], act, [h], nb, accumulate=True)]
            calls.append(lambda steps=steps: [s() for s in steps])
        out[str(nb)] = alternate({"layer": calls}, nbytes / 3.5e12 + 12e-6, rounds)["layer"]
        log(f"layer, rows {nb:2d}: {out[str(nb)] * 1e6:.2f} us ({nbytes / out[str(nb)] / 1e9:.0f} GB/s)")
    return out


if __name__ == "__main__":
    sys.exit(main())
