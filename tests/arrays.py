"""Small helpers the op tests share: float64 relative error, random float32 arrays, and a rank's
weights as the NumPy ops read them."""

import numpy as np


class W(dict):
    """A rank's weights as the ops read them (CpuWeights' interface)."""
    pre_quant: dict = {}


def rel(got, want) -> float:
    """||got - want|| / ||want|| in float64 (a zero `want` divides by 1e-30, not by zero)."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)
