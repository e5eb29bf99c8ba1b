"""The op kernels of ops_src.py, compiled once per process (NVRTC through cupy.RawModule)."""

from __future__ import annotations

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from .ops_src import SOURCE

NAMES = ("embed_k<0>", "embed_k<1>", "embed_k<2>", "rmsnorm_k", "rope_k", "rope_qk_kv_k", "kv_write_k",
         "attention_k<1>", "attention_k<2>", "attention_k<4>", "attention_k<8>", *(f"attn_chunk_k<{d}, {q}>" for d in (1, 2, 4, 8) for q in (1, 2)), "swiglu_k", "add_k",
         "scale_cols_k", "scale_cols_e_k", "moe_topk_k", "moe_combine_k", "argmax_k", "advance_k")
OPTIONS = ("-std=c++17",)
_K: dict = {}


def kernels() -> dict:
    """{name: cupy.RawKernel} of every op kernel (one module, compiled on first use)."""
    if not _K:
        mod = cp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=list(NAMES))
        _K.update({n: mod.get_function(n) for n in NAMES})
        _K["_module"] = mod
    return _K


def grid1d(n: int, threads: int = 256, cap: int = 4096) -> tuple[int]:
    """Blocks for a grid-stride loop over n elements."""
    return (max(1, min(cap, -(-n // threads))),)
