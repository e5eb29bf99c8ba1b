"""The CUDA executor: runs a rank's plan on the GPU, each program captured once into a CUDA graph.

    ex = CudaExecutor(plans, artifact, {"slots": 1, "ubatch": 64, "ctx": 2048})
    res = ex.run("decode", {"tokens": ..., "positions": ..., "slot_ids": ...}, want=("next_token",))
    ex.reset()

Contract: the NumpyExecutor's (runtime/numpy_executor.py), op by op (runtime/ops/*.py is the
reference of each op; runtime/cuda/ops_src.py and gemv_src.py hold the kernels; the hybrid
families' ops have theirs in runtime/cuda/<op>.cu, bound by runtime/cuda/<op>.py).

- Weights: every tensor the plan reads is uploaded once at load from the artifact's mmapped
  shards, in its artifact layout (Artifact.gguf_arrays): no dequantized copy; through pinned
  staging buffers, host copies and DMA overlapped (runtime/cuda/upload.py; lever BLOOMERY_UPLOAD).
  The GEMV kernels read the stored format; norm weights and pre_quant_scale vectors (a few KB) are
  float32.
- Buffers: the plan's, allocated once with the bound shapes (state shared by both programs: the KV
  cache and the recurrent states alike, zeroed at load and by reset(); a row at position 0 also
  starts its slot's recurrent state afresh inside the kernels).
  The input buffers (tokens, positions, slot_ids) are views into one device array, written by
  one asynchronous copy from pinned host memory per run.
- Each program is run once eagerly (positions -1: nothing is written to the KV cache; every
  kernel is compiled), then captured into a CUDA graph and replayed on every run; positions,
  slots and (through the positions) lengths are read from device memory by the kernels, so
  nothing that changes between steps is baked into the graph. The MoE experts are chosen on the
  device: the router's ids are read by the expert GEMV kernels (no host round trip).
- A run's only host synchronization is reading its outputs (the next token id; the logits
  only when asked for).
- Host ops (core/plan OpSig.host: qwen4_exp's n-gram ids and n-gram table rows) run on the host
  with their NumPy implementations (runtime/ops) before each replay, on the run's inputs, with
  their states on the host; the buffers they write that device ops read are copied to the
  device by one asynchronous copy each, from pinned memory, ahead of the replay on the same
  stream. Their tables are never uploaded: they are read through the artifact's mmap, so a
  step touches only the rows it needs (page-cache hits are a memcpy). host_stats() reports the
  time and bytes this adds.
- Linears of more than 8 rows (prefill chunks) run on the tensor cores (runtime/cuda/gemm.py: the
  weight decoded into a reused BF16 scratch, one cuBLAS GEMM), in the mode the lever
  BLOOMERY_PREFILL_GEMM names ("bf16", "bf16x2", or "off": the GEMV kernels over 8-row groups).
- The verify program (speculative decoding; where the engine drafts) and the mtp program (the MTP
  draft's layer) are bound once per row count, a graph each (_bind_counts; docs/plan.md "Verify"):
  each verify row is computed as the one-row decode graph computes it, and the graph ends by
  deciding the kept rows on the device and restoring the slot's recurrent states from the rows'
  histories (runtime/cuda/verify_keep.py).
- TP > 1: one CudaExecutor per rank, each in its own process on its own GPU (runtime/cuda/tp.py),
  given the rank and its collectives (NCCL all_reduce / all_gather on this executor's stream,
  captured into the graph like any launch). Without collectives, a plan holding them is refused.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from importlib import import_module
from pathlib import Path

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from bloomery.core import levers
from bloomery.core import plan as P
from bloomery.core.rope import inv_freq

from .. import device as devices
from .. import kv_cache
from ..errors import DeviceUnavailable, PlanMismatch
from ..ops import IMPL as NUMPY_OPS
from . import cu
from . import aot
from . import attention_chunk as AC
from . import attention_decode as AD
from . import gemm as M
from . import gemv as G
from . import gemv_row as GR
from . import pdl as PDL
from . import mla_attention as MLA
from . import moe_gemm as MG
from . import moe_router_grouped as MRG
from . import ops as K
from . import qsa_index as QSA
from . import upload as U

DTYPES = {"f32": np.float32, "i32": np.int32}
DENSE_DT = {"f32": 0, "bf16": 1, "f16": 2}
GEMV_ROWS = 8                            # rows per GEMV launch (gemv.MAX_BATCH)


def _norm_threads(g: int) -> int:
    """The threads of an rmsnorm_k CTA over a group of g values (and of norm_rope_qk_kv_k, whose norm must sum
    as rmsnorm_k does)."""
    return 512 if g >= 2048 else 256 if g >= 256 else max(32, -(-g // 32) * 32)


def _rotary_dim(op) -> int:
    """A rope op's rotated width: its rotary_dim, or the whole head."""
    return int(op.get("rotary_dim") or op["head_dim"])


def _dead_after(ops, j: int, buf: str) -> bool:
    """No op from j on reads `buf` before one writes it (so its value there is never used)."""
    for o in ops[j:]:
        sig = P.OPS[o["op"]]
        if any(o.get(k) == buf for k in (*sig.reads, *sig.opt_reads, *sig.state)):
            return False
        if any(o[k] == buf for k in sig.writes):
            return True
    return True


class DeviceWeights:
    """One rank's weights on the device, uploaded once, in the artifact's layout."""

    def __init__(self, art, rank: int, names):
        self.art, self.rank = art, rank
        self.table = art.tensors(rank)
        for n in names:
            if n not in self.table:
                raise PlanMismatch(f"{art.path}: rank {rank}'s plan reads tensor {n!r}, which the artifact does "
                                   f"not hold; re-prepare the artifact")
        self._raw: dict = {}
        self._lin: dict = {}
        self._vec: dict = {}
        self.nbytes = 0                  # bytes uploaded
        self.upload_s = 0.0              # time spent uploading (mmap -> device)
        # lever BLOOMERY_UPLOAD: through pinned staging (runtime/cuda/upload.py), or cupy.asarray
        self.up = U.Uploader() if levers.value("BLOOMERY_UPLOAD", os.environ) == "staged" else None
        self.loaded = False              # finish() ran: later uploads land before raw() returns
        self.pdl = PDL.enabled()         # lever BLOOMERY_PDL: the GEMV launches with programmatic dependent launch

    def raw(self, name: str) -> dict:
        """suffix -> device array, the GGUF arrays as they lie in the artifact (input_scale left out)."""
        if name not in self._raw:
            arrs = self.art.gguf_arrays(name, self.rank)
            t0 = time.perf_counter()
            d = {}
            for k, a in arrs.items():
                if k == "input_scale":
                    continue
                d[k] = self.up.put(a) if self.up is not None else cp.asarray(a)
                self.nbytes += int(a.nbytes)
            if self.up is None:
                cp.cuda.Device().synchronize()
            elif self.loaded:                # a tensor asked for after the load: landed before it is returned
                self.up.finish()
            self.upload_s += time.perf_counter() - t0
            self._raw[name] = d
        return self._raw[name]

    def finish(self) -> None:
        """Every upload has landed (before the executor's own stream runs a kernel)."""
        if self.up is not None:
            t0 = time.perf_counter()
            self.up.finish()
            self.upload_s += time.perf_counter() - t0
        self.loaded = True

    def linear(self, name: str) -> G.Linear:
        if name not in self._lin:
            t = self.table[name]
            arrays = {k: v for k, v in self.raw(name).items() if k != "pre_quant_scale"}
            try:
                self._lin[name] = G.Linear(t.format, t.shape, arrays, pdl=self.pdl)
            except (KeyError, NotImplementedError) as e:
                raise DeviceUnavailable(f"{self.art.path}: {name} ({t.format} {list(t.shape)}): no CUDA kernel "
                                        f"reads it ({e}); use --device cpu") from None
        return self._lin[name]

    def pre_quant(self, name: str):
        """NVFP4_AWQ's per-input scale (float32 [in] or [E, in]) or None."""
        if "pre_quant_scale" not in self.table[name].optional:
            return None
        return self.raw(name)["pre_quant_scale"]

    def vector(self, name: str, offset: float = 0.0):
        """A small tensor (norm weight) decoded to float32 on the device; with an offset, float32(offset) +
        the tensor, summed in float32 on the host (rmsnorm's `offset`: the NumPy op's arithmetic)."""
        key = name if not offset else (name, float(offset))
        if key not in self._vec:
            t0 = time.perf_counter()
            v = np.ascontiguousarray(self.art.decode(name, self.rank), dtype=np.float32).reshape(-1)
            if offset:
                v = np.float32(offset) + v
            self._vec[key] = cp.asarray(v)
            self.nbytes += v.nbytes
            self.upload_s += time.perf_counter() - t0
        return self._vec[key]

    def dense(self, name: str):
        """(device array, dtype code, rows, cols) of a dense table (the embedding)."""
        t = self.table[name]
        if t.format not in DENSE_DT or len(t.shape) != 2:
            raise DeviceUnavailable(f"{self.art.path}: {name} is {t.format} {list(t.shape)}; the CUDA embed kernel "
                                    f"reads f32/bf16/f16 tables; use --device cpu")
        return self.raw(name)["weight"], DENSE_DT[t.format], int(t.shape[0]), int(t.shape[1])


class HostTables:
    """The tables host ops read (host_embed's n-gram table), as stored in the artifact: a
    read-only view of the mmapped shard, indexed per step; nothing is decoded or uploaded. At load
    the kernel is asked to read their shards into the page cache in the background
    (POSIX_FADV_WILLNEED; prepare's publish drops the pages it wrote): a row still on disk costs
    the step a disk read, a cached one a memcpy."""

    def __init__(self, art, rank: int, names):
        self.art, self.rank, self._t = art, rank, {}
        files = set()
        for n in names:
            t = art.tensors(rank)[n]
            if t.format not in DENSE_DT:
                raise DeviceUnavailable(f"{art.path}: host table {n} is {t.format}; host ops read f32/bf16/f16 tables")
            files.add(Path(art.path) / t.shard)
        if files and hasattr(os, "posix_fadvise"):
            threading.Thread(target=_will_need, args=(sorted(files),), daemon=True).start()

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._t:
            self._t[name] = self.art.parts(name, self.rank)["weight"]
        return self._t[name]

    def opened(self) -> list:
        """The tables host ops have read so far (mmapped views)."""
        return list(self._t.values())


