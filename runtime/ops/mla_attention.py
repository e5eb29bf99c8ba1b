"""mla_attention: glm5_next's multi-head latent attention (HF's Glm5NextTextAttention, NoPE, eager)
over a cache of the compressed latent, optionally restricted to the DSA indexer's selection.

Keys: q f32 [rows, heads*nope_dim] (q_b_proj(q_a_layernorm(q_a_proj x)), head-major), c f32
[rows, r] (kv_a_layernorm(kv_a_proj_with_mqa x): the latent, r = kv_lora_rank), pos i32 [rows],
slot i32 [rows], optional sel i32 [rows, W] (dsa_index's positions, -1 padded); state cache f32
[slots, ctx, r]; out f32 [rows, heads*v_dim] (head-major, o_proj's input). Weight kv_b
[heads*(nope_dim+v_dim), r] (kv_b_proj as stored: per head h, rows h*(nope_dim+v_dim) on are
W_uk,h [nope_dim, r], then W_uv,h [v_dim, r]; a pre_quant_scale multiplies c, as for linear).
Attrs heads, nope_dim, v_dim, scale (qk_head_dim^-0.5), mode ("decode" | "prefill": the same
arithmetic here).

Each active row first writes its c at cache[slot, pos]; then, per head h, over the slot's cache
positions u <= pos (and, with sel, only the positions sel lists):

    qa_h = W_uk,h^T q_h                        [r]   the absorbed query (exact: there is no rope)
    p    = softmax_u(qa_h . cache[u] * scale)        float32, the row maximum subtracted
    o_h  = W_uv,h (sum_u p_u cache[u])         [v_dim]

which is k_h = W_uk,h c, v_h = W_uv,h c attention, reassociated. A row whose selection is empty
(dsa_index with tail off, before the first complete pool) gives zeros; HF's mask then adds
finfo.min to every position and attends uniformly over the whole cache, future included.
Inactive rows (pos < 0) give zeros and write nothing.
"""

import numpy as np


def run(op, buf, w):
    H, dn, dv = int(op["heads"]), int(op["nope_dim"]), int(op["v_dim"])
    q, c, pos, slot = buf[op["q"]], buf[op["c"]], buf[op["pos"]], buf[op["slot"]]
    cache, out = buf[op["cache"]], buf[op["out"]]
    out[...] = 0
    rows = np.nonzero(pos >= 0)[0]
    if rows.size == 0:
        return
    cache[slot[rows], pos[rows]] = c[rows]
    wb = w[op["kv_b"]]
    pq = w.pre_quant.get(op["kv_b"])
    if pq is not None:
        wb = wb * pq
    wb = wb.reshape(H, dn + dv, -1)
    wk, wv = wb[:, :dn], wb[:, dn:]                                       # [H, dn, r], [H, dv, r]
    sel = buf[op["sel"]] if "sel" in op else None
    for s in np.unique(slot[rows]):
        r = rows[slot[rows] == s]
        n, p = r.size, pos[r]
        L = int(p.max()) + 1
        C = cache[s, :L]                                                  # [L, r]
        qa = np.einsum("nhd,hdr->hnr", q[r].reshape(n, H, dn), wk)        # [H, n, r]
        S = (qa @ C.T) * np.float32(op["scale"])                          # [H, n, L]
        keep = np.arange(L)[None, :] <= p[:, None]                        # causal
        if sel is not None:
            chosen = np.zeros((n, L + 1), bool)                           # column L catches the -1s
            idx = sel[r]
            np.put_along_axis(chosen, np.where((idx >= 0) & (idx < L), idx, L), True, axis=-1)
            keep &= chosen[:, :L]
        S[:, ~keep] = -np.inf
        live = keep.any(axis=-1)
        S[:, ~live] = 0                                                   # an empty selection: zeros below
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        S[:, ~live] = 0
        o = np.einsum("hnr,hvr->nhv", S @ C, wv)                          # [n, H, dv]
        out[r] = o.reshape(n, H * dv)
