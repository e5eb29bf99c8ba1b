"""hc_mean: the final collapse of the hyper-connection streams (glm5_next's
Glm5NextTextHyperHead: an unweighted mean): x f32 [rows, n*D] -> out f32 [rows, D]; attr n.

    out = (1/n) sum_i x_i
"""


def run(op, buf, w):
    x = buf[op["x"]]
    buf[op["out"]][...] = x.reshape(x.shape[0], int(op["n"]), -1).mean(axis=1)
