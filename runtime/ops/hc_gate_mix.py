"""hc_gate_mix: the block input of qwen4_exp's hyper-connection (Qwen4ExpTextGatedResidual.forward's
`mixed_input`, and the final `hyper_connection_mixer`): a per-channel gated mean of the normed
streams,

    out = (1/n) * sum_i sigmoid(w_i) * xn_i

Keys: xn f32 [rows, n*D] (`hc_norm` of the streams: rmsnorm, group D, offset 1), w f32 [rows, n*D]
(`input_mix_weight_up`'s output, before the sigmoid), stream i at columns [i*D, (i+1)*D);
out f32 [rows, D]; attr n."""

import numpy as np

from .sigmoid_mul import sigmoid


def run(op, buf, w):
    xn, g = buf[op["xn"]], buf[op["w"]]
    n = int(op["n"])
    y = (sigmoid(g) * xn).reshape(xn.shape[0], n, -1)
    buf[op["out"]][...] = np.sum(y, axis=1) / np.float32(n)
