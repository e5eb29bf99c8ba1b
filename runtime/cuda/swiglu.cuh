#pragma once
// The swiglu op's arithmetic, one owner: the swiglu op's kernels (ops_src.py) and the GEMV kernels that fold
// the op into their launch (gemv_src.py, gemv_tile.cu, gemv_row.cu) all call these, so their values agree bit for bit.
// silu(g) * u, silu(x) = x / (1 + exp(-x)); _limit: glm5_next's clamp, silu(min(g, L)) * clip(u, -L, L)
__device__ __forceinline__ float swiglu1(float g, float u) { return __fmul_rn(g / (1.0f + expf(-g)), u); }
__device__ __forceinline__ float swiglu1_limit(float g, float u, float L) {
  return swiglu1(fminf(g, L), fminf(fmaxf(u, -L), L));
}
