"""Tensor parallelism on the CUDA executor: one process per rank (multiprocessing spawn; rank r uses
GPU r), the collectives over NCCL, inside each rank's captured CUDA graphs.

    ex = TpCudaExecutor(artifact_path, tp=2, symbols={"slots": 1, "ubatch": 64, "ctx": 2048})
    res = ex.run("decode", inputs, want=("next_token",))      # rank 0's outputs (the ranks' are equal)
    ex.reset(); ex.close()

- The parent makes the NCCL unique id (cupy.cuda.nccl.get_unique_id) and passes it to each rank's
  process; each rank opens the artifact, reads its own plan, uploads its own weights and builds a
  CudaExecutor (runtime/cuda/executor.py) with the communicator: all_reduce is ncclAllReduce (sum,
  float32, on the executor's stream); all_gather (vocab-parallel logits, per-rank `sizes`, possibly
  uneven) is a 2D copy into a padded [rows, max(sizes)] send buffer, ncclAllGather into
  [tp, rows, max], and one 2D copy per rank into its columns of the output (rank order, as
  runtime/ops/all_gather.py). All of it is captured into the graph with the other launches.
- The host drives the ranks in lockstep: each run sends the same inputs to every rank (a pipe per
  rank) and reads the outputs from rank 0; the other ranks return their next_token, compared with
  rank 0's (`disagreements` counts steps where they differ: the ranks are bit-equal by
  construction, all_reduce of two ranks being commutative).
- NCCL_NVLS_ENABLE=0 (and the multicast switches of docs/gpu notes) are set in the ranks' env
  unless already set.
- `factory` (a "module:function" name) replaces the rank's executor builder: the CPU tests drive
  the spawn / pipe / error paths with a fake rank (`fake_rank`) without CuPy or GPUs.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

import numpy as np

from ..errors import DeviceUnavailable

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
START_TIMEOUT_S = float(os.environ.get("BLOOMERY_TP_START_TIMEOUT", "600"))
RUN_TIMEOUT_S = float(os.environ.get("BLOOMERY_TP_RUN_TIMEOUT", "600"))


class NcclCollectives:
    """The two collectives of the plans over one NCCL communicator, launched on a given stream."""

    def __init__(self, comm, rank: int, world: int):
        self.comm, self.rank, self.world = comm, rank, world

    def all_reduce(self, x, out, stream_ptr: int) -> None:
        from cupy.cuda import nccl
        self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream_ptr)

    def all_gather_steps(self, x, out, sizes, rows: int, stream_getter) -> list:
        """Launch closures: out[r] = concat over ranks of x_k[r] (x_k: [rows, sizes[k]] on rank k)."""
        import cupy as cp
        from cupy.cuda import nccl
        sizes = [int(s) for s in sizes]
        M, V = max(sizes), sum(sizes)
        if x.dtype != np.float32 or out.dtype != np.float32 or x.size != rows * sizes[self.rank] or out.size != rows * V:
            raise DeviceUnavailable(f"all_gather: x {x.shape} {x.dtype} / out {out.shape} {out.dtype} do not match "
                                    f"rows {rows}, sizes {sizes}, rank {self.rank}")
        send = cp.zeros((rows, M), cp.float32)
        gath = cp.zeros((self.world, rows, M), cp.float32)
        offs = np.concatenate([[0], np.cumsum(sizes)])[:-1]
        d2d = cp.cuda.runtime.memcpyDeviceToDevice
        s_r = sizes[self.rank]
        comm = self.comm

        def run():
            sp = stream_getter()
            cp.cuda.runtime.memcpy2DAsync(send.data.ptr, M * 4, x.data.ptr, s_r * 4, s_r * 4, rows, d2d, sp)
            comm.allGather(send.data.ptr, gath.data.ptr, rows * M, nccl.NCCL_FLOAT32, sp)
            for k, (o, s) in enumerate(zip(offs, sizes)):
                cp.cuda.runtime.memcpy2DAsync(out.data.ptr + int(o) * 4, V * 4, gath.data.ptr + k * rows * M * 4,
                                              M * 4, s * 4, rows, d2d, sp)
        return [run]


# -- the rank's process ------------------------------------------------------------------------------
def cuda_rank(rank: int, world: int, uid, path: str, symbols: dict, graphs):
    """The real rank: GPU `rank`, an NCCL communicator, the rank's CudaExecutor."""
    import cupy as cp
    from cupy.cuda import nccl

    from bloomery.core.artifact import Artifact

    from ..engine import read_plans
    from .executor import CudaExecutor
    cp.cuda.Device(rank).use()
    art = Artifact.open(Path(path))
    plans = read_plans(art)
    comm = nccl.NcclCommunicator(world, uid, rank)
    ex = CudaExecutor([plans[rank]], art, symbols, graphs=graphs, rank=rank,
                      collectives=NcclCollectives(comm, rank, world))
    ex._nccl_comm = comm                   # kept alive with the executor
    return ex


