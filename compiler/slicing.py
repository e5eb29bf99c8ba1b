"""Tensor-parallel slices of stored tensors: where each rank's cut falls (checked at plan
time, with the numbers), and the lazy producers of a rank's parts (cut, expert stacking,
the Q8_0 rewrite). Producers read through the shards' mmaps and copy only the slice.

A `segments` cut (core/specs.py) takes, along axis 0, the rank's share of each of several
segments ((length, unit) pairs: its `unit` argument here) and joins them in order: Qwen3-Next's
conv weight [C, 1, K], whose channels are [q heads | k heads | v heads], keeps the channels of
the rank's heads of each. It reads plain formats only (bf16, f16, f32: values are sliced as is)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from bloomery.core import formats, specs
from bloomery.core.errors import FormatNotAllowed, NotOnBlockBoundary, SpecError, TPNotDivisible

AXIS = {"column": -2, "row": -1}
Q8_BLOCK = 32
SEGMENT_FORMATS = ("bf16", "f16", "f32")


def rank_range(n: int, tp: int, rank: int, unit: int | None = None) -> tuple[int, int]:
    """Rank's [start, stop) of an axis of length n: equal slices, or whole `unit`s shared out as
    evenly as possible (core/specs.share: the first ranks take one more)."""
    if unit is None:
        per = n // tp
        return rank * per, (rank + 1) * per
    units = n // unit
    start = sum(specs.share(units, tp, r) for r in range(rank))
    return start * unit, (start + specs.share(units, tp, rank)) * unit


def segment_ranges(segments, tp: int, rank: int) -> list[tuple[int, int]]:
    """A segments cut: rank's [start, stop) ranges along axis 0, its share of each (length, unit)."""
    out, at = [], 0
    for n, unit in segments:
        a, b = rank_range(n, tp, rank, unit)
        out.append((at + a, at + b))
        at += n
    return out


def _check_segments(fmt: formats.Format, shape: tuple, segments, tp: int, where: str) -> None:
    if sum(n for n, _ in segments) != shape[0]:
        raise SpecError(f"{where}: segments {[n for n, _ in segments]} do not add up to axis 0 of length {shape[0]}")
    if tp == 1:
        return
    if fmt.name not in SEGMENT_FORMATS:
        raise FormatNotAllowed(f"{where}: a segments cut slices plain values ({', '.join(SEGMENT_FORMATS)}); "
                               f"this tensor is stored as {fmt.name}.")
    for i, (n, unit) in enumerate(segments):
        _check_units(f"{where}: segment {i} of axis 0 ({n} of {shape[0]})", n, tp, unit)


