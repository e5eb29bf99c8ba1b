"""ple_gate: the stream gate of qwen4_exp's per-layer embedding (Qwen4ExpTextPLELayer.forward):
each stream i gates the shared value v by the signed square root of its scaled dot product with
its key,

    g_i = sum_d kn_i[d] * qn_i[d] / sqrt(D)
    g_i = sign(g_i) * sqrt(max(|g_i|, 1e-6))           (g_i = 0 stays 0)
    out_i = sigmoid(g_i) * v

Keys: kn f32 [rows, n*D] (`norm_key(key_proj(e))`), qn f32 [rows, n*D] (`norm_query(X)`), v f32
[rows, D] (`value_proj(e)`), stream i at columns [i*D, (i+1)*D); out f32 [rows, n*D]; attr n."""

import numpy as np

from .sigmoid_mul import sigmoid


def run(op, buf, w):
    kn, qn, v = buf[op["kn"]], buf[op["qn"]], buf[op["v"]]
    n, D = int(op["n"]), v.shape[1]
    rows = v.shape[0]
    g = np.sum(kn.reshape(rows, n, D) * qn.reshape(rows, n, D), axis=-1, keepdims=True) / np.float32(np.sqrt(D))
    g = np.sqrt(np.maximum(np.abs(g), np.float32(1e-6))) * np.sign(g)
    buf[op["out"]][...] = (sigmoid(g) * v[:, None, :]).reshape(rows, n * D)
