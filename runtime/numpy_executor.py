"""The NumPy executor: runs the plans of every rank on the CPU, op by op in lockstep (simulated
tensor-parallel ranks in one process; a collective combines the ranks' buffers).

Buffers are allocated once at load with the plan's static shapes: `state` buffers (the KV
cache) are shared by the programs, every other buffer belongs to one program (the ones its ops
name), with `rows` bound to that program's row count (decode: slots, prefill: ubatch, verify:
the drafts plus one).

The verify program runs row by row: each op once per active row, on one-row views of its
buffers, so that every row is computed exactly as a one-row decode step computes it (the same
arrays' shapes, the same BLAS calls): the logits of a verified row equal plain decoding's bit
for bit, and greedy output with a draft is plain greedy output by construction."""

from __future__ import annotations

import numpy as np

from bloomery.core import plan as P

from .errors import PlanMismatch
from .kv_cache import KvStore, typed_caches
from .ops import IMPL

DTYPES = {"f32": np.float32, "i32": np.int32}


class NumpyExecutor:
    def __init__(self, plans: list[dict], weights: list, symbols: dict[str, int], cache_types=("f32", "f32")):
        self.plans, self.weights, self.symbols = plans, weights, dict(symbols)
        _check_lockstep(plans)
        state = [{n: np.zeros(P.shape(b, symbols), DTYPES[b["dtype"]])
                  for n, b in p["buffers"].items() if b["kind"] == "state"} for p in plans]
        for p, st, w in zip(plans, state, weights):          # the attention caches in the chosen types (kv_cache.py)
            for op, key, kind in typed_caches(p, cache_types):
                if not isinstance(st[op[key]], KvStore):
                    sc = "k_scale" if key == "cache_k" else "v_scale"
                    scale = float(w[op[sc]].reshape(-1)[0]) if sc in op else None
                    st[op[key]] = KvStore(kind, st[op[key]].shape, scale, where=f"{op[key]} ({kind})")
        self.buffers: dict[str, list[dict]] = {}
        self.steps: dict[str, list] = {}
        self.where: dict[str, list] = {}     # per step: (op index, op name)
        self.row_steps: list[list] = []      # the verify program's steps on each row's views
        self._kept: list | None = None       # keep()'s (state, history) pairs
        progs = {p: r for p, r in P.programs_of(plans[0]).items() if r in symbols}
        for prog, rows_sym in progs.items():
            bind = {**symbols, "rows": symbols[rows_sym]}
            self.buffers[prog] = [{**st, **_program_buffers(p, prog, bind)} for p, st in zip(plans, state)]
            self.steps[prog], self.where[prog] = self._bind(prog, self.buffers[prog])
        if "verify" in self.buffers:
            for r in range(symbols["verify"]):
                views = [{n: (a[r:r + 1] if p["buffers"][n]["shape"][:1] == ["rows"] else a) for n, a in bufs.items()}
                         for p, bufs in zip(plans, self.buffers["verify"])]
                self.row_steps.append(self._bind("verify", views)[0])
        self.state = state

    def _bind(self, prog: str, bufs: list[dict]) -> tuple[list, list]:
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
        return self.symbols[P.ALL_PROGRAMS[prog]]

    def run(self, prog: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sets the input buffers (the same on every rank), runs the program, returns rank 0's outputs
        (the ranks' outputs are equal: the logits are gathered, argmax runs on every rank). The
        verify program runs row by row over its active rows (module docstring); its other rows'
        outputs are left as they were."""
        bufs = self.buffers[prog]
        for b in bufs:
            for n, v in inputs.items():
                b[n][...] = v
        if prog == "verify":
            live = np.nonzero(np.asarray(inputs["positions"]) >= 0)[0]
            rowed = [[steps[k] for steps in (self.row_steps[r] for r in live)] for k in range(len(self.steps[prog]))]
        else:
            rowed = [[step] for step in self.steps[prog]]
        for k, calls in enumerate(rowed):
            try:
                for fn, *args in calls:
                    fn(*args)
            except (ValueError, IndexError, TypeError, KeyError, ArithmeticError) as e:
                i, name = self.where[prog][k]
                raise P.PlanInvalid(f"{prog} op {i} ({name}): {type(e).__name__}: {e}; the plan's attributes do not "
                                    f"fit its buffers and weights: re-prepare the artifact") from None
        return {n: bufs[0][n] for n, b in self.plans[0]["buffers"].items() if b["kind"] == "output"}

    def state_nbytes(self) -> int:
        """Bytes of every rank's state buffers as held (the KV cache in its chosen type)."""
        return sum(int(a.nbytes) for st in self.state for a in st.values())

    def keep(self, slot: int, row: int) -> None:
        """After a verify run: the recurrent states of `slot` as they were after verify row `row`
        (the last accepted one), from the history the state ops wrote."""
        if self._kept is None:                       # (state, its history) of every rank's state ops, once
            self._kept = [(st[op[P.OPS[op["op"]].state[0]]], bufs[op["history"]])
                          for p, bufs, st in zip(self.plans, self.buffers["verify"], self.state)
                          for op in p["programs"]["verify"]["ops"] if "history" in op]
        for state, hist in self._kept:
            state[slot] = hist[row]

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


def _program_buffers(plan: dict, prog: str, bind: dict) -> dict[str, np.ndarray]:
    """A program's own buffers: the inputs and outputs, and the scratch its ops name."""
    used = P.buffers_used(plan, prog)
    return {n: np.zeros(P.shape(b, bind), DTYPES[b["dtype"]]) for n, b in plan["buffers"].items()
            if b["kind"] in ("input", "output") or (b["kind"] == "scratch" and n in used)}


def _check_lockstep(plans: list[dict]) -> None:
    """The ranks' programs must hold the same ops in the same order, collectives identical."""
    for prog in P.programs_of(plans[0]):
        if any(prog not in p["programs"] for p in plans):
            raise PlanMismatch(f"the ranks' plans do not all hold the {prog} program")
        ops = [p["programs"][prog]["ops"] for p in plans]
        if len({len(o) for o in ops}) > 1:
            raise PlanMismatch(f"{prog}: the ranks' plans hold {[len(o) for o in ops]} ops")
        for i, group in enumerate(zip(*ops)):
            names = {o["op"] for o in group}
            if len(names) > 1 or (P.OPS[group[0]["op"]].collective and any(o != group[0] for o in group)):
                raise PlanMismatch(f"{prog} op {i}: the ranks' plans differ ({[o['op'] for o in group]})")
