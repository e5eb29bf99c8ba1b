"""dsa_index: glm5_next's DSA indexer selection with k-pool compression (HF's
Glm5NextTextIndexer.forward on an unpadded sequence: the tokens are grouped into pools of
`kpool` consecutive positions, pools are scored, and the best pools' positions are attended).

Keys: q f32 [rows, heads*head_dim] (wq_b(q_resid)), k f32 [rows, head_dim] (k_norm(wk(x)), the
LayerNorm'd key), gs f32 [rows, head_dim] (x @ index_kpool_compress_gate.T), hw f32 [rows, heads]
(weights_proj(x)), pos i32 [rows], slot i32 [rows]; state cache f32 [slots, ctx, 2*head_dim]
(k | gs per position); writes sel i32 [rows, W] (W = topk + kpool - 1). Weights ape [kpool,
head_dim] (index_kpool_compress_ape). Attrs heads, head_dim, topk, kpool, tail (bool:
index_kpool_always_select_tail).

Each active row first writes its k | gs at cache[slot, pos]. Then, for a row at position t, with
pools p = positions [p*kpool, (p+1)*kpool) (complete pools only: (p+1)*kpool - 1 <= t):

    pk_p     = sum_j softmax_j(gs[p*kpool+j] + ape[j]) * k[p*kpool+j]      per channel, j < kpool
    score_p  = sum_h (hw_h / sqrt(heads)) * relu(q_h . pk_p / sqrt(head_dim))
    selected = the min(topk // kpool, (t+1) // kpool) pools of largest score, expanded to their
               positions, plus (tail) the (t+1) % kpool positions after the last complete pool

sel holds the selected positions ascending, then -1. Ties (equal float32 scores at the cut): the
lower pool index wins, here; HF's torch.topk promises no order (docs/flagships.md, Surprise 6).
A row at t < kpool - 1 with tail off selects nothing (all -1). Inactive rows (pos < 0): all -1,
no cache write.
"""

import numpy as np


def pool_keys(cache, ape, pools: int):
    """The pooled keys [pools, head_dim] of one slot's cache [ctx, 2*head_dim] (the first pools)."""
    kpool, Di = ape.shape
    c = cache[:pools * kpool].reshape(pools, kpool, 2 * Di)
    logits = c[..., Di:] + ape
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    return (p * c[..., :Di]).sum(axis=1)


def run(op, buf, w):
    Hi, Di, kpool = int(op["heads"]), int(op["head_dim"]), int(op["kpool"])
    pos, slot = buf[op["pos"]], buf[op["slot"]]
    cache, sel = buf[op["cache"]], buf[op["sel"]]
    sel[...] = -1
    rows = np.nonzero(pos >= 0)[0]
    if rows.size == 0:
        return
    cache[slot[rows], pos[rows]] = np.concatenate([buf[op["k"]][rows], buf[op["gs"]][rows]], axis=-1)
    ape = w[op["ape"]].astype(np.float32)
    top = int(op["topk"]) // kpool
    for s in np.unique(slot[rows]):
        r = rows[slot[rows] == s]
        t = pos[r]
        P = (int(t.max()) + 1) // kpool                                      # complete pools of the longest row
        npool = (t + 1) // kpool                                             # complete pools each row sees
        chosen = np.zeros((r.size, 0), np.int64)
        if P > 0:
            pk = pool_keys(cache[s], ape, P)                                 # [P, Di]
            q = buf[op["q"]][r].reshape(r.size, Hi, Di)
            sc = np.maximum((q @ pk.T) * np.float32(Di ** -0.5), np.float32(0))           # [n, Hi, P]
            score = np.einsum("nh,nhp->np", buf[op["hw"]][r] * np.float32(Hi ** -0.5), sc)
            score[np.arange(P)[None, :] >= npool[:, None]] = -np.inf
            chosen = np.sort(np.argsort(-score, axis=-1, kind="stable")[:, :min(top, P)], axis=-1)
        for i, row in enumerate(r):
            ps = chosen[i][chosen[i] < npool[i]]                             # drop the pools not yet complete
            got = (ps[:, None] * kpool + np.arange(kpool)).ravel()
            if op["tail"]:
                got = np.concatenate([got, np.arange(npool[i] * kpool, t[i] + 1)])
            sel[row, :got.size] = got
