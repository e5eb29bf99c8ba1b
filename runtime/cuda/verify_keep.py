"""CUDA verify_keep: the accepted count of a verify pass decided on the device and the slot's
recurrent states set to the last kept row's (kernel: verify_keep.cu; contract: NumpyExecutor.keep
with runtime/draft.py's greedy rule). Not a plan op: the executor appends it to every verify graph.

    k = verify_keep.Keep(pairs, tokens, next_token, pos, slot, rows)   # pairs: [(history, state)]
    k.step()            # in the graph: keep decided from the tokens, the states restored, k.out[0] = keep
    k.fetch(stream); stream.synchronize(); k.kept()       # that count on the host
    k.force(row)        # outside it: the states set to history row `row` (a caller that keeps fewer)
"""

from __future__ import annotations

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from ..errors import PlanMismatch
from . import cu

STEM = "verify_keep"
THREADS, BLOCKS = 256, 32               # per state: 32 x 256 threads copy its words (<= a few MB)


class Keep:
    def __init__(self, pairs, tokens, next_token, pos, slot, rows: int):
        for h, s in pairs:
            if h.dtype.itemsize != 4 or s.dtype.itemsize != 4 or h[0].size != s[0].size:
                raise PlanMismatch(f"verify history {h.shape} {h.dtype} against state {s.shape} {s.dtype}: "
                                   f"one 4-byte row per slot expected")
        self.pairs = list(pairs)
        self.src = cp.asarray(np.array([h.data.ptr for h, _ in pairs] or [0], np.uint64))
        self.dst = cp.asarray(np.array([s.data.ptr for _, s in pairs] or [0], np.uint64))
        self.words = cp.asarray(np.array([h[0].size for h, _ in pairs] or [0], np.int64))
        self.out = cp.zeros(1, cp.int32)
        self._mem = cp.cuda.alloc_pinned_memory(4)      # the count copied back with the pass's outputs
        self._host = np.frombuffer(self._mem, np.int32, 1)
        self.kern = cu.kernel(STEM, "verify_keep_k")
        self.args = (tokens, next_token, pos, slot, np.int32(rows), self.src, self.dst, self.words,
                     np.int32(len(self.pairs)))
        self.grid = (BLOCKS, max(1, len(self.pairs)))

    def step(self) -> None:
        """The graph's launch: keep decided from the pass's tokens and greedy picks."""
        self.kern(self.grid, (THREADS,), self.args + (np.int32(-1), self.out))

    def fetch(self, stream) -> None:
        """Queues the copy of the graph's decided count to the host (read by kept() after a sync)."""
        cp.cuda.runtime.memcpyAsync(self._mem.ptr, self.out.data.ptr, 4, cp.cuda.runtime.memcpyDeviceToHost,
                                    stream.ptr)

    def kept(self) -> int:
        return int(self._host[0])

    def force(self, row: int) -> None:
        """The slot's states set to history row `row` (launched on the current stream)."""
        if self.pairs:
            self.kern(self.grid, (THREADS,), self.args + (np.int32(row), self.out))
