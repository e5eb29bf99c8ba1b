"""qwen4_exp's hashed n-gram tables (per-layer embeddings, PLE), computed exactly as
transformers 5.24's Qwen4ExpTextNGramEmbedding does: the per-layer hash multipliers, each
n-gram head's prime vocabulary size and first row, and the padded row count of the layer's
table. Pure integer arithmetic (Python ints, 64-bit wrap where the reference masks).

The compiler checks a checkpoint's stored buffers (`layer_multipliers`,
`ngram_heads_vocab_sizes`, `ngram_heads_offsets`) against these and writes them into the plan's
ngram_hash op; the spec's shape rule of the table reads `rows`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
PRIME_1 = 10007


def splitmix64(v: int) -> int:
    v = (v + GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * M1) & MASK64
    v = ((v ^ (v >> 27)) * M2) & MASK64
    return (v ^ (v >> 31)) & MASK64


def is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


@lru_cache(maxsize=None)
def primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes greater than `start`."""
    out, p = [], start
    while len(out) < count:
        p += 1
        if is_prime(p):
            out.append(p)
    return tuple(out)


@dataclass(frozen=True)
class Tables:
    multipliers: tuple[int, ...]     # ngram_size hash multipliers (odd, < 2^63 / vocab)
    sizes: tuple[int, ...]           # per n-gram head: its prime vocabulary size
    offsets: tuple[int, ...]         # per n-gram head: its first row in the layer's table
    rows: int                        # the table's row count, padded to `divisor`


def tables(vocab_size: int, ngram_size: int, heads_per_ngram: int, base: int, seed: int, layer_index: int,
           divisor: int = 128) -> Tables:
    """The tables of the PLE layer whose index in sorted ple_layer_ids is `layer_index`."""
    heads = (ngram_size - 1) * heads_per_ngram
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    seed_k = seed + PRIME_1 * layer_index
    mult = tuple(2 * (splitmix64((seed_k + GAMMA * (j + 1)) & MASK64) % half) + 1 for j in range(ngram_size))
    sizes = primes_after(base - 1, (layer_index + 1) * heads)[layer_index * heads:]
    offsets = tuple(sum(sizes[:h]) for h in range(heads))
    rows = math.ceil(sum(sizes) / divisor) * divisor
    return Tables(mult, tuple(sizes), offsets, rows)


def chunks(n: int, parts: int) -> list[int]:
    """The lengths torch.chunk(x, parts) gives along an axis of n: ceil(n / parts) each, the last
    shorter, fewer pieces when they run out (how save_pretrained writes split_ngram_parts shards)."""
    c = -(-n // parts)
    return [min(c, n - i) for i in range(0, n, c)] if n else []
