"""gated_delta: the gated delta rule of Qwen3-Next's linear-attention layers (HF's
`torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule` with use_qk_l2norm_in_kernel,
and the g / beta that Qwen3NextGatedDeltaNet.forward computes from in_proj_ba's a and b).

Keys: qkv f32 [rows, 2*k_heads*k_dim + v_heads*v_dim]: the conv's output, HF's `mixed_qkv`:
q heads, then k heads, then v heads, each head's values contiguous; a, b f32 [rows, v_heads];
pos i32 [rows], slot i32 [rows]; state f32 [slots, v_heads, k_dim, v_dim]; out f32
[rows, v_heads*v_dim] (head-major, as HF's core_attn_out). Weights A_log [v_heads], dt_bias
[v_heads]. Attrs k_heads, v_heads, k_dim, v_dim, mode ("decode": the recurrent form;
"prefill": the chunked form), optional chunk (block length of the chunked form, default 64).

Per active row, per v head h (reading q/k head h // (v_heads/k_heads): HF's repeat_interleave,
each k head serves that many consecutive v heads):

    q = l2norm(q) / sqrt(k_dim), k = l2norm(k)         l2norm(x) = x * 1/sqrt(sum(x*x) + 1e-6)
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)     (softplus: x above 20)
    S = S * exp(g); S = S + k (x) (beta * (v - S^T k)); o = S^T q     (S: [k_dim, v_dim])

Rows are taken in order, each continuing its slot's sequence; a row at position 0 starts a new
one (S = 0 before it: the state is reset); a row with a negative position is inactive (output
zeros, no state change). Both forms accept any rows and agree to float32 rounding: "decode"
steps the recurrence one row at a time (vectorized over the runs of different slots), "prefill"
takes each run of a slot's rows in blocks of `chunk` tokens (HF's chunkwise WY / UT form: a unit
lower-triangular solve per block, then one state update per block). Optional write `history`
f32 [rows, v_heads, k_dim, v_dim] (the verify program, recurrent form only): history[r] = the
state of row r's slot after row r.
"""

import numpy as np

from .causal_conv1d import runs


def _prepare(op, buf, w, rows):
    """q, k (normalized, repeated to the v heads), v [n, Hv, d], g, beta [n, Hv] of the rows."""
    Hk, Hv, dk, dv = op["k_heads"], op["v_heads"], op["k_dim"], op["v_dim"]
    qkv = buf[op["qkv"]][rows]
    n = rows.size
    q = qkv[:, :Hk * dk].reshape(n, Hk, dk)
    k = qkv[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk)
    v = qkv[:, 2 * Hk * dk:].reshape(n, Hv, dv)
    eps = np.float32(1e-6)
    q = q * (np.float32(1) / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + eps))
    k = k * (np.float32(1) / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + eps))
    q = q * np.float32(1 / np.sqrt(dk))
    q, k = np.repeat(q, Hv // Hk, axis=1), np.repeat(k, Hv // Hk, axis=1)
    x = buf[op["a"]][rows] + w[op["dt_bias"]]
    with np.errstate(over="ignore"):
        sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, np.float32(20)))))
        beta = np.float32(1) / (np.float32(1) + np.exp(-buf[op["b"]][rows]))
    g = -np.exp(w[op["A_log"]].astype(np.float32)) * sp
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def _recurrent(S, q, k, v, g, beta):
    """One step for a batch: S [B, H, dk, dv]; q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]."""
    S = S * np.exp(g)[..., None, None]
    kv = (k[..., None, :] @ S)[..., 0, :]
    delta = (v - kv) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return S, (q[..., None, :] @ S)[..., 0, :]


