"""causal_conv1d: a causal depthwise conv1d over channels followed by SiLU, with a per-slot window
of the last inputs kept as state (Qwen3-Next's gated delta net: HF's `causal_conv1d_fn` on a
prompt and `causal_conv1d_update` on a decode step, activation "silu").

Keys: x f32 [rows, C] (C channels: the gated delta net's q|k|v channels, HF's `mixed_qkv`),
pos i32 [rows], slot i32 [rows]; state f32 [slots, kernel-1, C] (the slot's last kernel-1 inputs,
oldest first); out f32 [rows, C] (may be x); weight: the conv weight as HF stores it, [C, 1, kernel]
(or [C, kernel]), no bias (Qwen3-Next's conv has none); attr kernel.

    out[t, c] = silu(sum_j weight[c, j] * u[t - kernel + 1 + j, c])

where u is the slot's input sequence (weight[c, kernel-1] multiplies the current row, as HF's
cross-correlating F.conv1d with kernel-1 zeros of left padding). Rows are taken in order, each
one continuing its slot's sequence; a row whose position is 0 starts a new sequence (the
window before it is zeros: the state is reset); a row with a negative position is inactive
(output zeros, no state change). After the op, state[s] holds the slot's last kernel-1 inputs.
"""

import numpy as np

from .swiglu import silu


def runs(pos, slot):
    """The active rows cut into runs: [(slot, row indices in row order, starts a new sequence)],
    a run ending where its slot's next row has position 0. Runs of one slot after its first
    start with a reset, so they need only the state the slot had before the op."""
    active = np.nonzero(pos >= 0)[0]
    out = []
    for s in dict.fromkeys(slot[active].tolist()):
        r = active[slot[active] == s]
        cuts = [i for i in range(1, r.size) if pos[r[i]] == 0]
        for seg in np.split(r, cuts):
            out.append((s, seg, bool(pos[seg[0]] == 0)))
    return out


def run(op, buf, w):
    x, pos, slot = buf[op["x"]], buf[op["pos"]], buf[op["slot"]]
    state, out = buf[op["state"]], buf[op["out"]]
    K = int(op["kernel"])
    wt = w[op["weight"]].reshape(x.shape[1], K)              # [C, K]
    y = np.zeros_like(x)
    final = {}
    for s, r, reset in runs(pos, slot):
        win = np.zeros((K - 1, x.shape[1]), np.float32) if reset else state[s]
        u = np.concatenate([win, x[r]], axis=0)               # [K-1+n, C]
        n = r.size
        acc = u[0:n] * wt[:, 0]
        for j in range(1, K):
            acc += u[j:j + n] * wt[:, j]
        y[r] = silu(acc)
        final[s] = u[u.shape[0] - (K - 1):]
    for s, win in final.items():
        state[s] = win
    out[...] = y
