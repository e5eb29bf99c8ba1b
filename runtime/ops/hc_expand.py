"""hc_expand: the hyper-connection streams of qwen4_exp's first layer (Qwen4ExpTextModel.forward:
`inputs_embeds.repeat(1, 1, hc_count)`): stream i of every row is a copy of the row.

Keys: x f32 [rows, D]; out f32 [rows, n*D] (stream i at columns [i*D, (i+1)*D)); attr n."""

import numpy as np


def run(op, buf, w):
    buf[op["out"]][...] = np.tile(buf[op["x"]], (1, int(op["n"])))
