"""Which executor runs: --device auto | cpu | cuda."""

from __future__ import annotations

from .errors import DeviceUnavailable

DEVICES = ("auto", "cpu", "cuda")


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
