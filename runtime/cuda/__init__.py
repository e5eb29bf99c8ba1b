"""CUDA kernels of the runtime (CuPy RawModule / NVRTC). Importing this package needs no CuPy;
the kernels' Python wrappers raise a clear error when CuPy or a GPU is absent."""
