"""Rotary position frequencies, in one place: the inverse frequencies of the default rope and of
the scaled forms Llama 3.x (`rope_type: llama3`) and YaRN (`rope_type: yarn`) use, and YaRN's
attention factor, as transformers 5.24 computes them (modeling_rope_utils.py:
_compute_default_rope_parameters, _compute_llama3_parameters, _compute_yarn_parameters), in
float32 with the same order of operations.

The NumPy rope op (runtime/ops/rope.py) and the CUDA executor take their inv_freq from `inv_freq`;
the lowering reads the artifact metadata the specs write (`from_metadata`) into the rope op's
optional `scaling` attr, and folds YaRN's attention factor m into the attention op's scale
(m^2 / sqrt(head_dim)): transformers multiplies cos and sin of q and of k by m, and q.k is
bilinear, so the scores are the same with no multiply on the rotated q and k.

A rope op's `scaling` attr (absent: the default rope):
    {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_context"}
    {"type": "yarn", "factor", "original_context", "beta_fast", "beta_slow", "truncate"}
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from .errors import UnsupportedConfig
from .plan import PlanInvalid

# scaling field -> the artifact metadata key the specs write it under (llama.cpp's where it has one)
META = {"type": "{arch}.rope.scaling.type", "factor": "{arch}.rope.scaling.factor",
        "original_context": "{arch}.rope.scaling.original_context_length",
        "low_freq_factor": "bloomery.rope.scaling.low_freq_factor",
        "high_freq_factor": "bloomery.rope.scaling.high_freq_factor",
        "beta_fast": "{arch}.rope.scaling.yarn_beta_fast", "beta_slow": "{arch}.rope.scaling.yarn_beta_slow",
        "truncate": "bloomery.rope.scaling.yarn_truncate"}
ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"
# per scaling type: its fields and their types in the plan
FIELDS = {"llama3": {"factor": float, "low_freq_factor": float, "high_freq_factor": float, "original_context": int},
          "yarn": {"factor": float, "original_context": int, "beta_fast": float, "beta_slow": float,
                   "truncate": bool}}


def inv_freq(theta: float, dim: int, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
    """float32 [dim / 2], read-only: the inverse frequencies of a rope of `dim` rotated values."""
    return _inv_freq(float(theta), int(dim), tuple(sorted(scaling.items())) if scaling else None)


@lru_cache(maxsize=None)
def _inv_freq(theta: float, dim: int, scaling: tuple | None) -> np.ndarray:
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    out = np.float32(1.0) / pos_freqs
    if scaling is not None:
        s = _checked(dict(scaling))
        out = _llama3(out, s) if s["type"] == "llama3" else _yarn(pos_freqs, theta, dim, s)
    out = out.astype(np.float32)
    out.setflags(write=False)
    return out


def _checked(s: dict, error: type = PlanInvalid) -> dict:
    """A scaling attr with a known type and all of its fields (`error` naming what is wrong)."""
    kind = s.get("type")
    if kind not in FIELDS:
        raise error(f"rope scaling {kind!r} is not one bloomery computes ({', '.join(FIELDS)}); prepare the "
                    f"artifact again with this bloomery")
    missing = sorted(set(FIELDS[kind]) - set(s))
    if missing:
        raise error(f"rope scaling {kind!r} lacks {', '.join(missing)}; prepare the artifact again")
    return s


def _llama3(inv: np.ndarray, s: dict) -> np.ndarray:
    """_compute_llama3_parameters: long wavelengths divided by factor, short ones kept, smoothed between."""
    f32 = np.float32
    factor, lo, hi, old = f32(s["factor"]), s["low_freq_factor"], s["high_freq_factor"], s["original_context"]
    low_wavelen, high_wavelen = f32(old / lo), f32(old / hi)
    wavelen = f32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (f32(old) / wavelen - f32(lo)) / f32(hi - lo)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(pos_freqs: np.ndarray, theta: float, dim: int, s: dict) -> np.ndarray:
    """_compute_yarn_parameters: interpolation (divided by factor) below the correction range,
    extrapolation (as is) above it, a linear ramp across it."""
    f32 = np.float32

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s["original_context"] / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                      # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - f32(low)) / f32(high - low), f32(0), f32(1))
    extrapolation = f32(1) / pos_freqs
    interpolation = f32(1) / (f32(s["factor"]) * pos_freqs)
    keep = f32(1) - ramp                   # transformers' inv_freq_extrapolation_factor
    return interpolation * (f32(1) - keep) + extrapolation * keep


def yarn_attention_factor(factor, attention_factor=None, mscale=None, mscale_all_dim=None) -> float:
    """YaRN's multiplier of cos and sin: the config's attention_factor, else from factor (and
    mscale / mscale_all_dim where both are set), as _compute_yarn_parameters derives it."""
    if attention_factor is not None:
        return float(attention_factor)

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return float(get_mscale(factor))


def from_metadata(md: Mapping[str, Any], arch: str) -> tuple[dict | None, float]:
    """(the rope op's `scaling` attr or None, the attention factor) from an artifact's metadata."""
    key = lambda f: META[f].replace("{arch}", arch)      # noqa: E731
    if key("type") not in md:
        return None, 1.0
    kind = str(md[key("type")])
    fields = FIELDS.get(kind, {})
    scaling = {"type": kind, **{f: cast(md[key(f)]) for f, cast in fields.items() if key(f) in md}}
    _checked(scaling, UnsupportedConfig)
    return scaling, float(md.get(ATTN_FACTOR.replace("{arch}", arch), 1.0))
