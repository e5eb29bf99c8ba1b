"""ngram_hash: the hashed n-gram ids of qwen4_exp's per-layer embedding (Qwen4ExpTextNGramEmbedding:
`_shift_right_ignore_eos` and the multiply-XOR hash of its forward), run on the host before the
device step (host_embed gathers the rows).

Keys: tokens i32 [rows], pos i32 [rows], slot i32 [rows]; ids i32 [rows, G] (G = (ngram_size-1) *
heads_per_ngram n-gram heads: the heads of order 2, then of order 3, ...); state ctx i32
[slots, ngram_size-1]: the slot's last ngram_size-1 tokens, oldest first (EOS before the
sequence's start: HF's n-gram context cache). No weights. Attrs ngram_size (N), heads_per_ngram,
eos (the first eos_token_id), multipliers (N ints), sizes (G ints: each head's prime table size),
offsets (G ints: each head's first row in the layer's table): core/ngram.tables computes the
three, as the module's buffers.

Per active row at sequence index p of its slot (t: the slot's tokens, EOS before index 0):

    shift_s = t[p-s] if no EOS among t[p-s .. p-1], else EOS          (s = 0..N-1; shift_0 = t[p])
    x_o = XOR_{s<o} (shift_s * multipliers[s])                         (o = 2..N)
    ids[row, h] = x_o mod sizes[h] + offsets[h]                        (h: a head of order o)

in 64-bit integers, as torch's int64 (wrapping multiply, floor remainder; with tokens below the
vocab size no product overflows). Rows are taken in order, each continuing its slot's sequence;
a row at position 0 starts a new one (context all EOS). An EOS inside a sequence only cuts the
n-grams, as in HF. A row with a negative position is inactive: ids -1, no state change.
Optional write `history` i32 [rows, ngram_size-1] (the verify program): the context of row r's
slot after row r.
"""

import numpy as np

from .causal_conv1d import runs


def shifts(hist: np.ndarray, ngram_size: int, eos: int) -> np.ndarray:
    """hist int64 [N-1+n]: a context of N-1 tokens, then n rows' tokens -> shift_s [N, n]."""
    N, L = ngram_size, hist.size
    at = np.arange(L)
    last = np.maximum.accumulate(np.where(hist == eos, at, -1))
    before = np.concatenate([[-1], last[:-1]])[N - 1:]               # the last EOS before each row
    p = at[N - 1:]
    return np.stack([np.where(before < p - s, hist[p - s], eos) for s in range(N)])


def run(op, buf, w):
    tok, pos, slot = buf[op["tokens"]], buf[op["pos"]], buf[op["slot"]]
    ctx, ids = buf[op["ctx"]], buf[op["ids"]]
    N, hpn, eos = int(op["ngram_size"]), int(op["heads_per_ngram"]), int(op["eos"])
    m = np.array(op["multipliers"], np.int64)
    size, off = np.array(op["sizes"], np.int64), np.array(op["offsets"], np.int64)
    res = np.full(ids.shape, -1, np.int32)
    final = {}
    for s, r, reset in runs(pos, slot):
        hist = np.concatenate([np.full(N - 1, eos) if reset else ctx[s], tok[r]]).astype(np.int64)
        sh = shifts(hist, N, eos)
        x = sh[0] * m[0]
        for o in range(2, N + 1):
            x = x ^ (sh[o - 1] * m[o - 1])
            h = slice((o - 2) * hpn, (o - 1) * hpn)
            res[r, h] = np.remainder(x[:, None], size[h]) + off[h]
        final[s] = hist[hist.size - (N - 1):]
        if "history" in op:
            for i, row in enumerate(r):
                buf[op["history"]][row] = hist[i + 1:i + N]
    for s, c in final.items():
        ctx[s] = c
    ids[...] = res
