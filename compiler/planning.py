"""Tensor planning, in one place: which artifact tensor each checkpoint tensor becomes, in
which format, and which slice each tensor-parallel rank holds. Every refusal happens here,
before anything is written; the bytes are produced later, lazily, by PlannedTensor.produce.

Formats: every tensor keeps its stored format (BF16 stays BF16). BLOOMERY_PREPARE_Q8=1
rewrites the BF16 tensors whose role kind allows it (specs/roles.yaml: linears, experts, the
token embedding and the output head, as llama.cpp's --outtype q8_0 does; never norms or the
router) as q8_0, where the rank's row length is a multiple of 32.

Metadata (RankPlan.metadata): general.architecture, general.name, bloomery.spec,
bloomery.prepare_q8 and the spec's `metadata` keys (llama.cpp's {arch}.* hyperparameters)
hold the whole model's values and are the same on every rank; bloomery.tp.size,
bloomery.tp.rank and the spec's `rank_metadata` (bloomery.tp.head_count, .head_count_kv,
.feed_forward_length, .expert_feed_forward_length: the whole value // tp) are per rank.
Values are np.uint32 / np.int32 / np.float32 / bool / str (core/specs.gguf_value_type).
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from bloomery.compiler import slicing
from bloomery.compiler.checkpoint import PLAIN_FORMATS, QuantTensor
from bloomery.compiler.matching import Slot, check_constants, check_unread, match
from bloomery.compiler.planned import PlannedTensor, RankPlan
from bloomery.compiler.shard import StoredTensor
from bloomery.core import formats, levers, ngram, specs
from bloomery.core.errors import (DuplicateTensor, FormatNotAllowed, LeverConflict, MixedExpertFormats,
                                  TensorShapeMismatch, TPNotDivisible)

Q8_LEVER = "BLOOMERY_PREPARE_Q8"


def use_q8(env: Mapping[str, str], keep_bf16: bool = False) -> bool:
    """The lever's setting (BadLeverValue for a value it does not take); LeverConflict next to --keep-bf16."""
    on = levers.flag(Q8_LEVER, env)
    if on and keep_bf16:
        raise LeverConflict(f"--keep-bf16 keeps BF16 tensors as stored, {Q8_LEVER}=1 rewrites them as Q8_0: "
                            f"choose one (unset {Q8_LEVER} or drop --keep-bf16).")
    return on


def plan(ckpt, tp: int = 1, env: Mapping[str, str] = os.environ, keep_bf16: bool = False) -> list[RankPlan]:
    """One RankPlan per rank for a Checkpoint (compiler/checkpoint.py), or a named refusal."""
    if not isinstance(tp, int) or tp < 1:
        raise TPNotDivisible(f"tp must be a positive integer, got {tp!r}.")
    q8 = use_q8(env, keep_bf16)
    where = str(ckpt.folder)
    spec = specs.for_config(ckpt.config, f"{ckpt.folder / 'config.json'}")
    values = spec.values(ckpt.config, f"{ckpt.folder / 'config.json'}",
                         {"kv_cache_quant": bool(ckpt.quant.kv_cache_quant_algo),
                          "mtp": any(n.startswith("mtp.") for n in ckpt.tensors)})
    for c in spec.tp_checks:
        c.run({**values, "tp": tp}, f"{where}: --tp {tp}")
    tensors = {**ckpt.tensors, **{n: _plain(t) for n, t in ckpt.kv_scales.items()}}
    tensors = _canonical(spec, tensors, where)
    check_constants(spec, values, _canonical(spec, ckpt.integers, where), where)
    check_unread(spec, values, _canonical(spec, ckpt.unread, where))
    slots = match(spec, values, tensors, where)
    roles = specs.load_roles()
    rows = [_tensor_rows(ckpt.folder, tensors, s, roles.roles[s.rule.role], tp, q8) for s in slots]
    out = []
    for rank in range(tp):
        planned = [PlannedTensor(name=s.name, role=s.rule.role, format=fmt_out,
                                 shape=_rank_shape(shape, s.rule.cut, tp, rank, unit),
                                 optional=optional, sources=s.hf, cut=s.rule.cut,
                                 produce=slicing.producer(fmt, qts, s.rule.cut, rank, tp, s.rule.experts is not None,
                                                          fmt_out, f"{where}: {s.name}", shape == (1,), unit,
                                                          joined=s.rule.shards is not None),
                                 pieces=slicing.pieces(fmt, qts, fmt_out) if s.rule.shards is not None else None)
                   for s, (fmt, fmt_out, shape, optional, qts, unit) in zip(slots, rows)]
        out.append(RankPlan(rank, tp, planned, _metadata(ckpt, spec, values, tp, rank, q8)))
    return out


def _canonical(spec, tensors: dict, where: str) -> dict:
    """Stored name -> tensor, renamed as the spec's templates spell them (its aliases)."""
    if not spec.aliases:
        return tensors
    out = {}
    for n, t in tensors.items():
        c = spec.canonical(n)
        if c in out:
            raise DuplicateTensor(f"{where}: tensors {n!r} and {out[c].name!r} are both {c!r} to the {spec.family} "
                                  f"spec ({spec.path.name}'s aliases); a checkpoint holds one of them.")
        out[c] = t
    return out


def _plain(t: StoredTensor) -> QuantTensor:
    """A KV-cache scale (k_scale / v_scale, checked by the reader) as a plain tensor."""
    return QuantTensor(t.name, formats.get(PLAIN_FORMATS[t.dtype]), {"weight": t})


