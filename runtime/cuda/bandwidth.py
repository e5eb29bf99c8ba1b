"""The device's copy bandwidth, measured: the ceiling decode kernels are judged against."""

from __future__ import annotations

import numpy as np


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting bytes read plus written
    (median of `reps` after two warm-ups, timed with events)."""
    import cupy as cp
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    s = cp.cuda.Stream(non_blocking=True)
    ts = []
    for _ in range(reps + 2):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)
        e1.record(s)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / float(np.median(ts[2:]))
