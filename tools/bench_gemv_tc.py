"""Check and time the decode GEMV of several activation rows: the CUDA-core kernels (launches of up
to 8 rows) against the tensor-core kernel (gemv_tc.cu, up to 16 rows a launch) on the GPU.

    python -m bloomery.tools.bench_gemv_tc [--out DIR] [--rows 1 2 4 8 16] [--variants] [--xg] [--groups] [--bf16]

Every tensor-core variant is checked against float64 (16 rows, y poisoned) before it is timed.
Timing as tools/bench_kernels.py: a CUDA graph of launches rotating over copies of the weight
that cannot sit in L2, median of 5 replays. GB/s counts the weight bytes once per launch of all
rows (what a decode step of that many slots reads); % copy is against the device copy bandwidth
measured in the same run. The last table is the Llama-3-8B layer stack (32 x q,k,v,o,gate,up,down
+ head): ms per decode step of its linears and the ratio to one row. --groups: only the Llama-3-8B
q/k/v and gate/up as the executor launches them at several rows, each member alone against one
gemv.TcGroup launch, both with and without programmatic dependent launch (members checked bit for bit).
--bf16: BF16 weights (the output heads ModelOpt leaves unquantized): gemv_bf16_tc's configurations
(checked against float64 first) against the CUDA-core kernels and, past 8 rows, the prompt GEMM (cuBLAS,
bf16x2) that the executor used there before. --xg: also gemv.tc_config's shapes (with --bf16:
bf16_tc_config's and every variant's) with x's 16-bit parts made once a launch (TcConfig.xg,
Bf16TcConfig.xs), both forms in the same run, and a table of the two side by side. --stages N ..: also
gemv.tc_config's shapes with the weights staged N chunks deep (TcConfig.NS; the rule's is 2), each checked
against float64 at its row count first, and a table of them beside the rule (shapes whose stages do not fit
a CTA's shared memory are left out). --sweep: also every TcConfig of SWEEP (warps, m-tiles, grid, stages, x
made once) that fits a CTA at each row count, each checked against float64 at that row count first, and a
table per shape of the rule against the fastest few, with the 8B stack's linears at the rule and at the best
per shape; with --groups, the q/k/v and gate/up groups at every swept TcConfig that fits each member (each member
checked against float64 first, the group launched whole), against tc_config's; with --bf16, every Bf16TcConfig
of BF16_SWEEP (each checked against float64 at each row count) against bf16_tc_config's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import cupy as cp

from bloomery.runtime.cuda import gemv as G
from bloomery.runtime.cuda.bandwidth import copy_bandwidth
from bloomery.tools.bench_kernels import LLAMA, check_one, copies, log, make_arrays, ref_decode, time_calls, time_linears

STACK = {(4096, 4096): 64, (1024, 4096): 64, (14336, 4096): 64, (4096, 14336): 32, (128256, 4096): 1}
K = 1024
VARIANTS = [G.TcConfig(NS=2), G.TcConfig(W=8, ctas=528, NS=2), G.TcConfig(MT=1, ctas=528, NS=2),
            G.TcConfig(NS=2, xcap=32 * K), G.TcConfig(NS=2, xcap=16 * K), G.TcConfig(W=8, ctas=528, NS=2, xcap=32 * K),
            G.TcConfig(W=8, ctas=528, NS=2, xcap=16 * K), G.TcConfig(MT=1, ctas=528, NS=2, xcap=16 * K),
            G.TcConfig(MT=4, W=8, ctas=528, NS=2, xcap=16 * K), G.TcConfig(MT=4, W=8, ctas=528, NS=2),
            G.TcConfig(W=8, ctas=1056, NS=2, xcap=16 * K)]
SWEEP = dict(MT=(1, 2), W=(2, 4, 8), ctas=(132, 264, 528), NS=(2, 3, 4, 6), xg=(False, True))
XG_VARIANTS = [G.TcConfig(MT=1, W=8, ctas=264, NS=2, xg=True), G.TcConfig(W=8, ctas=528, NS=2, xg=True),
               G.TcConfig(MT=1, W=8, ctas=528, NS=2, xg=True)]


class Cores:
    """The CUDA-core kernels over launches of at most 8 rows (what the executor does today)."""
    def __init__(self, lin):
        self.lin, self.nbytes, self.out, self.inn = lin, lin.nbytes, lin.out, lin.inn

    def launch(self, x, y, nb, accumulate=False):
        for g in range(0, nb, G.MAX_BATCH):
            n = min(G.MAX_BATCH, nb - g)
            self.lin.launch(x[g:g + n], y[g:g + n], n, accumulate)

    __call__ = lambda self, x, y, accumulate=False: self.launch(x, y, x.shape[0], accumulate)  # noqa: E731


class Tc:
    def __init__(self, lin, cfg, part, sem):
        self.lin, self.cfg, self.part, self.sem = lin, cfg, part, sem
        self.nbytes, self.out, self.inn = lin.nbytes, lin.out, lin.inn

    def launch(self, x, y, nb, accumulate=False):
        self.lin.launch_tc(x, y, nb, accumulate, self.part, self.sem, self.cfg)

    __call__ = lambda self, x, y, accumulate=False: self.launch(x, y, x.shape[0], accumulate)  # noqa: E731


GROUPS = {"q,k,v": [(4096, 4096), (1024, 4096), (1024, 4096)], "gate,up": [(14336, 4096), (14336, 4096)]}


def bench_groups(rows, bw, sweep: bool = False) -> int:
    """us a launch of each group of GROUPS, its members alone and as one TcGroup, PDL off / on; sweep: also
    the group (PDL on) at every TcConfig of SWEEP that fits each member, each checked against float64 first."""
    failures, table = 0, []
    for name, shapes in GROUPS.items():
        arrs = [make_arrays("nvfp4", o, i) for o, i in shapes]
        nbytes = sum(G.Linear("nvfp4", s, a).nbytes for s, a in zip(shapes, arrs))
        swept = {}
        if sweep:                                    # float64 checks first, one member's reference at a time
            lins = [G.Linear("nvfp4", s, a) for s, a in zip(shapes, arrs)]
            for nb in rows:
                swept[nb] = [c for c in _swept_all() if all(_fits(o, i, nb, c) for o, i in shapes)]
            for m, (o, i) in enumerate(shapes):
                W64 = ref_decode("nvfp4", arrs[m], o, i)
                for nb, cs in swept.items():
                    for cfg in list(cs):
                        ok, rel, worst, fin = check_one(_Member(lins, m, nb, cfg), W64, nb, False, tol=2e-5)
                        if not ok:
                            cs.remove(cfg)
                            failures += 1
                            log(f"FAIL {name} member {m} {_short(cfg)} rows {nb}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
                del W64
            del lins
        sets = [[{k: v.copy() for k, v in a.items()} for a in arrs] for _ in copies(arrs[0], nbytes)[1:]] + [arrs]
        for nb in rows:
            x = cp.random.standard_normal((nb, shapes[0][1]), dtype=cp.float32)
            rec = {"group": name, "rows": nb, "bytes": nbytes}
            for pdl in (False, True):
                lin_sets = [[G.Linear("nvfp4", s, a, pdl=pdl) for s, a in zip(shapes, st)] for st in sets]
                ys = [cp.zeros((nb, o), cp.float32) for o, _ in shapes]
                grps = [G.TcGroup(ls, nb) for ls in lin_sets]
                part = cp.zeros(max(max(g.need()[0] for g in grps), 1), cp.float32)
                sem = cp.zeros(max(g.need()[1] for g in grps), cp.int32)
                alone = [cp.zeros_like(y) for y in ys]
                grps[0].launch(x, ys, False, part, sem)
                for L, a in zip(lin_sets[0], alone):
                    L.launch_tc(x, a, nb, False, part, sem)
                if not all((cp.asnumpy(a) == cp.asnumpy(y)).all() for a, y in zip(alone, ys)):
                    failures += 1
                    log(f"FAIL {name} rows {nb} pdl {pdl}: the group's outputs differ from its members' alone")
                sep = [lambda ls=ls: [L.launch_tc(x, y, nb, False, part, sem) for L, y in zip(ls, ys)] for ls in lin_sets]
                one = [lambda g=g: g.launch(x, ys, False, part, sem) for g in grps]
                est = nbytes / 3.5e12 + 1e-5
                rec[f"alone{int(pdl)}"] = time_calls(sep, est)[0] * 1e6
                rec[f"group{int(pdl)}"] = time_calls(one, est)[0] * 1e6
                if pdl and nb in swept:
                    rec["rule_cfg"] = _short(grps[0].cfg)
                    rec["sweep"] = sorted((_time_group(lin_sets, nb, c, x, ys, est), _short(c)) for c in swept[nb])
                    log(f"  swept {len(swept[nb])}: " + "  ".join(f"{t:.2f} {c}" for t, c in rec["sweep"][:3]))
            rec["pct"] = 100 * nbytes / (rec["group1"] * 1e-6) / bw
            table.append(rec)
            log(f"{name:8s} rows {nb:2d}: alone {rec['alone0']:7.2f} / pdl {rec['alone1']:7.2f} us   "
                f"group {rec['group0']:7.2f} / pdl {rec['group1']:7.2f} us ({rec['pct']:.1f}% copy)")
        del sets
        cp.get_default_memory_pool().free_all_blocks()
    log(f"\n## q/k/v and gate/up at several rows, us a launch set (copy {bw / 1e12:.2f} TB/s)")
    log("| group | rows | members alone | alone, PDL | one launch | one launch, PDL | % copy | alone / group, PDL |")
    log("|---|---|---|---|---|---|---|---|")
    for r in table:
        log(f"| {r['group']} | {r['rows']} | {r['alone0']:.2f} | {r['alone1']:.2f} | {r['group0']:.2f} | "
            f"{r['group1']:.2f} | {r['pct']:.1f} | {r['alone1'] / r['group1']:.2f}x |")
    if sweep:
        _log_sweep("the groups: tc_config's shape against the fastest swept ones, one launch with PDL", "group", "tc_config",
                   [(r["group"], r["rows"], r["group1"], r["rule_cfg"], r["pct"], r["sweep"]) for r in table if r.get("sweep")])
    return failures


class _Member:
    """check_one's calling convention for member m of a TcGroup launch at cfg (the group launched whole)."""
    def __init__(self, lins, m, nb, cfg):
        self.grp, self.m, self.out, self.inn = G.TcGroup(lins, nb, cfg), m, lins[m].out, lins[m].inn

    def __call__(self, x, y, accumulate=False):
        nb = x.shape[0]
        ys = [y if i == self.m else cp.zeros((nb, L.out), cp.float32) for i, L in enumerate(self.grp.lins)]
        self.grp.launch(x, ys, accumulate)


