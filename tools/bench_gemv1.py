"""Check and time the one-row GGML NVFP4 decode GEMV (gemv.TUNED's configs) in its launch variants: the
activation loads (plain, the read-only path, L2 only), programmatic dependent launch on and off
(runtime/cuda/pdl.py: a graph of back-to-back launches, each may start during the one before), and a
loads-only probe (BLOOMERY_PROBE_LOADS: the same loads, one XOR a word instead of the arithmetic)
that says how fast the access pattern alone can go.

    python -m bloomery.tools.bench_gemv1 [--out DIR] [--rounds 3] [--shapes 4096x14336 ...] [--profile]

Every variant except the probes is checked against float64 (1 and 3 rows, accumulate) and, bit for bit,
against the plain launch. Timing as tools/bench_kernels.py (a CUDA graph of launches
rotating over weight copies that cannot sit in L2, median of 5 replays), in `--rounds` rounds whose
variant order alternates; a variant's figure is the median of its rounds. % copy is against the device
copy bandwidth measured in the same run. --profile launches each variant once outside a graph
(for a profiler's kernel filter) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import cupy as cp

from bloomery.runtime.cuda import gemv as G
from bloomery.runtime.cuda.bandwidth import copy_bandwidth
from bloomery.tools.bench_kernels import LLAMA, check_one, copies, log, make_arrays, ref_decode, time_linears

STACK = {(4096, 4096): 64, (1024, 4096): 64, (14336, 4096): 64, (4096, 14336): 32, (128256, 4096): 1}
PROBE = ("BLOOMERY_PROBE_LOADS",)


def variants(out: int, inn: int):
    """(name, config, defines, pdl): the default config with the activation loads as they are (plain), as
    before 2026-12-02 (the read-only path) and from L2 only, each with and without programmatic dependent
    launch; and the loads-only probe (the same loads, one XOR a word instead of the arithmetic)."""
    base = G.default_config("nvfp4_ggml", out, inn, 1)
    v = [("direct", base, (), False), ("direct x nc (before)", base, ("BLOOMERY_X_NC",), False),
         ("direct x cg", base, ("BLOOMERY_X_CG",), False), ("direct pdl", base, (), True), ("direct pdl wait first", base, ("BLOOMERY_PDL_WAIT_FIRST",), True),
         ("direct pdl x cg", base, ("BLOOMERY_X_CG",), True), ("direct x nc pdl (unsafe)", base, ("BLOOMERY_X_NC",), True),
         ("loads only", base, PROBE, False), ("loads only pdl", base, PROBE, True)]
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=[f"{o}x{i}" for o, i in LLAMA])
    ap.add_argument("--profile", action="store_true", help="launch each variant once, no timing")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if args.profile:
        for out, inn in shapes:
            a = make_arrays("nvfp4", out, inn)
            x = cp.random.standard_normal((1, inn), dtype=cp.float32)
            y = cp.zeros((1, out), cp.float32)
            for name, cfg, defs, pdl in variants(out, inn):
                lin = G.Linear("nvfp4", (out, inn), a, config=cfg, defines=defs, pdl=pdl)
                lin.launch(x, y, 1)
                cp.cuda.runtime.deviceSynchronize()
                log(f"profiled {out}x{inn} {name}: {lin.kernel_name(1)}")
        return 0
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    failures, res = [], []
    for out, inn in shapes:
        a = make_arrays("nvfp4", out, inn)
        W64 = ref_decode("nvfp4", a, out, inn)
        vs = variants(out, inn)
        for name, cfg, defs, pdl in vs:
            if defs:
                continue
            lin = G.Linear("nvfp4", (out, inn), a, config=cfg, pdl=pdl)
            for nb, acc in ((1, False), (3, True)):
                ok, rel, worst, fin = check_one(lin, W64, nb, acc)
                if not ok:
                    failures.append(f"{out}x{inn} {name} nb={nb} acc={acc}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
            if defs or pdl:                               # bit for bit against the plain launch
                ref = G.Linear("nvfp4", (out, inn), a, config=cfg)
                for nb in (1, 2):
                    x = cp.random.standard_normal((nb, inn), dtype=cp.float32)
                    y1, y2 = lin(x), ref(x)
                    if not bool((y1.view(cp.uint32) == y2.view(cp.uint32)).all()):
                        failures.append(f"{out}x{inn} {name} nb={nb}: not bit-identical to the plain launch "
                                        f"({int((y1 != y2).sum())} of {y1.size} differ)")
        del W64
        bufs = copies(a, sum(int(v.nbytes) for v in a.values()))
        lins = {name: [G.Linear("nvfp4", (out, inn), b, config=cfg, defines=defs, pdl=pdl) for b in bufs]
                for name, cfg, defs, pdl in vs}
        nbytes = lins["direct"][0].nbytes
        x = cp.random.standard_normal((1, inn), dtype=cp.float32)
        y = cp.zeros((1, out), cp.float32)
        times = {name: [] for name, *_ in vs}
        for r in range(args.rounds):
            order = vs if r % 2 == 0 else vs[::-1]
            for name, *_ in order:
                times[name].append(time_linears(lins[name], x, y, 1)[0])
        rec = {"out": out, "in": inn, "bytes": nbytes, "us": {k: float(np.median(v)) * 1e6 for k, v in times.items()},
               "rounds_us": {k: [t * 1e6 for t in v] for k, v in times.items()}}
        res.append(rec)
        d = rec["us"]["direct"]
        for name in rec["us"]:
            u = rec["us"][name]
            log(f"{out:6d}x{inn:<6d} {name:26s} {u:8.2f} us  {nbytes / u / 1e3:6.0f} GB/s  "
                f"{100 * nbytes / (u * 1e-6) / bw:5.1f}% copy  {d / u:5.2f}x direct")
        del bufs, lins
        cp.get_default_memory_pool().free_all_blocks()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gemv1.json").write_text(json.dumps({"copy_bw": bw, "results": res, "failures": failures},
                                                                indent=1))
    log(f"\nchecks: {len(failures)} failures")
    for f in failures:
        log("  FAIL", f)
    names = [n for n, *_ in variants(*shapes[0])]
    log(f"\n## GGML NVFP4, one row: us (% copy; copy {bw / 1e12:.2f} TB/s), median of {args.rounds} alternating rounds")
    log("| variant | " + " | ".join(f"{r['out']}x{r['in']}" for r in res) + " |")
    log("|---|" + "---|" * len(res))
    for n in names:
        log(f"| {n} | " + " | ".join(f"{r['us'][n]:.2f} ({100 * r['bytes'] / (r['us'][n] * 1e-6) / bw:.0f}%)" for r in res) + " |")
    if {(r["out"], r["in"]) for r in res} >= set(STACK):
        log("\n## Llama-3-8B linears a decode step (32 layers + head), ms")
        for n in names:
            log(f"| {n} | {sum(STACK[(r['out'], r['in'])] * r['us'][n] for r in res if (r['out'], r['in']) in STACK) / 1e3:.3f} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