def _check_units(what: str, n: int, tp: int, unit: int | None, hint: str = "") -> None:
    """TPNotDivisible where `n` values (`what`) do not share out over tp ranks: evenly without a
    unit, or in whole units with one at least per rank."""
    if unit is None and n % tp:
        raise TPNotDivisible(f"{what} does not split into tp {tp} equal slices.{hint}")
    if unit is not None and (n % unit or n // unit < tp):
        raise TPNotDivisible(f"{what} holds {n // unit} units of {unit}; tp {tp} needs at least one whole unit per rank.")


def check_partition(fmt: formats.Format, cut: str, shape: tuple, tp: int, where: str,
                    unit: int | None = None) -> None:
    """Refuse a cut of a tensor of logical `shape` (per expert) over tp ranks that is uneven
    without a unit, or has fewer units than ranks (TPNotDivisible), or has a rank's slice start
    or stop off the format's block (NotOnBlockBoundary). The block is the format's own (NVFP4's
    16): a rank's NVFP4 slice that is not a multiple of GGML's super-block of 64 is held in the
    stored layout (core/artifact/layout.layout_name). A segments cut: `unit` is its
    ((length, unit), ...)."""
    if cut == "segments":
        return _check_segments(fmt, shape, unit, tp, where)
    if tp == 1 or cut == "replicated":
        return
    axis = AXIS[cut] if len(shape) > 1 else -1         # a 1-D column cut: its only axis (a bias's rows)
    n = shape[axis]
    side = "in (columns)" if cut == "row" else "out (rows)"
    _check_units(f"{where}: {fmt.name} axis {side} of length {n}", n, tp, unit, f" Use a tp that divides {n}.")
    block = fmt.cut_unit(axis)
    for rank in range(tp):
        start, stop = rank_range(n, tp, rank, unit)
        if start % block or (stop % block and stop != n):
            raise NotOnBlockBoundary(f"{where}: {fmt.name} axis {side} of length {n} cut for tp {tp} gives rank "
                                     f"{rank} the slice {start}..{stop}, not on a multiple of {block} (the "
                                     f"format's block). Use a tp whose slices fall on multiples of {block}.")


def q8_allowed(cut: str, shape: tuple, tp: int, unit: int | None = None) -> bool:
    """Q8_0 blocks run along in: every rank's row length must be a multiple of 32."""
    if len(shape) < 2 or cut == "segments":
        return False
    if cut != "row":
        return shape[-1] % Q8_BLOCK == 0
    return all((b - a) % Q8_BLOCK == 0 for a, b in (rank_range(shape[-1], tp, r, unit) for r in range(tp)))


def _unit_shape(a: np.ndarray) -> np.ndarray:
    """A one-element per-tensor scale as a 0-d array, so that stacking gives [E]."""
    a = np.asarray(a)
    return a.reshape(()) if a.ndim == 1 and a.shape == (1,) else a


def pieces(fmt: formats.Format, qts: list, out_fmt: str) -> Callable[[], list] | None:
    """The stored pieces of a joined table, for the writer to stream (None where they must be
    rewritten first: a table the Q8_0 lever re-encodes, or a format with side tensors)."""
    if out_fmt != fmt.name or fmt.name not in ("bf16", "f16", "f32"):
        return None
    return lambda: [qt.parts for qt in qts]


def producer(fmt: formats.Format, experts: list, cut: str, rank: int, tp: int, stacked: bool,
             out_fmt: str, where: str, scalar: bool = False, unit: int | None = None,
             joined: bool = False) -> Callable[[], dict]:
    """This rank's parts in `out_fmt`, produced when called: fmt's own, q8_0 (the lever), or the
    format fmt is held as. `experts` are QuantTensors (one unless stacked, or joined: the shards of
    one table, concatenated along axis 0)."""
    axis = AXIS.get(cut)

    def one(qt) -> dict:
        parts = qt.parts                          # mmapped views: nothing read yet
        if cut == "segments" and tp > 1:
            w = parts["weight"]
            return {"weight": np.ascontiguousarray(np.concatenate([w[a:b] for a, b in segment_ranges(unit, tp, rank)]))}
        if axis is None or tp == 1:
            return parts
        ax = axis if len(fmt.shape(parts)) > 1 else -1   # a 1-D column cut: its only axis (a bias's rows)
        start, stop = rank_range(fmt.shape(parts)[ax], tp, rank, unit)
        return fmt.cut(parts, ax, start, stop, where, check=False)    # checked by the reader; the writer checks the cut

    def produce() -> dict:
        if joined:
            out = {k: np.concatenate([qt.parts[k] for qt in experts]) for k in experts[0].parts}
        elif not stacked:
            out = one(experts[0])
        else:
            out = {}
            for i, qt in enumerate(experts):
                p = one(qt)
                for k, v in p.items():
                    v = _unit_shape(v)
                    if i == 0:
                        out[k] = np.empty((len(experts),) + v.shape, v.dtype)
                    out[k][i] = v
        if out_fmt == "q8_0" != fmt.name:
            return formats.get("q8_0").encode(fmt.decode(out, where))
        if out_fmt != fmt.name:
            out = fmt.held(out, where)
        if scalar:                                # a one-value tensor (stored as [] or [1]) planned as [1]
            return {k: np.asarray(v).reshape((1,)) for k, v in out.items()}
        return out

    return produce
