"""Kernel launches with programmatic dependent launch (PDL, sm_90+): a kernel launched so may start while
the kernel before it on the stream is still running, and waits for it (its results written and
visible) only where its own code says `griddepcontrol.wait`.

    from bloomery.runtime.cuda import pdl
    pdl.launch(kern, grid, block, args, shared_mem=0)      # kern: a cupy.RawKernel; args as kern() takes them

The kernels launched through here are written for it (runtime/cuda/ops_src.py GRID_DEP, used by the GEMVs
of gemv_src.py and by rope_qk_kv_k; attention_decode.cu): each CTA first allows the next kernel to be
scheduled (`griddepcontrol.launch_dependents`: once every CTA of this grid has started, the next grid's CTAs may take the SM slots this grid's tail
leaves idle), reads what no kernel writes (the weights), then waits before it reads an activation or
writes an output. So the next kernel's launch, its CTAs' start and its first weight loads overlap this
kernel's tail, in a CUDA graph too (stream capture keeps the programmatic edge). Launched without the
attribute (the lever BLOOMERY_PDL=off) the same kernels run as before: both griddepcontrol
instructions do nothing then. What such a kernel reads after the wait that the kernel before wrote, it
reads through plain loads: the read-only path (ld.global.nc, what the compiler makes of const
__restrict__ pointers) is undefined for data written while the kernel runs, and a chain of launches
reading it so gave wrong values on the H200 (tests/test_cuda_kernels.py::test_gemv_pdl_chain_in_a_graph).

cupy.RawKernel takes no launch attributes, so this calls the driver's cuLaunchKernelEx through ctypes
(libcuda, present wherever CuPy runs a kernel); arguments are marshalled as CuPy does it: a device
array is its pointer, numpy scalars keep their width.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


_LIB = []
_ATTR = _Attr(ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, b"", _AttrValue())
_ATTR.value.programmaticStreamSerializationAllowed = 1


def _lib():
    if not _LIB:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _LIB.append(lib)
    return _LIB[0]


def mode(env=os.environ) -> str:
    """Lever BLOOMERY_PDL (specs/levers.yaml): "on" (the default: the decode GEMVs, the fused rope and cache
    write, the decode attention), "gemv" (the GEMVs only) or "off"; "off" too where the GPU is older than
    sm_90 or CuPy is absent."""
    from bloomery.core import levers
    m = levers.value("BLOOMERY_PDL", env)
    if m == "off" or cp is None or int(cp.cuda.Device().compute_capability) < 90:
        return "off"
    return m


def enabled(env=os.environ) -> bool:
    """Whether the lever allows programmatic dependent launch at all (mode() is not "off")."""
    return mode(env) != "off"


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def _arg(a):
    if cp is not None and isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic):
        t = _SCALARS.get(a.dtype)
        if t is None:
            raise TypeError(f"pdl.launch: no C type for a {a.dtype} argument")
        return t(a.item())
    raise TypeError(f"pdl.launch: pass device arrays and numpy scalars (as cupy.RawKernel takes them), got {type(a)}")


def _dims(d):
    d = tuple(int(v) for v in (d if isinstance(d, (tuple, list)) else (d,)))
    return d + (1,) * (3 - len(d))


def launch(kern, grid, block, args, shared_mem: int = 0, stream=None) -> None:
    """kern(grid, block, args, shared_mem=...) with the programmatic-serialization attribute, on the current
    CuPy stream (or `stream`). Raises RuntimeError with the driver's code when the launch is refused."""
    vals = [_arg(a) for a in args]
    ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
    g, b = _dims(grid), _dims(block)
    s = stream if stream is not None else cp.cuda.get_current_stream()
    cfg = _Config(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), ctypes.c_void_p(s.ptr), ctypes.pointer(_ATTR), 1)
    rc = _lib().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(kern.kernel.ptr), ptrs, None)
    if rc:
        raise RuntimeError(f"pdl.launch: cuLaunchKernelEx returned CUDA error {rc} for {getattr(kern, 'name', kern)} "
                           f"grid {g} block {b} shared {shared_mem} (set BLOOMERY_PDL=off to launch without it)")


def launcher(on: bool):
    """A function (kern, grid, block, args, shared_mem=0) that launches with PDL when `on`, else as CuPy does."""
    if on:
        return launch
    return lambda kern, grid, block, args, shared_mem=0: kern(grid, block, args, shared_mem=shared_mem)
