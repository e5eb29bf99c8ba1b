"""mhc_inject: the manifold hyper-connection's residual after a block (glm5_next's decoder layer:
`post[..., None] * y[..., None, :] + comb^T @ residual`): x f32 [rows, n*D] (the streams the block
read, before it), y f32 [rows, D] (the block's output), post f32 [rows, n], comb f32 [rows, n*n]
(mhc_weights', row-major [i, j]) -> out f32 [rows, n*D] (may be x); attr n.

    out_j = post_j * y + sum_i comb[i, j] * x_i
"""

import numpy as np


def run(op, buf, w):
    x, y, post, comb = buf[op["x"]], buf[op["y"]], buf[op["post"]], buf[op["comb"]]
    rows, n = x.shape[0], int(op["n"])
    mixed = np.einsum("rij,rid->rjd", comb.reshape(rows, n, n), x.reshape(rows, n, -1))
    buf[op["out"]][...] = (post[:, :, None] * y[:, None, :] + mixed).reshape(rows, -1)
