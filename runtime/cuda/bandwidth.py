"""The device's ceilings, measured: the copy bandwidth (decode kernels are judged against it) and
the BF16 tensor-core rate (prefill is judged against it)."""

from __future__ import annotations

import numpy as np


def _time(s, fn, reps: int) -> float:
    """Median seconds of fn() on stream s over `reps` runs after two warm-ups (events)."""
    import cupy as cp
    ts = []
    for _ in range(reps + 2):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        fn()
        e1.record(s)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return float(np.median(ts[2:]))


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting bytes read plus written
    (median of `reps` after two warm-ups, timed with events)."""
    import cupy as cp

    def timed():                          # the buffers live until it returns
        a = cp.ones(nbytes // 4, cp.float32)
        b = cp.empty_like(a)
        s = cp.cuda.Stream(non_blocking=True)
        return _time(s, lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes,
                                                            cp.cuda.runtime.memcpyDeviceToDevice, s.ptr), reps)
    t = timed()
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / t


def bf16_gemm_rate(n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an n x n x n cuBLAS GEMM with BF16 inputs, float32 accumulation and output (the
    prefill GEMM's configuration, runtime/cuda/gemm.py), on random normal data; median of `reps`."""
    import cupy as cp

    from . import cublas

    def timed():                          # the matrices live until it returns
        rng = cp.random.default_rng(0)
        a = (rng.standard_normal((n, n), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        b = (rng.standard_normal((n, n), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        c = cp.empty((n, n), cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        h = cublas.create(s.ptr)
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        try:
            return _time(s, lambda: cublas.gemm_ex(h, cublas.OP_T, cublas.OP_N, n, n, n, one.ctypes.data, a.data.ptr,
                                                   cublas.CUDA_R_16BF, n, b.data.ptr, cublas.CUDA_R_16BF, n,
                                                   zero.ctypes.data, c.data.ptr, cublas.CUDA_R_32F, n), reps)
        finally:
            cublas.destroy(h)
    t = timed()
    cp.get_default_memory_pool().free_all_blocks()
    return 2.0 * n ** 3 / t
