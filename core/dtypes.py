"""safetensors dtype names <-> NumPy dtypes (the one owner of that mapping)."""

import ml_dtypes
import numpy as np

# Stored element types as safetensors names them. FP8 and BF16 come from ml_dtypes.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def to_numpy(name: str) -> np.dtype:
    """The NumPy dtype of a safetensors dtype name (KeyError if unknown)."""
    return SAFETENSORS_DTYPES[name]


def st_name(dtype) -> str:
    """The safetensors name of a NumPy dtype."""
    return _NAMES[np.dtype(dtype)]