def _will_need(files) -> None:
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except OSError:                   # advice only: a failure costs speed, never correctness
            pass


class _HostOps:
    """One program's host ops: their NumPy implementations on host buffers (the pinned input rows,
    host states, pinned outputs), then the asynchronous copies of the outputs device ops read."""

    def __init__(self, ops: list, plan: dict, bind: dict, host_in, index: dict, dev: dict, state: dict,
                 tables: HostTables, progs=P.PROGRAMS):
        self.ops, self.tables = ops, tables
        shapes = plan["buffers"]
        self.bufs: dict = {n: host_in[i] for n, i in index.items()}
        self.copies = []                             # (pinned host array, device array)
        written = {o[k] for o in ops for k in (*P.OPS[o["op"]].writes, *P.OPS[o["op"]].opt_writes) if k in o}
        device_reads = {o[k] for prog in progs for o in plan["programs"][prog]["ops"]
                        if not P.OPS[o["op"]].host for k in (*P.OPS[o["op"]].reads, *P.OPS[o["op"]].opt_reads)
                        if k in o}
        for o in ops:
            for k in P.OPS[o["op"]].state:
                self.bufs[o[k]] = state[o[k]]
        self._mem = []
        for n in sorted(written):
            shp, dt = P.shape(shapes[n], bind), DTYPES[shapes[n]["dtype"]]
            if n in device_reads:
                m = cp.cuda.alloc_pinned_memory(max(4, int(np.prod(shp)) * np.dtype(dt).itemsize))
                self._mem.append(m)
                self.bufs[n] = np.frombuffer(m, dt, int(np.prod(shp))).reshape(shp)
                self.copies.append((m, self.bufs[n], dev[n]))
            else:
                self.bufs[n] = np.zeros(shp, dt)
        self.seconds, self.runs, self.h2d_bytes = 0.0, 0, 0

    def run(self, stream) -> None:
        t0 = time.perf_counter()
        for o in self.ops:
            NUMPY_OPS[o["op"]].run(o, self.bufs, self.tables)
        for m, h, d in self.copies:
            cp.cuda.runtime.memcpyAsync(d.data.ptr, m.ptr, h.nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            self.h2d_bytes += h.nbytes
        self.seconds += time.perf_counter() - t0
        self.runs += 1


def linears_after(ops, j: int) -> list:
    """The weights of the linears that come next after op j: past any add and rmsnorm ops, the run of linear
    ops (after an attention: its o projection; after a layer's experts: the next layer's q, k and v)."""
    i = j + 1
    while i < len(ops) and ops[i]["op"] in ("add", "rmsnorm"):
        i += 1
    out = []
    while i < len(ops) and ops[i]["op"] == "linear":
        out.append(ops[i]["weight"])
        i += 1
    return out


def prefetch_plan(ops, attention: bool, experts: bool) -> dict:
    """{index of an op: the weights of the linears after it} for the launches that bring the next linears'
    weights into the L2 while they wait on latency: decode attention (BLOOMERY_ATTN_PREFETCH, its o
    projection) and the experts' combine (BLOOMERY_MOE_PREFETCH, the next layer's first linears)."""
    kinds = {"attention"} if attention else set()
    kinds |= {"moe_experts"} if experts else set()
    return {j: w for j, o in enumerate(ops) if o["op"] in kinds and (w := linears_after(ops, j))}


class CudaExecutor:
    def __init__(self, plans: list[dict], art, symbols: dict[str, int], graphs: bool | None = None,
                 rank: int = 0, collectives=None, cache_types=("f32", "f32")):
        if cp is None:
            raise DeviceUnavailable("the CUDA executor needs CuPy")
        self.rank, self.coll = int(rank), collectives
        if len(plans) != 1 or (collectives is None and any(P.OPS[o["op"]].collective for p in plans
                                                           for prog in P.programs_of(p) for o in p["programs"][prog]["ops"])):
            raise DeviceUnavailable(f"{art.path}: tp={len(plans)}: the CUDA executor runs TP=1 plans only in this "
                                    f"version without NCCL ranks (runtime/cuda/tp.py); use --device cpu or prepare "
                                    f"with --tp 1")
        self.plan, self.art, self.symbols = plans[0], art, dict(symbols)
        # the programs bound: decode and prefill; verify where the plan holds it and symbols bind its rows
        # (the engine drafts), with mtp where the plan has an MTP layer (its draft)
        self.progs = dict(P.PROGRAMS)
        if "verify" in self.plan["programs"] and symbols.get("verify"):
            self.progs["verify"] = "verify"
            if "mtp" in self.plan["programs"]:
                self.progs["mtp"] = "ubatch"
        # verify and mtp are bound once per row count (a graph each): verify 1..its rows; mtp 1..verify's
        # rows (a pass's kept rows, a chained draft) and ubatch (prompt chunks)
        self.counts = {"verify": list(range(1, symbols.get("verify", 0) + 1)),
                       "mtp": sorted({r for r in range(1, symbols.get("verify", 0) + 1) if r <= symbols["ubatch"]}
                                     | {symbols["ubatch"]})}
        self.graphs = (os.environ.get("BLOOMERY_CUDA_GRAPHS", "1") != "0") if graphs is None else graphs
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.k = K.kernels()
        # the artifact's ahead-of-time kernels where they run on this GPU (bloomery prepare --target), and
        # the start message's line on them
        cc = cp.cuda.Device().compute_capability
        self.aot, self.aot_line = aot.load(art.metadata(self.rank), (int(cc[:-1]), int(cc[-1])), os.environ,
                                           str(art.path))
        # the attention caches' types (-ctk / -ctv; runtime/kv_cache.py): f32, bf16 or f16 on the GPU
        for kind in cache_types:
            if kind not in K.CACHE_CODE:
                raise DeviceUnavailable(f"{art.path}: --cache-type {kind}: the CUDA kernels hold the KV cache as "
                                        f"{', '.join(K.CACHE_CODE)}; choose one of them, or --device cpu")
        # attention cache buffer -> its type code where not f32 (keys: -ctk, values: -ctv)
        self.cache_code = {o[key]: K.CACHE_CODE[kind] for o, key, kind in kv_cache.typed_caches(self.plan, cache_types)}
        self._read_levers()
        self.mm = None                   # the prefill GEMM (made when a linear of > 8 rows is bound)
        free, total = cp.cuda.runtime.memGetInfo()       # refused before anything is uploaded
        devices.check_fits(devices.device_bytes(self.plan, art.tensors(self.rank), symbols,
                                                dict.fromkeys(self.cache_code, 2)), free, total,
                           f"{art.path}: rank {self.rank} on GPU {cp.cuda.Device().id}")
        t0 = time.perf_counter()
        self.w = DeviceWeights(art, self.rank, P.weights_of(self.plan))
        shapes = {n: b for n, b in self.plan["buffers"].items()}
        host_ops = {prog: [o for o in self.plan["programs"][prog]["ops"] if P.OPS[o["op"]].host]
                    for prog in self.progs}
        host_state = {o[k] for ops in host_ops.values() for o in ops for k in P.OPS[o["op"]].state}
        self.host_state = {n: np.zeros(P.shape(shapes[n], symbols), DTYPES[shapes[n]["dtype"]]) for n in host_state}
        self.tables = HostTables(art, self.rank, sorted({o[k] for ops in host_ops.values() for o in ops
                                                         for k in P.OPS[o["op"]].weights}))
        self.host: dict[str, _HostOps] = {}
        self.state = {n: cp.zeros(P.shape(b, symbols), cp.uint16 if self.cache_code.get(n) else DTYPES[b["dtype"]])
                      for n, b in shapes.items() if b["kind"] == "state" and n not in host_state}
        self.buffers: dict[str, dict] = {}
        self.inputs: dict[str, tuple] = {}
        self.pinned_out: dict[str, dict] = {}
        self.steps: dict[str, list] = {}
        self.tags: dict[str, list] = {}      # the op (or fused ops) of each launch, for profile()
        self.graph: dict = {}
        self.decode_bytes = 0            # weight bytes one decode step reads (bench)
        self.flops = {p: {"linear": 0, "attention_per_key": 0} for p in self.progs}   # per run, all rows active
        self._need: list = []            # (Linear, rows per launch | None: the MoE form, one) to compile
        self._need_names: list = []      # and GEMV kernels named as they are
        self._after: dict = {}           # the program being bound: op -> the linears after it, which it prefetches
        self.prefetching: list = []      # the weights decode launches prefetch (BLOOMERY_ATTN_ / MOE_PREFETCH)
        self._pooled: dict = {}          # scratch shared by ops (_pool)
        self.keeper = None               # the verify graphs' last launch (verify_keep.py)
        self.finputs: dict = {}          # per program: float32 input name -> (device, pinned memory, host view)
        self.verified_keep = 0           # the rows the last verify pass kept, as the device decided
        for prog, rows_sym in self.progs.items():
            rows = symbols[rows_sym]
            bind = {**symbols, "rows": rows}
            bufs = dict(self.state)
            used = P.buffers_used(self.plan, prog)          # not the verify program's state histories
            names_in = [n for n, b in shapes.items() if b["kind"] == "input" and n in used and b["dtype"] == "i32"]
            for n in names_in:
                if P.shape(shapes[n], bind) != (rows,):
                    raise PlanMismatch(f"input buffer {n!r}: the CUDA executor takes i32 [rows] inputs")
            fin = {}                                        # float32 inputs (the mtp program's hidden rows)
            for n, b in shapes.items():
                if b["kind"] == "input" and n in used and b["dtype"] == "f32":
                    shp = P.shape(b, bind)
                    if shp[0] != rows:
                        raise PlanMismatch(f"input buffer {n!r}: f32 {list(shp)}, [rows, ...] expected")
                    m = cp.cuda.alloc_pinned_memory(max(4, int(np.prod(shp)) * 4))
                    fin[n] = (cp.zeros(shp, cp.float32), m, np.frombuffer(m, np.float32, int(np.prod(shp))).reshape(shp))
            self.finputs[prog] = fin
            dev_in = cp.zeros(len(names_in) * rows, cp.int32)
            host_mem = cp.cuda.alloc_pinned_memory(max(4, dev_in.nbytes))
            host_in = np.frombuffer(host_mem, np.int32, len(names_in) * rows).reshape(len(names_in), rows)
            for i, n in enumerate(names_in):
                bufs[n] = dev_in[i * rows:(i + 1) * rows]
            for n, (d, _, _) in fin.items():
                bufs[n] = d
            for n, b in shapes.items():
                if b["kind"] == "output" or (b["kind"] == "scratch" and n in used):
                    bufs[n] = cp.zeros(P.shape(b, bind), DTYPES[b["dtype"]])
            self.buffers[prog] = bufs
            self.inputs[prog] = (dev_in, host_mem, host_in, {n: i for i, n in enumerate(names_in)})
            if host_ops[prog]:
                self.host[prog] = _HostOps(host_ops[prog], self.plan, bind, host_in, self.inputs[prog][3], bufs,
                                           self.host_state, self.tables, self.progs)
            outs = {}
            for n, b in shapes.items():
                if b["kind"] == "output":
                    a = bufs[n]
                    m = cp.cuda.alloc_pinned_memory(max(4, a.nbytes))
                    outs[n] = (m, np.frombuffer(m, a.dtype, a.size).reshape(a.shape))
            self.pinned_out[prog] = outs
            if prog in ("verify", "mtp"):
                self._bind_counts(prog)
            else:
                self.steps[prog] = self._bind(prog, rows)
        self.w.finish()                  # the staged uploads have landed: the stream's kernels may read them
        self.load_s = time.perf_counter() - t0
        self.warm_s = 0.0
        t1 = time.perf_counter()
        self._precompile()
        for prog in self.progs:
            self._warm(prog)
        self.warm_s = time.perf_counter() - t1

    def _read_levers(self) -> None:
        """The environment's kernel choices (specs/levers.yaml) and the device's multiprocessor count."""
        self.gemm_mode = levers.value("BLOOMERY_PREFILL_GEMM", os.environ)
        self.split_k = int(levers.value("BLOOMERY_PREFILL_SPLIT_K", os.environ))
        self.tc_mode = levers.value("BLOOMERY_DECODE_TC", os.environ)
        self.row_mode = levers.value("BLOOMERY_GEMV_ROW", os.environ)
        self.group_mode = levers.value("BLOOMERY_GROUP_LINEARS", os.environ)
        self.fold_norm = levers.value("BLOOMERY_FOLD_NORM", os.environ)
        self.fold_swiglu = levers.value("BLOOMERY_FOLD_SWIGLU", os.environ)
        self.fold_qk_norm = levers.value("BLOOMERY_FOLD_QK_NORM", os.environ)
        self.fold_moe_norm = levers.value("BLOOMERY_FOLD_MOE_NORM", os.environ)
        self.attn_mode = levers.value("BLOOMERY_DECODE_ATTENTION", os.environ)
        self.chunk_mode = levers.value("BLOOMERY_CHUNK_ATTENTION", os.environ)
        self.moe_mode = levers.value("BLOOMERY_MOE_GEMM", os.environ)
        self.moe_decode = levers.value("BLOOMERY_MOE_DECODE", os.environ)
        self.moe_router = levers.value("BLOOMERY_MOE_ROUTER", os.environ)
        self.moe_prefetch = levers.value("BLOOMERY_MOE_PREFETCH", os.environ)
        self.attn_prefetch = levers.value("BLOOMERY_ATTN_PREFETCH", os.environ)
        w, _, u = levers.value("BLOOMERY_ATTN_WARPS", os.environ).partition("-u")
        self.attn_warps, self.attn_pv_unroll = int(w), int(u or 0)     # the FMA form's launch (attention_decode)
        self.pdl_all = PDL.mode() == "on"    # lever BLOOMERY_PDL: rope + cache write and attention too
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    # -- binding: each op becomes a list of argument-bound launches --------------------------------
    def _bind(self, prog: str, rows: int, bufs: dict | None = None, tag_key=None) -> list:
        """The program's launches. Two fusions that change no arithmetic: a linear (or the experts) whose
        output only feeds the next op's residual add accumulates into the residual (y += W x: the same
        rounding as NumPy's h + o); rope of q, rope of k and attention's cache write run as one kernel."""
        bufs = self.buffers[prog] if bufs is None else bufs
        ops = self.plan["programs"][prog]["ops"]
        steps: list = []
        tags: list = []
        # the linears after each decode attention / experts op, whose weights those launches may bring into the L2
        self._after = {id(ops[j]): w for j, w in prefetch_plan(ops, self.attn_prefetch == "on",
                                                                self.moe_prefetch == "on").items()} \
            if prog == "decode" else {}
        i = 0
        while i < len(ops):
            op = ops[i]
            if P.OPS[op["op"]].host:                      # run before the replay (_HostOps)
                i += 1
                continue
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            fn = self._binder(op["op"])
            if fn is None:
                raise DeviceUnavailable(f"{prog} op {i} ({op['op']}): no CUDA implementation")
            if self._into_residual(ops, i):
                new = fn(op, bufs, rows, prog, acc=nxt["out"])
                tag, i = op["op"] + "+add", i + 2
            elif op["op"] == "rmsnorm" and self._fusable_qk_norm(ops, i):
                new = self._rope_qk_kv(ops[i + 2], ops[i + 3], ops[i + 4], bufs, rows, norms=(op, nxt)) + \
                    self._op_attention(ops[i + 4], bufs, rows, prog, write=False)
                tag, i = "rmsnorm+rmsnorm+rope+rope+attention", i + 5
            elif op["op"] == "rmsnorm" and (n := self._moe_norm_fold(ops, i, rows, prog)):
                norm, r_op = (op["x"], self._norm_weight(op), float(op["eps"])), ops[i + 1]
                new = self._binder(r_op["op"])(r_op, bufs, rows, prog, norm=norm) + \
                    self._op_moe_experts(ops[i + 2], bufs, rows, prog, acc=ops[i + 3]["out"] if n == 4 else None, norm=norm)
                tag, i = "+".join(o["op"] for o in ops[i:i + 3]) + ("+add" if n == 4 else ""), i + n
            elif op["op"] == "rmsnorm" and (n := self._norm_fold(ops, i, bufs, rows, prog)):
                sw = self._swiglu_after(ops, i + 1, n)
                new = self._op_norm_linears(op, ops[i + 1:i + 1 + n], bufs, rows, prog, swiglu=sw)
                tag, i = "rmsnorm+linear" + ("+swiglu" if sw else ""), i + 1 + n + (sw is not None)
            elif op["op"] == "linear" and (n := self._tc_group_size(ops, i, rows, prog)) > 1:
                new = self._op_tc_group(ops[i:i + n], bufs, rows, prog)
                tag, i = "linear", i + n
            elif op["op"] == "linear" and self.group_mode != "off" and (n := self._group_size(ops, i, rows, prog)) > 1:
                sw = self._swiglu_after(ops, i, n)
                new = self._op_linear_group(ops[i:i + n], bufs, rows, prog, swiglu=sw)
                tag, i = "linear" + ("+swiglu" if sw else ""), i + n + (sw is not None)
            elif op["op"] == "rope" and self._fusable_rope(ops, i):
                new = self._rope_qk_kv(op, nxt, ops[i + 2], bufs, rows) + \
                    self._op_attention(ops[i + 2], bufs, rows, prog, write=False)
                tag, i = "rope+rope+attention", i + 3
            else:
                new = fn(op, bufs, rows, prog)
                tag, i = op["op"], i + 1
            steps.extend(new)
            tags.extend([tag] * len(new))
        self.tags[prog if tag_key is None else tag_key] = tags
        return steps

    def _bind_counts(self, prog: str) -> None:
        """A program bound once per row count r of self.counts[prog] (a graph each): its row buffers'
        first r rows, the states whole.
        - verify (r = 1..R: a graph per drafted-token count k = r-1): each op computes every row as a
          one-row decode step computes it (linears: the 1-row GEMV kernel's shape for each row, the weight
          read once for all; attention: the 1-row context splits; the recurrent ops: the decode kernels,
          the slot's rows in order, each row's state into `history`); then verify_keep decides the kept
          rows and restores the states from the histories (runtime/cuda/verify_keep.py).
        - mtp (the MTP draft's layer): a pass's kept rows, one chained row, a prompt chunk."""
        full = self.buffers[prog]
        shapes = self.plan["buffers"]
        if prog == "verify":
            from . import verify_keep as VK
            ops = self.plan["programs"]["verify"]["ops"]
            pairs = [(full[o["history"]], self.state[o[P.OPS[o["op"]].state[0]]]) for o in ops
                     if "history" in o and not P.OPS[o["op"]].host]
            # host ops' states (qwen4_exp's n-gram context) and their host histories, restored by keep()
            self._host_keep = [(self.host_state[o[P.OPS[o["op"]].state[0]]], self.host["verify"].bufs[o["history"]])
                               for o in ops if "history" in o and P.OPS[o["op"]].host]
            self.keeper = VK.Keep(pairs, full["tokens"], full["next_token"], full["positions"], full["slot_ids"],
                                  self.rows(prog))
        for r in self.counts[prog]:
            views = {n: (a[:r] if shapes[n]["kind"] != "state" and shapes[n]["shape"][:1] == ["rows"] else a)
                     for n, a in full.items()}
            self.flops[prog] = {"linear": 0, "attention_per_key": 0}     # per run: the last binding's (all rows)
            steps = self._bind(prog, r, views, tag_key=(prog, r))
            if prog == "verify":
                steps.append(self.keeper.step)
                self.tags[(prog, r)].append("verify_keep")
            self.steps[(prog, r)] = steps
        last = (prog, self.counts[prog][-1])
        self.steps[prog], self.tags[prog] = self.steps[last], self.tags[last]

    @staticmethod
    def _into_residual(ops, i) -> bool:
        """Whether linear (or experts) ops[i] accumulates into the residual of the add after it (y += W x:
        its output read by that add only, the add in place on the residual)."""
        op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        return (op["op"] in ("linear", "moe_experts") and nxt is not None and nxt["op"] == "add"
                and _dead_after(ops, i + 2, op["out"]) and nxt["out"] in (nxt["a"], nxt["b"])
                and op["out"] in (nxt["a"], nxt["b"]) and nxt["out"] != op["out"] and nxt["out"] != op["x"])

    def _cores_one_launch(self, prog: str, lin: G.Linear, rows: int) -> bool:
        """Whether _gemv runs this linear on the CUDA-core GEMV kernels in one launch (what a Group
        replaces); the verify program's rows in launches of up to 8 rows whatever their count, as the
        1-row decode step computes each row (a Group there too, or verify would not be that step)."""
        if (rows > GEMV_ROWS and prog != "verify") or lin.experts or lin.mma or lin.kind not in G.GROUP_KINDS \
                or lin.config:
            return False
        if self._tc_path(prog, lin, rows):
            return not self._tc_wins(lin, rows)
        return True

    def _tc_path(self, prog: str, lin, rows: int) -> bool:
        """Whether _gemv takes its tensor-core branch for this linear (decode steps of up to 16 rows of a kind a
        tensor-core GEMV reads, BLOOMERY_DECODE_TC not off); each launch of it then runs there where _tc_wins."""
        return (prog == "decode" and self.tc_mode != "off" and G.tc_takes(lin.kind, lin.inn) and not lin.experts
                and rows <= G.TC_ROWS)

    def _tc_wins(self, lin, rows: int) -> bool:
        """Whether a launch of `rows` rows of this linear runs on the tensor cores (gemv.tc_wins, or
        BLOOMERY_DECODE_TC=on)."""
        return self.tc_mode == "on" or G.tc_wins(lin.kind, lin.out, lin.inn, rows)

    def _tensor_cores(self, prog: str, lin, rows: int) -> bool:
        """Whether _gemv runs this linear's rows on the tensor-core GEMV (one launch of up to 16 rows)."""
        return self._tc_path(prog, lin, rows) and self._tc_wins(lin, rows)

    def _tc_group_size(self, ops, i, rows: int, prog: str) -> int:
        """How many consecutive linears from ops[i] run as one tensor-core launch (gemv.TcGroup; 0: ops[i] is
        not such a linear, or BLOOMERY_GROUP_LINEARS is off): the same x, each on the tensor cores alone,
        one kernel shape, no activation pre-scale, an output of its own other than x, none accumulating into
        the next op's residual add (_into_residual)."""
        if self.group_mode == "off":
            return 0
        first, lins, outs = ops[i], [], set()
        while i + len(lins) < len(ops) and len(lins) < G.TC_MEMBERS:
            j = i + len(lins)
            op = ops[j]
            if op["op"] != "linear" or op["x"] != first["x"] or op["out"] in outs or op["out"] == first["x"]:
                break
            lin = self.w.linear(op["weight"])
            if (self.w.pre_quant(op["weight"]) is not None or not self._tensor_cores(prog, lin, rows)
                    or self._into_residual(ops, j) or not G.TcGroup.fits(lins + [lin], rows)):
                break
            lins.append(lin)
            outs.add(op["out"])
        return len(lins)

    def _op_tc_group(self, ops, bufs, rows: int, prog: str) -> list:
        """Linears that read one x as one tensor-core launch (gemv.TcGroup): each member's rows as its own
        launch computes them."""
        lins = [self.w.linear(op["weight"]) for op in ops]
        for lin in lins:
            self.flops[prog]["linear"] += 2 * rows * lin.out * lin.inn
            self.decode_bytes += lin.nbytes
        grp = G.TcGroup(lins, rows)
        pf, si = grp.need()
        part, sem = self._pool("gemv_tc_part", (pf,)), self._pool("gemv_tc_sem", (si,), np.int32)
        grp.kernel()                                   # compiled now, not inside the capture
        x, ys = bufs[ops[0]["x"]][:rows], [bufs[op["out"]][:rows] for op in ops]
        return [lambda: grp.launch(x, ys, False, part, sem)]

    def _member(self, ops, j: int, first, rows: int, prog: str, outs) -> bool:
        """Whether linear ops[j] can join a Group led by linear `first`: the same x, kernel family and
        width, no activation pre-scale, one CUDA-core launch, an output of its own other than x, and
        not one that accumulates into the next op's residual add instead (_into_residual)."""
        op = ops[j]
        if op["op"] != "linear" or op["x"] != first["x"] or op["out"] in outs or op["out"] == first["x"]:
            return False
        lin, lead = self.w.linear(op["weight"]), self.w.linear(first["weight"])
        if (self.w.pre_quant(op["weight"]) is not None or (lin.kind, lin.inn) != (lead.kind, lead.inn)
                or not self._cores_one_launch(prog, lin, rows)):
            return False
        return not self._into_residual(ops, j)

    def _group_size(self, ops, i, rows: int, prog: str) -> int:
        """How many consecutive linears from ops[i] launch as one Group (_member; 0: not even ops[i])."""
        n, outs = 0, set()
        while i + n < len(ops) and n < G.GROUP_MAX and self._member(ops, i + n, ops[i], rows, prog, outs):
            outs.add(ops[i + n]["out"])
            n += 1
        return n

    def _norm_fold(self, ops, i, bufs, rows: int, prog: str) -> int:
        """How many linears after the rmsnorm ops[i] take it into their launch (0: none): a whole-row norm
        (BLOOMERY_FOLD_NORM on) whose output only those linears read, the linears a Group (_group_size; one
        linear alone when BLOOMERY_GROUP_LINEARS is off)."""
        op = ops[i]
        if self.fold_norm == "off" or i + 1 >= len(ops) or ops[i + 1]["op"] != "linear" or ops[i + 1]["x"] != op["out"]:
            return 0
        width = bufs[op["x"]].shape[-1]
        if int(op["group"]) != width or op["out"] == op["x"] or self._norm_weight(op).size != width:
            return 0
        if self.group_mode == "off":
            n = int(self._member(ops, i + 1, ops[i + 1], rows, prog, set()))
        else:
            n = self._group_size(ops, i + 1, rows, prog)
        if any(o["out"] == op["x"] for o in ops[i + 1:i + 1 + n]):     # the launch reads x while writing
            return 0
        return n if n and _dead_after(ops, i + 1 + n, op["out"]) else 0

    def _norm_weight(self, op):
        """An rmsnorm op's weight as it multiplies (offset + weight: Qwen3-Next's norms)."""
        return self.w.vector(op["weight"], float(op.get("offset") or 0.0))

    def _moe_norm_fold(self, ops, i, rows: int, prog: str) -> int:
        """How many ops from the rmsnorm ops[i] run as the router's and the experts' launches with the norm
        folded into both (0: none; lever BLOOMERY_FOLD_MOE_NORM on): a whole-row norm, then the router (its
        GEMV on the CUDA-core kernels in launches of up to 8 rows, as a Group folds a norm) and the experts
        (their two-launch form, _moe_fused), both reading the norm's output and nothing after them (3), or
        after them the residual add the experts accumulate into (4)."""
        if self.fold_moe_norm == "off" or i + 2 >= len(ops):
            return 0
        op, r, e = ops[i], ops[i + 1], ops[i + 2]
        if (r["op"] not in ("moe_router", "moe_router_grouped") or e["op"] != "moe_experts"
                or r["x"] != op["out"] or e["x"] != op["out"] or op["out"] == op["x"]):
            return 0
        lin = self.w.linear(r["weight"])
        if int(op["group"]) != lin.inn or self._norm_weight(op).size != lin.inn:
            return 0
        if not self._cores_one_launch(prog, lin, rows) or self._row_rows([lin], prog, min(rows, GEMV_ROWS)):
            return 0
        lins = tuple(self.w.linear(e[n]) for n in ("gate", "up", "down"))
        if self._moe_grouped(prog, rows, lins) or not self._moe_fused(e, lins, int(e["top_k"])):
            return 0
        n = 4 if self._into_residual(ops, i + 2) else 3
        return n if _dead_after(ops, i + n, op["out"]) else 0

    def _swiglu_after(self, ops, j: int, n: int):
        """The swiglu op that takes the Group ops[j:j + n] into its launch (gemv.Group(pair=True)), or
        None: exactly a gate and an up of one shape, the next op their swiglu, neither read after it
        (BLOOMERY_FOLD_SWIGLU on)."""
        if self.fold_swiglu == "off" or n != 2 or j + 2 >= len(ops):
            return None
        sw, g, u = ops[j + 2], ops[j], ops[j + 1]
        if sw["op"] != "swiglu" or sw["gate"] != g["out"] or sw["up"] != u["out"]:
            return None
        if self.w.linear(g["weight"]).out != self.w.linear(u["weight"]).out:
            return None
        if any(b != sw["out"] and not _dead_after(ops, j + 3, b) for b in (g["out"], u["out"])):
            return None
        return sw

    def _op_norm_linears(self, nop, ops, bufs, rows: int, prog: str, swiglu=None) -> list:
        """An rmsnorm and the linears that read its output, as one launch (gemv.Group with norm=True)."""
        return self._op_linear_group(ops, bufs, rows, prog, norm=(self._norm_weight(nop), float(nop["eps"])),
                                     x_buf=nop["x"], swiglu=swiglu)

    def _op_linear_group(self, ops, bufs, rows: int, prog: str, norm=None, x_buf: str | None = None,
                         swiglu=None, ys=None) -> list:
        """The linears ops (a Group) in launches of up to 8 rows; norm (weight, eps): an RMSNorm of x_buf
        folded in; swiglu: the swiglu op folded into a gate / up pair; ys: the outputs (default the ops')."""
        lins = [self.w.linear(op["weight"]) for op in ops]
        grp = G.Group(lins, norm=norm is not None, pair=swiglu is not None)
        one = prog == "verify"
        for lin in lins:
            self.flops[prog]["linear"] += 2 * rows * lin.out * lin.inn
            if prog == "decode":
                self.decode_bytes += lin.nbytes
        nw, eps = norm if norm is not None else (None, 0.0)
        x, steps = bufs[x_buf or ops[0]["x"]], []
        if ys is None:
            ys = [bufs[swiglu["out"]]] if swiglu is not None else [bufs[op["out"]] for op in ops]
        limit = swiglu.get("limit") if swiglu is not None else None
        for g in range(0, rows, GEMV_ROWS):             # more than 8 rows: verify only (_cores_one_launch)
            nb = min(GEMV_ROWS, rows - g)
            if self._row_rows(lins, prog, nb, pair=swiglu is not None):
                steps.append(self._row_bind(lins, x[g:g + nb], [y[g:g + nb] for y in ys], nb, norm_weight=nw, eps=eps,
                                            pair=swiglu is not None, limit=None if limit is None else float(limit)))
                continue
            self._need.append((grp, nb, one))
            steps.append(grp.bind(x[g:g + nb], [y[g:g + nb] for y in ys], nb, one, norm_weight=nw, eps=eps,
                                  limit=None if limit is None else float(limit)))
        return steps

    @staticmethod
    def _fusable_rope(ops, i) -> bool:
        if i + 2 >= len(ops):
            return False
        a, b, at = ops[i], ops[i + 1], ops[i + 2]
        return (b["op"] == "rope" and at["op"] == "attention" and a["x"] == a["out"] == at["q"]
                and b["x"] == b["out"] == at["k"] and a["pos"] == b["pos"] == at["pos"]
                and a["theta"] == b["theta"] and a.get("scaling") == b.get("scaling")
                and a["head_dim"] == b["head_dim"] == at["head_dim"]
                and a["heads"] == at["heads"] and b["heads"] == at["kv_heads"] and at["head_dim"] % 2 == 0
                and _rotary_dim(a) == _rotary_dim(b) and _rotary_dim(a) % 2 == 0 and _rotary_dim(a) <= a["head_dim"])

    def _fusable_qk_norm(self, ops, i) -> bool:
        """Whether ops[i:i + 5] are Qwen3's q and k norms (each in place over one head, a [head_dim] weight)
        and then a fusable rope q, rope k and attention: one launch (norm_rope_qk_kv_k; lever
        BLOOMERY_FOLD_QK_NORM on)."""
        if self.fold_qk_norm == "off" or i + 4 >= len(ops) or not self._fusable_rope(ops, i + 2):
            return False
        a, b, rq, rk = ops[i:i + 4]
        D = int(rq["head_dim"])
        return (b["op"] == "rmsnorm" and a["x"] == a["out"] == rq["x"] and b["x"] == b["out"] == rk["x"]
                and int(a["group"]) == int(b["group"]) == D and D <= 512
                and all(self._norm_weight(n).size == D for n in (a, b)))

    def _rope_qk_kv(self, rq, rk, at, bufs, rows, norms=None) -> list:
        """rope q, rope k and attention's cache write as one launch; norms: the q and k rmsnorm ops before
        them, folded in too (_fusable_qk_norm)."""
        D, Hq, Hk = int(at["head_dim"]), int(at["heads"]), int(at["kv_heads"])
        RD = _rotary_dim(rq)                  # partial rotary: the other D - RD values pass through to the cache
        invf = cp.asarray(inv_freq(float(rq["theta"]), RD, rq.get("scaling")))     # core/rope.py, as NumPy's
        ck = bufs[at["cache_k"]]
        args = (bufs[rq["x"]], bufs[rk["x"]], bufs[at["v"]], bufs[at["pos"]], bufs[at["slot"]], invf, ck,
                bufs[at["cache_v"]], np.int32(rows), np.int32(Hq), np.int32(Hk), np.int32(D), np.int32(RD),
                np.int32(ck.shape[1]))
        go = PDL.launcher(self.pdl_all)
        if norms is not None:                 # a CTA a (row, head) of rmsnorm_k's threads for a group of D
            wq, wk = (self._norm_weight(n) for n in norms)
            kern = K.cache_kernel("norm_rope_qk_kv_k", (), self._codes(at))
            args += (wq, wk, np.float32(norms[0]["eps"]), np.float32(norms[1]["eps"]))
            grid, block = (rows * (Hq + Hk),), (_norm_threads(D),)
            return [lambda: go(kern, grid, block, args)]
        kern = K.cache_kernel("rope_qk_kv_k", (), self._codes(at))
        grid = K.grid1d(rows * (Hq + Hk) * (D // 2))
        return [lambda: go(kern, grid, (256,), args)]

    def _precompile(self) -> None:
        """Every GEMV kernel the programs launch, compiled in one NVRTC module (one compile, not one per
        kernel; gemv.compile_kernels caches per process, CuPy on disk)."""
        names = {}
        for lin, nb, one in self._need:
            if nb is None:
                c = lin.config or G.default_config(lin.kind, lin.out, lin.inn, 1)
                names[G.kernel_name(lin.kind, c.R, 1, c.U, c.WPC, experts=True)] = None
            else:
                names[lin.kernel_name(nb, one)] = None
        names.update(dict.fromkeys(self._need_names))
        if names:
            G.compile_kernels(list(names))

    def _pool(self, key: str, shape, dtype=np.float32):
        """A scratch array shared by every op of this executor that asks for `key` and shape (the ops of a
        program run one after another on one stream, so one array serves all of them)."""
        k = (key, tuple(int(d) for d in shape), np.dtype(dtype).str)
        if k not in self._pooled:
            self._pooled[k] = cp.zeros(shape, dtype)
        return self._pooled[k]

    def _gemv(self, prog: str, lin: G.Linear, x, y, rows: int, accumulate: bool = False,
              exact: bool = False) -> list:
        """y[:rows] = W x[:rows] (+ y). Decode steps of GGML NVFP4 and BF16: the tensor-core GEMV (gemv_tc.cu,
        16 rows a launch) where it is measured faster (gemv.tc_wins; lever BLOOMERY_DECODE_TC), else the
        CUDA-core GEMV kernels in launches of at most 8 rows (BF16 past 8 rows: the prompt GEMM, as
        before); prompt chunks of more rows: the tensor-core GEMM (gemm.py) when the mode allows and the
        format has a decoder."""
        self.flops[prog]["linear"] += 2 * rows * lin.out * lin.inn
        steps = []
        # more slots: the prompt GEMM (measured faster at 64); BF16 past 8 rows where the tensor cores do not win
        # stays on it too (as before they took BF16)
        if self._tc_path(prog, lin, rows) and not (lin.kind == "bf16" and rows > GEMV_ROWS and not self._tc_wins(lin, rows)):
            for g in range(0, rows, G.TC_ROWS):         # decode rows (slots): the weight read once for them
                nb = min(G.TC_ROWS, rows - g)
                xv, yv = x[g:g + nb], y[g:g + nb]
                if self._tc_wins(lin, nb):
                    pf, si = lin.tc_need(nb)
                    part, sem = self._pool("gemv_tc_part", (pf,)), self._pool("gemv_tc_sem", (si,), np.int32)
                    lin.tc_kernel(nb)                    # compiled now, not inside the capture
                    steps.append(lambda lin=lin, xv=xv, yv=yv, nb=nb, part=part, sem=sem:
                                 lin.launch_tc(xv, yv, nb, accumulate, part, sem))
                else:
                    for h in range(0, nb, GEMV_ROWS):
                        n = min(GEMV_ROWS, nb - h)
                        if self._row_rows([lin], prog, n):
                            steps.append(self._row_bind([lin], xv[h:h + n], [yv[h:h + n]], n, accumulate=accumulate))
                            continue
                        self._need.append((lin, n, False))
                        steps.append(lambda lin=lin, xv=xv[h:h + n], yv=yv[h:h + n], n=n: lin.launch(xv, yv, n, accumulate))
            return steps
        if prog == "verify":                            # each row as the 1-row decode step computes it
            for g in range(0, rows, GEMV_ROWS):
                nb = min(GEMV_ROWS, rows - g)
                xv, yv = x[g:g + nb], y[g:g + nb]
                if self._row_rows([lin], prog, nb):
                    steps.append(self._row_bind([lin], xv, [yv], nb, accumulate=accumulate))
                    continue
                self._need.append((lin, nb, True))
                steps.append(lambda lin=lin, xv=xv, yv=yv, nb=nb: lin.launch(xv, yv, nb, accumulate, one=True))
            return steps
        if rows > GEMV_ROWS and self.gemm_mode != "off" and M.Matmul.supports(lin):
            if self.mm is None:
                self.mm = M.Matmul(self.stream, self.gemm_mode, self.split_k, aot=self.aot)
            return [self.mm.bind(lin, x, y, rows, accumulate, exact=exact)]
        for g in range(0, rows, GEMV_ROWS):
            nb = min(GEMV_ROWS, rows - g)
            xv, yv = x[g:g + nb], y[g:g + nb]
            if self._row_rows([lin], prog, nb):
                steps.append(self._row_bind([lin], xv, [yv], nb, accumulate=accumulate))
                continue
            self._need.append((lin, nb, False))
            steps.append(lambda lin=lin, xv=xv, yv=yv, nb=nb: lin.launch(xv, yv, nb, accumulate))
        return steps

    def _row_rows(self, lins, prog: str, nb: int, pair: bool = False) -> bool:
        """Whether a launch of nb rows of these GGML NVFP4 linears runs on the one-row tensor-core GEMV
        (runtime/cuda/gemv_row.cu; lever BLOOMERY_GEMV_ROW): a 1-row launch of any program, and the verify
        program's rows, each of which it computes exactly as its 1-row launch does."""
        return self.row_mode == "on" and (nb == 1 or prog == "verify") and GR.supported(lins, pair) is None

    def _row_bind(self, lins, x, ys, nb: int, accumulate: bool = False, **kw):
        """gemv_row.bind with this executor's scratch (one array of each size: the launches run in order)."""
        pf, si = GR.need([L.out for L in lins], lins[0].inn, nb, kw.get("pair", False))
        part, sem = self._pool("gemv_row_part", (max(pf, 1),)), self._pool("gemv_row_sem", (si,), np.int32)
        return GR.bind(lins, x, ys, nb, accumulate=accumulate, part=part, sem=sem, pdl=all(L.pdl for L in lins), **kw)

    def _op_embed(self, op, bufs, rows, prog):
        table, dt, vocab, n = self.w.dense(op["weight"])
        ids, out = bufs[op["ids"]], bufs[op["out"]]
        kern = self.k[f"embed_k<{dt}>"]
        grid = (max(1, min(64, -(-n // 256))), rows)
        args = (table, ids, out, np.int32(vocab), np.int32(n))
        if prog == "decode":
            self.decode_bytes += n * (4 if dt == 0 else 2) * rows
        return [lambda: kern(grid, (256,), args)]

    def _op_rmsnorm(self, op, bufs, rows, prog):
        x, out = bufs[op["x"]], bufs[op["out"]]
        g = int(op["group"])
        w = self._norm_weight(op)                                            # offset + weight (Qwen3-Next's norms)
        if x.shape[-1] % g or w.size not in (g, x.shape[-1]):               # [group] or as wide as the row
            raise PlanMismatch(f"rmsnorm {op['weight']}: weight of {w.size} values, group {g}, row {x.shape[-1]}")
        groups = x.size // g
        T = _norm_threads(g)
        kern = self.k["rmsnorm_k"]
        args = (x, out, w, np.int32(g), np.float32(op["eps"]), np.int32(w.size // g))
        return [lambda: kern((groups,), (T,), args)]

    def _op_linear(self, op, bufs, rows, prog, acc=None):
        name = op["weight"]
        lin = self.w.linear(name)
        x, y = bufs[op["x"]], bufs[acc or op["out"]]
        steps = []
        pq = self.w.pre_quant(name)
        if pq is not None:
            xs = self._pool("linear_pq", x.shape)      # written whole, read by the next launch only
            kern = self.k["scale_cols_k"]
            args = (x, pq.reshape(-1), xs, np.int32(rows), np.int32(x.shape[-1]))
            grid = K.grid1d(x.size)
            steps.append(lambda: kern(grid, (256,), args))
            x = xs
        if prog == "decode":
            self.decode_bytes += lin.nbytes + (pq.nbytes if pq is not None else 0)
        return steps + self._gemv(prog, lin, x, y, rows, accumulate=acc is not None)

    def _op_logits(self, op, bufs, rows, prog):
        t = self.w.table[op["weight"]]
        if "rows" in op and tuple(op["rows"]) != (0, int(t.shape[0])):
            lin = self._row_share(op["weight"], int(op["rows"][0]), int(op["rows"][1]))
        else:
            lin = self.w.linear(op["weight"])
        if prog == "decode":
            self.decode_bytes += lin.nbytes
        return self._gemv(prog, lin, bufs[op["x"]], bufs[op["out"]], rows)

    def _op_rope(self, op, bufs, rows, prog):
        x, out, pos = bufs[op["x"]], bufs[op["out"]], bufs[op["pos"]]
        H, D, RD = int(op["heads"]), int(op["head_dim"]), _rotary_dim(op)
        if RD % 2 or RD > D:
            raise PlanMismatch(f"rope: rotary_dim {RD} with head_dim {D} (an even rotary_dim <= head_dim expected)")
        invf = cp.asarray(inv_freq(float(op["theta"]), RD, op.get("scaling")))      # core/rope.py, as NumPy's
        n = rows * H * max(RD // 2, D - RD)
        kern = self.k["rope_k"]
        args = (x, out, pos, invf, np.int32(rows), np.int32(H), np.int32(D), np.int32(RD))
        grid = K.grid1d(n)
        return [lambda: kern(grid, (256,), args)]

    def _op_attention(self, op, bufs, rows, prog, write: bool = True):
        H, KV, D = int(op["heads"]), int(op["kv_heads"]), int(op["head_dim"])
        if H % KV or D % 4 or D > 256:
            raise DeviceUnavailable(f"attention heads {H}, kv_heads {KV}, head_dim {D}: the CUDA kernel needs "
                                    f"heads % kv_heads == 0, head_dim % 4 == 0 and <= 256")
        q, k, v = bufs[op["q"]], bufs[op["k"]], bufs[op["v"]]
        pos, slot, out = bufs[op["pos"]], bufs[op["slot"]], bufs[op["out"]]
        ck, cv = bufs[op["cache_k"]], bufs[op["cache_v"]]
        ctx = int(ck.shape[1])
        codes = self._codes(op)
        dpl = next(d for d in (1, 2, 4, 8) if 32 * d >= D)
        kw, ka = K.cache_kernel("kv_write_k", (), codes), K.cache_kernel("attention_k", (dpl,), codes)
        nw = 8
        smem = 4 * (D + 2 * nw + nw * D)
        wargs = (k, v, pos, slot, ck, cv, np.int32(KV * D), np.int32(ctx))
        self.flops[prog]["attention_per_key"] += 4 * H * D       # q.k and p.v for each (row, cached key)
        sel = self._attn_select(op, bufs, rows, ctx) if "select" in op else None   # qwen4_exp's QSA selection
        prompt = prog not in ("decode", "verify")
        tc_chunk = prompt and sel is None and self.chunk_mode == "tc" and AC.supports(H, KV, D) is None
        # the CUDA-core chunk kernel (compiled here) only where the tensor-core one does not serve the chunk
        chunk = AC.fma_kernel(H, KV, D, select=sel is not None, cache=codes) if prompt and not tc_chunk else None
        if tc_chunk:
            attend = AC.bind(q, ck, cv, pos, slot, out, rows, H, KV, D, float(op["scale"]), cache=codes)
        elif chunk is not None:               # prompt chunks: keys staged once per (kv head, row block)
            kc, rb, csmem = chunk
            cargs = (q, ck, cv, pos, slot, out, np.int32(rows), np.int32(H), np.int32(KV), np.int32(D),
                     np.int32(ctx), np.float32(op["scale"]))
            if sel is not None:
                cargs = cargs[:5] + sel[1:] + cargs[5:]
            attend = lambda: kc((KV, -(-rows // rb)), (256,), cargs, shared_mem=csmem)   # noqa: E731
        elif sel is None and self.attn_mode in ("split", "split-fma") and AD.supports(H, KV, D) is None:
            nxt = self._after.get(id(op), [None])[0]      # BLOOMERY_ATTN_PREFETCH: the o projection's weights
            if nxt is not None:
                self.prefetching.append(nxt)
            attend = AD.bind(q, ck, cv, pos, slot, out, rows, H, KV, D, float(op["scale"]), self._pool, self.sms,
                             split_rows=1 if prog == "verify" else None, cache=codes, pdl=self.pdl_all,
                             tc=False if self.attn_mode == "split-fma" else None,
                             prefetch=None if nxt is None else self.w.linear(nxt).w,
                             warps=self.attn_warps, pv_unroll=self.attn_pv_unroll)
        else:
            aargs = (q, ck, cv, pos, slot, out, np.int32(H), np.int32(KV), np.int32(D), np.int32(ctx),
                     np.float32(op["scale"]))
            if sel is not None:
                ka = K.cache_kernel("attention_sel_k", (dpl,), codes)
                aargs = aargs[:5] + sel[1:3] + aargs[5:]
            attend = lambda: ka((H, rows), (32 * nw,), aargs, shared_mem=smem)   # noqa: E731
        steps = [lambda: kw((rows,), (128,), wargs), attend] if write else [attend]
        return steps if sel is None else [sel[0]] + steps

    def _codes(self, op) -> tuple[int, int]:
        """An attention op's cache type codes (keys, values): ops.CACHE_CODE."""
        return self.cache_code.get(op["cache_k"], 0), self.cache_code.get(op["cache_v"], 0)

    def _swiglu(self, g, u, out, limit) -> list:
        """out = silu(g) * u over g's elements; with a limit, glm5_next's clamp (swiglu_limit_k)."""
        if limit is None:
            kern, args = self.k["swiglu_k"], (g, u, out, np.int32(g.size))
        else:
            kern, args = self.k["swiglu_limit_k"], (g, u, out, np.int32(g.size), np.float32(limit))
        grid = K.grid1d(g.size)
        return [lambda: kern(grid, (256,), args)]

    def _op_swiglu(self, op, bufs, rows, prog):
        return self._swiglu(bufs[op["gate"]], bufs[op["up"]], bufs[op["out"]], op.get("limit"))

    def _op_add(self, op, bufs, rows, prog):
        a, b, out = bufs[op["a"]], bufs[op["b"]], bufs[op["out"]]
        kern, args = self.k["add_k"], (a, b, out, np.int32(a.size))
        grid = K.grid1d(a.size)
        return [lambda: kern(grid, (256,), args)]

    def _op_argmax(self, op, bufs, rows, prog):
        x, out = bufs[op["x"]], bufs[op["out"]]
        kern, args = self.k["argmax_k"], (x, out, np.int32(x.shape[-1]))
        return [lambda: kern((rows,), (1024,), args)]

    def _router_logits(self, op, bufs, rows, prog, norm=None):
        """The router's logits x @ weight.T into a scratch [rows, experts], float32 and exact (the
        expert choice is never rounded): (logits, launches). norm (x buffer, weight, eps): the RMSNorm
        before the router folded into its GEMV (_moe_norm_fold), a Group(norm=True) launch of 8 rows at most."""
        lin = self.w.linear(op["weight"])
        lg = self._pool("router_logits", (rows, lin.out))     # written whole, read by the op's next launch
        if norm is not None:                                  # (the group counts its bytes and FLOPs)
            return lg, self._op_linear_group([op], bufs, rows, prog, norm=norm[1:], x_buf=norm[0], ys=[lg])
        if prog == "decode":
            self.decode_bytes += lin.nbytes
        return lg, self._gemv(prog, lin, bufs[op["x"]], lg, rows, exact=True)

    @staticmethod
    def _norm_args(norm, bufs, x) -> tuple:
        """A launch's (x, norm weight, eps): a folded RMSNorm's (its input buffer, weight, eps: _moe_norm_fold's
        norm), or x as it is (None, 0)."""
        return (x, None, 0.0) if norm is None else (bufs[norm[0]], norm[1], norm[2])

    def _router_fused(self, op, rows: int, prog: str) -> bool:
        """Whether the moe_router op runs as one launch (gemv_plain_topk; lever BLOOMERY_MOE_ROUTER fused): a
        decode step of up to 8 rows whose router GEMV runs on the CUDA-core kernels in one launch, a matrix
        and top k that Linear.bind_topk takes."""
        if self.moe_router != "fused" or prog != "decode" or rows > GEMV_ROWS:
            return False
        lin = self.w.linear(op["weight"])
        return self._cores_one_launch(prog, lin, rows) and G.topk_supported(lin, rows, int(op["top_k"])) is None

    def _op_moe_router(self, op, bufs, rows, prog, norm=None):
        if self._router_fused(op, rows, prog):
            lin = self.w.linear(op["weight"])
            lg = self._pool("router_logits", (rows, lin.out))
            sem = self._pool("router_sem", (1,), np.int32)
            self.flops[prog]["linear"] += 2 * rows * lin.out * lin.inn
            self.decode_bytes += lin.nbytes
            nx, nw, eps = self._norm_args(norm, bufs, bufs[op["x"]])
            self._need_names.append(lin.topk_name(rows, norm is not None))
            return [lin.bind_topk(nx, lg, rows, bufs[op["ids"]], bufs[op["weights"]], int(op["top_k"]),
                                  bool(op["norm"]), sem, norm_weight=nw, eps=eps)]
        lg, steps = self._router_logits(op, bufs, rows, prog, norm)
        E, k = lg.shape[1], int(op["top_k"])
        kern = self.k["moe_topk_k"]
        args = (lg, bufs[op["ids"]], bufs[op["weights"]], np.int32(E), np.int32(k), np.int32(bool(op["norm"])))
        return steps + [lambda: kern((rows,), (32,), args, shared_mem=4 * E)]

    def _op_moe_experts(self, op, bufs, rows, prog, acc=None, norm=None):
        """norm (x buffer, weight, eps): the RMSNorm before the experts folded into their paired launch
        (_moe_norm_fold; the two-launch form only)."""
        gate, up, down = (self.w.linear(op[n]) for n in ("gate", "up", "down"))
        k, E = int(op["top_k"]), int(op["experts"])
        if not (gate.experts == up.experts == down.experts == E):
            raise PlanMismatch(f"moe_experts {op['gate']}: {gate.experts} experts stacked, the plan says {E}")
        x, ids, wts, out = bufs[op["x"]], bufs[op["ids"]], bufs[op["weights"]], bufs[acc or op["out"]]
        pairs, inter, hidden = rows * k, gate.out, down.out
        # scratch shared by every moe_experts op (_pool): each op writes g, u, d (and the scaled copies) whole
        # before reading them, and the ops of a program run one after another on one stream
        g, u, d = self._pool("moe_g", (pairs, inter)), self._pool("moe_u", (pairs, inter)), self._pool("moe_d", (pairs, hidden))
        sce = self.k["scale_cols_e_k"]
        steps = []

        def scaled(name, src, n, xdiv):          # the experts' pre_quant_scale, chosen by the ids
            pq = self.w.pre_quant(op[name])
            if pq is None:
                return src, xdiv
            dst = self._pool(f"moe_pq_{name}", (pairs, n))
            args = (src, pq.reshape(-1), ids, dst, np.int32(n), np.int32(xdiv), np.int32(E))
            grid = (max(1, min(64, -(-n // 256))), pairs)
            steps.append(lambda: sce(grid, (256,), args))
            return dst, 1

        self.flops[prog]["linear"] += 2 * pairs * (gate.out * gate.inn + up.out * up.inn + down.out * down.inn)
        fused = False
        if self._moe_grouped(prog, rows, (gate, up, down)):
            # prompt chunks: the pairs sorted by expert once, each matrix one grouped GEMM (moe_gemm.cu); the sort
            # and the bf16 parts are pooled as g, u and d are
            route = MG.Route(pairs, E, alloc=lambda name, shape: self._pool(f"moe_route_{name}", shape, np.int32))
            parts = 2 if self.gemm_mode == "bf16x2" else 1
            steps.append(route.bind(ids))

            def parted(name, src):               # the activations' bf16 parts, split once for the GEMMs reading them
                xs = self._pool(f"moe_parts_{name}", (parts, *src.shape), np.uint16)
                steps.append(MG.split(src, xs))
                return xs
            xg, dg = scaled("gate", x, x.shape[-1], k)
            xu, du = scaled("up", x, x.shape[-1], k)
            sg = parted("gate", xg)
            su = sg if xu is xg else parted("up", xu)
            steps.append(MG.bind(gate, sg, g, route, dg, parts))
            steps.append(MG.bind(up, su, u, route, du, parts))
            steps += self._swiglu(g, u, g, op.get("limit"))
            xd, dd = scaled("down", g, inter, 1)
            steps.append(MG.bind(down, parted("down", xd), d, route, dd, parts))
        elif fused := self._moe_fused(op, (gate, up, down), k):
            # two launches: gate, up and the SwiGLU of every pair (the norm before them folded in when norm);
            # the down of a row's k choices, weighted, summed and added (the combine, the residual add when acc)
            pf = down if self.moe_prefetch == "on" else None     # the down matrices into the L2 meanwhile
            self._need_names += [gate.pair_experts_name(norm=norm is not None, prefetch=pf is not None),
                                 down.combine_experts_name()]
            nx, nw, eps = self._norm_args(norm, bufs, x)
            steps.append(gate.bind_pair_experts(up, nx, g, ids, pairs, k, op.get("limit"), norm_weight=nw, eps=eps,
                                                prefetch=pf))
            nxt = self._after.get(id(op), [])[:3]          # BLOOMERY_MOE_PREFETCH: the next layer's first linears
            self.prefetching += nxt
            steps.append(down.bind_combine_experts(g, wts, out, ids, rows, k, add=acc is not None,
                                                   prefetch=[self.w.linear(n).w for n in nxt]))
        else:
            self._need += [(gate, None, False), (up, None, False), (down, None, False)]
            xg, dg = scaled("gate", x, x.shape[-1], k)
            steps.append(lambda: gate.launch_experts(xg, g, ids, pairs, dg))
            xu, du = scaled("up", x, x.shape[-1], k)
            steps.append(lambda: up.launch_experts(xu, u, ids, pairs, du))
            steps += self._swiglu(g, u, g, op.get("limit"))
            xd, dd = scaled("down", g, inter, 1)
            steps.append(lambda: down.launch_experts(xd, d, ids, pairs, dd))
        if norm is not None and not fused:
            raise PlanMismatch(f"moe_experts {op['gate']}: a folded RMSNorm needs the two-launch experts")
        if not fused:                            # the fused down sums the choices itself
            cb = self.k["moe_combine_k"]
            cargs = (d, wts, out, np.int32(rows), np.int32(k), np.int32(hidden), np.int32(acc is not None))
            cgrid = K.grid1d(rows * hidden)
            steps.append(lambda: cb(cgrid, (256,), cargs))
        if prog == "decode":
            self.decode_bytes += rows * k * (gate.expert_nbytes + up.expert_nbytes + down.expert_nbytes)
        return steps

    def _moe_fused(self, op, lins, k: int) -> bool:
        """Whether a moe_experts op's expert GEMVs run as two launches (lever BLOOMERY_MOE_DECODE fused):
        GGML NVFP4 gate, up and down with no pre_quant_scale."""
        gate, up, down = lins
        return (self.moe_decode == "fused" and G.pair_experts_supported(gate, up) is None
                and G.combine_experts_supported(down, k) is None
                and all(self.w.pre_quant(op[n]) is None for n in ("gate", "up", "down")))

    def _moe_grouped(self, prog: str, rows: int, lins) -> bool:
        """Whether a moe_experts op of this program runs as grouped GEMMs (moe_gemm.cu): prompt chunks of more
        than 8 rows (as the dense linears' GEMM), lever BLOOMERY_MOE_GEMM grouped, the tensor-core prefill on,
        every matrix in a layout the grouped kernel decodes."""
        return (rows > GEMV_ROWS and prog != "verify" and self.moe_mode == "grouped" and self.gemm_mode != "off"
                and all(MG.supports(lin) is None for lin in lins))

    def _op_moe_router_grouped(self, op, bufs, rows, prog, norm=None):
        lg, steps = self._router_logits(op, bufs, rows, prog, norm)
        return steps + MRG.launches(op, lg, self.w.vector(op["bias"]), bufs[op["ids"]], bufs[op["weights"]], rows)

    # -- the hybrid and flagship families' ops: kernels in runtime/cuda/<op>.cu, bound by
    # runtime/cuda/<op>.py; _bind calls _op_module for an op with no method of its own here
    def _binder(self, name: str):
        """The method that binds op `name`: its own _op_<name>, else _op_module where
        runtime/cuda/<name>.py exists, else None."""
        fn = getattr(self, f"_op_{name}", None)
        if fn is None and (cu.HERE / f"{name}.py").exists():
            fn = self._op_module
        return fn

    def bind_op(self, op, bufs, rows: int, prog: str) -> list:
        """One op's argument-bound launches on `bufs` (what _bind does per op, without fusions)."""
        fn = self._binder(op["op"])
        if fn is None:
            raise DeviceUnavailable(f"op {op['op']}: no CUDA implementation")
        return fn(op, bufs, rows, prog)

    def _op_module(self, op, bufs, rows, prog):
        """An op whose CUDA side is runtime/cuda/<op>.py: its launches(op, bufs, rows, w[, scratch])."""
        mod = import_module(f"{__package__}.{op['op']}")
        kw = {"scratch": self._pool} if "scratch" in inspect.signature(mod.launches).parameters else {}
        return mod.launches(op, bufs, rows, self.w, **kw)

    def _attn_select(self, op, bufs, rows: int, ctx: int) -> tuple:
        """attention's `select` (ops_src.py attn_select_k, once per row for all heads): each row's listed
        cache positions <= its position, as an ascending list (the per-row kernel's keys) and a bitmap
        (the prompt-chunk kernel's masks). (launch, list, list width, bitmap, words per row)."""
        sel = bufs[op["select"]]
        if sel.dtype != np.int32 or sel.ndim != 2 or sel.shape[0] != rows:
            raise PlanMismatch(f"attention {op['select']}: select {sel.dtype} {sel.shape}, i32 [rows {rows}, W] expected")
        W, nwords = int(sel.shape[1]), -(-ctx // 32)
        smem = 4 * nwords                                 # the row's bitmap, in shared memory
        if smem > QSA.SMEM_MAX:
            raise DeviceUnavailable(f"attention select: ctx {ctx} needs a {smem}-byte bitmap per row in shared memory "
                                    f"(at most {QSA.SMEM_MAX}); use a smaller --ctx or --device cpu")
        kern = K.select_kernels()["attn_select_k"]
        if smem > 48 * 1024 and kern.max_dynamic_shared_size_bytes < smem:
            kern.max_dynamic_shared_size_bytes = smem
        lst = self._pool("attention.select_list", (rows, W + 1), np.int32)
        bits = self._pool("attention.select_bits", (rows, nwords), np.uint32)
        args = (sel, np.int32(W), bufs[op["pos"]], np.int32(ctx), lst, bits, np.int32(nwords))
        return (lambda: kern((rows,), (256,), args, shared_mem=smem)), lst, np.int32(W + 1), bits, np.int32(nwords)

    def _op_mla_attention(self, op, bufs, rows, prog):
        self.flops[prog]["attention_per_key"] += 4 * int(op["heads"]) * int(bufs[op["c"]].shape[-1])
        return MLA.launches(op, bufs, rows, self.w, scratch=self._pool)

    def _row_share(self, name: str, start: int, stop: int) -> G.Linear:
        """A rank's share [start, stop) of a replicated table's rows (the vocab-parallel tied head): views
        of the uploaded arrays whose first axis is the table's rows (no copy)."""
        t = self.w.table[name]
        n = int(t.shape[0])
        def share(v):                     # row-major [n, ...] (or flat n * row): rows start..stop; scalars kept
            if v.ndim >= 1 and v.shape[0] == n:
                return v[start:stop]
            if v.ndim == 1 and v.size > 1 and v.size % n == 0:
                return v.reshape(n, -1)[start:stop].reshape(-1)
            return v
        arrays = {k: share(v) for k, v in self.w.raw(name).items() if k != "pre_quant_scale"}
        try:
            return G.Linear(t.format, (stop - start, *t.shape[1:]), arrays)
        except (KeyError, NotImplementedError) as e:
            raise DeviceUnavailable(f"{self.art.path}: {name} rows {start}..{stop} ({t.format}): no CUDA kernel "
                                    f"reads it ({e}); use --device cpu") from None

    def _op_all_reduce(self, op, bufs, rows, prog):
        if self.coll is None:                             # refused in __init__; kept for the message
            raise DeviceUnavailable("all_reduce: the CUDA executor has no collectives (runtime/cuda/tp.py)")
        x, out = bufs[op["x"]], bufs[op["out"]]
        if x.dtype != np.float32 or out.dtype != np.float32 or x.size != out.size:
            raise PlanMismatch(f"all_reduce {op['x']} -> {op['out']}: float32 buffers of one size expected")
        coll, sp = self.coll, self.stream.ptr
        return [lambda: coll.all_reduce(x, out, sp)]

    def _op_all_gather(self, op, bufs, rows, prog):
        if self.coll is None:
            raise DeviceUnavailable("all_gather: the CUDA executor has no collectives (runtime/cuda/tp.py)")
        sp = self.stream.ptr
        return self.coll.all_gather_steps(bufs[op["x"]], bufs[op["out"]], op["sizes"], rows, lambda: sp)

    # -- running ------------------------------------------------------------------------------------
    def rows(self, prog: str) -> int:
        return self.symbols[self.progs[prog]]

    def _set_inputs(self, prog: str, inputs: dict) -> None:
        dev_in, host_mem, host_in, index = self.inputs[prog]
        fin = self.finputs.get(prog, {})
        for n, v in inputs.items():
            if n in fin:
                d, m, h = fin[n]
                h[...] = v
                cp.cuda.runtime.memcpyAsync(d.data.ptr, m.ptr, h.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                            self.stream.ptr)
            else:
                host_in[index[n]] = v
        cp.cuda.runtime.memcpyAsync(dev_in.data.ptr, host_mem.ptr, dev_in.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        if prog in self.host:
            self.host[prog].run(self.stream)

    def _launch(self, key) -> None:
        """Replays program `key` (a program's name; ("verify", r): the verify program's r-row binding)."""
        g = self.graph.get(key)
        if g is not None:
            g.launch(self.stream)
        else:
            with self.stream:
                for f in self.steps[key]:
                    f()

    def _warm(self, prog: str) -> None:
        """One eager run with every row inactive (compiles every kernel, writes no cache), then the
        capture of the program into a CUDA graph (the verify program: one per row count)."""
        rows = self.rows(prog)
        _, _, host_in, index = self.inputs[prog]
        keys = [(prog, r) for r in self.counts[prog]] if prog in ("verify", "mtp") else [prog]
        for key in keys:
            with self.stream:
                self._set_inputs(prog, {n: (np.full(rows, -1, np.int32) if n == "positions" else np.zeros(rows, np.int32))
                                        for n in index})
                for f in self.steps[key]:
                    f()
            self.stream.synchronize()
            if self.graphs:
                s = self.stream
                with s:
                    s.begin_capture()
                    try:
                        for f in self.steps[key]:
                            f()
                    finally:
                        graph = s.end_capture()
                self.graph[key] = graph
                graph.launch(s)          # a replay with the inactive inputs: checks the graph runs
                s.synchronize()

    def run(self, prog: str, inputs: dict, want=None, rows: tuple | None = None) -> dict:
        """Sets the inputs, replays the program, returns the outputs in `want` (default: all) as host
        arrays (views of pinned buffers, valid until the next run of this program); rows=(lo, hi):
        only those rows (first axis) are copied and returned. The verify program replays the graph of
        rows[1] rows (default all): its rows past them must be inactive (positions -1)."""
        self._set_inputs(prog, inputs)
        key = prog
        if prog in ("verify", "mtp"):                   # the graph of the fewest rows that holds them
            n = self.rows(prog) if rows is None else int(rows[1])
            r = next((c for c in self.counts[prog] if c >= n), None)
            if n < 1 or r is None:
                raise ValueError(f"{prog}: {n} rows; this executor's {prog} program takes 1..{self.counts[prog][-1]}")
            key = (prog, r)
        self._launch(key)
        outs = self.pinned_out[prog]
        want = tuple(outs) if want is None else tuple(want)
        bufs = self.buffers[prog]
        res = {}
        for n in want:
            m, h = outs[n]
            a = bufs[n]
            lo, hi = (0, a.shape[0]) if rows is None or a.ndim == 0 else rows
            per = a.nbytes // max(1, a.shape[0]) if a.ndim else a.nbytes
            cp.cuda.runtime.memcpyAsync(m.ptr + lo * per, a.data.ptr + lo * per, (hi - lo) * per,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
            res[n] = h[lo:hi] if a.ndim else h
        if prog == "verify":
            self.keeper.fetch(self.stream)               # the kept count, with the outputs: one sync
        self.stream.synchronize()
        if prog == "verify":
            self.verified_keep = self.keeper.kept()
        return res

    def keep(self, slot: int, row: int) -> None:
        """After a verify run of `slot`: its recurrent states as they were after verify row `row` (the
        last kept one). The graph has already restored the device states to the row the greedy rule
        kept (verified_keep - 1); another row is restored here by one launch (no host sync). Host
        ops' states (qwen4_exp's n-gram context) are restored from their host histories."""
        for state, hist in self._host_keep:
            state[slot] = hist[row]
        if row + 1 != self.verified_keep:
            with self.stream:
                self.keeper.force(row)
            self.verified_keep = row + 1

    def profile(self, prog: str = "decode", reps: int = 20) -> dict:
        """Device time per op kind (ms per run): the launches of each kind captured into a graph of their
        own and replayed `reps` times (inputs as the last run left them)."""
        res = {}
        s = self.stream
        for tag in dict.fromkeys(self.tags[prog]):
            fns = [f for f, t in zip(self.steps[prog], self.tags[prog]) if t == tag]
            with s:
                s.begin_capture()
                try:
                    for f in fns:
                        f()
                finally:
                    g = s.end_capture()
            g.launch(s)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            for _ in range(reps):
                g.launch(s)
            e1.record(s)
            e1.synchronize()
            res[tag] = (cp.cuda.get_elapsed_time(e0, e1) / reps, len(fns))
        return res

    def device_outputs(self, prog: str) -> dict:
        """The output buffers on the device (no copy)."""
        return {n: self.buffers[prog][n] for n in self.pinned_out[prog]}

    def host_stats(self) -> dict:
        """Per program: host-op runs, seconds, bytes copied to the device (the PLE rows)."""
        return {p: {"runs": h.runs, "seconds": h.seconds, "h2d_bytes": h.h2d_bytes} for p, h in self.host.items()}

    def reset(self, slot: int | None = None) -> None:
        for a in self.host_state.values():
            if slot is None:
                a[...] = 0
            else:
                a[slot] = 0
        with self.stream:
            for a in self.state.values():
                if slot is None:
                    a.fill(0)
                else:
                    a[slot] = 0
        self.stream.synchronize()

    def copy_state(self, slot: int, names) -> dict:
        """A copy (on the device) of one slot's state buffers `names`, for set_state."""
        with self.stream:
            saved = {n: (self.host_state[n][slot].copy() if n in self.host_state else self.state[n][slot].copy())
                     for n in names}
        self.stream.synchronize()
        return saved

    def set_state(self, slot: int, saved: dict) -> None:
        with self.stream:
            for n, a in saved.items():
                (self.host_state if n in self.host_state else self.state)[n][slot] = a
        self.stream.synchronize()

    def state_nbytes(self) -> int:
        """Bytes of the per-slot state (KV caches in their type, recurrent states, host ops' states)."""
        return sum(int(a.nbytes) for a in self.state.values()) + sum(int(a.nbytes) for a in self.host_state.values())

    def weight_nbytes(self) -> int:
        return self.w.nbytes
