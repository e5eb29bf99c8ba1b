"""Minifloat value tables and casts shared by the stored formats (the one owner).

Tables are built from the bit layouts, not from ml_dtypes, so the tests' ml_dtypes
tables are an independent check. Every table is float32 and exact.
"""

from __future__ import annotations

import numpy as np

# E2M1 (FP4): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; code 8 is -0.0.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    t = (sign * mag).astype(np.float32)
    t[(b & 0x7F) == 0x7F] = np.nan           # E4M3FN: S.1111.111 is NaN, there is no Inf
    return t


def _e8m0_table() -> np.ndarray:
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e == 0, np.uint32(0x00400000), e << np.uint32(23))   # 2^-127 is a float32 subnormal
    t = bits.astype(np.uint32).view(np.float32).copy()
    t[255] = np.nan
    return t


E4M3 = _e4m3_table()          # byte -> float32 value of float8_e4m3fn
E8M0 = _e8m0_table()          # byte -> 2^(e-127); 255 is NaN
# packed byte -> (low nibble value, high nibble value), as one uint64 per byte for a fast take
E2M1_PAIRS = np.stack([E2M1[np.arange(256) & 0xF], E2M1[np.arange(256) >> 4]], axis=1).copy()
_E2M1_PAIRS_U64 = E2M1_PAIRS.view(np.uint64).reshape(256)


def e4m3_bits(a: np.ndarray) -> np.ndarray:
    """uint8 view of an E4M3 (or already uint8) array."""
    return np.asarray(a).view(np.uint8)


def decode_e4m3(a: np.ndarray) -> np.ndarray:
    return E4M3[e4m3_bits(a)]


def decode_e8m0(a: np.ndarray) -> np.ndarray:
    return E8M0[np.asarray(a).view(np.uint8)]


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] (element 2k low nibble, 2k+1 high) -> float32 [..., n]."""
    packed = np.asarray(packed, dtype=np.uint8)
    v = np.take(_E2M1_PAIRS_U64, packed)
    return v.view(np.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> codes uint8 [..., n] (element 2k = low nibble)."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1], 2), dtype=np.uint8)
    np.bitwise_and(packed, 0xF, out=out[..., 0])
    np.right_shift(packed, 4, out=out[..., 1])
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """codes uint8 [..., n] (n even) -> uint8 [..., n/2]."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes: nearest, ties to even, saturating at 6; x < 0 sets the sign
    (so a small negative becomes -0.0). The same rule as ModelOpt's NVFP4QTensor._cast_fp4."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    idx = np.searchsorted(_E2M1_BOUNDS, a, side="left").astype(np.uint8)
    # a tie on 0.75 / 1.75 / 3.5 sits below an even code: move up to it
    idx += ((a == 0.75) | (a == 1.75) | (a == 3.5)).astype(np.uint8)
    return idx | ((x < 0).astype(np.uint8) << 3)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn, nearest-even, saturating at +-448 (never NaN from overflow)."""
    import ml_dtypes
    x = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn)


def e8m0_exponent(amax: np.ndarray, maxval: float) -> np.ndarray:
    """Biased E8M0 byte of 2^ceil(log2(amax/maxval)), clamped to [0, 254]; amax 0 -> 0.
    Computed exactly with frexp (no float log2)."""
    d = np.asarray(amax, dtype=np.float64) / maxval
    m, e = np.frexp(d)                      # d = m * 2^e, m in [0.5, 1)
    k = np.where(m == 0.5, e - 1, e)        # ceil(log2(d))
    k = np.where(d > 0, k, -127)
    return (np.clip(k, -127, 127) + 127).astype(np.uint8)
