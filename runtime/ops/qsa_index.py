"""qsa_index: the token selection of qwen4_exp's QSA attention (Qwen4ExpTextQSAIndexer.forward):
each row scores the complete blocks of `ratio` cached keys it sees and keeps the best
budget/ratio of them, plus the incomplete tail; attention (with `select`) then attends only there.

Keys: q f32 [rows, heads*head_dim] (the indexer's query heads, already normed by q_layernorm and
roped: the rmsnorm and rope ops), k f32 [rows, head_dim] (the raw index key: the last head_dim
values of index_qk_proj), pos i32 [rows], slot i32 [rows]; sel i32 [rows, budget + ratio - 1];
state cache f32 [slots, ctx, head_dim] (the raw keys, by position). Weight k_norm [head_dim]
(k_layernorm). Attrs heads, head_dim, ratio, budget, theta, rotary_dim, eps, offset (1.0: the
Qwen4 RMSNorm's `1 + weight`).

The active rows first write their k at cache[slot, pos] (a prompt chunk sees its own keys). A row
at position p then sees positions 0..p: nb = (p+1) // ratio complete blocks, block b = positions [b*ratio, (b+1)*ratio), and

    kb_b = rope(rmsnorm(mean_j cache[b*ratio + j]) * (offset + k_norm), position b*ratio)
    score_b = sum_h relu(q_h . kb_b) / sqrt(head_dim)

(mean in float32, rmsnorm with eps, rope as the rope op: the first rotary_dim values of the key
rotate, theta). The min(budget // ratio, nb) best blocks are kept (ties: the lower block index
wins), and with them the tail positions nb*ratio..p. sel[row] lists the kept positions in
ascending order, -1 padded. Inactive rows (negative position): all -1, no cache write.
"""

import numpy as np

from . import rope
from .rmsnorm import normalize


def block_keys(keys, op, wt):
    """The first keys.shape[0] // ratio blocks' keys [nb, head_dim] of one slot's raw keys."""
    R, Di = int(op["ratio"]), int(op["head_dim"])
    nb = keys.shape[0] // R
    if nb == 0:                           # before the first complete block: no block keys yet
        return np.zeros((0, Di), np.float32)
    kb = np.mean(keys[:nb * R].reshape(nb, R, Di), axis=1, dtype=np.float32)
    kb = normalize(kb, Di, op["eps"])[:, 0] * (np.float32(op["offset"]) + wt)
    b = {"x": kb, "pos": np.arange(nb, dtype=np.int32) * R}
    rope.run({"x": "x", "pos": "pos", "out": "x", "heads": 1, "head_dim": Di, "theta": op["theta"],
              "rotary_dim": op["rotary_dim"]}, b, None)
    return kb


def scores(q, kb, op):
    """q [n, heads*head_dim], kb [nb, head_dim] -> [n, nb]."""
    Di = int(op["head_dim"])
    s = q.reshape(q.shape[0], int(op["heads"]), Di) @ kb.T                  # [n, heads, nb]
    return np.sum(np.maximum(s, np.float32(0)), axis=1) / np.float32(np.sqrt(Di))


def run(op, buf, w):
    q, k, pos, slot = buf[op["q"]], buf[op["k"]], buf[op["pos"]], buf[op["slot"]]
    cache, sel = buf[op["cache"]], buf[op["sel"]]
    R, top = int(op["ratio"]), int(op["budget"]) // int(op["ratio"])
    rows = np.nonzero(pos >= 0)[0]
    res = np.full(sel.shape, -1, np.int32)
    cache[slot[rows], pos[rows]] = k[rows]
    for s in np.unique(slot[rows]):
        r = rows[slot[rows] == s]
        kb = block_keys(cache[s, :int(pos[r].max()) + 1], op, w[op["k_norm"]])
        sc = scores(q[r], kb, op)
        for j, (i, p) in enumerate(zip(r, pos[r])):
            nb = (int(p) + 1) // R
            best = np.sort(np.argsort(-sc[j, :nb], kind="stable")[:min(top, nb)])
            kept = np.concatenate([(best[:, None] * R + np.arange(R)).ravel(), np.arange(nb * R, p + 1)])
            res[i, :kept.size] = kept
    sel[...] = res
