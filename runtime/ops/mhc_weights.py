"""mhc_weights: the manifold hyper-connection's stream weights (glm5_next's
Glm5NextTextHyperConnection.forward, all float32), from the hc projection of the streams.

Keys: z f32 [rows, (2+n)*n] = fn applied to the UN-normalised flat streams (x @ fn.T, the plan's
linear; the unweighted RMSNorm is a per-row scalar, so this op applies it afterwards); x f32
[rows, n*D] (the flat streams, for that scalar); writes pre, post f32 [rows, n] and comb f32
[rows, n*n] (row-major [i, j]: comb[i, j] weighs input stream i into output stream j, as
mhc_inject reads it). Weights base f32 [(2+n)*n], scale f32 [3]. Attrs n (hc_mult), iters
(hc_sinkhorn_iters), hc_eps, eps (rms_norm_eps of the unweighted norm).

    zz   = z / sqrt(mean(x^2) + eps)                       [pre | post | comb] = zz split n, n, n*n
    pre  = sigmoid(zz_pre * scale[0] + base_pre) + hc_eps
    post = 2 * sigmoid(zz_post * scale[1] + base_post)
    comb = softmax_j(zz_comb[i, j] * scale[2] + base_comb[i, j]) + hc_eps
    comb /= sum_i comb + hc_eps                            (columns first)
    iters - 1 times: comb /= sum_j comb + hc_eps; comb /= sum_i comb + hc_eps

Row by row, no state: inactive rows are computed like any other (their values are not used).
"""

import numpy as np

from .sigmoid_mul import sigmoid


def run(op, buf, w):
    n, he = int(op["n"]), np.float32(op["hc_eps"])
    x, z = buf[op["x"]], buf[op["z"]]
    rows = z.shape[0]
    zz = z * (np.float32(1) / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(op["eps"])))
    base, scale = w[op["base"]].astype(np.float32), w[op["scale"]].astype(np.float32)
    buf[op["pre"]][...] = sigmoid(zz[:, :n] * scale[0] + base[:n]) + he
    buf[op["post"]][...] = np.float32(2) * sigmoid(zz[:, n:2 * n] * scale[1] + base[n:2 * n])
    c = zz[:, 2 * n:].reshape(rows, n, n) * scale[2] + base[2 * n:].reshape(n, n)
    c = np.exp(c - c.max(axis=-1, keepdims=True))
    c = c / c.sum(axis=-1, keepdims=True) + he
    c = c / (c.sum(axis=-2, keepdims=True) + he)
    for _ in range(int(op["iters"]) - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + he)
        c = c / (c.sum(axis=-2, keepdims=True) + he)
    buf[op["comb"]][...] = c.reshape(rows, n * n)