def _chunked(S, q, k, v, g, beta, C):
    """One run: S [H, dk, dv]; q, k [H, n, dk]; v [H, n, dv]; g, beta [H, n]. Returns S, o [H, n, dv]."""
    H, n, dk = k.shape
    o = np.empty(v.shape, np.float32)
    for b0 in range(0, n, C):
        sl = slice(b0, min(b0 + C, n))
        qb, kb, vb, gb, bb = q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl]
        m = kb.shape[1]
        cum = np.cumsum(gb, axis=-1)                                     # [H, m]
        diff = cum[:, :, None] - cum[:, None, :]
        diff[:, np.triu(np.ones((m, m), bool), 1)] = -np.inf
        decay = np.exp(diff)                                             # exp(cum_i - cum_j), i >= j
        kbeta = kb * bb[..., None]
        kt = kb.transpose(0, 2, 1)
        L = np.tril((kbeta @ kt) * decay, -1)
        T = L + np.eye(m, dtype=np.float32)
        ecum = np.exp(cum)[..., None]
        X = np.linalg.solve(T, np.concatenate([vb * bb[..., None], kbeta * ecum], axis=-1))
        u, w_ = X[..., :vb.shape[-1]], X[..., vb.shape[-1]:]
        v_new = u - w_ @ S
        o[:, sl] = (qb * ecum) @ S + ((qb @ kt) * decay) @ v_new
        last = cum[:, -1:]
        S = S * np.exp(last)[..., None] + (kb * np.exp(last - cum)[..., None]).transpose(0, 2, 1) @ v_new
    return S, o


def run(op, buf, w):
    drive(op, buf, w, _prepare, _chunked, _recurrent, op["v_heads"], op["k_dim"], op["v_dim"])


def drive(op, buf, w, prepare, chunked, recurrent, heads: int, k_dim: int, v_dim: int) -> None:
    """The runs of a delta rule (this one, or kda's with a decay per key channel): each slot's rows
    in order from its state (zeros after a position-0 row), chunked over a prompt (mode prefill),
    recurrent row by row otherwise; the slot's state after its last run kept. `prepare` gives
    q, k, v, g, beta of the rows; `chunked` / `recurrent` are the rule's two forms."""
    pos, slot = buf[op["pos"]], buf[op["slot"]]
    state, out = buf[op["state"]], buf[op["out"]]
    segs = runs(pos, slot)
    res = np.zeros(out.shape, np.float32)
    final = {}
    hist = buf[op["history"]] if "history" in op else None
    if hist is not None and op["mode"] == "prefill":
        raise ValueError("a delta rule writes its state history in the recurrent form only (mode decode or verify)")
    if segs:
        rows = np.concatenate([r for _, r, _ in segs])
        q, k, v, g, beta = prepare(op, buf, w, rows)
        start = np.cumsum([0] + [r.size for _, r, _ in segs])
        init = [np.zeros((heads, k_dim, v_dim), np.float32) if reset else state[s] for s, _, reset in segs]
        if op["mode"] == "prefill":
            C = int(op.get("chunk", 64))
            for (s, r, _), S, i0, i1 in zip(segs, init, start[:-1], start[1:]):
                tr = lambda a: a[i0:i1].swapaxes(0, 1)                  # noqa: E731  [n, H, ...] -> [H, n, ...]
                S, o = chunked(S, tr(q), tr(k), tr(v), tr(g), tr(beta), C)
                res[r] = o.swapaxes(0, 1).reshape(r.size, heads * v_dim)
                final[s] = S
        else:
            S = np.stack(init)                                           # one batch row per run
            lengths = start[1:] - start[:-1]
            for t in range(int(lengths.max())):
                live = np.nonzero(lengths > t)[0]
                i = start[live] + t
                S[live], o = recurrent(S[live], q[i], k[i], v[i], g[i], beta[i])
                res[rows[i]] = o.reshape(live.size, heads * v_dim)
                if hist is not None:
                    hist[rows[i]] = S[live]
            for j, (s, _, _) in enumerate(segs):
                final[s] = S[j]
    for s, S in final.items():                                           # the slot's last run
        state[s] = S
    out[...] = res
