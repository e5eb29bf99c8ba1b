"""rmsnorm: over each group of `group` values of the last axis (the whole row, or one head for
Qwen3's q/k norms): x * 1/sqrt(mean(x^2) + eps) * (offset + weight), as HF's LlamaRMSNorm in
float32. `offset` (optional, default 0) is 1.0 for the families whose norms store weight - 1
(Qwen3-Next's Qwen3NextRMSNorm: `output * (1.0 + weight)`, the sum taken in float32 first).
The weight is [group] (shared by every group) or the row's whole width [n*group] (one weight
per value: qwen4_exp's hyper-connection norms, Qwen4ExpTextRMSNorm with group_size).
`normalize` is the normalization alone, shared with rmsnorm_gated."""

import numpy as np


def normalize(x, group, eps):
    """x [rows, n*group] -> x / sqrt(mean(x^2) + eps) per group, as [rows, n, group]."""
    xr = x.reshape(x.shape[0], -1, group)
    var = np.mean(np.square(xr), axis=-1, keepdims=True)
    return xr * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))


def run(op, buf, w):
    x = buf[op["x"]]
    y = normalize(x, op["group"], op["eps"])
    wt = w[op["weight"]]
    if op.get("offset"):
        wt = np.float32(op["offset"]) + wt
    buf[op["out"]][...] = (y * wt.reshape(-1, op["group"])).reshape(x.shape)
