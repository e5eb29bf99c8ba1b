"""Write one rank's GGUF split: `rank{r}-{i:05d}-of-{n:05d}.gguf`, streamed.

gguf-py's GGUFWriter writes the header, the metadata and the tensor infos (sizes known up
front from core/artifact/layout.gguf_parts); then each tensor's bytes are written as its
planned `produce()` yields them, the main tensor in row chunks (core/artifact/layout.iter_gguf).
Two threads (`_Sink`s) take the chunks from there: one writes them, the other digests them
(file writes and hashlib release the GIL), while this thread produces, checks and repacks the
next ones; memory stays bounded by one tensor's parts plus the bytes in flight (SINK_BYTES). The digests are
DIGESTS.json's (core/artifact/integrity.py: the SHA-256 and word sum of the header and of every
GGUF tensor), which publish's re-read of the file checks (compiler/publish.verify_rank).
A few rows of every tensor are decoded from the planned parts (hashed) for publish's spot
check. Deterministic: no timestamps, sorted keys and JSON, the plan's tensor order.

Metadata (every shard): general.architecture, split.no (u16), split.count (u16),
split.tensors.count (i32), bloomery.rank, bloomery.tp (u32). The first shard of a rank
also holds every other key: the plan's and the caller's metadata (sorted by key),
bloomery.layout_version, bloomery.tensors (JSON), tokenizer.huggingface.json and
tokenizer.chat_template when given.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from gguf import GGUFValueType as VT
from gguf import GGUFWriter
from gguf.gguf_writer import GGUFValue

from bloomery.core import formats
from bloomery.core.artifact import integrity, layout
from bloomery.core.errors import ArtifactMalformed, MetadataTypeError

from .planned import PlannedTensor, RankPlan

DEFAULT_MAX_SHARD_BYTES = 4 << 30
CHUNK_BYTES = 32 << 20
SINK_BYTES = 4 * CHUNK_BYTES     # bytes handed to the writer thread and not yet written: at most this, or one job
BATCH_BYTES = 1 << 20            # the writer thread's jobs: a chunk, or small ones gathered to this many bytes
ALIGN = 32

KEY_TENSORS = "bloomery.tensors"
KEY_LAYOUT = "bloomery.layout_version"
KEY_RANK = "bloomery.rank"
KEY_TP = "bloomery.tp"
KEY_TOKENIZER = "tokenizer.huggingface.json"
KEY_TEMPLATE = "tokenizer.chat_template"


def shard_name(rank: int, i: int, n: int) -> str:
    """File name of shard i (1-based) of n of a rank, as llama.cpp's gguf-split names them."""
    return f"rank{rank}-{i:05d}-of-{n:05d}.gguf"


# -- metadata typing -------------------------------------------------------------------------


def _int_type(vals) -> VT:
    lo, hi = min(vals), max(vals)
    if lo >= 0:
        return VT.UINT32 if hi < 2**32 else VT.UINT64
    if lo >= -2**31 and hi < 2**31:
        return VT.INT32
    return VT.INT64


def gguf_value(key: str, v: Any) -> GGUFValue:
    """A Python value typed for GGUF: str; bool; int -> u32 (0 <= v < 2^32), i32 (negative,
    fits), u64 / i64 otherwise; float -> f32; a list of one kind -> an array (ints typed by
    the same rule over all elements; ints mixed with floats -> f32). A GGUFValue passes as is.
    Anything else (None, dict, an empty or mixed list) is MetadataTypeError."""
    if isinstance(v, GGUFValue):
        return v
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, str):
        return GGUFValue(v, VT.STRING)
    if isinstance(v, bool):
        return GGUFValue(v, VT.BOOL)
    if isinstance(v, int):
        return GGUFValue(v, _int_type([v]))
    if isinstance(v, float):
        return GGUFValue(v, VT.FLOAT32)
    if isinstance(v, (list, tuple)):
        vs = [x.item() if isinstance(x, np.generic) else x for x in v]
        if not vs:
            raise MetadataTypeError(f"metadata {key!r}: an empty list has no GGUF element type")
        kinds = {("bool" if isinstance(x, bool) else "int" if isinstance(x, int) else
                  "float" if isinstance(x, float) else "str" if isinstance(x, str) else type(x).__name__)
                 for x in vs}
        if kinds == {"str"}:
            return GGUFValue(vs, VT.ARRAY, VT.STRING)
        if kinds == {"bool"}:
            return GGUFValue(vs, VT.ARRAY, VT.BOOL)
        if kinds == {"int"}:
            return GGUFValue(vs, VT.ARRAY, _int_type(vs))
        if kinds <= {"int", "float"}:
            return GGUFValue([float(x) for x in vs], VT.ARRAY, VT.FLOAT32)
        raise MetadataTypeError(f"metadata {key!r}: list of {sorted(kinds)} has no GGUF type "
                                f"(expected all str, all bool, or numbers)")
    raise MetadataTypeError(f"metadata {key!r}: value of type {type(v).__name__} has no GGUF type "
                            f"(expected str, bool, int, float or a list of them)")


