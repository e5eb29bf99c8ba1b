"""Batch-1 decode on the GPU: synthetic checkpoints of real shapes, made and prepared here, run by
the CUDA executor (one CUDA graph per step), against the device copy bandwidth measured in the
same run and against Hugging Face transformers (torch, bf16) on the same shape.

    python -m bloomery.tools.bench_decode [--shapes smollm2-135m llama3-8b] [--steps 256]
        [--peer] [--work DIR] [--out DIR] [--layers shape=N ...]

Per shape: load time (and upload GB/s), decode tok/s through Engine.decode (the host feeds the
token, reads back the next id: one sync per token), ms/token, weight bytes read per token (the
linears', the head's, the top-k experts', the embedding row), achieved GB/s and % of the copy
bandwidth; also the graph replayed back to back (no host in the loop) for the device-side time.
--peer: HF transformers in bf16 (random init, same config): eager (DynamicCache) and a
StaticCache decode loop under torch.compile(mode="reduce-overhead", fullgraph=True).
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bloomery.runtime.cuda.bandwidth import bf16_gemm_rate, copy_bandwidth


def log(*a):
    print(*a, flush=True)


def bench_cuda(art: Path, steps: int, prompt_len: int = 16) -> dict:
    import cupy as cp

    from bloomery.runtime import Engine
    t0 = time.perf_counter()
    eng = Engine(art, device="cuda", ctx=prompt_len + steps + 64, ubatch=64)
    load_s = time.perf_counter() - t0
    ex = eng.exec
    rng = np.random.default_rng(0)
    prompt = [int(i) for i in rng.integers(0, eng.vocab_size, prompt_len)]
    t1 = time.perf_counter()
    row = eng.prefill(prompt, last_only=True)
    prefill_s = time.perf_counter() - t1
    tok = int(np.argmax(row))
    for _ in range(8):                            # warm
        _, nxt = eng.decode([tok], logits=False)
        tok = int(nxt[0])
    t2 = time.perf_counter()
    n = steps - 8
    for _ in range(n):
        _, nxt = eng.decode([tok], logits=False)
        tok = int(nxt[0])
    dt = (time.perf_counter() - t2) / n
    # the graph alone, replayed back to back (positions stay: the same attention length)
    g = ex.graph.get("decode")
    replay = None
    if g is not None:
        s = ex.stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(50):
            g.launch(s)
        e1.record(s)
        e1.synchronize()
        replay = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 50
    prof = ex.profile("decode", reps=20) if g is not None else {}
    return {"profile": {k: [round(v[0], 4), v[1]] for k, v in prof.items()},"load_s": load_s, "upload_gb": ex.w.nbytes / 1e9, "upload_s": ex.w.upload_s,
            "warm_s": ex.warm_s, "prefill_s": prefill_s, "s_per_tok": dt, "replay_s": replay,
            "bytes_per_tok": ex.decode_bytes, "kernels": len(ex.steps["decode"])}


def bench_prefill(art: Path, n: int, mode: str | None = None) -> dict:
    """One prompt of n tokens in one chunk (ubatch n): the prefill program's graph replayed (device
    time), the end-to-end Engine.prefill (host included), the useful FLOPs (linears, experts, head,
    causal attention) and the per-op-kind split."""
    import cupy as cp

    from bloomery.runtime import Engine
    old = os.environ.get("BLOOMERY_PREFILL_GEMM")
    if mode:
        os.environ["BLOOMERY_PREFILL_GEMM"] = mode              # the lever, read by the executor
    try:
        eng = Engine(art, device="cuda", ctx=n + 8, ubatch=n)
    finally:
        if old is None:
            os.environ.pop("BLOOMERY_PREFILL_GEMM", None)
        else:
            os.environ["BLOOMERY_PREFILL_GEMM"] = old
    ex = eng.exec
    rng = np.random.default_rng(1)
    prompt = [int(i) for i in rng.integers(0, eng.vocab_size, n)]
    t0 = time.perf_counter()
    eng.prefill(prompt, last_only=True)
    wall = time.perf_counter() - t0
    s, g = ex.stream, ex.graph["prefill"]
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    g.launch(s)
    e0.record(s)
    for _ in range(3):
        g.launch(s)                              # same inputs: the same cache rows rewritten
    e1.record(s)
    e1.synchronize()
    dev = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / 3
    f = ex.flops["prefill"]
    flops = f["linear"] + f["attention_per_key"] * n * (n + 1) // 2
    prof = ex.profile("prefill", reps=2)
    res = {"n": n, "wall_s": wall, "device_s": dev, "flops": flops, "linear_flops": f["linear"],
           "profile": {k: [round(v[0], 3), v[1]] for k, v in prof.items()}, "gemm_mode": ex.gemm_mode}
    del eng, ex, g
    cp.get_default_memory_pool().free_all_blocks()
    return res


def bench_peer(ckpt: Path, steps: int, prompt_len: int = 16, compiled: bool = True) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache
    cfg = AutoConfig.from_pretrained(ckpt)
    cfg.torch_dtype = torch.bfloat16
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")
    res = {"peer_bytes": nbytes}
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)          # eager, DynamicCache
        pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            if i == 8:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=pkv, use_cache=True)
            pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        res["eager_s_per_tok"] = (time.perf_counter() - t0) / (steps - 8)
        del pkv, out
        if compiled:
            t0 = time.perf_counter()
            cache = StaticCache(config=model.config, max_cache_len=prompt_len + steps + 16)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(prompt_len, device="cuda"))
            tok = out.logits[:, -1:].argmax(-1)

            def step(t, pos):
                return model(input_ids=t, past_key_values=cache, use_cache=True, cache_position=pos).logits

            cstep = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            for i in range(steps):
                if i == 8:
                    torch.cuda.synchronize()
                    res["compile_s"] = time.perf_counter() - t0
                    t1 = time.perf_counter()
                torch.compiler.cudagraph_mark_step_begin()
                lg = cstep(tok, torch.tensor([prompt_len + i], device="cuda"))
                tok = lg[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            res["compiled_s_per_tok"] = (time.perf_counter() - t1) / (steps - 8)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["smollm2-135m", "llama3-8b"])
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--layers", nargs="*", default=[], help="shape=N: fewer layers than the real model")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--peer-shapes", nargs="*", default=None, help="run the peer on these only (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="peer: eager only")
    ap.add_argument("--prefill", nargs="*", type=int, default=[512, 4096], help="prompt lengths timed in one chunk")
    ap.add_argument("--prefill-modes", nargs="*", default=[None],
                    help="BLOOMERY_PREFILL_GEMM settings to time prefill in (default: the lever's setting)")
    ap.add_argument("--prefill-shapes", nargs="*", default=None, help="time prefill on these only (default: all)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bloomery-bench"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from bloomery.compiler.prepare import prepare
    from bloomery.tools import synthetic
    layers = {k: int(v) for k, v in (x.split("=") for x in a.layers)}
    bw = copy_bandwidth()
    log(f"copy bandwidth (D2D 2 GiB, read + write, median of 10): {bw / 1e12:.3f} TB/s")
    tc = bf16_gemm_rate() if a.prefill else 0.0
    if tc:
        log(f"bf16 tensor-core rate (cuBLAS 8192^3, bf16 in, f32 accumulate and out, median of 10): {tc / 1e12:.1f} TFLOP/s")
    rows = []
    for shape in a.shapes:
        r = {"shape": shape, "format": a.format, "layers": layers.get(shape, synthetic.SHAPES[shape]["layers"])}
        ck, art = a.work / f"{shape}-{a.format}-ckpt", a.work / f"{shape}-{a.format}"
        try:
            if not art.exists():
                t0 = time.perf_counter()
                synthetic.write(shape, ck, a.format, layers=layers.get(shape))
                r["synthetic_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                prepare(ck, art, progress=False)
                r["prepare_s"] = time.perf_counter() - t0
                log(f"{shape}: synthetic {r['synthetic_s']:.1f} s, prepare {r['prepare_s']:.1f} s")
            r.update(bench_cuda(art, a.steps))
            r["gb_s"] = r["bytes_per_tok"] / r["s_per_tok"] / 1e9
            r["pct_copy"] = 100 * r["bytes_per_tok"] / r["s_per_tok"] / bw
            log(json.dumps(r))
            if a.prefill_shapes is None or shape in a.prefill_shapes:
                r["prefill"] = []
                for n, mode in ((n, m) for m in a.prefill_modes for n in a.prefill):
                    try:
                        p = bench_prefill(art, n, mode)
                        p["pct_tc"] = 100 * p["flops"] / p["device_s"] / tc
                    except Exception as e:
                        import traceback
                        traceback.print_exc()
                        p = {"n": n, "error": f"{type(e).__name__}: {e}"}
                    r["prefill"].append(p)
                    log(json.dumps(p))
            if a.peer and (a.peer_shapes is None or shape in a.peer_shapes):
                import torch        # the peer needs torch; bloomery does not
                r.update(bench_peer(ck, a.steps, compiled=not a.no_compile))
                torch.cuda.empty_cache()             # the peer's model is gone with bench_peer's frame
                log(json.dumps(r))
        except Exception as e:
            import traceback
            traceback.print_exc()
            r["error"] = f"{type(e).__name__}: {e}"
        rows.append(r)
        import shutil
        shutil.rmtree(ck, ignore_errors=True)
        try:
            import cupy as cp
            cp.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_decode.json").write_text(json.dumps({"copy_bw": bw, "bf16_tc": tc, "rows": rows}, indent=1,
                                                            default=str))
    log()
    log("decode device time per op kind (each kind's launches replayed alone from a graph; ms per token, launches):")
    for r in rows:
        if r.get("profile"):
            tot = sum(v[0] for v in r["profile"].values())
            parts = ", ".join(f"{k} {v[0]:.3f} ({v[1]})" for k, v in sorted(r["profile"].items(), key=lambda kv: -kv[1][0]))
            log(f"  {r['shape']}: sum {tot:.3f} ms over {r['kernels']} launches: {parts}")
    log()
    if tc:
        log(f"prefill (one chunk; device time of the prefill graph; bf16 tensor-core rate {tc / 1e12:.1f} TFLOP/s):")
        log("| shape | tokens | mode | ms (device) | tok/s | TFLOP/s | % tc | wall ms | top op kinds (ms) |")
        log("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            for p in r.get("prefill", []):
                if "error" in p:
                    log(f"| {r['shape']} | {p['n']} | ERROR {p['error'][:80]} |")
                    continue
                top = ", ".join(f"{k} {v[0]:.1f}" for k, v in sorted(p["profile"].items(), key=lambda kv: -kv[1][0])[:3])
                log(f"| {r['shape']} | {p['n']} | {p['gemm_mode']} | {1e3 * p['device_s']:.1f} | {p['n'] / p['device_s']:.0f} | "
                    f"{p['flops'] / p['device_s'] / 1e12:.1f} | {p['pct_tc']:.1f} | {1e3 * p['wall_s']:.1f} | {top} |")
        log()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    log("| shape | fmt | layers | load s (upload GB/s) | tok/s | ms/tok | graph ms/tok | MB/tok | GB/s | % copy "
        "| peer eager tok/s | peer compiled tok/s | x compiled peer |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "s_per_tok" not in r:
            log(f"| {r['shape']} | {r['format']} | {r['layers']} | ERROR {r.get('error', '')[:90]} |")
            continue
        pe = f"{1 / r['eager_s_per_tok']:.1f}" if "eager_s_per_tok" in r else "-"
        pc = f"{1 / r['compiled_s_per_tok']:.1f}" if "compiled_s_per_tok" in r else "-"
        ratio = f"{r['compiled_s_per_tok'] / r['s_per_tok']:.2f}" if "compiled_s_per_tok" in r else "-"
        rp = f"{1e3 * r['replay_s']:.3f}" if r.get("replay_s") else "-"
        up = r["upload_gb"] / r["upload_s"] if r["upload_s"] else 0
        log(f"| {r['shape']} | {r['format']} | {r['layers']} | {r['load_s']:.2f} ({up:.1f}) | {1 / r['s_per_tok']:.1f} | "
            f"{1e3 * r['s_per_tok']:.3f} | {rp} | {r['bytes_per_tok'] / 1e6:.1f} | {r['gb_s']:.0f} | "
            f"{r['pct_copy']:.1f} | {pe} | {pc} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
