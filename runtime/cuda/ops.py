"""The op kernels of ops_src.py, compiled once per process (NVRTC through cupy.RawModule)."""

from __future__ import annotations

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from .ops_src import SOURCE

NAMES = ("embed_k<0>", "embed_k<1>", "embed_k<2>", "rmsnorm_k", "rope_k", "rope_qk_kv_k<0, 0>", "norm_rope_qk_kv_k<0, 0>",
         "kv_write_k<0, 0>",
         *(f"attention_k<{d}, 0, 0>" for d in (1, 2, 4, 8)),
         *(f"attn_chunk_k<{d}, {q}, 0, 0>" for d in (1, 2, 4, 8) for q in (1, 2)), "swiglu_k", "swiglu_limit_k", "add_k",
         "scale_cols_k", "scale_cols_e_k", "moe_topk_k", "moe_combine_k", "argmax_k", "advance_k")
# attention's `select` (qwen4_exp's QSA): a second module of SOURCE, compiled when a plan first has one
SELECT_NAMES = ("attn_select_k", *(f"attention_sel_k<{d}, 0, 0>" for d in (1, 2, 4, 8)),
                *(f"attn_chunk_sel_k<{d}, {q}, 0, 0>" for d in (1, 2, 4, 8) for q in (1, 2)))
OPTIONS = ("-std=c++17",)
_K: dict = {}
_S: dict = {}


def kernels() -> dict:
    """{name: cupy.RawKernel} of every op kernel (one module, compiled on first use)."""
    if not _K:
        mod = cp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=list(NAMES))
        _K.update({n: mod.get_function(n) for n in NAMES})
        _K["_module"] = mod
    return _K


def select_kernels() -> dict:
    """{name: cupy.RawKernel} of SELECT_NAMES (one module, compiled on first use)."""
    if not _S:
        mod = cp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=list(SELECT_NAMES))
        _S.update({n: mod.get_function(n) for n in SELECT_NAMES})
        _S["_module"] = mod
    return _S


def grid1d(n: int, threads: int = 256, cap: int = 4096) -> tuple[int]:
    """Blocks for a grid-stride loop over n elements."""
    return (max(1, min(cap, -(-n // threads))),)


CACHE_CODE = {"f32": 0, "bf16": 1, "f16": 2}      # ops_src.py cget / cput: the KV cache types the kernels take
_C: dict = {}


def cache_kernel(base: str, args: tuple, codes) -> object:
    """The attention kernel base<args..., ck, cv> for the cache type codes (ck, cv) (CACHE_CODE): the
    float32 ones from kernels() / select_kernels(), the others compiled on first use (a module each)."""
    name = f"{base}<{', '.join(str(int(a)) for a in (*args, *codes))}>"
    if name in NAMES:
        return kernels()[name]
    if name in SELECT_NAMES:
        return select_kernels()[name]
    if name not in _C:
        mod = cp.RawModule(code=SOURCE, options=OPTIONS, name_expressions=[name])
        _C[name] = (mod, mod.get_function(name))
    return _C[name][1]
