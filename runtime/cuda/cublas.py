"""cuBLAS through ctypes: the four calls the prefill GEMM makes (create, set stream, GemmEx, destroy).

CuPy's own wrapper refuses any cuBLAS call while a stream is being captured; cuBLAS itself
supports capture, and the executor captures prefill into a CUDA graph, so bloomery calls the
library directly. The library is the one CuPy's CUDA installation provides (located by
cuda.pathfinder when present, else by the loader's search path)."""

from __future__ import annotations

import ctypes
import ctypes.util

CUDA_R_32F, CUDA_R_16BF = 0, 14
COMPUTE_32F = 68
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1

_LIB = None


def lib():
    global _LIB
    if _LIB is None:
        path = None
        try:
            from cuda import pathfinder
            path = pathfinder.load_nvidia_dynamic_lib("cublas").abs_path
        except Exception:
            pass
        names = [path] if path else []
        names += ["libcublas.so.13", "libcublas.so.12", ctypes.util.find_library("cublas")]
        err = None
        for n in names:
            if not n:
                continue
            try:
                _LIB = ctypes.CDLL(n)
                break
            except OSError as e:
                err = e
        if _LIB is None:
            raise OSError(f"cuBLAS could not be loaded ({err}); the prefill GEMM needs it "
                          f"(BLOOMERY_PREFILL_GEMM=off runs prompt chunks without it)")
        V, I = ctypes.c_void_p, ctypes.c_int
        _LIB.cublasCreate_v2.argtypes = [ctypes.POINTER(V)]
        _LIB.cublasDestroy_v2.argtypes = [V]
        _LIB.cublasSetStream_v2.argtypes = [V, V]
        _LIB.cublasGemmEx.argtypes = [V, I, I, I, I, I, V, V, I, I, V, I, I, V, V, I, I, I, I]
    return _LIB


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLAS {what} failed with status {status}")


def create(stream_ptr: int) -> ctypes.c_void_p:
    """A handle whose calls go to the stream `stream_ptr`."""
    h = ctypes.c_void_p()
    _check(lib().cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
    _check(lib().cublasSetStream_v2(h, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
    return h


def destroy(h) -> None:
    lib().cublasDestroy_v2(h)


def gemm_ex(h, transa: int, transb: int, m: int, n: int, k: int, alpha_ptr: int, a: int, atype: int, lda: int,
            b: int, btype: int, ldb: int, beta_ptr: int, c: int, ctype: int, ldc: int,
            compute: int = COMPUTE_32F, algo: int = GEMM_DEFAULT) -> None:
    """cublasGemmEx, column-major; alpha and beta are host pointers to float32 (the default pointer mode)."""
    _check(lib().cublasGemmEx(h, transa, transb, m, n, k, ctypes.c_void_p(alpha_ptr), ctypes.c_void_p(a), atype, lda,
                              ctypes.c_void_p(b), btype, ldb, ctypes.c_void_p(beta_ptr), ctypes.c_void_p(c), ctype,
                              ldc, compute, algo), "cublasGemmEx")