# -- planning the shards -----------------------------------------------------------------------


@dataclass
class GGUFTensor:
    name: str                  # GGUF name: "{base}.{suffix}"
    base: str
    suffix: str
    shape: tuple[int, ...]     # element shape, NumPy order
    qtype: Any                 # GGMLQuantizationType
    nbytes: int


@dataclass
class ShardPlan:
    name: str                  # file name
    tensors: list[PlannedTensor]
    gguf: list[GGUFTensor]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gguf)


def gguf_tensors(t: PlannedTensor) -> list[GGUFTensor]:
    where = f"artifact tensor {t.name!r} ({', '.join(t.sources[:2])}{', ...' if len(t.sources) > 2 else ''})"
    return [GGUFTensor(layout.gguf_name(t.name, s), t.name, s, shp, qt, layout.nbytes(shp, qt))
            for s, shp, qt in layout.gguf_parts(t.format, t.shape, t.optional, where)]


def plan_shards(plan: RankPlan, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[ShardPlan]:
    """Greedy in plan order; an artifact tensor's GGUF tensors never straddle shards; a new
    shard starts when the next tensor would take this one past max_shard_bytes."""
    seen = set()
    groups: list[tuple[list, list]] = [([], [])]
    size = 0
    for t in plan.tensors:
        if t.name in seen:
            raise ArtifactMalformed(f"rank {plan.rank}: artifact tensor {t.name!r} is planned twice")
        seen.add(t.name)
        g = gguf_tensors(t)
        n = sum(x.nbytes for x in g)
        if groups[-1][0] and size + n > max_shard_bytes:
            groups.append(([], []))
            size = 0
        groups[-1][0].append(t)
        groups[-1][1].extend(g)
        size += n
    k = len(groups)
    return [ShardPlan(shard_name(plan.rank, i + 1, k), ts, gs) for i, (ts, gs) in enumerate(groups)]


def tensor_table(shards: list[ShardPlan]) -> dict[str, dict]:
    """bloomery.tensors: base name -> {format, role, shape, optional, sources, cut, layout,
    shard, parts: {part: GGUF name}} (NVFP4 / MXFP4 in GGML blocks: weight and scale both
    name the `.weight` tensor)."""
    table = {}
    for sh in shards:
        by_base: dict[str, dict[str, str]] = {}
        for g in sh.gguf:
            by_base.setdefault(g.base, {})[g.suffix] = g.name
        for t in sh.tensors:
            names = by_base[t.name]
            parts = dict(names)
            if "scale" not in names and t.format in ("nvfp4", "mxfp4"):
                parts["scale"] = names["weight"]
            table[t.name] = {"format": t.format, "role": t.role, "shape": list(t.shape),
                             "optional": list(t.optional), "sources": list(t.sources), "cut": t.cut,
                             "layout": layout.layout_name(t.format, t.shape), "shard": sh.name,
                             "parts": dict(sorted(parts.items()))}
    return table


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# -- spot-check samples ---------------------------------------------------------------------------


def sample_windows(fmt_name: str, shape) -> list[tuple[int, int, int]]:
    """(matrix index, row start, row stop): first and last matrix of a stack, first and last
    row block (the format's row cut unit) of each. A 1-D tensor: the whole of it."""
    if len(shape) < 2:
        return [(0, 0, shape[0] if shape else 1)]
    n = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    out = shape[-2]
    u = formats.get(fmt_name).cut_unit(-2)
    rows = sorted({(0, min(u, out)), ((out - 1) // u * u, out)})
    return [(li, r0, r1) for li in sorted({0, n - 1}) for r0, r1 in rows]


def decoded_digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return hashlib.sha256(repr(a.shape).encode() + a.view(np.uint8).tobytes()).hexdigest()


def sample_parts(fmt_name: str, shape, parts, li: int, r0: int, r1: int) -> dict:
    """The planned parts of one window (format's own cut on the stored layout)."""
    fmt = formats.get(fmt_name)
    if len(shape) < 2:
        return parts
    sub = layout.take_lead(parts, shape[:-2], li)
    return fmt.cut(sub, -2, r0, r1, check=False)          # the writer checked the parts once


# -- writing ---------------------------------------------------------------------------------------


@dataclass
class RankWrite:
    """What was written, per shard: DIGESTS.json's entry (bytes, header, GGUF tensors) and each GGUF
    tensor's data offset; per artifact tensor its spot-check digests."""

    rank: int
    shards: list[ShardPlan]
    digests: dict[str, dict] = field(default_factory=dict)      # shard file name -> DIGESTS.json entry
    offsets: dict[str, int] = field(default_factory=dict)       # GGUF tensor name -> data offset in its file
    samples: dict[str, list] = field(default_factory=dict)      # base -> [(li, r0, r1, digest)]
    syncs: list = field(default_factory=list)                   # each shard's fsync, run behind (wait_synced)

    def wait_synced(self) -> None:
        """Every shard fsynced and closed (an fsync's error raised here)."""
        for t in self.syncs:
            t.join()
        err = next((t.err for t in self.syncs if t.err is not None), None)
        if err is not None:
            raise err

    @property
    def files(self) -> list[str]:
        return [s.name for s in self.shards]


def shard_metadata(plan: RankPlan, i: int, shards: list[ShardPlan], extra: Mapping[str, Any] | None,
                   tokenizer_json: str | None, chat_template: str | None) -> tuple[str, dict]:
    """(architecture, {key: GGUFValue}) for shard i (0-based) of a rank, in write order."""
    md = dict(plan.metadata)
    md.update(extra or {})
    arch = md.pop("general.architecture", "bloomery")
    if not isinstance(arch, str):
        raise MetadataTypeError(f"metadata 'general.architecture': expected str, got {type(arch).__name__}")
    kv = {"split.no": GGUFValue(i, VT.UINT16), "split.count": GGUFValue(len(shards), VT.UINT16),
          "split.tensors.count": GGUFValue(sum(len(s.gguf) for s in shards), VT.INT32),
          KEY_RANK: GGUFValue(plan.rank, VT.UINT32), KEY_TP: GGUFValue(plan.tp, VT.UINT32)}
    if i == 0:
        for k in sorted(md):
            if k in kv or k in (KEY_TENSORS, KEY_LAYOUT, KEY_TOKENIZER, KEY_TEMPLATE):
                raise MetadataTypeError(f"metadata {k!r} is written by the artifact writer itself")
            kv[k] = gguf_value(k, md[k])
        kv[KEY_LAYOUT] = GGUFValue(layout.LAYOUT_VERSION, VT.UINT32)
        kv[KEY_TENSORS] = GGUFValue(dumps(tensor_table(shards)), VT.STRING)
        if tokenizer_json is not None:
            kv[KEY_TOKENIZER] = GGUFValue(tokenizer_json, VT.STRING)
        if chat_template is not None:
            kv[KEY_TEMPLATE] = GGUFValue(chat_template, VT.STRING)
    return arch, kv


class _Sink:
    """A worker thread of the writer: runs the jobs it is handed (write chunks, or digest them) in
    order, while at most `budget` bytes wait (a job bigger than that waits alone). An error there
    comes back at the next put or drain, and the jobs after it are skipped."""

    def __init__(self, budget: int):
        self._jobs: list = []
        self._cv = threading.Condition()
        self._budget, self._waiting, self._err = budget, 0, None
        self._t = threading.Thread(target=self._run, name="bloomery-writer", daemon=True)
        self._t.start()

    def _run(self):
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job, n = self._jobs[0]
            if job is None:
                return
            try:
                if self._err is None:
                    job()
            except BaseException as e:           # handed back to the producing thread
                self._err = e
            with self._cv:
                self._jobs.pop(0)
                self._waiting -= n
                self._cv.notify_all()

    def _raise(self):
        if self._err is not None:
            raise self._err

    def put(self, job, nbytes: int = 0) -> None:
        with self._cv:
            while self._waiting and self._waiting + nbytes > self._budget and self._err is None:
                self._cv.wait()
            self._raise()
            self._jobs.append((job, nbytes))
            self._waiting += nbytes
            self._cv.notify_all()

    def drain(self) -> None:
        with self._cv:
            while self._jobs:
                self._cv.wait()
        self._raise()

    def close(self) -> None:
        with self._cv:
            self._jobs.append((None, 0))
            self._cv.notify_all()
        self._t.join()


def write_rank(folder, plan: RankPlan, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               extra_metadata: Mapping[str, Any] | None = None, tokenizer_json: str | None = None,
               chat_template: str | None = None, progress=None, chunk_bytes: int = CHUNK_BYTES,
               hook=None, shards: list[ShardPlan] | None = None) -> RankWrite:
    """Write the rank's shards into `folder` (each fsynced behind: RankWrite.wait_synced); return
    their digests and the spot-check digests. `progress`: an object with update(nbytes) (a tqdm
    bar) or None.
    `hook(point)`: called after each artifact tensor ("tensor") and shard ("shard")."""
    folder = Path(folder)
    shards = shards if shards is not None else plan_shards(plan, max_shard_bytes)
    res = RankWrite(plan.rank, shards)
    sinks = (_Sink(SINK_BYTES), _Sink(SINK_BYTES))        # writes; digests
    try:
        for i, sh in enumerate(shards):
            arch, kv = shard_metadata(plan, i, shards, extra_metadata, tokenizer_json, chat_template)
            w = GGUFWriter(None, arch)
            for k, v in kv.items():
                w.add_key_value(k, v.value, v.type, v.sub_type)
            for g in sh.gguf:
                w.add_tensor_info(g.name, g.shape, np.dtype(np.float32), g.nbytes, raw_dtype=g.qtype)
            w.write_header_to_file(folder / sh.name)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            fout = w.fout[0]
            out = _Out(sinks, fout, folder / sh.name, w.data_alignment, res, progress)
            expected = iter(sh.gguf)
            for t in sh.tensors:
                _write_tensor(out, t, expected, res, chunk_bytes)
                if hook:
                    hook("tensor")
            left = next(expected, None)
            if left is not None:
                raise ArtifactMalformed(f"{sh.name}: GGUF tensor {left.name!r} was planned but never written")
            out.flush()
            for sink in sinks:
                sink.drain()
            out.finish(sh.name)
            fout.flush()
            res.syncs.append(_Fsync(w))
            if hook:
                hook("shard")
    finally:
        for sink in sinks:
            sink.close()
    return res


class _Fsync(threading.Thread):
    """A written shard's fsync and close, behind the caller (publish re-reads the shard meanwhile and
    waits for it before SHA256SUMS: RankWrite.wait_synced)."""

    def __init__(self, w: GGUFWriter):
        super().__init__(name="bloomery-fsync", daemon=True)
        self.w, self.err = w, None
        self.start()

    def run(self):
        try:
            os.fsync(self.w.fout[0].fileno())
            self.w.close()
        except BaseException as e:
            self.err = e


class _Out:
    """One shard's bytes after gguf-py's header: written by one thread and digested by another, in
    jobs of at least BATCH_BYTES (or a shard's last), the position kept here (so the padding is
    known without asking the file). The header (metadata and tensor infos, padded to the data
    alignment) is read back once and digested first."""

    def __init__(self, sinks: tuple[_Sink, _Sink], fout, path: Path, align: int, res: RankWrite, progress):
        self.sinks, self.fout, self.align, self.res, self.progress = sinks, fout, align, res, progress
        fout.flush()
        n = fout.tell()
        pad = bytes(-n % align)
        fout.write(pad)
        with open(path, "rb") as f:
            head = f.read(n) + pad
        self.pos = len(head)
        self.tensors: dict[str, dict] = {}       # filled by the writer thread, in file order
        self.header = {"bytes": self.pos, "sha256": hashlib.sha256(head).hexdigest(),
                       "sum": integrity.word_sum(head)}
        self._batch: list = []                   # (bytes, hashes) to write, or (name, hashes) done
        self._batch_bytes = 0

    def pad(self) -> None:
        n = -self.pos % self.align
        if n:
            self.write(bytes(n), ())

    def write(self, b, hashes) -> None:
        self._batch.append((b, hashes))
        self._batch_bytes += len(b)
        self.pos += len(b)
        if self._batch_bytes >= BATCH_BYTES:
            self.flush()

    def begin(self, name: str) -> tuple:
        """The digests of GGUF tensor `name`, which starts here (aligned)."""
        self.pad()
        self.res.offsets[name] = self.pos
        return hashlib.sha256(), integrity.WordSum()

    def end(self, name: str, hashes) -> None:
        self._batch.append((name, hashes))
        self.pad()

    def flush(self) -> None:
        """Hand the batch to the two threads."""
        batch, n, fout, progress, tensors = self._batch, self._batch_bytes, self.fout, self.progress, self.tensors
        self._batch, self._batch_bytes = [], 0

        def write():
            for item, hashes in batch:
                if not isinstance(item, str):
                    fout.write(item)
                    if hashes and progress is not None:
                        progress.update(len(item))

        def digest():
            for item, hashes in batch:
                if isinstance(item, str):            # a GGUF tensor's last byte went by: its digests
                    tensors[item] = {"sha256": hashes[0].hexdigest(), "sum": hashes[1].hexdigest()}
                    continue
                for h in hashes:
                    h.update(item)
        if batch:
            self.sinks[0].put(write, n)
            self.sinks[1].put(digest, n)

    def finish(self, shard: str) -> None:
        """After the writer thread drained: the shard's digests into the RankWrite."""
        self.res.digests[shard] = {"bytes": self.pos, "header": self.header, "tensors": self.tensors}


def _rows(pieces: list[dict], r0: int, r1: int) -> dict:
    """Rows r0..r1 of a table held as pieces along axis 0 (only those rows read)."""
    out, at = [], 0
    for p in pieces:
        w = p["weight"]
        lo, hi = max(r0 - at, 0), min(r1 - at, w.shape[0])
        if lo < hi:
            out.append(np.asarray(w[lo:hi]))
        at += w.shape[0]
    return {"weight": np.concatenate(out)}


def _write_tensor(out: _Out, t: PlannedTensor, expected, res: RankWrite, chunk_bytes: int):
    where = f"artifact tensor {t.name!r} ({', '.join(t.sources[:2])}{', ...' if len(t.sources) > 2 else ''})"
    fmt = formats.get(t.format)
    pieces = t.pieces() if t.pieces is not None else None
    if pieces is not None:                        # a table in pieces: streamed, never joined in memory
        for p in pieces:
            fmt.check(p, where)
        shapes = [tuple(fmt.shape(p)) for p in pieces]
        got_shape = ((sum(x[0] for x in shapes), *shapes[0][1:]) if all(x[1:] == shapes[0][1:] for x in shapes)
                     else tuple(shapes))                # pieces that do not stack: named in the error below
        got_opt = ()
    else:
        parts = t.produce()
        fmt.check(parts, where)
        got_shape = tuple(fmt.shape(parts))
        got_opt = tuple(k for k in ("input_scale", "pre_quant_scale") if k in parts)
    if got_shape != tuple(t.shape) or set(got_opt) != set(t.optional):
        raise ArtifactMalformed(f"{where}: produce() gave {t.format} of shape {list(got_shape)} with "
                                f"optional parts {list(got_opt)}; the plan says {list(t.shape)} with "
                                f"{list(t.optional)}")
    windows = sample_windows(t.format, t.shape)
    res.samples[t.name] = [(li, r0, r1, decoded_digest(fmt.decode(
        _rows(pieces, r0, r1) if pieces is not None else sample_parts(t.format, t.shape, parts, li, r0, r1),
        check=False))) for li, r0, r1 in windows]          # a cut of checked parts
    cur, h, n = None, None, 0

    def finish():
        if cur is None:
            return
        if n != cur.nbytes:
            raise ArtifactMalformed(f"{where}: GGUF tensor {cur.name!r} came out {n} bytes; "
                                    f"its header says {cur.nbytes}")
        out.end(cur.name, h)

    chunks = (c for p in pieces for c in layout.iter_gguf(t.format, p, chunk_bytes, where, checked=True)) \
        if pieces is not None else layout.iter_gguf(t.format, parts, chunk_bytes, where, checked=True)
    for suffix, chunk in chunks:
        if cur is None or suffix != cur.suffix:
            finish()
            cur = next(expected)
            if cur.suffix != suffix or cur.base != t.name:
                raise ArtifactMalformed(f"{where}: layout yielded {suffix!r} where {cur.name!r} was planned")
            h, n = out.begin(cur.name), 0
        b = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        out.write(b, h)
        n += len(b)
    finish()
