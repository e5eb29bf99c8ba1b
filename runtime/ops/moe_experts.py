"""moe_experts: out[r] = sum_j weights[r, j] * down_e(silu(gate_e x[r]) * up_e x[r]), e = ids[r, j],
over stacked [E, out, in] expert weights (each expert's pre_quant_scale, where stored, multiplies
its input). With TP each rank holds a slice inside every expert and its sum is partial.
Optional attr limit: swiglu's clamp (glm5_next's swiglu_limit) inside every expert."""

import numpy as np

from .swiglu import swiglu


def _apply(w, name, e, x):
    pq = w.pre_quant.get(name)
    if pq is not None:
        x = x * (pq[e] if pq.ndim == 2 else pq)
    return x @ w[name][e].T


def run(op, buf, w):
    x, ids, wts = buf[op["x"]], buf[op["ids"]], buf[op["weights"]]
    out = buf[op["out"]]
    out[...] = 0
    for e in np.unique(ids):
        r, j = np.nonzero(ids == e)
        xe = x[r]
        h = swiglu(_apply(w, op["gate"], e, xe), _apply(w, op["up"], e, xe), op.get("limit"))
        out[r] += _apply(w, op["down"], e, h) * wts[r, j][:, None]     # r is unique within one expert
