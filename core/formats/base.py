"""The contract every stored weight format implements (one module per format).

A quantized tensor is held as `parts`: a dict from a canonical part name to a NumPy
array in its stored dtype (see core/dtypes.py: F8_E4M3 is ml_dtypes.float8_e4m3fn,
BF16 is ml_dtypes.bfloat16, packed nibbles and E8M0 bytes are uint8).

Canonical part names (the checkpoint reader maps the stored names onto these):
    weight           the stored elements (packed for 4-bit formats)
    scale            the per-block / per-channel / per-tensor scale
                     (ModelOpt `weight_scale`, DeepSeek-style `weight_scale_inv`)
    scale_2          NVFP4's global F32 scale (`weight_scale_2`)
    input_scale      the activation scale (kept, never used to decode the weight)
    pre_quant_scale  NVFP4_AWQ's per-input-channel smoothing scale (kept; the
                     runtime multiplies activations by it)

Logical shape: the decoded weight's shape, `[..., out, in]` (a linear weight is
`[out, in]`; stacked experts `[expert, out, in]`). Blocks run along the last axis
(`in`), except the 2-D block formats (128x128, 32x32) which block both last axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class PartSpec:
    name: str                 # canonical part name
    dtypes: tuple[str, ...]   # safetensors dtype names accepted for it
    required: bool = True


class Format:
    """One stored weight format. Subclasses set `name` and `parts` and implement the methods."""

    name: str = ""
    parts: tuple[PartSpec, ...] = ()
    held_as: str | None = None    # the format the artifact holds it in, when not itself (see held)

    # -- structure -------------------------------------------------------------
    def shape(self, parts: Mapping[str, np.ndarray]) -> tuple[int, ...]:
        """Logical (decoded) shape."""
        raise NotImplementedError

    def check(self, parts: Mapping[str, np.ndarray], where: str) -> None:
        """Refuse malformed input by name (core/errors.py): missing or unexpected part,
        wrong dtype, wrong scale shape, NaN/Inf or negative scale. `where` names the
        tensor (and file) in the message."""
        raise NotImplementedError

    def cut_unit(self, axis: int) -> int:
        """Granularity of a tensor-parallel cut along logical axis -1 (in) or -2 (out):
        a slice must start and stop on a multiple of this many elements."""
        raise NotImplementedError

    def cut(self, parts: Mapping[str, np.ndarray], axis: int, start: int, stop: int, where: str = "",
            check: bool = True) -> dict:
        """The parts of logical slice [start, stop) along axis -1 or -2 (NotOnBlockBoundary
        if either end is off the cut unit). decode(cut(p)) == decode(p)[slice] exactly.
        check=False: the parts passed check() already (the cut's own bounds are still checked)."""
        raise NotImplementedError

    # -- values ----------------------------------------------------------------
    def decode(self, parts: Mapping[str, np.ndarray], where: str = "", check: bool = True) -> np.ndarray:
        """float32 array of the logical shape, bit-exact to the format's definition.
        Runs check(parts, where) first (check=False: the parts passed it already)."""
        raise NotImplementedError

    def encode(self, x: np.ndarray, **kw) -> dict:
        """Quantize float values into this format's parts (for the Q8_0 lever and for tests)."""
        raise NotImplementedError

    def held(self, parts: Mapping[str, np.ndarray], where: str = "") -> dict:
        """The parts in format `held_as`, every element decoding to the same value bit for bit
        (a format with no artifact layout of its own)."""
        raise NotImplementedError
