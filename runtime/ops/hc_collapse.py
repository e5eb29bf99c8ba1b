"""hc_collapse: the weighted sum of the hyper-connection streams (glm5_next's block input,
Glm5NextTextHyperConnection's `collapsed`): x f32 [rows, n*D] (stream i = x[:, i*D:(i+1)*D]),
w f32 [rows, n] (mhc_weights' pre) -> out f32 [rows, D]; attr n.

    out = sum_i w_i * x_i                 (a sum, not a mean)
"""

import numpy as np


def run(op, buf, w):
    x, wt = buf[op["x"]], buf[op["w"]]
    n = int(op["n"])
    buf[op["out"]][...] = np.einsum("rn,rnd->rd", wt, x.reshape(x.shape[0], n, -1))
