// rmsnorm_gated: the contract of runtime/ops/rmsnorm_gated.py (Qwen3-Next's and qwen4_exp's gated
// RMSNorm, norm before gate): over each group of g values (one v head),
//     out = ((x * 1/sqrt(mean(x^2) + eps)) * weight) * act(gate),
// act 0: silu(z) = z / (1 + exp(-z)) (the op's default), act 1: sigmoid(z) = 1 / (1 + exp(-z)) (the
// op's act "sigmoid"), each product rounded in that order (NumPy's). One block per group (blockIdx.x =
// row * groups + group; blockDim a multiple of 32); the sum of squares is a block reduction, after
// which x is read again, so out may be x (each element is read and written by one thread).

__global__ void rmsnorm_gated_k(const float *x, const float *__restrict__ gate, float *out,
                                const float *__restrict__ w, int g, float eps, int act) {
  __shared__ float sh[32];
  const size_t base = (size_t)blockIdx.x * g;
  const float *px = x + base;
  float ss = 0.f;
  for (int i = threadIdx.x; i < g; i += blockDim.x) { const float v = px[i]; ss = fmaf(v, v, ss); }
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) sh[wid] = ss;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  const float inv = 1.0f / sqrtf(t / (float)g + eps);
  for (int i = threadIdx.x; i < g; i += blockDim.x) {
    const float z = gate[base + i];
    const float y = __fmul_rn(__fmul_rn(px[i], inv), w[i]);
    out[base + i] = __fmul_rn(y, (act ? 1.0f : z) / (1.0f + expf(-z)));
  }
}
