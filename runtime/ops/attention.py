"""attention: grouped-query attention over the KV cache.

Each active row r (pos[r] >= 0) first writes its k, v at cache[slot[r], pos[r]]; then attends
to its slot's cache rows 0..pos[r] (so a prompt chunk is causal within itself, and the length
comes from the positions buffer). Query head h reads KV head h // (heads / kv_heads), as HF's
repeat_kv. Softmax in float32 with the row maximum subtracted. Inactive rows give zeros.
cache: [slots, ctx, kv_heads, head_dim]; q/out: [rows, heads*head_dim]; k/v: [rows, kv_heads*head_dim].

Optional read `select` i32 [rows, W] (qwen4_exp's QSA: qsa_index's output): row r attends only
over the cache positions listed in select[r] that are <= pos[r] (-1 entries skipped, order and
repeats irrelevant): HF's causal mask AND the indexer's selection mask. A row left with no
position gives zeros. Without `select`, every position 0..pos[r].
"""

import numpy as np


def run(op, buf, w):
    H, KV, D = op["heads"], op["kv_heads"], op["head_dim"]
    G = H // KV
    q, k, v = buf[op["q"]], buf[op["k"]], buf[op["v"]]
    pos, slot = buf[op["pos"]], buf[op["slot"]]
    ck, cv, out = buf[op["cache_k"]], buf[op["cache_v"]], buf[op["out"]]
    rows = np.nonzero(pos >= 0)[0]
    out[...] = 0
    if rows.size == 0:
        return
    ck[slot[rows], pos[rows]] = k[rows].reshape(-1, KV, D)
    cv[slot[rows], pos[rows]] = v[rows].reshape(-1, KV, D)
    scale = np.float32(op["scale"])
    for s in np.unique(slot[rows]):
        r = rows[slot[rows] == s]
        n, p = r.size, pos[r]
        L = int(p.max()) + 1
        K = ck[s, :L].transpose(1, 2, 0)                          # [KV, D, L]
        V = cv[s, :L].transpose(1, 0, 2)                          # [KV, L, D]
        Q = q[r].reshape(n, KV, G, D).transpose(1, 2, 0, 3).reshape(KV, G * n, D)
        S = (Q @ K).reshape(KV, G, n, L) * scale
        masked = np.arange(L)[None, :] > p[:, None]                # causal: keys after the row's position
        alive = None
        if "select" in op:
            sel = buf[op["select"]][r]
            keep = np.zeros((n, L + 1), bool)                     # column L takes -1 and out-of-range
            keep[np.arange(n)[:, None], np.where((sel >= 0) & (sel < L), sel, L)] = True
            masked |= ~keep[:, :L]
            alive = ~masked.all(axis=-1)
            masked &= alive[:, None]                              # a row left empty: zeroed below
        S[..., masked] = -np.inf
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        O = S.reshape(KV, G * n, L) @ V                           # [KV, G*n, D]
        o = O.reshape(KV, G, n, D).transpose(2, 0, 1, 3).reshape(n, H * D)
        out[r] = o if alive is None else o * alive[:, None]
