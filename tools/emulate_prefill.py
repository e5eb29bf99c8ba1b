"""The CUDA prompt GEMM's arithmetic emulated on the CPU (NumPy executor, linears of more than 8
rows replaced), to tell the bf16x2 split's error from the device's accumulation error.

    python -m bloomery.tools.emulate_prefill ARTIFACT [--accumulate exact|tc] [--kblock 16] [--bits 24]
        [--split-k K]

Teacher-forces the gate tool's 320 random ids (tools/gpu_gates.py, seed 0) through the NumPy
executor twice: as it is (float32), and with every prompt-chunk linear computed as the bf16x2
mode does (activations split into hi + lo BF16, two products summed). --accumulate exact sums
the products in float64; tc models the tensor cores' float32 accumulation: per k-block of
--kblock products, the products and the running sum are aligned to the largest of them and
truncated to --bits significant bits, then the sum is rounded to float32. --split-k K: the hi
product runs over K-deep slices of the inner dimension, their results added in IEEE float32 (what
GEMMs of depth K with beta = 1 do: lever BLOOMERY_PREFILL_SPLIT_K), the lo product over the whole
depth (runtime/cuda/gemm.py). Prints the relative L2
of the emulated logits against the float32 ones per position (max, where, median, p99).
Slow on purpose (exact per-block arithmetic): ~8 minutes for SmolLM2 with tc on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np


def _bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def tc_matmul(x: np.ndarray, W: np.ndarray, kblock: int = 16, bits: int = 24) -> np.ndarray:
    """x [r, k] @ W[o, k].T with the truncating block accumulation described above (float64 arrays of
    BF16 values in, float32 values out)."""
    acc = np.zeros((x.shape[0], W.shape[0]))
    for b in range(0, x.shape[1], kblock):
        p = x[:, None, b:b + kblock] * W[None, :, b:b + kblock]
        m = np.maximum(np.abs(p).max(-1), np.abs(acc))
        ulp = np.exp2(np.floor(np.log2(np.where(m > 0, m, 1.0))) - (bits - 1))
        acc = np.trunc(acc / ulp) * ulp + (np.trunc(p / ulp[..., None]) * ulp[..., None]).sum(-1)
        acc = acc.astype(np.float32).astype(np.float64)
    return acc


def split_matmul(x: np.ndarray, W: np.ndarray, split_k: int, kblock: int = 16, bits: int = 24) -> np.ndarray:
    """tc_matmul over slices of split_k columns, each slice's float32 result added to the running
    float32 output with round-to-nearest (cuBLAS's beta = 1 epilogue); split_k 0: one slice."""
    k = x.shape[1]
    step = split_k or k
    y = np.zeros((x.shape[0], W.shape[0]), np.float32)
    for c in range(0, k, step):
        y = (y + tc_matmul(x[:, c:c + step], W[:, c:c + step], kblock, bits).astype(np.float32)).astype(np.float32)
    return y.astype(np.float64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--accumulate", choices=("exact", "tc"), default="tc")
    ap.add_argument("--kblock", type=int, default=16)
    ap.add_argument("--bits", type=int, default=24)
    ap.add_argument("--positions", type=int, default=320)
    ap.add_argument("--split-k", type=int, default=0, help="tc: GEMMs over slices this deep, summed in float32")
    a = ap.parse_args(argv)
    from bloomery.runtime import Engine, logits
    from bloomery.runtime.ops import IMPL

    eng = Engine(a.artifact, device="cpu", ctx=a.positions + 80, ubatch=64)
    rng = np.random.default_rng(0)                       # the gate tool's draws: 12 prompt ids, then these
    rng.integers(0, eng.vocab_size, 12)
    ids = [int(i) for i in rng.integers(0, eng.vocab_size, a.positions)]
    ref = logits(eng, ids)
    orig = IMPL["linear"].run

    def emulated(op, buf, w):
        x = buf[op["x"]]
        if x.shape[0] <= 8:                              # decode rows: the GEMV path, float32
            return orig(op, buf, w)
        pq = w.pre_quant.get(op["weight"])
        if pq is not None:
            x = x * pq
        hi = _bf16(x)
        lo = _bf16((x.astype(np.float64) - hi).astype(np.float32))
        W = np.asarray(w[op["weight"]], np.float64)
        if a.accumulate == "exact":
            y = hi @ W.T + lo @ W.T
        else:
            y = split_matmul(hi, W, a.split_k, a.kblock, a.bits) + split_matmul(lo, W, 0, a.kblock, a.bits)   # gemm.py: lo whole
        buf[op["out"]][...] = y.astype(np.float32)

    t0 = time.perf_counter()
    IMPL["linear"].run = emulated
    try:
        emu = logits(Engine(a.artifact, device="cpu", ctx=a.positions + 80, ubatch=64), ids)
    finally:
        IMPL["linear"].run = orig
    rel = np.linalg.norm(emu - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    i = int(np.argmax(rel))
    sk = f", split-k {a.split_k}" if a.split_k and a.accumulate == "tc" else ""
    print(f"{a.artifact.name}: bf16x2 with {a.accumulate} accumulation{sk} vs float32: max rel L2 {rel.max():.2e} at "
          f"position {i}, median {np.median(rel):.2e}, p99 {np.quantile(rel, 0.99):.2e} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
