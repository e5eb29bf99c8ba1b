"""kda: the Kimi delta attention of glm5_next's linear-attention layers (HF's
`recurrent_kimi_delta_attention` / `chunk_kimi_delta_attention` with use_qk_l2norm_in_kernel, and
the decay Glm5NextTextForgetGate computes): the gated delta rule with a decay per key channel.

Keys: q, k, v f32 [rows, heads*head_dim] (each the output of its own causal_conv1d, silu; head h
is values h*head_dim .. (h+1)*head_dim); g f32 [rows, heads*head_dim] (the forget gate's raw
f_b_proj(f_a_proj(x))); b f32 [rows, heads] (b_proj's output, before the sigmoid); pos i32 [rows],
slot i32 [rows]; state f32 [slots, heads, head_dim, head_dim] (HF's recurrent state, [key, value]);
out f32 [rows, heads*head_dim] (before the output norm, rmsnorm_gated with a sigmoid). Weights
A_log [heads], dt_bias [heads*head_dim]. Attrs heads, head_dim, lower_bound (a float, or null),
mode ("decode": the recurrent form; "prefill": the chunked form), optional chunk (block length of
the chunked form, default 64).

Per active row, per head h, over the key channels c (d = head_dim):

    q = l2norm(q) / sqrt(d), k = l2norm(k)          l2norm(x) = x / sqrt(sum(x*x) + 1e-6)
    u = g + dt_bias;  a = exp(A_log[h])
    gate = lower_bound * sigmoid(a * u)              (lower_bound null: -a * softplus(u), x above 20)
    beta = sigmoid(b)
    S[c, :] *= exp(gate[c]);  S += k (x) (beta * (v - S^T k));  o = S^T q        (S: [d key, d value])

The gate is <= 0, so every exp of it (or of a sum of it) is <= 1. Rows are taken in order, each
continuing its slot's sequence; a row at position 0 starts a new one (S = 0 before it); a row
with a negative position is inactive (output zeros, no state change). Both forms accept any rows
and agree to float32 rounding: "decode" steps the recurrence one row at a time (vectorized over
the runs of different slots); "prefill" takes each run in blocks of `chunk` tokens (HF's chunk
fallback: gated_delta's WY form with the cumulative decay kept per channel, so the intra-block
products carry a [block, block, d] decay). gated_delta is the special case of one decay per head.
"""

import numpy as np

from . import gated_delta
from .sigmoid_mul import sigmoid


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def _prepare(op, buf, w, rows):
    """q (scaled), k, v, gate [n, H, d] and beta [n, H] of the rows."""
    H, d = int(op["heads"]), int(op["head_dim"])
    n = rows.size
    q, k, v = (buf[op[key]][rows].reshape(n, H, d) for key in ("q", "k", "v"))
    q = _l2norm(q) * np.float32(1 / np.sqrt(d))
    k = _l2norm(k)
    u = (buf[op["g"]][rows] + w[op["dt_bias"]].astype(np.float32)).reshape(n, H, d)
    a = np.exp(w[op["A_log"]].astype(np.float32))[:, None]
    if op["lower_bound"] is not None:
        gate = np.float32(op["lower_bound"]) * sigmoid(a * u)
    else:
        with np.errstate(over="ignore"):
            gate = -a * np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, np.float32(20)))))
    return q, k, v, gate.astype(np.float32), sigmoid(buf[op["b"]][rows])


def _recurrent(S, q, k, v, g, beta):
    """One step for a batch: S [B, H, d, d]; q, k, v, g [B, H, d]; beta [B, H]."""
    S = S * np.exp(g)[..., None]
    kv = (k[..., None, :] @ S)[..., 0, :]
    delta = (v - kv) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return S, (q[..., None, :] @ S)[..., 0, :]


def _chunked(S, q, k, v, g, beta, C):
    """One run: S [H, d, d]; q, k, v, g [H, n, d]; beta [H, n]. Returns S, o [H, n, d]."""
    n = k.shape[1]
    o = np.empty(v.shape, np.float32)
    for b0 in range(0, n, C):
        sl = slice(b0, min(b0 + C, n))
        qb, kb, vb, gb, bb = q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl]
        m = kb.shape[1]
        cum = np.cumsum(gb, axis=1)                                      # [H, m, d]
        diff = cum[:, :, None, :] - cum[:, None, :, :]                   # [H, i, j, d]
        diff[:, np.triu(np.ones((m, m), bool), 1)] = -np.inf
        decay = np.exp(diff)                                             # exp(cum_i - cum_j), i >= j
        kbeta = kb * bb[..., None]
        L = np.tril(np.einsum("hic,hjc,hijc->hij", kbeta, kb, decay), -1)
        T = L + np.eye(m, dtype=np.float32)
        ecum = np.exp(cum)
        X = np.linalg.solve(T, np.concatenate([vb * bb[..., None], kbeta * ecum], axis=-1))
        u, w_ = X[..., :vb.shape[-1]], X[..., vb.shape[-1]:]
        v_new = u - w_ @ S
        A = np.einsum("hic,hjc,hijc->hij", qb, kb, decay)                # lower, diagonal included
        o[:, sl] = (qb * ecum) @ S + A @ v_new
        last = cum[:, -1:]                                               # [H, 1, d]
        S = S * np.exp(last).transpose(0, 2, 1) + (kb * np.exp(last - cum)).transpose(0, 2, 1) @ v_new
    return S, o


def run(op, buf, w):
    d = int(op["head_dim"])
    gated_delta.drive(op, buf, w, _prepare, _chunked, _recurrent, int(op["heads"]), d, d)