def _time_group(lin_sets, nb, cfg, x, ys, est) -> float:
    """us a launch of the groups of lin_sets (rotating over the weight copies) at cfg, PDL on."""
    grps = [G.TcGroup(ls, nb, cfg) for ls in lin_sets]
    part = cp.zeros(max(max(g.need()[0] for g in grps), 1), cp.float32)
    sem = cp.zeros(max(g.need()[1] for g in grps), cp.int32)
    return time_calls([lambda g=g: g.launch(x, ys, False, part, sem) for g in grps], est)[0] * 1e6


BF16_SHAPES = [(128256, 4096), (49152, 576), (4096, 4096), (14336, 4096)]
BF16_VARIANTS = [G.Bf16TcConfig(), G.Bf16TcConfig(ctas=264), G.Bf16TcConfig(ctas=1056), G.Bf16TcConfig(MT=4),
                 G.Bf16TcConfig(MT=1, W=8)]


BF16_SWEEP = dict(MT=(1, 2, 4), W=(2, 4, 8), ctas=(132, 264, 528, 1056), xs=(False, True))


def bench_bf16(rows, bw, xg: bool = False, sweep: bool = False) -> int:
    """us a launch of BF16 weights at several rows: CUDA cores, the prompt GEMM past 8 rows, gemv_bf16_tc
    (xg: also each variant with x's parts made once, Bf16TcConfig.xs; sweep: every Bf16TcConfig of
    BF16_SWEEP instead of the variants, and a table of the rule against the fastest few)."""
    variants = BF16_VARIANTS + ([dataclasses.replace(c, xs=True) for c in BF16_VARIANTS] if xg else [])
    if sweep:
        variants = _grid(G.Bf16TcConfig, BF16_SWEEP)
    from bloomery.runtime.cuda import gemm as M
    failures, table = 0, []
    part = cp.zeros(1 << 24, cp.float32)
    sem = cp.zeros(1 << 16, cp.int32)
    gs = cp.cuda.Stream(non_blocking=True)
    mm = M.Matmul(gs, "bf16x2")                  # its cuBLAS handle runs on gs: timed there (time_calls' stream)
    for out, inn in (BF16_SHAPES if not sweep else [s for s in BF16_SHAPES if s[0] >= 32768]):   # sweep: the heads
        a = make_arrays("bf16", out, inn)
        lin = G.Linear("bf16", (out, inn), a)
        W64 = ref_decode("bf16", a, out, inn)
        checks = ((16, False), (11, True), (3, False), (1, False)) if not sweep else tuple((nb, False) for nb in rows)
        for cfg in list(variants):
            for nb, acc in checks:
                ok, rel, worst, fin = check_one(Tc(lin, cfg, part, sem), W64, nb, acc, tol=2e-5)
                if not ok:
                    failures += 1
                    log(f"FAIL bf16 {out}x{inn} {cfg} nb={nb} acc={acc}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
                    if sweep:
                        variants.remove(cfg)
                        break
        del W64
        lins = [G.Linear("bf16", (out, inn), b) for b in copies(a, lin.nbytes)]
        for nb in rows:
            x = cp.random.standard_normal((nb, inn), dtype=cp.float32)
            y = cp.zeros((nb, out), cp.float32)
            rec = {"shape": f"{out}x{inn}", "rows": nb, "bytes": lin.nbytes,
                   "cores": time_linears([Cores(L) for L in lins], x, y, nb)[0] * 1e6}
            if nb > 8:
                rec["gemm"] = time_calls([mm.bind(L, x, y, nb) for L in lins[:4]], lin.nbytes / 3.5e12, stream=gs)[0] * 1e6
            for cfg in variants:
                rec[repr(cfg)] = time_linears([Tc(L, cfg, part, sem) for L in lins], x, y, nb)[0] * 1e6
            rec["rule"] = time_linears([Tc(L, None, part, sem) for L in lins], x, y, nb)[0] * 1e6
            if xg:
                xc = dataclasses.replace(G.bf16_tc_config(out, inn, nb), xs=True)
                rec["rule_xs"] = time_linears([Tc(L, xc, part, sem) for L in lins], x, y, nb)[0] * 1e6
            best = min(variants, key=lambda c: rec[repr(c)])
            rec["best"], rec["best_cfg"] = rec[repr(best)], best
            table.append(rec)
            timed = [(rec[repr(c)], _short_bf16(c)) for c in variants]
            rec["sweep"], rec["rule_cfg"] = sorted(timed), _short_bf16(G.bf16_tc_config(out, inn, nb))
            log(f"bf16 {rec['shape']:12s} rows {nb:2d}: cores {rec['cores']:8.2f}  gemm {rec.get('gemm', float('nan')):8.2f}  "
                + "  ".join(f"{c} {t:7.2f}" for t, c in (rec["sweep"][:3] if sweep else timed)))
        del lins
        cp.get_default_memory_pool().free_all_blocks()
    log(f"\n## BF16 weights, us a launch (copy {bw / 1e12:.2f} TB/s; % copy counts the weight bytes once)")
    log("| out x in | rows | CUDA cores | prompt GEMM | tensor cores (bf16_tc_config) | best (MT/W/ctas) | % copy (best) | cores / best |")
    log("|---|---|---|---|---|---|---|---|")
    for r in table:
        c = r["best_cfg"]
        log(f"| {r['shape']} | {r['rows']} | {r['cores']:.2f} | {r.get('gemm', float('nan')):.2f} | {r['rule']:.2f} | "
            f"{r['best']:.2f} ({_short_bf16(c)}) | {100 * r['bytes'] / (r['best'] * 1e-6) / bw:.1f} | "
            f"{r['cores'] / r['best']:.2f}x |")
    if sweep:
        _log_sweep("BF16: bf16_tc_config's shape against the fastest swept ones, us a launch", "out x in", "bf16_tc_config",
                   [(r["shape"], r["rows"], r["rule"], r["rule_cfg"], 100 * r["bytes"] / (r["rule"] * 1e-6) / bw, r["sweep"])
                    for r in table])
    if xg:
        log("\n## BF16: x's parts made once (Bf16TcConfig.xs) on bf16_tc_config's shape: us a launch")
        log("| out x in | rows | bf16_tc_config | + xs | xs speed |")
        log("|---|---|---|---|---|")
        for r in table:
            log(f"| {r['shape']} | {r['rows']} | {r['rule']:.2f} | {r['rule_xs']:.2f} | {r['rule'] / r['rule_xs']:.3f}x |")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--variants", action="store_true", help="also time the TcConfig variants (VARIANTS)")
    ap.add_argument("--xg", action="store_true", help="also time tc_config's shapes with x's fragments made once, and XG_VARIANTS")
    ap.add_argument("--stages", type=int, nargs="*", default=[], help="also tc_config's shapes staged this many chunks deep")
    ap.add_argument("--sweep", action="store_true", help="also every TcConfig of SWEEP that fits (slow: ~100 a shape)")
    ap.add_argument("--groups", action="store_true", help="only the q/k/v and gate/up groups (GROUPS)")
    ap.add_argument("--bf16", action="store_true", help="only BF16 weights (BF16_SHAPES, BF16_VARIANTS)")
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    if args.groups or args.bf16:
        failures = (bench_groups(args.rows, bw, args.sweep) if args.groups else 0) + (bench_bf16(args.rows, bw, args.xg, args.sweep) if args.bf16 else 0)
        return 1 if failures else 0
    part = cp.zeros(64 << 20, cp.float32)
    sem = cp.zeros(1 << 16, cp.int32)
    res, failures = [], []
    for out, inn in LLAMA:
        a = make_arrays("nvfp4", out, inn)
        lin = G.Linear("nvfp4", (out, inn), a)
        W64 = ref_decode("nvfp4", a, out, inn)
        cfgs = [None] + (VARIANTS if args.variants else []) + (XG_VARIANTS if args.xg else [])  # None: tc_config's
        for cfg in cfgs:
            for nb, acc in ((16, False), (3, True), (1, False)):
                ok, rel, worst, fin = check_one(Tc(lin, cfg, part, sem), W64, nb, acc, tol=2e-5)
                if not ok:
                    failures.append(f"{out}x{inn} {cfg} nb={nb} acc={acc}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
        staged = {(nb, n): _staged(out, inn, nb, n) for nb in args.rows for n in args.stages}
        swept = {nb: _swept(out, inn, nb) for nb in args.rows} if args.sweep else {}
        for nb, cs in swept.items():
            for cfg in list(cs):
                ok, rel, worst, fin = check_one(Tc(lin, cfg, part, sem), W64, nb, False, tol=2e-5)
                if not ok:
                    cs.remove(cfg)
                    failures.append(f"{out}x{inn} {cfg} nb={nb}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
        for (nb, n), cfg in staged.items():
            ok, rel, worst, fin = check_one(Tc(lin, cfg, part, sem), W64, nb, False, tol=2e-5) if cfg else (True,) * 4
            if not ok:
                failures.append(f"{out}x{inn} {cfg} nb={nb}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
        del W64
        bufs = copies(a, lin.nbytes)
        lins = [G.Linear("nvfp4", (out, inn), b) for b in bufs]
        for nb in args.rows:
            x = cp.random.standard_normal((nb, inn), dtype=cp.float32)
            y = cp.zeros((nb, out), cp.float32)
            rec = {"out": out, "in": inn, "rows": nb, "bytes": lin.nbytes,
                   "cores_us": time_linears([Cores(L) for L in lins], x, y, nb)[0] * 1e6}
            for cfg in cfgs:
                rec[repr(cfg)] = time_linears([Tc(L, cfg, part, sem) for L in lins], x, y, nb)[0] * 1e6
            rec["tc_us"] = rec[repr(cfgs[0])]
            if args.xg:                              # the rule's own shape with x's fragments made once
                xc = dataclasses.replace(G.tc_config(out, inn, nb), xg=True)
                rec["xg_us"] = time_linears([Tc(L, xc, part, sem) for L in lins], x, y, nb)[0] * 1e6
            for n in args.stages:
                cfg = staged[nb, n]
                rec[f"ns{n}"] = time_linears([Tc(L, cfg, part, sem) for L in lins], x, y, nb)[0] * 1e6 if cfg else float("nan")
            if swept:
                rec["sweep"] = sorted((time_linears([Tc(L, c, part, sem) for L in lins], x, y, nb)[0] * 1e6, _short(c))
                                      for c in swept[nb])
                log(f"  swept {len(swept[nb])}: " + "  ".join(f"{t:.2f} {c}" for t, c in rec["sweep"][:3]))
            rec["best"] = min((rec[repr(c)], repr(c)) for c in cfgs)
            rec["rule_cfg"] = repr(G.tc_config(out, inn, nb))
            res.append(rec)
            log(f"{out:6d}x{inn:<6d} rows {nb:2d}: cores {rec['cores_us']:8.2f} us  tc {rec['tc_us']:8.2f} us  "
                + (f"tc+xg {rec['xg_us']:8.2f} us  " if args.xg else "") + f"best {rec['best'][0]:8.2f} {rec['best'][1]}")
        del bufs, lins
        cp.get_default_memory_pool().free_all_blocks()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gemv_tc.json").write_text(json.dumps({"copy_bw": bw, "results": res,
                                                                   "failures": failures}, indent=1))
    log(f"\nchecks: {len(failures)} failures")
    for f in failures:
        log("  FAIL", f)
    log(f"\n## GGML NVFP4, rows per launch (copy {bw / 1e12:.2f} TB/s; GB/s = weight bytes once / time)")
    log("| out x in | rows | CUDA cores us | tensor cores us | tc GB/s | tc % copy | speed |")
    log("|---|---|---|---|---|---|---|")
    for r in res:
        log(f"| {r['out']}x{r['in']} | {r['rows']} | {r['cores_us']:.2f} | {r['tc_us']:.2f} | "
            f"{r['bytes'] / r['tc_us'] / 1e3:.0f} | {100 * r['bytes'] / (r['tc_us'] * 1e-6) / bw:.1f} | "
            f"{r['cores_us'] / r['tc_us']:.2f}x |")
    log("\n## Llama-3-8B linears per decode step (ms), by rows (slots)")
    log("| rows | CUDA cores ms | tensor cores ms | best-of ms | cores / 1 row | tc / 1 row | best / 1 row |")
    log("|---|---|---|---|---|---|---|")
    base = {}
    for nb in args.rows:
        tot = {k: sum(STACK[(r["out"], r["in"])] * (r[k] if k != "best" else min(r["best"][0], r["cores_us"]))
                      for r in res if r["rows"] == nb) / 1e3 for k in ("cores_us", "tc_us", "best")}
        base = base or tot
        log(f"| {nb} | {tot['cores_us']:.3f} | {tot['tc_us']:.3f} | {tot['best']:.3f} | "
            f"{tot['cores_us'] / base['cores_us']:.2f} | {tot['tc_us'] / base['cores_us']:.2f} | "
            f"{tot['best'] / base['best']:.2f} |")
    if args.xg:
        log("\n## x's fragments made once (TcConfig.xg) on tc_config's shape: us a launch")
        log("| out x in | rows | tc_config | tc_config + xg | xg speed |")
        log("|---|---|---|---|---|")
        for r in res:
            log(f"| {r['out']}x{r['in']} | {r['rows']} | {r['tc_us']:.2f} | {r['xg_us']:.2f} | {r['tc_us'] / r['xg_us']:.3f}x |")
        for nb in args.rows:
            t0 = sum(STACK[(r["out"], r["in"])] * r["tc_us"] for r in res if r["rows"] == nb) / 1e3
            t1 = sum(STACK[(r["out"], r["in"])] * r["xg_us"] for r in res if r["rows"] == nb) / 1e3
            log(f"Llama-3-8B linears a step at {nb} rows: {t0:.3f} ms, with xg {t1:.3f} ms ({t0 / t1:.3f}x)")
    if args.stages:
        log("\n## tc_config's shapes staged N chunks deep (TcConfig.NS): us a launch (nan: does not fit)")
        log("| out x in | rows | tc_config | " + " | ".join(f"NS={n}" for n in args.stages) + " |")
        log("|---|---|---|" + "---|" * len(args.stages))
        for r in res:
            log(f"| {r['out']}x{r['in']} | {r['rows']} | {r['tc_us']:.2f} | "
                + " | ".join(f"{r[f'ns{n}']:.2f} ({r['tc_us'] / r[f'ns{n}']:.3f}x)" for n in args.stages) + " |")
    if args.sweep:
        _log_sweep("tc_config's shape against the fastest swept ones, us a launch", "out x in", "tc_config",
                   [(f"{r['out']}x{r['in']}", r["rows"], r["tc_us"], "", 100 * r["bytes"] / (r["tc_us"] * 1e-6) / bw,
                     r["sweep"]) for r in res])
        for nb in args.rows:
            t0 = sum(STACK[(r["out"], r["in"])] * r["tc_us"] for r in res if r["rows"] == nb) / 1e3
            t1 = sum(STACK[(r["out"], r["in"])] * min(r["tc_us"], r["sweep"][0][0]) for r in res if r["rows"] == nb) / 1e3
            log(f"Llama-3-8B linears a step at {nb} rows: tc_config {t0:.3f} ms, best swept per shape {t1:.3f} ms ({t0 / t1:.3f}x)")
    return 1 if failures else 0


def _log_sweep(title: str, what: str, rule: str, items) -> None:
    """A sweep's table: per (name, rows, rule us, rule's config, rule % copy, [(us, config) fastest first]),
    the rule against the fastest three and the speed of the fastest over it."""
    log(f"\n## SWEEP, {title} (% copy)")
    log(f"| {what} | rows | {rule} | fastest | 2nd | 3rd | speed |")
    log("|---|---|---|---|---|---|---|")
    for name, nb, us, cfg, pct, sw in items:
        log(f"| {name} | {nb} | {us:.2f}{' ' + cfg if cfg else ''} ({pct:.1f}%) | "
            + " | ".join(f"{t:.2f} {c}" for t, c in sw[:3]) + f" | {us / sw[0][0]:.3f}x |")


def _short(c) -> str:
    """A TcConfig as MT/W/ctas/NS[/xg]."""
    return f"{c.MT}/{c.W}/{c.ctas}/{c.NS}" + ("/xg" if c.xg else "")


def _short_bf16(c) -> str:
    """A Bf16TcConfig as MT/W/ctas[/xs]."""
    return f"{c.MT}/{c.W}/{c.ctas}" + ("/xs" if c.xs else "")


def _fits(out: int, inn: int, nb: int, cfg) -> bool:
    """Whether a launch of cfg at nb rows fits a CTA (tc_launch_shape accepts it)."""
    try:
        G.tc_launch_shape(out, inn, nb, cfg)
    except ValueError:
        return False
    return True


def _grid(cls, grid: dict) -> list:
    """Every config of cls over a grid {field: values}."""
    return [cls(**dict(zip(grid, v))) for v in itertools.product(*grid.values())]


def _swept_all() -> list:
    """Every TcConfig of SWEEP."""
    return _grid(G.TcConfig, SWEEP)


def _swept(out: int, inn: int, nb: int) -> list:
    """SWEEP's TcConfigs that fit a CTA at nb rows."""
    return [c for c in _swept_all() if _fits(out, inn, nb, c)]


def _staged(out: int, inn: int, nb: int, n: int):
    """tc_config's shape at nb rows staged n chunks deep, or None where those stages do not fit a CTA."""
    cfg = dataclasses.replace(G.tc_config(out, inn, nb), NS=n)
    return cfg if _fits(out, inn, nb, cfg) else None


if __name__ == "__main__":
    sys.exit(main())
