"""all_reduce: every rank's out = the sum over ranks of x (rank order, float32)."""

import numpy as np


def run_ranks(ops, bufs):
    total = bufs[0][ops[0]["x"]].copy()
    for op, b in zip(ops[1:], bufs[1:]):
        total += b[op["x"]]
    for op, b in zip(ops, bufs):
        np.copyto(b[op["out"]], total)