class FakeRank:
    """A stand-in rank for the CPU tests: next_token = (sum of tokens + step) % 97 on every rank,
    logits a one-hot row; `fail_at` raises on that run (the error path)."""

    def __init__(self, rank, world, uid, path, symbols, graphs, fail_at=None):
        if symbols.get("fail_init") == rank:
            raise ValueError(f"fake rank {rank}: init failure")
        self.rank, self.step, self.fail_at = rank, 0, symbols.get("fail_at")
        self.uid = uid

    def run(self, prog, inputs, want=None, rows=None):
        self.step += 1
        if self.fail_at is not None and self.step == self.fail_at:
            raise RuntimeError(f"fake rank {self.rank}: failure at run {self.step}")
        t = np.asarray(inputs["tokens"], np.int64)
        nt = ((t + int(t.sum()) + self.step) % 97).astype(np.int32)
        lg = np.zeros((t.size, 97), np.float32)
        lg[np.arange(t.size), nt] = 1.0
        outs = {"next_token": nt, "logits": lg}
        lo, hi = rows if rows is not None else (0, t.size)
        return {n: outs[n][lo:hi] for n in (want or outs)}

    def reset(self, slot=None):
        self.step = 0

    def weight_nbytes(self):
        return 1000 + self.rank


def fake_rank(rank, world, uid, path, symbols, graphs):
    return FakeRank(rank, world, uid, path, symbols, graphs)


def _resolve(name: str):
    mod, fn = name.split(":")
    return getattr(importlib.import_module(mod), fn)


