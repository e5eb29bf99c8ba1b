"""Check and time the decode GEMV kernels (runtime/cuda/gemv.py) on the GPU.

    python -m bloomery.tools.bench_kernels [--out DIR] [--quick] [--sweep] [--formats ...]

1. Device copy bandwidth (cudaMemcpy device to device, 2 GiB, bytes read + written, median of 10).
2. The float64 GPU reference decoders (cupy, value tables from core/formats/minifloat) against
   core/formats' own decoders (from_gguf + decode) on small random artifacts: bit for bit.
3. Correctness: fresh random artifact arrays per format and shape, x random normal, y poisoned
   with NaN; every element compared with x64 @ W64.T (rel L2 and a per-element bound); batch
   1, 3 and 8, and accumulate=True once.
4. Timing: a CUDA graph of N launches rotating among enough copies of the weights that they
   cannot sit in the 60 MB L2; replayed 7 times, median per launch. --sweep tries R x U x T
   variants at batch 1 (each variant checked before it is timed) and keeps the best.
5. Tables: per format and shape us, GB/s of weight bytes, % of copy bandwidth; the Llama-3-8B
   layer stack (32 x q,k,v,o,gate,up,down + head) ms and tok/s its linears alone allow.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import cupy as cp

from bloomery.runtime.cuda import gemv as G
from bloomery.runtime.cuda.bandwidth import copy_bandwidth

SMOL = [(576, 1536), (1536, 576), (49152, 576)]
LLAMA = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
KINDS = ["nvfp4", "nvfp4_stored", "mxfp8", "fp8_tensor", "fp8_channel", "fp8_block128", "bf16", "f32", "q8_0"]
FMT_OF = {"nvfp4_stored": "nvfp4"}
ODD = [(1, 64), (3, 192), (7, 96), (130, 320), (257, 576), (9, 1000)]

# minifloat value tables (float64), from the one owner of the formats' values
from bloomery.core.formats import minifloat as mf   # noqa: E402

T_E2M1 = cp.asarray(mf.E2M1.astype(np.float64))
T_E4M3 = cp.asarray(mf.E4M3.astype(np.float64))
T_E8M0 = cp.asarray(mf.E8M0.astype(np.float64))


def log(*a):
    print(*a, flush=True)


# -- random artifact arrays (as layout.to_gguf lays them out), made on the GPU ------------------

def rand_u8(shape):
    return cp.random.randint(0, 256, size=shape, dtype=cp.int32).astype(cp.uint8)


def no_nan_e4m3(b):
    return cp.where((b & 0x7F) == 0x7F, b - 1, b).astype(cp.uint8)


def make_arrays(kind, out, inn):
    """Random valid GGUF arrays of one matrix: every E2M1 / E4M3 code, scales over a wide range
    (zero and subnormal block scales included)."""
    if kind == "f32":
        return {"weight": cp.random.standard_normal((out, inn), dtype=cp.float32)}
    if kind == "bf16":
        f = cp.random.standard_normal((out, inn), dtype=cp.float32)
        return {"weight": (f.view(cp.uint32) >> 16).astype(cp.uint16)}
    if kind == "q8_0":
        nb = inn // 32
        d = cp.random.uniform(1e-3, 1e-2, (out, nb, 1)).astype(cp.float16).view(cp.uint8)
        q = rand_u8((out, nb, 32))
        return {"weight": cp.ascontiguousarray(cp.concatenate([d, q], axis=-1).reshape(out, nb * 34))}
    if kind in ("nvfp4", "nvfp4_stored"):
        s = cp.random.randint(0, 0x5C, size=(out, inn // 16), dtype=cp.int32).astype(cp.uint8)   # E4M3 >= 0
        s2 = cp.asarray(np.array([1.7e-3], np.float32))
        q = rand_u8((out, inn // 2))
        if kind == "nvfp4_stored":
            return {"weight": q.view(cp.int8), "scale": s.view(cp.int8), "scale_2": s2}
        # GGML blocks: 4 scale bytes + 32 data bytes per 64 elements (random nibbles either way)
        blocks = cp.concatenate([s.reshape(out, inn // 64, 4), q.reshape(out, inn // 64, 32)], axis=-1)
        return {"weight": cp.ascontiguousarray(blocks.reshape(out, inn // 64 * 36)), "scale_2": s2}
    w = no_nan_e4m3(rand_u8((out, inn))).view(cp.int8)
    if kind == "mxfp8":
        return {"weight": w, "scale": cp.random.randint(117, 132, size=(out, inn // 32), dtype=cp.int32)
                .astype(cp.uint8).view(cp.int8)}
    if kind == "fp8_tensor":
        return {"weight": w, "scale": cp.asarray(np.array([3.1e-3], np.float32))}
    if kind == "fp8_channel":
        return {"weight": w, "scale": cp.random.uniform(1e-3, 1e-2, out).astype(cp.float32)}
    if kind == "fp8_block128":
        return {"weight": w, "scale": cp.random.uniform(1e-3, 1e-2, (-(-out // 128), -(-inn // 128)))
                .astype(cp.float32)}
    raise KeyError(kind)


def ref_decode(kind, a, out, inn):
    """float64 [out, inn] from the GGUF arrays, by table lookups (independent of the kernels)."""
    w = a["weight"]
    if kind == "f32":
        return w.astype(cp.float64)
    if kind == "bf16":
        return (w.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    if kind == "q8_0":
        b = w.view(cp.uint8).reshape(out, inn // 32, 34)
        d = cp.ascontiguousarray(b[..., :2]).view(cp.float16).astype(cp.float64)       # [out, nb, 1]
        q = b[..., 2:].view(cp.int8).astype(cp.float64)
        return (q * d).reshape(out, inn)
    if kind == "nvfp4":
        b = w.view(cp.uint8).reshape(out, inn // 64, 36)
        d = T_E4M3[b[..., :4]]                                                           # [out, nb, 4]
        qs = b[..., 4:].reshape(out, inn // 64, 4, 8)
        v = cp.concatenate([T_E2M1[qs & 15], T_E2M1[qs >> 4]], axis=-1)                  # [.., 4, 16]
        return (v * d[..., None]).reshape(out, inn) * float(a["scale_2"].reshape(-1)[0])
    if kind == "nvfp4_stored":
        q = w.view(cp.uint8)
        v = cp.stack([T_E2M1[q & 15], T_E2M1[q >> 4]], axis=-1).reshape(out, inn // 16, 16)
        s = T_E4M3[a["scale"].view(cp.uint8)]
        return (v * s[..., None]).reshape(out, inn) * float(a["scale_2"].reshape(-1)[0])
    v = T_E4M3[w.view(cp.uint8)]
    s = a["scale"]
    if kind == "mxfp8":
        return (v.reshape(out, inn // 32, 32) * T_E8M0[s.view(cp.uint8)][..., None]).reshape(out, inn)
    if kind == "fp8_tensor":
        return v * float(s.reshape(-1)[0])
    if kind == "fp8_channel":
        return v * s.astype(cp.float64)[:, None]
    if kind == "fp8_block128":
        full = cp.repeat(cp.repeat(s.astype(cp.float64), 128, axis=0), 128, axis=1)[:out, :inn]
        return v * full
    raise KeyError(kind)


def to_host_gguf(kind, a):
    """The GGUF arrays as layout.from_gguf takes them (host)."""
    h = {k: cp.asnumpy(v) for k, v in a.items()}
    if kind == "bf16":
        import ml_dtypes
        h["weight"] = h["weight"].view(ml_dtypes.bfloat16)
    return h


def check_refs(shapes=((3, 192), (64, 256), (130, 320), (576, 1536))):
    """GPU reference decoders == core/formats decoders (bit for bit, +0 == -0)."""
    from bloomery.core import formats
    from bloomery.core.artifact import layout
    bad = []
    for kind in KINDS:
        for out, inn in shapes:
            if G.supported(G.kernel_kind(FMT_OF.get(kind, kind), {"scale": 1} if kind == "nvfp4_stored" else {}),
                           out, inn) or (kind == "q8_0" and inn % 32):
                continue
            a = make_arrays(kind, out, inn)
            fmt = FMT_OF.get(kind, kind)
            parts = layout.from_gguf(fmt, to_host_gguf(kind, a))
            want = formats.get(fmt).decode(parts)
            got = cp.asnumpy(ref_decode(kind, a, out, inn)).astype(np.float32)
            ok = np.array_equal(np.where(np.isnan(want), 0, want), np.where(np.isnan(got), 0, got))
            if not ok:
                i = np.argwhere(want != got)[0]
                bad.append(f"{kind} {out}x{inn} at {list(i)}: core {want[tuple(i)]} gpu-ref {got[tuple(i)]}")
    return bad


def check_one(lin, W64, nb, accumulate=False, ref_abs=None, tol=1e-5):
    """Run lin on fresh x (y poisoned), compare every element with float64."""
    x = cp.random.standard_normal((nb, lin.inn), dtype=cp.float32)
    x64 = x.astype(cp.float64)
    if accumulate:
        y0 = cp.random.standard_normal((nb, lin.out), dtype=cp.float32)
        y = y0.copy()
    else:
        y = cp.full((nb, lin.out), cp.nan, dtype=cp.float32)
    lin(x, y, accumulate=accumulate)
    cp.cuda.runtime.deviceSynchronize()
    ref = x64 @ W64.T
    if accumulate:
        ref += y0.astype(cp.float64)
    bound = cp.abs(x64) @ cp.abs(W64).T + (cp.abs(y0.astype(cp.float64)) if accumulate else 0)
    finite = bool(cp.isfinite(y).all())
    err = cp.abs(y.astype(cp.float64) - ref)
    rel = float(cp.linalg.norm(err) / max(float(cp.linalg.norm(ref)), 1e-300))
    worst = float((err / (bound + 1e-300)).max())
    ok = finite and rel <= tol and worst <= tol
    return ok, rel, worst, finite


# -- timing ------------------------------------------------------------------------------------

def time_calls(calls, est_s, n=None, reps=5, stream=None):
    """(median, min, max) seconds per call of a graph of n calls rotating over `calls` (zero-argument
    launches; n from the estimate est_s seconds a call when not given), over reps replays. stream: the
    stream the calls enqueue on where they bring their own (a cuBLAS handle's); a new one otherwise."""
    if n is None:
        n = int(min(max(2e-3 / est_s, 10, len(calls)), 1000))
    s = stream or cp.cuda.Stream(non_blocking=True)
    with s:
        for c in calls[:2]:
            c()                                    # compile / warm
        s.synchronize()
        s.begin_capture()
        for i in range(n):
            calls[i % len(calls)]()
        g = s.end_capture()
    g.upload(s)
    g.launch(s)
    s.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        g.launch(s)
        e1.record(s)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / n)
    return float(np.median(ts)), float(np.min(ts)), float(np.max(ts))


