"""The KV cache in the type the user picks (--cache-type-k / --cache-type-v, llama.cpp's names):

    f32    float32, as computed (the default: the gates' reference)
    f16    IEEE half, round to nearest even (numpy)
    bf16   bfloat16, round to nearest even (ml_dtypes)
    q8_0   GGML Q8_0 blocks of 32 along head_dim: an f16 d = amax / 127, 32 int8 (core/formats/q8_0:
           bit-exact with gguf-py's quantize); 34 bytes per 32 values
    fp8    E4M3 of value / scale, saturating at 448 (ml_dtypes float8_e4m3fn, nearest even), read as
           e4m3 * scale: the checkpoint's own k_scale / v_scale, where ModelOpt exported an FP8 KV
           cache (kv_cache_quant_algo FP8; the attention op's k_scale / v_scale weights)

A value is rounded to the type when attention writes it (cache[slot, pos] = k) and decoded to
float32 when attention reads it, so a row attends to the rounded keys and values of every
position, its own included, as an engine with that cache does. KvStore is the NumPy executor's
state buffer for an attention cache: it takes the two indexings the attention op uses (a write
at [slots, positions], a read of [slot, :L]) and clearing ([...] = 0, [slot] = 0).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bloomery.core import plan as P
from bloomery.core.formats.q8_0 import BLOCK, BYTES, FORMAT as Q8

from .errors import RuntimeRefusal

TYPES = ("f32", "f16", "bf16", "q8_0", "fp8")
BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": BYTES / BLOCK, "fp8": 1.0}
_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}
FP8_MAX = 448.0


class CacheTypeRefused(RuntimeRefusal):
    """A KV-cache type this model or executor cannot take (q8_0 off its block, fp8 without scales)."""


def typed_caches(plan: dict, cache_types) -> list[tuple[dict, str, str]]:
    """(attention op, its cache key "cache_k" / "cache_v", type) of every attention cache of the plan's
    programs (the mtp program's too) held in a type other than f32: what both executors hold typed.
    Refused by name where a type is asked of a model with no attention cache."""
    if tuple(cache_types) == ("f32", "f32"):
        return []
    ops = [o for prog in P.programs_of(plan) for o in plan["programs"][prog]["ops"] if o["op"] == "attention"]
    if not ops:
        raise CacheTypeRefused(f"--cache-type {'/'.join(cache_types)}: this model keeps no attention K/V cache "
                               f"(glm5_next's MLA latent cache and the indexers' key caches stay float32); use f32")
    return [(o, key, kind) for o in ops for key, kind in (("cache_k", cache_types[0]), ("cache_v", cache_types[1]))
            if kind != "f32"]


class KvStore:
    def __init__(self, kind: str, shape: tuple, scale: float | None = None, where: str = ""):
        if kind not in TYPES:
            raise CacheTypeRefused(f"cache type {kind!r}: choose one of {', '.join(TYPES)}")
        if kind == "q8_0" and shape[-1] % BLOCK:
            raise CacheTypeRefused(f"{where}: --cache-type q8_0 quantizes blocks of {BLOCK} along head_dim, and "
                                   f"head_dim is {shape[-1]}; choose f16 or bf16")
        if kind == "fp8" and scale is None:
            raise CacheTypeRefused(f"{where}: --cache-type fp8 reads the checkpoint's own k_scale / v_scale, and "
                                   f"this artifact holds none (the checkpoint was not exported with ModelOpt's FP8 KV "
                                   f"cache, kv_cache_quant_algo FP8); choose f16, bf16 or q8_0")
        self.kind, self.shape, self.scale = kind, tuple(shape), None if scale is None else np.float32(scale)
        if kind == "q8_0":
            self.a = np.zeros((*shape[:-1], shape[-1] // BLOCK * BYTES), np.uint8)
        else:
            self.a = np.zeros(shape, _DTYPE[kind])

    @property
    def nbytes(self) -> int:
        return int(self.a.nbytes)

    def encode(self, x) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if self.kind == "q8_0":
            return Q8.encode(x)["weight"]
        if self.kind == "fp8":
            x = np.clip(x / self.scale, -FP8_MAX, FP8_MAX)
        return x.astype(_DTYPE[self.kind])

    def decode(self, a: np.ndarray) -> np.ndarray:
        if self.kind == "q8_0":
            return Q8.decode({"weight": a}, check=False)
        x = a.astype(np.float32)
        return x * self.scale if self.kind == "fp8" else x

    def __setitem__(self, key, value) -> None:
        if np.isscalar(value) and value == 0:
            self.a[key] = 0                       # clearing (a reset): zeros decode to zeros in every type
        else:
            self.a[key] = self.encode(value)

    def __getitem__(self, key) -> np.ndarray:
        return self.decode(self.a[key])