def _worker(rank: int, world: int, uid, path: str, symbols: dict, graphs, factory: str, conn) -> None:
    """Entry point of a rank's process: build the executor, then serve commands from the parent."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    try:
        t0 = time.perf_counter()
        ex = _resolve(factory)(rank, world, uid, path, symbols, graphs)
        conn.send(("ready", {"rank": rank, "init_s": time.perf_counter() - t0,
                             "weight_nbytes": int(ex.weight_nbytes()),
                             "load_s": getattr(ex, "load_s", 0.0), "warm_s": getattr(ex, "warm_s", 0.0)}))
    except BaseException as e:                                     # noqa: BLE001 - reported to the parent
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd = msg[0]
        try:
            if cmd == "run":
                _, prog, inputs, want, rows = msg
                res = ex.run(prog, inputs, want, rows=rows)
                if rank == 0:
                    conn.send(("ok", {n: np.array(v) for n, v in res.items()}))
                else:
                    nt = res.get("next_token")
                    conn.send(("ok", {"next_token": None if nt is None else np.array(nt)}))
            elif cmd == "reset":
                ex.reset(msg[1])
                conn.send(("ok", None))
            elif cmd == "call":                                 # a method of the executor (bench, profile)
                _, name, args = msg
                conn.send(("ok", getattr(ex, name)(*args)))
            elif cmd == "close":
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"rank {rank}: unknown command {cmd!r}"))
        except BaseException as e:                                 # noqa: BLE001
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


# -- the parent ------------------------------------------------------------------------------------
class TpCudaExecutor:
    """Drives tp ranks' processes in lockstep; the Engine's executor for a tp > 1 artifact on cuda."""

    def __init__(self, path, tp: int, symbols: dict, graphs: bool | None = None, factory: str | None = None,
                 uid=None):
        self.tp, self.path, self.symbols = int(tp), str(path), dict(symbols)
        self.factory = factory or f"{__name__}:cuda_rank"
        if uid is None:
            if factory is None:
                from cupy.cuda import nccl
                uid = nccl.get_unique_id()
            else:
                uid = ("fake-uid",)
        self.disagreements = 0
        self.steps = 0
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        saved = {k: os.environ.get(k) for k in NCCL_ENV}
        for k, v in NCCL_ENV.items():            # inherited by the spawned ranks
            os.environ.setdefault(k, v)
        try:
            for r in range(self.tp):
                a, b = ctx.Pipe()
                p = ctx.Process(target=_worker, name=f"bloomery-tp-rank{r}", daemon=True,
                                args=(r, self.tp, uid, self.path, self.symbols, graphs, self.factory, b))
                p.start()
                b.close()
                self.procs.append(p)
                self.conns.append(a)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
        self.info = []
        try:
            for r in range(self.tp):
                self.info.append(self._recv(r, START_TIMEOUT_S))
        except BaseException:
            self.close(force=True)
            raise
        self.load_s = max(i.get("init_s", 0.0) for i in self.info)

    def _recv(self, r: int, timeout: float):
        conn, p = self.conns[r], self.procs[r]
        t0 = time.monotonic()
        while not conn.poll(0.05):
            if not p.is_alive() and not conn.poll(0):
                raise DeviceUnavailable(f"{self.path}: tp rank {r}'s process exited (code {p.exitcode})")
            if time.monotonic() - t0 > timeout:
                raise DeviceUnavailable(f"{self.path}: tp rank {r} did not answer in {timeout:.0f} s")
        kind, val = conn.recv()
        if kind == "error":
            raise DeviceUnavailable(f"{self.path}: tensor-parallel CUDA executor: {val}")
        return val

    def _all(self, msg, timeout: float = RUN_TIMEOUT_S) -> list:
        for c in self.conns:
            c.send(msg)
        out, err = [], None
        for r in range(self.tp):                 # read every rank's answer, even after an error
            try:
                out.append(self._recv(r, timeout))
            except DeviceUnavailable as e:
                err = err or e
                out.append(None)
        if err:
            self.close(force=True)
            raise err
        return out

    def run(self, prog: str, inputs: dict, want=None, rows: tuple | None = None) -> dict:
        """Every rank runs; rank 0's outputs in `want` (rows=(lo, hi): only those rows, as
        CudaExecutor.run)."""
        inputs = {n: np.asarray(v) for n, v in inputs.items()}
        res = self._all(("run", prog, inputs, None if want is None else tuple(want), rows))
        self.steps += 1
        nt0 = res[0].get("next_token")
        for r in res[1:]:
            if nt0 is not None and r.get("next_token") is not None and not np.array_equal(nt0, r["next_token"]):
                self.disagreements += 1
                break
        return res[0]

    def reset(self, slot: int | None = None) -> None:
        self._all(("reset", slot))

    def call(self, name: str, *args) -> list:
        """A method of every rank's executor (e.g. "profile"); their results in rank order."""
        return self._all(("call", name, args))

    def weight_nbytes(self) -> int:
        return sum(int(i.get("weight_nbytes", 0)) for i in self.info)

    def close(self, force: bool = False) -> None:
        if not self.procs:
            return
        if not force:
            for c in self.conns:
                try:
                    c.send(("close",))
                except (OSError, BrokenPipeError):
                    pass
        for p in self.procs:
            p.join(timeout=0.5 if force else 10)
            if p.is_alive():
                p.terminate()                    # only the processes this executor started
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
