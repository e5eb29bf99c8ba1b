"""The NumPy executor: runs the plans of every rank on the CPU, op by op in lockstep (simulated
tensor-parallel ranks in one process; a collective combines the ranks' buffers).

Buffers are allocated once at load with the plan's static shapes: `state` buffers (the KV
cache) are shared by both programs, every other buffer belongs to one program, with `rows`
bound to that program's row count (decode: slots, prefill: ubatch)."""

from __future__ import annotations

import numpy as np

from bloomery.core import plan as P

from .errors import PlanMismatch
from .ops import IMPL

DTYPES = {"f32": np.float32, "i32": np.int32}


class NumpyExecutor:
    def __init__(self, plans: list[dict], weights: list, symbols: dict[str, int]):
        self.plans, self.weights, self.symbols = plans, weights, dict(symbols)
        _check_lockstep(plans)
        state = [{n: np.zeros(P.shape(b, symbols), DTYPES[b["dtype"]])
                  for n, b in p["buffers"].items() if b["kind"] == "state"} for p in plans]
        self.buffers: dict[str, list[dict]] = {}
        self.steps: dict[str, list] = {}
        self.where: dict[str, list] = {}     # per step: (op index, op name)
        for prog, rows_sym in P.PROGRAMS.items():
            bind = {**symbols, "rows": symbols[rows_sym]}
            self.buffers[prog] = [{**st, **{n: np.zeros(P.shape(b, bind), DTYPES[b["dtype"]])
                                            for n, b in p["buffers"].items() if b["kind"] != "state"}}
                                  for p, st in zip(plans, state)]
            self.steps[prog], self.where[prog] = self._bind(prog)
        self.state = state

    def _bind(self, prog: str) -> tuple[list, list]:
        bufs = self.buffers[prog]
        ops = [p["programs"][prog]["ops"] for p in self.plans]
        steps, where = [], []
        for i, op0 in enumerate(ops[0]):
            impl = IMPL[op0["op"]]
            if P.OPS[op0["op"]].collective:
                steps.append((impl.run_ranks, [o[i] for o in ops], bufs))
                where.append((i, op0["op"]))
            else:
                for r in range(len(self.plans)):
                    steps.append((impl.run, ops[r][i], bufs[r], self.weights[r]))
                    where.append((i, op0["op"]))
        return steps, where

    def rows(self, prog: str) -> int:
        return self.symbols[P.PROGRAMS[prog]]

    def run(self, prog: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sets the input buffers (the same on every rank), runs the program, returns rank 0's outputs
        (the ranks' outputs are equal: the logits are gathered, argmax runs on every rank)."""
        bufs = self.buffers[prog]
        for b in bufs:
            for n, v in inputs.items():
                b[n][...] = v
        for k, (fn, *args) in enumerate(self.steps[prog]):
            try:
                fn(*args)
            except (ValueError, IndexError, TypeError, KeyError, ArithmeticError) as e:
                i, name = self.where[prog][k]
                raise P.PlanInvalid(f"{prog} op {i} ({name}): {type(e).__name__}: {e}; the plan's attributes do not "
                                    f"fit its buffers and weights: re-prepare the artifact") from None
        return {n: bufs[0][n] for n, b in self.plans[0]["buffers"].items() if b["kind"] == "output"}

    def reset(self, slot: int | None = None) -> None:
        """Clears the state buffers (of one slot: their first axis)."""
        for st in self.state:
            for a in st.values():
                if slot is None:
                    a[...] = 0
                else:
                    a[slot] = 0

    def copy_state(self, slot: int, names) -> list[dict]:
        """A copy of one slot's state buffers `names` (every rank's), for set_state."""
        return [{n: st[n][slot].copy() for n in names} for st in self.state]

    def set_state(self, slot: int, saved: list[dict]) -> None:
        for st, d in zip(self.state, saved):
            for n, a in d.items():
                st[n][slot] = a


def _check_lockstep(plans: list[dict]) -> None:
    """The ranks' programs must hold the same ops in the same order, collectives identical."""
    for prog in P.PROGRAMS:
        ops = [p["programs"][prog]["ops"] for p in plans]
        if len({len(o) for o in ops}) > 1:
            raise PlanMismatch(f"{prog}: the ranks' plans hold {[len(o) for o in ops]} ops")
        for i, group in enumerate(zip(*ops)):
            names = {o["op"] for o in group}
            if len(names) > 1 or (P.OPS[group[0]["op"]].collective and any(o != group[0] for o in group)):
                raise PlanMismatch(f"{prog} op {i}: the ranks' plans differ ({[o['op'] for o in group]})")
