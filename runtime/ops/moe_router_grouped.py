"""moe_router_grouped: the sigmoid router with a score-correction bias and group-limited choice
(GLM-4.5 MoE; DeepSeek-V3's noaux_tc). The contract is transformers 5.24's Glm4MoeTopkRouter.forward:

    logits = x @ weight.T                       float32, the router weight as stored (F32 / BF16, decoded)
    s      = sigmoid(logits)                    [rows, E]
    c      = s + bias                           e_score_correction_bias: used for the choice only
    group score of each of n_group groups of E/n_group consecutive experts: its two largest c, summed
    the topk_group groups of largest score are kept, every other expert's c set to -inf
    ids    = the top_k experts of largest c      largest first
    w      = s[ids]                              the unbiased scores
    w      = w / (sum(w) + 1e-20)                when `norm` (norm_topk_prob)
    w      = w * scale                           routed_scaling_factor

Ties (equal float32 values, at either stage): the lower index wins, here. HF's torch.topk on the
CPU makes no such promise (its partition leaves equal values in no documented order: among 8
equal scores it was seen to pick 5 and 6 for top 2): both are top-k sets; only the members of an
exact tie can differ (sigmoid scores tie exactly only when the logits do, or saturate at 1.0).
The weights are summed in the ids' order (largest first), HF's in torch.topk's: they agree to
float32 rounding (exactly for top_k 2).
"""

import numpy as np

from .sigmoid_mul import sigmoid


def route(logits, bias, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float):
    """(ids i32 [rows, top_k], weights f32 [rows, top_k]) from router logits [rows, E] (float32)."""
    s = sigmoid(logits.astype(np.float32, copy=False))
    c = s + bias.astype(np.float32, copy=False)
    rows, E = c.shape
    per = E // n_group
    two = np.sort(c.reshape(rows, n_group, per), axis=-1)[..., -2:]
    gscore = two[..., 1] + two[..., 0]
    groups = np.argsort(-gscore, axis=-1, kind="stable")[:, :topk_group]
    keep = np.zeros((rows, n_group), bool)
    np.put_along_axis(keep, groups, True, axis=-1)
    c = np.where(np.repeat(keep, per, axis=-1), c, np.float32(-np.inf))
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(s, ids, axis=-1)
    if norm:
        w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return ids.astype(np.int32), (w * np.float32(scale)).astype(np.float32)


def run(op, buf, w):
    logits = buf[op["x"]] @ w[op["weight"]].T
    ids, wts = route(logits, w[op["bias"]], op["top_k"], op["n_group"], op["topk_group"], op["norm"], op["scale"])
    buf[op["ids"]][...] = ids
    buf[op["weights"]][...] = wts
