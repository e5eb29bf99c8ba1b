"""Decode attention alone on the GPU (runtime/cuda/attention_decode.cu): one row attending n cached
keys, timed over as many layers' caches as it takes to exceed the L2 (each launch reads keys and
values from HBM, as a decode step's 32 layers do), against the device copy bandwidth measured in the
same run. Compares the split counts (--waves: the CTAs a multiprocessor the splits aim at).

    python -m bloomery.tools.bench_attention [--shapes llama3-8b smollm2-135m] [--contexts 1024 8192 32768]
        [--cache-types f32 f16] [--forms fma tc] [--waves 2 4 6 8] [--rounds 3]

Per row: the splits and CTAs, us a launch (median), the bytes it must read (keys and values at the
cache's type, the query; the output and partials are small), GB/s and % of the copy bandwidth.
Rounds alternate the --waves settings. Prints a table last."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64), "qwen3-next-80b-a3b": (16, 2, 256)}


FORMS = {"fma": (False, 2), "tc": (True, 2), "tc3": (True, 3), "tc4": (True, 4)}   # (tensor cores, stages)


def bench(shape: str, n: int, cache: str, waves: int, reps: int = 20, l2_bytes: int = 1 << 29,
          form: str = "fma") -> dict:
    import cupy as cp

    from bloomery.runtime.cuda import attention_decode as AD
    from bloomery.runtime.cuda import ops as K
    H, KV, D = SHAPES[shape]
    code = K.CACHE_CODE[cache]
    per = n * KV * D * (4 if code == 0 else 2)           # bytes of one layer's keys (values the same)
    layers = max(2, -(-l2_bytes // (2 * per)))
    dt = cp.float32 if code == 0 else cp.uint16
    rng = cp.random.default_rng(n + KV)
    caches = []
    for _ in range(layers):
        kv = rng.standard_normal((2, 1, n, KV, D), dtype=cp.float32)
        if code == 1:
            kv = (kv.view(cp.uint32) >> 16).astype(cp.uint16)
        elif code == 2:
            kv = kv.astype(cp.float16).view(cp.uint16)
        caches.append(kv)
    q = rng.standard_normal((1, H * D), dtype=cp.float32) * 0.3
    pos, slot = cp.asarray([n - 1], cp.int32), cp.zeros(1, cp.int32)
    out = cp.empty((1, H * D), cp.float32)
    pool: dict = {}

    def take(key, shp, dtype=np.float32):
        return pool.setdefault((key, shp), cp.zeros(shp, dtype))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    S = AD.splits(KV, 1, n, sms, waves)
    tc, stages = FORMS[form]
    steps = [AD.bind(q, c[0], c[1], pos, slot, out, 1, H, KV, D, 1 / np.sqrt(D), take, sms=sms, cache=(code, code),
                     waves=waves, tc=tc, stages=stages) for c in caches]
    s = cp.cuda.get_current_stream()
    for f in steps:
        f()
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for f in steps:
            f()
        e1.record(s)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / len(steps))
    t = float(np.median(ts))
    nbytes = 2 * per + H * D * 4
    return {"shape": shape, "context": n, "cache": cache, "form": form, "waves": waves, "splits": S, "ctas": KV * S,
            "us": t * 1e6, "bytes": nbytes, "gb_s": nbytes / t / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768])
    ap.add_argument("--cache-types", nargs="+", default=["f32", "f16"], choices=["f32", "f16", "bf16"])
    ap.add_argument("--waves", nargs="+", type=int, default=[2, 4, 6, 8])
    ap.add_argument("--forms", nargs="+", default=["fma"], choices=sorted(FORMS),
                    help="fma: float32 FMAs (every cache type); tc, tc3, tc4: the tensor cores (16-bit caches), "
                         "2, 3 or 4 chunks in flight a warp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    from bloomery.runtime.cuda.bandwidth import copy_bandwidth
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows: dict = {}
    for rnd in range(a.rounds):
        for shape in a.shapes:
            for n in a.contexts:
                for cache in a.cache_types:
                    forms = [f for f in a.forms if f == "fma" or cache != "f32"]
                    for form in (forms if rnd % 2 == 0 else forms[::-1]):
                        for w in (a.waves if rnd % 2 == 0 else a.waves[::-1]):
                            r = bench(shape, n, cache, w, form=form)
                            rows.setdefault((shape, n, cache, form, w), []).append(r)
                            print(json.dumps(r), flush=True)
    print("\n| shape | keys | cache | form | waves | splits | CTAs | us a launch (median of rounds) | GB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for (shape, n, cache, form, w), rs in rows.items():
        us = float(np.median([r["us"] for r in rs]))
        gb = rs[0]["bytes"] / us / 1e3
        out.append({**rs[0], "us": us, "gb_s": gb, "rounds": [r["us"] for r in rs]})
        print(f"| {shape} | {n} | {cache} | {form} | {w} | {rs[0]['splits']} | {rs[0]['ctas']} | {us:.1f} | {gb:.0f} | "
              f"{100 * gb * 1e9 / bw:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"copy_bw": bw, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