def time_linears(lins, x, y, nb, n=None, reps=5):
    """time_calls of launches rotating over lins (y[:nb] = W x[:nb])."""
    return time_calls([lambda L=L: L.launch(x, y, nb) for L in lins], lins[0].nbytes / 3.5e12 + 3e-6, n, reps)


def copies(a, nbytes, l2=60e6, factor=4, cap=400):
    nbuf = int(min(max(2, math.ceil(factor * l2 / max(nbytes, 1))), cap))
    return [a] + [{k: v.copy() for k, v in a.items()} for _ in range(nbuf - 1)]


def sweep_configs(kind, out, inn):
    plain = kind not in ("nvfp4", "q8_0")
    out_cfg = []
    for R in (1, 2, 4, 8):
        for U in (1, 2, 4):
            for T in (64, 128, 256):
                if R == 8 and U == 4:
                    continue
                out_cfg.append(G.Config(R=R, T=T, U=U, WPC=(G.default_config(G.kernel_kind(
                    FMT_OF.get(kind, kind), {"scale": 1} if kind == "nvfp4_stored" else {}), out, inn).WPC
                    if plain else 1)))
    return out_cfg


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--formats", nargs="*", default=KINDS)
    ap.add_argument("--sweep", action="store_true", help="try R x U x T variants at batch 1")
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shapes and 4096x4096 only")
    ap.add_argument("--na", action="store_true", help="also time weight loads with L1::no_allocate")
    ap.add_argument("--torch", action="store_true", help="time torch bf16 matmul (cuBLAS) on the same shapes")
    args = ap.parse_args(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    log(f"device {props['name'].decode()} cc {dev.compute_capability} SMs {props['multiProcessorCount']} "
        f"L2 {props['l2CacheSize'] >> 20} MiB; cupy {cp.__version__}")
    t0 = time.time()
    bw = copy_bandwidth()
    log(f"copy bandwidth (read + write): {bw / 1e12:.3f} TB/s  [{time.time() - t0:.1f}s]")

    shapes = SMOL + ([(4096, 4096)] if args.quick else LLAMA)
    # precompile what will run (one NVRTC call per define set)
    names, dnames = set(), set()
    for kind in args.formats:
        kk = G.kernel_kind(FMT_OF.get(kind, kind), {"scale": 1} if kind == "nvfp4_stored" else {})
        for out, inn in shapes:
            for nb in (1, 3, 8):
                c = G.default_config(kk, out, inn, nb)
                names.add(G.kernel_name(kk, c.R, G.batch_bucket(nb), c.U, c.WPC))
                if nb == 1:
                    dnames.add(G.kernel_name(kk, c.R, 1, c.U, c.WPC))
        for out, inn in ODD:
            if not G.supported(kk, out, inn):
                for nb in (1, 5, 8):
                    c = G.default_config(kk, out, inn, nb)
                    names.add(G.kernel_name(kk, c.R, G.batch_bucket(nb), c.U, c.WPC))
        for out, inn in shapes:
            if args.sweep:
                for c in sweep_configs(kind, out, inn):
                    names.add(G.kernel_name(kk, c.R, 1, c.U, c.WPC))
    t0 = time.time()
    G.compile_kernels(sorted(names))
    if args.na:
        G.compile_kernels(sorted(dnames), defines=("BLOOMERY_NA",))
    log(f"compiled {len(names)} kernels{' x2' if args.na else ''} in {time.time() - t0:.1f}s")

    t0 = time.time()
    bad = check_refs()
    log(f"GPU float64 reference decoders vs core/formats decoders: {'OK' if not bad else 'MISMATCH'} "
        f"[{time.time() - t0:.1f}s]")
    for b in bad:
        log("  ", b)

    results, failures = [], []
    t0 = time.time()
    nodd = 0
    for kind in args.formats:                       # odd shapes: partial row groups / blocks, WPC 1
        fmt = FMT_OF.get(kind, kind)
        for out, inn in ODD:
            kk = G.kernel_kind(fmt, {"scale": 1} if kind == "nvfp4_stored" else {})
            if G.supported(kk, out, inn) or (kind == "nvfp4_stored" and inn % 16):
                continue
            a = make_arrays(kind, out, inn)
            W64 = ref_decode(kind, a, out, inn)
            for nb, acc in ((1, False), (5, False), (8, True)):
                ok, rel, worst, fin = check_one(G.Linear(fmt, (out, inn), a), W64, nb, acc)
                nodd += 1
                if not ok:
                    failures.append(f"{kind} {out}x{inn} nb={nb} acc={acc}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
    log(f"odd shapes: {nodd} checks, {len(failures)} failures [{time.time() - t0:.1f}s]")
    for kind in args.formats:
        fmt = FMT_OF.get(kind, kind)
        for out, inn in shapes:
          try:
            t0 = time.time()
            a = make_arrays(kind, out, inn)
            lin = G.Linear(fmt, (out, inn), a)
            W64 = ref_decode(kind, a, out, inn)
            checks = []
            for nb, acc in ((1, False), (3, False), (8, False), (2, True)):
                ok, rel, worst, fin = check_one(lin, W64, nb, acc)
                checks.append((nb, acc, ok, rel, worst))
                if not ok:
                    failures.append(f"{kind} {out}x{inn} nb={nb} acc={acc}: rel {rel:.2e} worst {worst:.2e} finite {fin}")
            rows = []
            xs = {nb: cp.random.standard_normal((nb, inn), dtype=cp.float32) for nb in (1, 8)}
            ys = {nb: cp.empty((nb, out), dtype=cp.float32) for nb in (1, 8)}
            bufs = copies(a, lin.nbytes)
            cands = [(lin.config or G.default_config(lin.kind, out, inn, 1), ())]
            if args.sweep:
                cands += [(c, ()) for c in sweep_configs(kind, out, inn)]
            if args.na:
                cands += [(cands[0][0], ("BLOOMERY_NA",))]
            best = None
            for cfg, defs in cands:
                L = G.Linear(fmt, (out, inn), a, config=cfg, defines=defs)
                if cfg != cands[0][0] or defs:
                    ok, rel, worst, fin = check_one(L, W64, 1)
                    if not ok:
                        failures.append(f"{kind} {out}x{inn} {cfg} {defs}: rel {rel:.2e} worst {worst:.2e}")
                        continue
                lins = [G.Linear(fmt, (out, inn), b, config=cfg, defines=defs) for b in bufs]
                med, lo, hi = time_linears(lins, xs[1], ys[1], 1)
                rows.append({"cfg": [cfg.R, cfg.T, cfg.U, cfg.WPC], "defs": list(defs), "us": med * 1e6,
                             "us_min": lo * 1e6, "us_max": hi * 1e6})
                if best is None or med < best[0]:
                    best = (med, cfg, defs)
            default_us = rows[0]["us"]
            # batch 8 with the default config
            lins8 = [G.Linear(fmt, (out, inn), b) for b in bufs]
            med8, _, _ = time_linears(lins8, xs[8], ys[8], 8)
            rec = {"kind": kind, "out": out, "in": inn, "bytes": lin.nbytes, "checks": checks,
                   "default": [*rows[0]["cfg"]], "default_us": default_us, "best_us": best[0] * 1e6,
                   "best_cfg": [best[1].R, best[1].T, best[1].U, best[1].WPC], "best_defs": list(best[2]),
                   "b8_us": med8 * 1e6, "variants": rows}
            results.append(rec)
            gbs = lin.nbytes / best[0] / 1e9
            log(f"{kind:13s} {out:6d}x{inn:<6d} {lin.nbytes / 1e6:8.2f} MB  default {default_us:8.2f} us  "
                f"best {best[0] * 1e6:8.2f} us {rec['best_cfg']}{''.join(best[2])} {gbs:7.0f} GB/s "
                f"{100 * lin.nbytes / best[0] / bw:5.1f}%  b8 {med8 * 1e6:8.2f} us  "
                f"check {'ok' if all(c[2] for c in checks) else 'FAIL'} rel<= {max(c[3] for c in checks):.1e} "
                f"[{time.time() - t0:.1f}s]")
            del bufs, lins, lins8, W64, a
          except Exception as e:                      # keep going: one broken case must not cost the run
            import traceback
            failures.append(f"{kind} {out}x{inn}: {type(e).__name__}: {e}")
            log(traceback.format_exc())
          cp.get_default_memory_pool().free_all_blocks()

    torch_rows = []
    if args.torch:
        import torch
        for out, inn in shapes:
            nbuf = max(2, math.ceil(240e6 / (out * inn * 2)))
            ws = [torch.randn(out, inn, device="cuda", dtype=torch.bfloat16) for _ in range(min(nbuf, 200))]
            x = torch.randn(1, inn, device="cuda", dtype=torch.bfloat16)
            for w in ws[:2]:
                torch.matmul(x, w.t())
            torch.cuda.synchronize()
            n = max(len(ws), 50)
            ts = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for i in range(n):
                    torch.matmul(x, ws[i % len(ws)].t())
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3 / n)
            t = float(np.median(ts))
            torch_rows.append({"out": out, "in": inn, "us": t * 1e6, "gbs": out * inn * 2 / t / 1e9})
            del ws
            torch.cuda.empty_cache()

    (outdir / "bench_kernels.json").write_text(json.dumps(
        {"copy_bw": bw, "results": results, "torch_bf16": torch_rows, "failures": failures, "refs_bad": bad},
        indent=1))

    # -- tables --
    log("\n## per format and shape (batch 1, best config; b8 = batch 8 default config)")
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    log("| format | out x in | MB | us | GB/s | % copy | default us | b8 us | config R,T,U,WPC |")
    log("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r["best_us"] * 1e-6
        log(f"| {r['kind']} | {r['out']}x{r['in']} | {r['bytes'] / 1e6:.2f} | {r['best_us']:.2f} | "
            f"{r['bytes'] / t / 1e9:.0f} | {100 * r['bytes'] / t / bw:.1f} | {r['default_us']:.2f} | "
            f"{r['b8_us']:.2f} | {','.join(map(str, r['best_cfg']))}{' NA' if r['best_defs'] else ''} |")
    if torch_rows:
        log("| torch bf16 (cuBLAS) | " + " | ".join(f"{t['out']}x{t['in']} {t['us']:.1f} us {t['gbs']:.0f} GB/s"
                                                  for t in torch_rows) + " |")
    if not args.quick:
        log("\n## Llama-3-8B linears: 32 x (q, k, v, o, gate, up, down) + head 128256x4096")
        per_layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                     (4096, 14336)]
        by = {(r["kind"], r["out"], r["in"]): r for r in results}
        log("| format | layers ms | head ms | total ms | GB | GB/s | % copy | tok/s (linears only) | bf16 head: tok/s |")
        log("|---|---|---|---|---|---|---|---|---|")
        for kind in args.formats:
            try:
                lay = sum(by[(kind, o, i)]["best_us"] for o, i in per_layer) * 32e-6
                lb = sum(by[(kind, o, i)]["bytes"] for o, i in per_layer) * 32
                hd = by[(kind, 128256, 4096)]["best_us"] * 1e-6
                hb = by[(kind, 128256, 4096)]["bytes"]
                bh = by.get(("bf16", 128256, 4096))
            except KeyError:
                continue
            tot = lay + hd
            bf = (f"{1 / (lay + bh['best_us'] * 1e-6):.0f}" if bh else "-")
            log(f"| {kind} | {lay * 1e3:.3f} | {hd * 1e3:.3f} | {tot * 1e3:.3f} | {(lb + hb) / 1e9:.2f} | "
                f"{(lb + hb) / tot / 1e9:.0f} | {100 * (lb + hb) / tot / bw:.1f} | {1 / tot:.0f} | {bf} |")
    log(f"\nfailures: {len(failures)}; reference mismatches: {len(bad)}")
    for f in failures[:30]:
        log("  FAIL", f)
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())
