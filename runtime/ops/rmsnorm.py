"""rmsnorm: over each group of `group` values of the last axis (the whole row, or one head for
Qwen3's q/k norms): x * 1/sqrt(mean(x^2) + eps) * weight, as HF's LlamaRMSNorm in float32."""

import numpy as np


def run(op, buf, w):
    x = buf[op["x"]]
    g = op["group"]
    xr = x.reshape(x.shape[0], -1, g)
    var = np.mean(np.square(xr), axis=-1, keepdims=True)
    y = xr * (np.float32(1.0) / np.sqrt(var + np.float32(op["eps"])))
    buf[op["out"]][...] = (y * w[op["weight"]]).reshape(x.shape)
