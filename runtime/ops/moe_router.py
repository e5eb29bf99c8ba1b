"""moe_router: softmax over the experts of x @ weight.T (float32), the top_k experts per row
(largest first, ties to the lower index), their probabilities renormalised to sum 1 when `norm`
(Qwen3's norm_topk_prob)."""

import numpy as np


def run(op, buf, w):
    logits = buf[op["x"]] @ w[op["weight"]].T
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    k = op["top_k"]
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(p, ids, axis=-1)
    if op["norm"]:
        top = top / top.sum(axis=-1, keepdims=True)
    buf[op["ids"]][...] = ids
    buf[op["weights"]][...] = top
