"""swiglu: out = silu(gate) * up, silu(x) = x / (1 + exp(-x))."""

import numpy as np


def silu(x):
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def run(op, buf, w):
    buf[op["out"]][...] = silu(buf[op["gate"]]) * buf[op["up"]]
