// layernorm: the contract of runtime/ops/layernorm.py (torch's LayerNorm over each group of g
// values: glm5_next's DSA indexer k_norm), float32:
//     mu = mean(x);  d = x - mu;  var = mean(d^2);  out = d / sqrt(var + eps) * weight + bias
// the squares, the quotient and the affine products / sums rounded in NumPy's order (the two means are
// block reductions, not NumPy's pairwise order: within an ulp or so). One block per group
// (blockIdx.x = row * groups + group; blockDim a multiple of 32). Every value is read and written by
// one thread, and written after both reductions, so out may be x.

__device__ __forceinline__ float ln_block_sum(float v, float *sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();                                          // sh free (a previous call's readers are done)
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  return t;
}

__global__ void layernorm_k(const float *x, float *out, const float *__restrict__ w, const float *__restrict__ b,
                            int g, float eps) {
  __shared__ float sh[32];
  const size_t base = (size_t)blockIdx.x * g;
  const float *px = x + base;
  float s = 0.f;
  for (int i = threadIdx.x; i < g; i += blockDim.x) s += px[i];
  const float mu = __fdiv_rn(ln_block_sum(s, sh), (float)g);
  float ss = 0.f;
  for (int i = threadIdx.x; i < g; i += blockDim.x) {
    const float d = __fsub_rn(px[i], mu);
    ss = __fadd_rn(ss, __fmul_rn(d, d));
  }
  const float sd = sqrtf(__fadd_rn(__fdiv_rn(ln_block_sum(ss, sh), (float)g), eps));
  for (int i = threadIdx.x; i < g; i += blockDim.x) {
    const float d = __fsub_rn(px[i], mu);
    out[base + i] = __fadd_rn(__fmul_rn(__fdiv_rn(d, sd), w[i]), b[i]);
  }
}
