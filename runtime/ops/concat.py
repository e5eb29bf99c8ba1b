"""concat: out = [a | b] along the last axis (the MTP layer's eh_proj input [enorm(e) | hnorm(h)])."""

import numpy as np


def run(op, buf, w):
    a = buf[op["a"]]
    buf[op["out"]][...] = np.concatenate([a, buf[op["b"]]], axis=-1)
