"""Choosing the next token from a row of logits: greedy (temperature 0, the plan's argmax), or
sampling with temperature, then top-k, then top-p (nucleus), from a seeded generator."""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> int:
    z = logits.astype(np.float64) / max(temperature, 1e-6)
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)      # the smallest prefix holding top_p
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(order.size, p=p)])
