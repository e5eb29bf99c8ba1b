"""swiglu: out = silu(gate) * up, silu(x) = x / (1 + exp(-x)).

Optional attr limit (glm5_next's swiglu_limit, Glm5NextTextMLP and the experts' `_apply_gate`):
gate is clamped from above and up to [-limit, limit] first, out = silu(min(gate, limit)) *
clip(up, -limit, limit). Absent (or null): no clamp."""

import numpy as np


def silu(x):
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate, up, limit=None):
    if limit is not None:
        L = np.float32(limit)
        gate, up = np.minimum(gate, L), np.clip(up, -L, L)
    return silu(gate) * up


def run(op, buf, w):
    buf[op["out"]][...] = swiglu(buf[op["gate"]], buf[op["up"]], op.get("limit"))
