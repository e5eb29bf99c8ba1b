"""Check and time the one-row NVFP4 GEMV on the tensor cores, weights as the mma's A operand
(runtime/cuda/gemv_row.cu: GGML NVFP4 repacked at load), against the one-row kernel the executor launches
today (the CUDA-core GGML kernel, gemv.TUNED's configs), and both kernels' loads-only probes (the same loads,
one XOR a word instead of the arithmetic: how fast each access pattern alone goes).

    python -m bloomery.tools.bench_gemv_row [--out DIR] [--rounds 3] [--variants] [--shapes 4096x4096 ...]

Checks first, every one must pass before a time counts: the GPU repack equals the NumPy twin
(gemv_row.repack) byte for byte; every shape against float64 (y poisoned; x of unit scale, x times 1e3 and
times 1e-3, accumulate), rel-L2 and per element against 2e-5 of |x| @ |W|^T; two launches bit for bit equal;
each row of a 3- and an 8-row launch bit for bit that row launched alone; q/k/v with the RMSNorm folded in
and gate/up with the norm and SwiGLU against float64.
Timing as tools/bench_kernels.py (a CUDA graph of launches rotating over weight copies that cannot sit in L2,
median of 5 replays), every launch with programmatic dependent launch, the variants alternating within each
of --rounds rounds, the median round kept. % copy is against the copy bandwidth measured in the same run.
Last, the Llama-3-8B decode step's linears (32 layers of q, k, v, o, gate, up, down one matrix a launch,
and an NVFP4 head) in ms for each variant.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cupy as cp
import numpy as np

from bloomery.runtime.cuda import gemv as G
from bloomery.runtime.cuda import gemv_row as R
from bloomery.runtime.cuda.bandwidth import copy_bandwidth
from bloomery.tools.bench_gemv_tc import STACK
from bloomery.tools.bench_gemv_tile import alternate, check_groups, rel_err
from bloomery.tools.bench_kernels import LLAMA, copies, log, make_arrays, ref_decode

PROBE = ("BLOOMERY_PROBE_LOADS",)
CLAMP = ("BLOOMERY_ROW_CLAMP",)
VARIANTS = [R.RowConfig(U=8), R.RowConfig(W=8), R.RowConfig(W=8, U=8), R.RowConfig(W=2, U=8),
            R.RowConfig(warps=1056), R.RowConfig(warps=4224), R.RowConfig(min_groups=16)]


class Scratch:
    """One part / sem pair for every launch of the run (launches follow each other on one stream)."""
    def __init__(self):
        self.part = cp.zeros(8 << 20, cp.float32)
        self.sem = cp.zeros(1 << 16, cp.int32)

    def bind(self, lins, x, ys, nb=1, cfg=R.RowConfig(), **kw):
        pf, si = R.need([L.out for L in lins], lins[0].inn, nb, kw.get("pair", False), cfg)
        assert pf <= self.part.size and si <= self.sem.size, (pf, si)
        return R.bind(lins, x, ys, nb, part=self.part, sem=self.sem, pdl=True, cfg=cfg, **kw)


def check_repack(failures):
    for out, inn in ((100, 192), (40, 576), (1024, 4096)):
        a = make_arrays("nvfp4", out, inn)
        lin = G.Linear("nvfp4", (out, inn), a)
        wa, sa = R.layout(lin)
        w_np, s_np = R.repack(cp.asnumpy(a["weight"]), out, inn)
        ok = cp.asnumpy(wa).tobytes() == w_np.tobytes() and cp.asnumpy(sa).tobytes() == s_np.tobytes()
        log(f"repack {out}x{inn}: GPU == NumPy twin: {ok}")
        if not ok:
            failures.append(f"repack {out}x{inn}: the GPU layout differs from gemv_row.repack")


def check(lin, W64, sc, cfg, failures, tol=2e-5, defines=()):
    for scale, acc in ((1.0, False), (1e3, False), (1e-3, False), (1.0, True)):
        x = (scale * cp.random.standard_normal((1, lin.inn))).astype(cp.float32)
        y0 = cp.random.standard_normal((1, lin.out), dtype=cp.float32)
        y = y0.copy() if acc else cp.full((1, lin.out), cp.nan, cp.float32)
        sc.bind([lin], x, [y], 1, cfg, accumulate=acc, defines=defines)()
        cp.cuda.runtime.deviceSynchronize()
        x64 = x.astype(cp.float64)
        ref = x64 @ W64.T + (y0.astype(cp.float64) if acc else 0)
        bound = cp.abs(x64) @ cp.abs(W64).T + (cp.abs(y0.astype(cp.float64)) if acc else 0)
        rel, worst, fin = rel_err(y, ref, bound)
        if not (fin and rel <= tol and worst <= tol):
            failures.append(f"{lin.out}x{lin.inn} {cfg} {defines} x*{scale:g} acc={acc}: rel {rel:.2e} worst {worst:.2e} "
                            f"finite {fin}")
        if acc:
            continue
        y2 = cp.full((1, lin.out), cp.nan, cp.float32)
        sc.bind([lin], x, [y2], 1, cfg)()
        if not bool((y2.view(cp.uint32) == y.view(cp.uint32)).all()):
            failures.append(f"{lin.out}x{lin.inn} {cfg}: two launches differ")
    # each row of a 3- and an 8-row launch is that row launched alone, bit for bit (the verify program)
    for nb in ((3, 8) if cfg == R.RowConfig() and not defines else ()):
        x = cp.random.standard_normal((nb, lin.inn), dtype=cp.float32)
        x[1] *= 1e3
        y = cp.full((nb, lin.out), cp.nan, cp.float32)
        sc.bind([lin], x, [y], nb, cfg)()
        for b in range(nb):
            y1 = cp.full((1, lin.out), cp.nan, cp.float32)
            sc.bind([lin], x[b:b + 1], [y1], 1, cfg)()
            if not bool((y1[0].view(cp.uint32) == y[b].view(cp.uint32)).all()):
                failures.append(f"{lin.out}x{lin.inn} {cfg}: row {b} of a {nb}-row launch differs from the row alone")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", action="store_true", help="also time the RowConfig variants (VARIANTS)")
    ap.add_argument("--shapes", nargs="*", default=[f"{o}x{i}" for o, i in LLAMA])
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    failures: list = []
    check_repack(failures)
    check_groups(failures, sc=Scratch(), rows=(1, 3))
    sc = Scratch()
    cfgs = [R.RowConfig()] + (VARIANTS if args.variants else [])
    res = []
    for out, inn in shapes:
        a = make_arrays("nvfp4", out, inn)
        lin = G.Linear("nvfp4", (out, inn), a, pdl=True)
        W64 = ref_decode("nvfp4", a, out, inn)
        for c in cfgs:
            check(lin, W64, sc, c, failures)
        check(lin, W64, sc, cfgs[0], failures, defines=CLAMP)
        del W64
        cp.get_default_memory_pool().free_all_blocks()
        log(f"{out}x{inn}: checked ({len(failures)} failures so far)")
        bufs = copies(a, lin.nbytes)
        base = G.default_config("nvfp4_ggml", out, inn, 1)
        lins = [G.Linear("nvfp4", (out, inn), b, pdl=True) for b in bufs]
        probes = [G.Linear("nvfp4", (out, inn), b, config=base, defines=PROBE, pdl=True) for b in bufs]
        for L in lins:
            R.layout(L)
        x = cp.random.standard_normal((1, inn), dtype=cp.float32)
        y = cp.zeros((1, out), cp.float32)
        var = {"cores": [lambda L=L: L.launch(x, y, 1) for L in lins],
               "cores loads only": [lambda L=L: L.launch(x, y, 1) for L in probes]}
        for c in cfgs:
            var[repr(c)] = [sc.bind([L], x, [y], 1, c) for L in lins]
        var["row clamp"] = [sc.bind([L], x, [y], 1, cfgs[0], defines=CLAMP) for L in lins]
        var["row loads only"] = [sc.bind([L], x, [y], 1, cfgs[0], defines=PROBE) for L in lins]
        t = alternate(var, lin.nbytes / 3.0e12 + 3e-6, args.rounds)
        rec = {"out": out, "in": inn, "bytes": lin.nbytes, "us": {k: v * 1e6 for k, v in t.items()}}
        res.append(rec)
        u = rec["us"]
        best = min((v, k) for k, v in u.items() if k.startswith("RowConfig") or k == "row clamp")
        log(f"{out:6d}x{inn:<6d}: cores {u['cores']:8.2f} (probe {u['cores loads only']:8.2f})  row "
            f"{u[repr(cfgs[0])]:8.2f} (probe {u['row loads only']:8.2f})  best row {best[0]:8.2f} {best[1]}")
        del bufs, lins, probes
        cp.get_default_memory_pool().free_all_blocks()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gemv_row.json").write_text(json.dumps(
        {"copy_bw": bw, "results": res, "failures": failures}, indent=1))
    log(f"\nchecks: {len(failures)} failures")
    for f in failures:
        log("  FAIL", f)
    names = list(res[0]["us"]) if res else []
    log(f"\n## One-row GGML NVFP4 GEMV (copy {bw / 1e12:.2f} TB/s; us, % copy = weight bytes / time / copy)")
    log("| out x in | " + " | ".join(names) + " |")
    log("|---|" + "---|" * len(names))
    for r in res:
        log(f"| {r['out']}x{r['in']} | " + " | ".join(
            f"{r['us'][k]:.2f} ({100 * r['bytes'] / (r['us'][k] * 1e-6) / bw:.0f}%)" for k in names) + " |")
    have = {(r["out"], r["in"]): r for r in res}
    if all(s in have for s in STACK):
        tot_b = sum(n * have[s]["bytes"] for s, n in STACK.items())
        log("\nLlama-3-8B linears a token (32 layers + NVFP4 head, one matrix a launch):")
        for k in names:
            ms = sum(n * have[s]["us"][k] for s, n in STACK.items()) * 1e-3
            log(f"  {k:40s} {ms:7.3f} ms  {tot_b / (ms * 1e-3) / 1e9:7.0f} GB/s  {100 * tot_b / (ms * 1e-3) / bw:5.1f}% copy")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
