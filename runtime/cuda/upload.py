"""Weights to the GPU through pinned staging: host arrays (the artifact's mmapped tensors) copied to
device arrays in chunks, each chunk first copied into one of a few pinned buffers by several host
threads (page-cache pages touched in parallel), then moved by the copy engine while the next chunk
is staged. A pageable `cupy.asarray` of an mmapped array does both steps one after the other on one
thread (measured 1.3 GB/s for the 8B shape's 6 GB on the H200 machine).

    up = Uploader()
    d = up.put(host_array)        # a device array; its bytes land asynchronously
    up.finish()                   # every put has landed (the executor calls it before its first kernel);
                                  # the pinned buffers and the copy threads are freed

The copies run on a blocking stream: work on CuPy's default (legacy null) stream, such as the
bind-time transforms of some weights, waits for them, while the executor's own (non-blocking)
stream is ordered by finish(). `BLOOMERY_UPLOAD=plain` (specs/levers.yaml) uses cupy.asarray."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

CHUNK = 32 << 20                         # bytes a staging buffer holds
DEPTH = 4                                # staging buffers in rotation
THREADS = 4                              # host threads copying a chunk into its buffer
PIECE = 4 << 20                          # a chunk's share a thread copies at least


class Uploader:
    def __init__(self, chunk: int = CHUNK, depth: int = DEPTH, threads: int = THREADS):
        self.chunk, self.depth = int(chunk), int(depth)
        self.stream = cp.cuda.Stream(non_blocking=False)
        self._bufs: list = []            # pinned buffers, made on first use
        self._events: list = [None] * self.depth
        self.threads = max(1, min(int(threads), os.cpu_count() or 1))
        self._pool = None                # host copy threads, made on first use, ended by finish()
        self._i = 0
        self.nbytes = 0

    def _buffer(self, i: int):
        while len(self._bufs) <= i:
            self._bufs.append(cp.cuda.alloc_pinned_memory(self.chunk))
        return self._bufs[i]

    def put(self, a: np.ndarray):
        """A device array with a's shape, dtype and bytes (landing when the stream gets there)."""
        a = np.asarray(a)
        dev = cp.empty(a.shape, a.dtype)
        if a.nbytes == 0:
            return dev
        src = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for off in range(0, src.size, self.chunk):
            m = min(self.chunk, src.size - off)
            slot = self._i % self.depth
            self._i += 1
            if self._events[slot] is not None:
                self._events[slot].synchronize()           # the copy that read this buffer is done
            buf = self._buffer(slot)
            dst = np.frombuffer(buf, np.uint8, m)
            seg = src[off:off + m]
            step = max(PIECE, -(-m // self.threads))
            spans = [(c, min(c + step, m)) for c in range(0, m, step)]
            if len(spans) == 1:
                np.copyto(dst, seg)
            else:                                          # numpy releases the GIL for the copies
                self._pool = self._pool or ThreadPoolExecutor(self.threads)
                list(self._pool.map(lambda s: np.copyto(dst[s[0]:s[1]], seg[s[0]:s[1]]), spans))
            cp.cuda.runtime.memcpyAsync(dev.data.ptr + off, buf.ptr, m, cp.cuda.runtime.memcpyHostToDevice,
                                        self.stream.ptr)
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.stream)
            self._events[slot] = ev
        self.nbytes += a.nbytes
        return dev

    def finish(self) -> None:
        """Waits until every put has landed, then frees the pinned buffers and the threads (a later put
        makes new ones)."""
        self.stream.synchronize()
        self._bufs.clear()
        self._events = [None] * self.depth
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
