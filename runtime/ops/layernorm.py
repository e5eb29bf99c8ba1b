"""layernorm: torch's LayerNorm over each group of `group` values of the last axis (glm5_next's
DSA indexer k_norm, eps 1e-6), float32:

    out = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias       var: the biased (1/group) variance

x, out f32 [rows, n*group] (out may be x); weights weight, bias [group]; attrs eps, group.
"""

import numpy as np


def run(op, buf, w):
    x = buf[op["x"]]
    xr = x.reshape(x.shape[0], -1, int(op["group"]))
    d = xr - xr.mean(axis=-1, keepdims=True)
    y = d / np.sqrt(np.mean(np.square(d), axis=-1, keepdims=True) + np.float32(op["eps"]))
    buf[op["out"]][...] = (y * w[op["weight"]] + w[op["bias"]]).reshape(x.shape)
