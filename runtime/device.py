"""Which executor runs: --device auto | cpu | cuda."""

from __future__ import annotations

from .errors import DeviceUnavailable

DEVICES = ("auto", "cpu", "cuda")


def gpu_present() -> bool:
    """A CUDA GPU that CuPy can see."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve(device: str) -> str:
    """The device that will run: auto picks cuda when a GPU and CuPy are present and its executor
    exists, else cpu. cuda is refused by name until the CUDA executor lands."""
    if device not in DEVICES:
        raise DeviceUnavailable(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda":
        raise DeviceUnavailable("--device cuda: the CUDA executor is not implemented yet; use --device cpu "
                                "(or auto, which runs on the CPU for now)")
    return "cpu"
