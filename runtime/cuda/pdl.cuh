#pragma once
// Programmatic dependent launch (sm_90+; the host side: runtime/cuda/pdl.py). A kernel launched with the
// programmatic-serialization attribute may start while the kernel before it on the stream still runs:
// grid_dep_launch() lets the next kernel be scheduled once every CTA of this grid has called it;
// grid_dep_wait() returns when the kernel before has finished and its writes are visible. Read only what no
// kernel writes (weights) before the wait; activations, outputs and scratch after it, through plain loads
// (the read-only path is undefined for data written while the kernel runs). Launched without the
// attribute, both do nothing.
__device__ __forceinline__ void grid_dep_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
