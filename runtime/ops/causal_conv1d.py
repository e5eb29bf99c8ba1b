"""causal_conv1d: a causal depthwise conv1d over channels followed by SiLU, with a per-slot window
of the last inputs kept as state (Qwen3-Next's gated delta net: HF's `causal_conv1d_fn` on a
prompt and `causal_conv1d_update` on a decode step, activation "silu"; qwen4_exp's per-layer
embedding: Qwen4ExpTextPLELayer._short_conv, `silu(conv1d(...))` with dilation `ngram_size`).

Keys: x f32 [rows, C] (C channels: the gated delta net's q|k|v channels, HF's `mixed_qkv`; the
PLE's n*D normed gated values), pos i32 [rows], slot i32 [rows]; state f32
[slots, (kernel-1)*dilation, C] (the slot's last (kernel-1)*dilation inputs, oldest first); out
f32 [rows, C] (may be x); weight: the conv weight as HF stores it, [C, 1, kernel] (or [C, kernel]),
no bias (neither conv has one); attr kernel; optional dilation (default 1); optional channels
[a, b]: the op's C channels are rows a..b of the weight (glm5_next's fused [q | k | v] conv,
read by three ops).

    out[t, c] = silu(sum_j weight[c, j] * u[t - (kernel - 1 - j) * dilation, c])

where u is the slot's input sequence (weight[c, kernel-1] multiplies the current row, as HF's
cross-correlating F.conv1d with (kernel-1)*dilation zeros of left padding). Rows are taken in
order, each one continuing its slot's sequence; a row whose position is 0 starts a new sequence
(the window before it is zeros: the state is reset); a row with a negative position is inactive
(output zeros, no state change). After the op, state[s] holds the slot's last
(kernel-1)*dilation inputs. Optional write `history` f32 [rows, (kernel-1)*dilation, C] (the
verify program): history[r] = the window of row r's slot after row r.
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
    K, dil = int(op["kernel"]), int(op.get("dilation", 1))
    W = (K - 1) * dil                                         # the window's length
    wt = w[op["weight"]].reshape(-1, K)                       # [C, K]
    if "channels" in op:                                      # rows [a, b) of a fused conv weight
        wt = wt[op["channels"][0]:op["channels"][1]]
    wt = wt.reshape(x.shape[1], K)
    y = np.zeros_like(x)
    final = {}
    for s, r, reset in runs(pos, slot):
        win = np.zeros((W, x.shape[1]), np.float32) if reset else state[s]
        u = np.concatenate([win, x[r]], axis=0)               # [W+n, C]
        n = r.size
        acc = u[0:n] * wt[:, 0]
        for j in range(1, K):
            acc += u[j * dil:j * dil + n] * wt[:, j]
        y[r] = silu(acc)
        final[s] = u[u.shape[0] - W:]
        if "history" in op:
            for i, row in enumerate(r):
                buf[op["history"]][row] = u[i + 1:i + 1 + W]
    for s, win in final.items():
        state[s] = win
    out[...] = y