def _tensor_rows(folder, tensors: dict, s: Slot, kind, tp: int, q8: bool):
    """Checks one artifact tensor; returns (stored format, artifact format, full logical shape,
    optional parts, QuantTensors, cut unit)."""
    qts = [tensors[h] for h in s.hf]
    fmt = qts[0].format
    for qt in qts[1:]:
        if qt.format is not fmt or sorted(qt.sources) != sorted(qts[0].sources):
            raise MixedExpertFormats(f"{folder}: artifact tensor {s.name!r} stacks {len(qts)} experts, but "
                                     f"{qts[0].name!r} is {fmt.name} with parts {sorted(qts[0].sources)} and "
                                     f"{qt.name!r} is {qt.format.name} with parts {sorted(qt.sources)}.")
    want = tuple(e.as_int(s.env) for e in s.rule.shape)
    if s.rule.shards is not None:
        _check_shards(s, qts, fmt, want)
    for qt in ([] if s.rule.shards is not None else qts):
        if tuple(qt.shape) != want and not (want == (1,) and int(np.prod(qt.shape)) == 1):   # [1]: one value
            exprs = ", ".join(e.text for e in s.rule.shape)
            raise TensorShapeMismatch(f"{qt.where()}: artifact tensor {s.name!r} (role {s.rule.role}, {fmt.name}) "
                                      f"has logical shape {list(qt.shape)}; the {s.rule.hf!r} template expects "
                                      f"{list(want)} = [{exprs}] from config.json.")
    where = f"{qts[0].where()} -> artifact tensor {s.name!r} (role {s.rule.role}, cut {s.rule.cut})"
    unit = None if s.rule.unit is None else s.rule.unit.as_int(s.env)
    if s.rule.segments is not None:               # a segments cut: its ((length, unit), ...)
        unit = tuple((n.as_int(s.env), None if u is None else u.as_int(s.env)) for n, u in s.rule.segments)
    slicing.check_partition(fmt, s.rule.cut, want, tp, where, unit)
    out_fmt = fmt.held_as or fmt.name              # nvfp4_g32 is held as nvfp4 (core/formats/nvfp4.py)
    if q8 and kind.q8 and fmt.name == "bf16" and slicing.q8_allowed(s.rule.cut, want, tp, unit):
        out_fmt = "q8_0"
    if kind.formats is not None and out_fmt not in kind.formats:
        note = f" ({kind.note})" if kind.note else ""
        raise FormatNotAllowed(f"{qts[0].where()}: artifact tensor {s.name!r} is stored as {fmt.name}, which the "
                               f"runtime does not read in role {s.rule.role} (kind {kind.name}: "
                               f"{', '.join(kind.formats)}){note}.")
    optional = tuple(sorted(p.name for p in fmt.parts if not p.required and p.name in qts[0].sources))
    if out_fmt == "q8_0":
        optional = ()
    shape = (len(qts), *want) if s.rule.experts is not None else want
    return fmt, out_fmt, shape, optional, qts, unit


def _check_shards(s: Slot, qts: list, fmt, want: tuple) -> None:
    """The pieces of a sharded table: plain values, torch.chunk's lengths along axis 0, the rest of `want`."""
    if fmt.name not in slicing.SEGMENT_FORMATS:
        raise FormatNotAllowed(f"{qts[0].where()}: artifact tensor {s.name!r} joins {len(qts)} stored shards, which "
                               f"bloomery joins in plain formats ({', '.join(slicing.SEGMENT_FORMATS)}); this one is "
                               f"stored as {fmt.name}.")
    lengths = ngram.chunks(want[0], len(qts)) if len(qts) > 1 else [want[0]]
    exprs = ", ".join(e.text for e in s.rule.shape)
    for qt, n in zip(qts, lengths + [0] * len(qts)):
        if tuple(qt.shape) != (n, *want[1:]):
            raise TensorShapeMismatch(f"{qt.where()}: shard of artifact tensor {s.name!r} (role {s.rule.role}) has "
                                      f"shape {list(qt.shape)}; the {s.rule.hf!r} template joins {len(qts)} shards "
                                      f"of {list(want)} = [{exprs}] from config.json, so this one should be "
                                      f"{[n, *want[1:]]}.")


def _rank_shape(shape: tuple, cut: str, tp: int, rank: int, unit: int | None) -> tuple:
    if cut == "replicated" or tp == 1:
        return tuple(shape)
    if cut == "segments":
        return (sum(b - a for a, b in slicing.segment_ranges(unit, tp, rank)), *shape[1:])
    axis = slicing.AXIS[cut] % len(shape)
    start, stop = slicing.rank_range(shape[axis], tp, rank, unit)
    return tuple(stop - start if i == axis else d for i, d in enumerate(shape))


def _metadata(ckpt, spec, values: dict, tp: int, rank: int, q8: bool) -> dict:
    name = ckpt.config.get("_name_or_path") or ckpt.folder.name
    md = {"general.architecture": spec.gguf_arch, "general.name": str(name).rstrip("/").split("/")[-1],
          "bloomery.spec": spec.family, "bloomery.prepare_q8": bool(q8)}
    md.update({k: m.value(values) for k, m in spec.metadata.items() if m.applies(values)})
    md.update({"bloomery.tp.size": np.uint32(tp), "bloomery.tp.rank": np.uint32(rank)})
    env = {**values, "tp": tp, "rank": rank}
    md.update({k: m.value(env) for k, m in spec.rank_metadata.items() if m.applies(env)})
    return md
