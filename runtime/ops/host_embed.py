"""host_embed: the n-gram embedding gather of qwen4_exp's per-layer embedding
(Qwen4ExpTextNGramEmbedding's `ngram_embedding(ngram_ids).flatten(-2)`), run on the host before
the device step (the table stays in the mmapped artifact; only the rows a step needs move).

Keys: ids i32 [rows, G] (ngram_hash's output: one row of the table per n-gram head); out f32
[rows, P], P = G * d; weight table [R, d] (the layer's n-gram table, its stored shards
concatenated along rows); attr heads (G).

    out[r, h*d:(h+1)*d] = table[ids[r, h]]       (an id outside [0, R), e.g. -1: zeros)
"""

import numpy as np


def run(op, buf, w):
    table, ids = w[op["table"]], buf[op["ids"]]
    G = int(op["heads"])
    ok = (ids >= 0) & (ids < table.shape[0])
    e = np.where(ok[..., None], table[np.where(ok, ids, 0)], np.float32(0))      # [rows, G, d]
    buf[op["out"]][...] = e.reshape(ids.shape[0], G * table.shape[1])
