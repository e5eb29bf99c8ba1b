"""Which executor runs: --device auto | cpu | cuda."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from bloomery.core import plan as P

from .errors import DeviceUnavailable, InsufficientDeviceMemory

DEVICES = ("auto", "cpu", "cuda")
BUFFER_ITEMSIZE = 4                      # f32 / i32: every plan buffer (core/plan.py DTYPES)


def cuda_unavailable() -> str | None:
    """Why the CUDA executor cannot run here (None when CuPy sees a CUDA GPU)."""
    try:
        import cupy
    except Exception as e:
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no CUDA driver or GPU ({type(e).__name__}: {e})"
    return None if n > 0 else "no CUDA GPU"


def gpu_count() -> int:
    """CUDA GPUs CuPy can see (0 without CuPy or a driver)."""
    if cuda_unavailable() is not None:
        return 0
    import cupy
    return int(cupy.cuda.runtime.getDeviceCount())


def gpu_present() -> bool:
    """A CUDA GPU that CuPy can see."""
    return cuda_unavailable() is None


def resolve(device: str) -> str:
    """The device that will run: auto picks cuda when CuPy and a GPU are present, else cpu;
    cuda without them is refused by name."""
    if device not in DEVICES:
        raise DeviceUnavailable(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    why = cuda_unavailable()
    if device == "cuda":
        if why:
            raise DeviceUnavailable(f"--device cuda: {why}; use --device cpu (or auto)")
        return "cuda"
    return "cpu" if why else "cuda"


def device_bytes(plan: dict, table: Mapping, symbols: Mapping[str, int],
                 itemsize: Mapping[str, int] | None = None) -> dict[str, int]:
    """What a rank's plan puts on the GPU, at least (the CUDA executor's allocations): the GGUF bytes
    of every tensor a device op reads (host ops' tables stay in the mmapped artifact) and every
    buffer at its bound shape (the state once, host ops' states left out; each program's others)."""
    host_ops = [op for prog in P.programs_of(plan) for op in plan["programs"][prog]["ops"] if P.OPS[op["op"]].host]
    tables = {op[k] for op in host_ops for k in P.OPS[op["op"]].weights}
    host_state = {op[k] for op in host_ops for k in P.OPS[op["op"]].state}
    weights = sum(int(table[n].nbytes) for n in P.weights_of(plan) if n not in tables)
    bufs = 0
    progs = dict(P.PROGRAMS)
    if "verify" in plan["programs"] and symbols.get("verify"):     # bound where the engine drafts
        progs["verify"] = "verify"
    size = itemsize or {}                                          # a buffer held in fewer bytes (a KV cache type)
    for prog, rows in progs.items():
        bind = {**symbols, "rows": symbols[rows]}
        used = P.buffers_used(plan, prog)
        bufs += sum(int(np.prod(P.shape(b, bind))) * size.get(n, BUFFER_ITEMSIZE) for n, b in plan["buffers"].items()
                    if (b["kind"] == "output" or (b["kind"] == "state" and prog == "decode")
                        or (b["kind"] in ("input", "scratch") and n in used)) and n not in host_state)
    return {"weights": weights, "buffers": bufs}


def check_fits(need: Mapping[str, int], free: int, total: int, where: str) -> None:
    """Refuses, before anything is uploaded, a model whose device bytes exceed the GPU's free memory."""
    n = sum(need.values())
    if n > free:
        parts = " + ".join(f"{k} {v:,}" for k, v in need.items())
        raise InsufficientDeviceMemory(
            f"{where}: needs at least {n:,} bytes on the GPU ({parts}); {free:,} of its {total:,} bytes are free. "
            f"Free the GPU, use fewer slots or a shorter context (-np, --ctx-size: the KV cache), prepare with "
            f"--tp 2 for two GPUs, or use --device cpu")
