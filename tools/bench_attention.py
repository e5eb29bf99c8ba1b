"""Decode attention alone on the GPU (runtime/cuda/attention_decode.cu): one row (or --rows) attending n cached
keys, timed over as many layers' caches as it takes to exceed the L2 (each launch reads keys and
values from HBM, as a decode step's 32 layers do), against the device copy bandwidth measured in the
same run. Compares the split counts (--waves: the CTAs a multiprocessor the splits aim at).

    python -m bloomery.tools.bench_attention [--shapes llama3-8b smollm2-135m] [--contexts 1024 8192 32768]
        [--cache-types f32 f16] [--forms fma tc] [--waves 2 4 6 8] [--rounds 3] [--rows 1 16]

--rows: decode rows in one launch (slots, each attending its own n keys), as a step of several slots;
--splits: also exactly these context splits (the waves column reads S<n>); --waves 0: the rule's splits
(attention_decode.splits: the tensor-core form at most one CTA a multiprocessor).
Per row: the splits and CTAs, us a launch (median), the bytes it must read (keys and values at the
cache's type, the query; the output and partials are small), GB/s and % of the copy bandwidth.
Rounds alternate the --waves settings. Prints a table last, whose last column says whether a variant of the FMA
form (--forms fma8 fma-u8 fma8-u8: 8 warps a CTA, the P.V loop unrolled by 8) wrote the fma form's output bit for
bit. --graph: the launches replayed from one CUDA graph (at short contexts the host's launch rate otherwise
sets the time).

    python -m bloomery.tools.bench_attention --chunk [--shapes llama3-8b] [--contexts 512 4096] [--rounds 3]

--chunk times the prompt-chunk attention instead (a chunk of n rows at positions 0..n-1 of one slot, the
whole causal triangle): the CUDA-core kernel (fma) against the tensor-core one (attention_chunk.cu) in its
variants (keys a tile, register prefetch), alternating, with the useful TFLOP/s (4 x heads x head_dim a
(row, key) pair) and the largest relative L2 of a (row, head) against the fma kernel's output."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64), "qwen3-next-80b-a3b": (16, 2, 256),
          "qwen3-30b-a3b": (32, 4, 128)}


# (tensor cores, stages, warps, P.V unroll): the FMA form at 4 or 8 warps a CTA, its P.V loop as the compiler
# unrolls it or by 8 (attention_decode.kernel_name); the tensor-core form at 2, 3 or 4 chunks in flight a warp
FORMS = {"fma": (False, 2, 4, 0), "fma-u8": (False, 2, 4, 8), "fma8": (False, 2, 8, 0), "fma8-u8": (False, 2, 8, 8),
         "tc": (True, 2, 4, 0), "tc3": (True, 3, 4, 0), "tc4": (True, 4, 4, 0)}


def bench(shape: str, n: int, cache: str, waves: int, reps: int = 20, l2_bytes: int = 1 << 29,
          form: str = "fma", rows: int = 1, splits: int | None = None, graph: bool = False) -> dict:
    import cupy as cp

    from bloomery.runtime.cuda import attention_decode as AD
    from bloomery.runtime.cuda import ops as K
    H, KV, D = SHAPES[shape]
    code = K.CACHE_CODE[cache]
    per = rows * n * KV * D * (4 if code == 0 else 2)    # bytes of one layer's keys, all rows (values the same)
    layers = max(2, -(-l2_bytes // (2 * per)))
    dt = cp.float32 if code == 0 else cp.uint16
    rng = cp.random.default_rng(n + KV)
    caches = []
    for _ in range(layers):
        kv = rng.standard_normal((2, rows, n, KV, D), dtype=cp.float32)
        if code == 1:
            kv = (kv.view(cp.uint32) >> 16).astype(cp.uint16)
        elif code == 2:
            kv = kv.astype(cp.float16).view(cp.uint16)
        caches.append(kv)
    q = rng.standard_normal((rows, H * D), dtype=cp.float32) * 0.3
    pos, slot = cp.full(rows, n - 1, cp.int32), cp.arange(rows, dtype=cp.int32)     # row r: slot r, n keys
    out = cp.empty((rows, H * D), cp.float32)
    pool: dict = {}

    def take(key, shp, dtype=np.float32):
        return pool.setdefault((key, shp), cp.zeros(shp, dtype))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    if splits:                                           # exactly this many splits (capped at one per 64 keys)
        sms, waves = splits * KV * rows, 1
    tc, stages, warps, pvu = FORMS[form]
    waves = waves or None                                # 0: the rule's (runtime/cuda/attention_decode.splits)
    S = AD.splits(KV, rows, n, sms, waves, tc)
    steps = [AD.bind(q, c[0], c[1], pos, slot, out, rows, H, KV, D, 1 / np.sqrt(D), take, sms=sms, cache=(code, code),
                     waves=waves, tc=tc, stages=stages, warps=warps, pv_unroll=pvu) for c in caches]
    s = cp.cuda.Stream(non_blocking=True) if graph else cp.cuda.get_current_stream()

    def layers_once():
        for f in steps:
            f()
    with s:
        layers_once()
        s.synchronize()
        run = layers_once
        if graph:                                        # every layer's launch in one graph, replayed
            s.begin_capture()
            layers_once()
            run = s.end_capture().launch
        digest = hash(cp.asnumpy(out).tobytes())
        ts = []
        for _ in range(reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            run()
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / len(steps))
    t = float(np.median(ts))
    nbytes = 2 * per + rows * H * D * 4
    return {"shape": shape, "rows": rows, "context": n, "cache": cache, "form": form, "waves": waves, "splits": S,
            "ctas": KV * rows * S,
            "us": t * 1e6, "bytes": nbytes, "gb_s": nbytes / t / 1e9, "digest": digest}


CHUNK_FORMS = {"fma": None, "tc-bn32-pf": (32, 1), "tc-bn32": (32, 0), "tc-bn64": (64, 0)}


def bench_chunk(shape: str, n: int, cache: str, forms, rounds: int, reps: int = 10) -> list:
    import cupy as cp

    from bloomery.runtime.cuda import attention_chunk as AC
    from bloomery.runtime.cuda import ops as K
    H, KV, D = SHAPES[shape]
    code = K.CACHE_CODE[cache]
    rng = cp.random.default_rng(n + KV)
    kv = rng.standard_normal((2, 1, n, KV, D), dtype=cp.float32)
    if code == 1:
        kv = (kv.view(cp.uint32) >> 16).astype(cp.uint16)
    elif code == 2:
        kv = kv.astype(cp.float16).view(cp.uint16)
    q = rng.standard_normal((n, H * D), dtype=cp.float32) * 0.3
    pos, slot = cp.arange(n, dtype=cp.int32), cp.zeros(n, cp.int32)
    outs, steps = {}, {}
    for f in forms:
        outs[f] = cp.empty((n, H * D), cp.float32)
        if CHUNK_FORMS[f] is None:
            steps[f] = AC.bind_fma(q, kv[0], kv[1], pos, slot, outs[f], n, H, KV, D, 1 / np.sqrt(D), cache=(code, code))
        else:
            bn, pf = CHUNK_FORMS[f]
            steps[f] = AC.bind(q, kv[0], kv[1], pos, slot, outs[f], n, H, KV, D, 1 / np.sqrt(D), cache=(code, code),
                               bn=bn, pf=pf)
        steps[f]()
    s = cp.cuda.get_current_stream()
    ts = {f: [] for f in forms}
    for rnd in range(rounds):
        for f in (forms if rnd % 2 == 0 else forms[::-1]):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            for _ in range(reps):
                steps[f]()
            e1.record(s)
            e1.synchronize()
            ts[f].append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps)
    flops = 4 * H * D * n * (n + 1) / 2
    ref = outs.get("fma")
    rows = []
    for f in forms:
        t = float(np.median(ts[f]))
        err = None
        if ref is not None and f != "fma":
            a, b = outs[f].reshape(n, H, D), ref.reshape(n, H, D)
            err = float(cp.max(cp.linalg.norm(a - b, axis=-1) / cp.linalg.norm(b, axis=-1)))
        rows.append({"shape": shape, "rows": n, "cache": cache, "form": f, "ms": t * 1e3, "tflops": flops / t / 1e12,
                     "rounds_ms": [x * 1e3 for x in ts[f]], "rel_vs_fma": err})
    return rows


def main_chunk(a) -> int:
    forms = a.chunk_forms
    out = []
    for shape in a.shapes:
        for n in a.contexts:
            for cache in a.cache_types:
                rs = bench_chunk(shape, n, cache, forms, a.rounds)
                for r in rs:
                    print(json.dumps(r), flush=True)
                out += rs
    print("\n| shape | rows (keys 0..pos) | cache | form | ms (median of rounds) | TFLOP/s | x fma | max rel L2 vs fma |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        base = next((x["ms"] for x in out if x["form"] == "fma" and x["shape"] == r["shape"] and x["rows"] == r["rows"]
                     and x["cache"] == r["cache"]), None)
        sp = f"{base / r['ms']:.2f}" if base else "-"
        e = f"{r['rel_vs_fma']:.1e}" if r["rel_vs_fma"] is not None else "-"
        print(f"| {r['shape']} | {r['rows']} | {r['cache']} | {r['form']} | {r['ms']:.3f} | {r['tflops']:.1f} | {sp} | {e} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": out}, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768])
    ap.add_argument("--cache-types", nargs="+", default=["f32", "f16"], choices=["f32", "f16", "bf16"])
    ap.add_argument("--waves", nargs="+", type=int, default=[2, 4, 6, 8])
    ap.add_argument("--forms", nargs="+", default=["fma"], choices=sorted(FORMS),
                    help="fma: float32 FMAs (every cache type; fma8: 8 warps a CTA, -u8: the P.V loop unrolled by 8); "
                         "tc, tc3, tc4: the tensor cores (16-bit caches), 2, 3 or 4 chunks in flight a warp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true",
                    help="time the layers' launches replayed from one CUDA graph (no host launch cost; a decode step's gaps)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1], help="decode rows (slots), each its own n keys")
    ap.add_argument("--splits", nargs="*", type=int, default=[], help="also these split counts, whatever the waves")
    ap.add_argument("--chunk", action="store_true", help="time the prompt-chunk attention (--contexts: chunk rows)")
    ap.add_argument("--chunk-forms", nargs="+", default=list(CHUNK_FORMS), choices=list(CHUNK_FORMS))
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.chunk:
        return main_chunk(a)
    from bloomery.runtime.cuda.bandwidth import copy_bandwidth
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows: dict = {}
    for rnd in range(a.rounds):
        for shape in a.shapes:
            for n in a.contexts:
                for cache in a.cache_types:
                    forms = [f for f in a.forms if not FORMS[f][0] or cache != "f32"]
                    for form in (forms if rnd % 2 == 0 else forms[::-1]):
                        for nr in a.rows:
                            runs = [(w, None) for w in a.waves] + [(f"S{k}", k) for k in a.splits]
                            for w, k in (runs if rnd % 2 == 0 else runs[::-1]):
                                r = bench(shape, n, cache, 1 if k else w, form=form, rows=nr, splits=k, graph=a.graph)
                                rows.setdefault((shape, nr, n, cache, form, w), []).append(r)
                                print(json.dumps(r), flush=True)
    print("\n| shape | rows | keys | cache | form | waves | splits | CTAs | us a launch (median of rounds) | GB/s | % copy "
          "| output = fma's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for (shape, nr, n, cache, form, w), rs in rows.items():
        us = float(np.median([r["us"] for r in rs]))
        gb = rs[0]["bytes"] / us / 1e3
        out.append({**rs[0], "us": us, "gb_s": gb, "rounds": [r["us"] for r in rs]})
        ref = rows.get((shape, nr, n, cache, "fma", w))
        same = "-" if ref is None or form == "fma" else ("bitwise" if ref[0]["digest"] == rs[0]["digest"] else "differs")
        print(f"| {shape} | {nr} | {n} | {cache} | {form} | {w} | {rs[0]['splits']} | {rs[0]['ctas']} | {us:.1f} | {gb:.0f} | "
              f"{100 * gb * 1e9 / bw:.1f} | {same} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"copy_bw": bw, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
