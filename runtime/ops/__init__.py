"""The NumPy implementation of every op of core/plan.OPS, one module each.

Contract: `run(op, buf, w)` reads and writes the rank's buffers (dict name -> ndarray, the
plan's static shapes) in place; `w` is the rank's CpuWeights. A collective instead has
`run_ranks(ops, bufs)`: the same op of every rank, and every rank's buffers. Rows whose
position is negative are inactive: attention neither writes nor reads the cache for them.
All arithmetic is float32 (the plan's buffers), accumulation included.
"""

from __future__ import annotations

from importlib import import_module

from bloomery.core.plan import OPS

IMPL = {name: import_module(f"{__name__}.{name}") for name in OPS}
