"""sigmoid_mul: out = x * sigmoid(gate), float32; gate [rows, n] like x, or [rows, 1] (one gate
per row, broadcast: Qwen3-Next's shared_expert_gate). sigmoid(g) = 1 / (1 + exp(-g)), as torch."""

import numpy as np


def sigmoid(g: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-g))


def run(op, buf, w):
    buf[op["out"]][...] = buf[op["x"]] * sigmoid(buf[op["gate"]])
