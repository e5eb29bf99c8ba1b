"""Synthetic rank plans for the artifact tests, and a driver that publishes one in a
subprocess (kill, concurrency and RSS tests).

    python tests/artifact_driver.py OUT --tensors N --mb M [--tp T] [--seed S] [--max-shard MB]

prints 'ok <peak RSS (VmHWM) KiB> <seconds>' when done."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bloomery.compiler.planned import PlannedTensor, RankPlan  # noqa: E402

FORMATS = ("nvfp4", "fp8_block128", "bf16", "mxfp4", "nvfp4")


def synthetic_parts(fmt: str, shape, seed: int) -> dict:
    """Random valid parts of `fmt` generated from the seed (cheap: random bytes, scales drawn
    from the valid codes)."""
    rng = np.random.default_rng(seed)
    import ml_dtypes
    lead, out, inn = tuple(shape[:-2]), shape[-2], shape[-1]
    rows = int(np.prod(shape[:-1]))
    if fmt == "nvfp4":
        w = np.frombuffer(rng.bytes(rows * inn // 2), np.uint8).reshape(*shape[:-1], inn // 2)
        s = rng.integers(0x08, 0x60, (*shape[:-1], inn // 16), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        s2 = rng.uniform(1e-4, 1e-2, lead or ()).astype(np.float32)
        return {"weight": w, "scale": s, "scale_2": s2, "input_scale": np.float32(0.5)}
    if fmt == "mxfp4":
        w = np.frombuffer(rng.bytes(rows * inn // 2), np.uint8).reshape(*shape[:-1], inn // 2)
        return {"weight": w, "scale": rng.integers(100, 140, (*shape[:-1], inn // 32), dtype=np.uint8)}
    if fmt == "fp8_block128":
        b = np.frombuffer(rng.bytes(rows * inn), np.uint8).reshape(shape) & np.uint8(0xF7)   # no NaN codes
        s = rng.uniform(1e-3, 1, (*lead, -(-out // 128), -(-inn // 128))).astype(np.float32)
        return {"weight": b.view(ml_dtypes.float8_e4m3fn), "scale": s}
    if fmt == "bf16":
        b = np.frombuffer(rng.bytes(rows * inn * 2), np.uint16).reshape(shape)
        return {"weight": b.view(ml_dtypes.bfloat16)}
    raise KeyError(fmt)


def tensor(name: str, fmt: str, shape, seed: int) -> PlannedTensor:
    opt = ("input_scale",) if fmt == "nvfp4" else ()
    return PlannedTensor(name=name, role="ffn_up", format=fmt, shape=tuple(shape), optional=opt,
                         sources=(f"model.{name}.weight",), cut="column",
                         produce=lambda: synthetic_parts(fmt, shape, seed))


def plans(n_tensors: int, mb: float, tp: int = 1, seed: int = 0, fmts=FORMATS) -> list[RankPlan]:
    """tp rank plans of n_tensors each, about `mb` MB of weight bytes per tensor."""
    res = []
    for r in range(tp):
        ts = []
        for i in range(n_tensors):
            fmt = fmts[i % len(fmts)]
            inn = 1024
            bpe = {"nvfp4": 0.5, "mxfp4": 0.5, "fp8_block128": 1, "bf16": 2}[fmt]
            out = max(1, int(mb * 1e6 / (inn * bpe)))
            shape = (out, inn) if i % 3 else (2, max(1, out // 2), inn)
            ts.append(tensor(f"blk.{i}.ffn_up", fmt, shape, seed * 100003 + r * 1009 + i))
        res.append(RankPlan(rank=r, tp=tp, tensors=ts,
                            metadata={"general.architecture": "llama", "llama.block_count": n_tensors,
                                      "llama.rope.freq_base": 10000.0, "general.name": f"synthetic-{seed}"}))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard", type=float, default=4096, help="MB")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-exchange", action="store_true", help="force the two-rename fallback swap")
    a = ap.parse_args()
    from bloomery.compiler import publish as pub
    from bloomery.compiler.publish import publish
    if a.no_exchange:
        pub._exchange = lambda src, dst: False
    t0 = time.perf_counter()
    publish(a.out, plans(a.tensors, a.mb, a.tp, a.seed, tuple(a.formats.split(","))),
            tokenizer_json='{"model": {}}', chat_template="{{ messages }}",
            max_shard_bytes=int(a.max_shard * 1e6), progress=False)
    # VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over exec)
    hwm = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)
    print("ok", hwm, f"{time.perf_counter() - t0:.2f}", flush=True)


if __name__ == "__main__":
    main()
