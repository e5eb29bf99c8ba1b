"""Write one rank's GGUF split: `rank{r}-{i:05d}-of-{n:05d}.gguf`, streamed.

gguf-py's GGUFWriter writes the header, the metadata and the tensor infos (sizes known up
front from core/artifact/layout.gguf_parts); then each tensor's bytes are written as its
planned `produce()` yields them, the main tensor in row chunks (core/artifact/layout.iter_gguf),
so memory stays bounded by one tensor's parts plus a chunk. Every GGUF tensor's SHA-256 is
taken as it is written, and a few rows of every tensor are decoded from the planned parts
(hashed) for publish's spot check. Deterministic: no timestamps, sorted keys and JSON, the
plan's tensor order.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from gguf import GGUFValueType as VT
from gguf import GGUFWriter
from gguf.gguf_writer import GGUFValue

from bloomery.core import formats
from bloomery.core.artifact import layout
from bloomery.core.errors import ArtifactMalformed, MetadataTypeError

from .planned import PlannedTensor, RankPlan

DEFAULT_MAX_SHARD_BYTES = 4 << 30
CHUNK_BYTES = 32 << 20
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
        for t in sh.tensors:
            names = {g.suffix: g.name for g in sh.gguf if g.base == t.name}
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
    return fmt.cut(sub, -2, r0, r1)


# -- writing ---------------------------------------------------------------------------------------


@dataclass
class RankWrite:
    rank: int
    shards: list[ShardPlan]
    sha256: dict[str, str] = field(default_factory=dict)        # GGUF tensor name -> hex
    samples: dict[str, list] = field(default_factory=dict)      # base -> [(li, r0, r1, digest)]

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


def write_rank(folder, plan: RankPlan, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               extra_metadata: Mapping[str, Any] | None = None, tokenizer_json: str | None = None,
               chat_template: str | None = None, progress=None, chunk_bytes: int = CHUNK_BYTES,
               hook=None, shards: list[ShardPlan] | None = None) -> RankWrite:
    """Write the rank's shards into `folder` (fsynced); return their tensors' SHA-256 and the
    spot-check digests. `progress`: an object with update(nbytes) (a tqdm bar) or None.
    `hook(point)`: called after each artifact tensor ("tensor") and shard ("shard")."""
    folder = Path(folder)
    shards = shards if shards is not None else plan_shards(plan, max_shard_bytes)
    res = RankWrite(plan.rank, shards)
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
        expected = iter(sh.gguf)
        for t in sh.tensors:
            _write_tensor(w, fout, t, expected, res, progress, chunk_bytes)
            if hook:
                hook("tensor")
        left = next(expected, None)
        if left is not None:
            raise ArtifactMalformed(f"{sh.name}: GGUF tensor {left.name!r} was planned but never written")
        fout.flush()
        os.fsync(fout.fileno())
        w.close()
        if hook:
            hook("shard")
    return res


def _write_tensor(w, fout, t: PlannedTensor, expected, res: RankWrite, progress, chunk_bytes):
    where = f"artifact tensor {t.name!r} ({', '.join(t.sources[:2])}{', ...' if len(t.sources) > 2 else ''})"
    parts = t.produce()
    fmt = formats.get(t.format)
    fmt.check(parts, where)
    got_shape = tuple(fmt.shape(parts))
    got_opt = tuple(k for k in ("input_scale", "pre_quant_scale") if k in parts)
    if got_shape != tuple(t.shape) or set(got_opt) != set(t.optional):
        raise ArtifactMalformed(f"{where}: produce() gave {t.format} of shape {list(got_shape)} with "
                                f"optional parts {list(got_opt)}; the plan says {list(t.shape)} with "
                                f"{list(t.optional)}")
    res.samples[t.name] = [(li, r0, r1, decoded_digest(fmt.decode(sample_parts(t.format, t.shape, parts, li, r0, r1))))
                           for li, r0, r1 in sample_windows(t.format, t.shape)]
    cur, h, n = None, None, 0

    def finish():
        if cur is None:
            return
        if n != cur.nbytes:
            raise ArtifactMalformed(f"{where}: GGUF tensor {cur.name!r} came out {n} bytes; "
                                    f"its header says {cur.nbytes}")
        w.write_padding(fout, n)
        res.sha256[cur.name] = h.hexdigest()

    for suffix, chunk in layout.iter_gguf(t.format, parts, chunk_bytes, where):
        if cur is None or suffix != cur.suffix:
            finish()
            cur = next(expected)
            if cur.suffix != suffix or cur.base != t.name:
                raise ArtifactMalformed(f"{where}: layout yielded {suffix!r} where {cur.name!r} was planned")
            w.write_padding(fout, fout.tell())
            h, n = hashlib.sha256(), 0
        b = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        fout.write(b)
        h.update(b)
        n += len(b)
        if progress is not None:
            progress.update(len(b))
    finish()
