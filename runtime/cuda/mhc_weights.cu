// mhc_weights: the contract of runtime/ops/mhc_weights.py (glm5_next's manifold hyper-connection
// weights, Glm5NextTextHyperConnection.forward, float32). Per row, with N = n * D the flat streams x
// and z = x @ fn.T (the plan's linear, before the unweighted RMSNorm, a per-row scalar):
//     inv  = 1 / sqrt(mean(x^2) + eps);  zz = z * inv
//     pre  = sigmoid(zz[:n] * scale[0] + base[:n]) + hc_eps
//     post = 2 * sigmoid(zz[n:2n] * scale[1] + base[n:2n])
//     comb = softmax_j(zz[2n + i*n + j] * scale[2] + base[2n + i*n + j]) + hc_eps
//     comb /= colsum + hc_eps, then iters - 1 times: comb /= rowsum + hc_eps; comb /= colsum + hc_eps
// (sigmoid(v) = 1 / (1 + exp(-v)), products and sums rounded in NumPy's order; the row and column
// sums of comb are sequential, as NumPy's for n < 8; the mean of x^2 is a block reduction, not
// NumPy's pairwise order: within an ulp or so).
//
// One block per row (blockDim a multiple of 32): the block sums x^2, then warp 0 does the rest, lane
// l holding pre[l] / post[l] (l < n) and comb[l] (l < n*n, row l / n, column l % n; the row / column
// sums gathered by shuffles, in order). n*n <= 32. Rows with a negative position are computed like
// the others (the op has no positions; their values are not used).

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float sigmoidf_np(float v) { return 1.0f / (1.0f + expf(-v)); }

// the sum of the n values of lanes base, base + stride, ... (in that order), every lane active
__device__ __forceinline__ float lane_sum(float v, int base, int stride, int n) {
  float s = __shfl_sync(FULL_MASK, v, base);
  for (int k = 1; k < n; k++) s = __fadd_rn(s, __shfl_sync(FULL_MASK, v, (base + k * stride) & 31));
  return s;
}

__global__ void mhc_weights_k(const float *__restrict__ z, const float *__restrict__ x, const float *__restrict__ base,
                              const float *__restrict__ scale, float *__restrict__ pre, float *__restrict__ post,
                              float *__restrict__ comb, int n, int D, int iters, float hc_eps, float eps) {
  __shared__ float sh[32];
  const int r = blockIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int N = n * D;
  const float *xr = x + (size_t)r * N;
  float ss = 0.f;
  for (int i = threadIdx.x; i < N; i += blockDim.x) { const float v = xr[i]; ss = __fadd_rn(ss, __fmul_rn(v, v)); }
#pragma unroll
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
  if (lane == 0) sh[wid] = ss;
  __syncthreads();
  if (wid) return;
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  const float inv = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(t, (float)N), eps));
  const int W = (2 + n) * n;
  const float *zr = z + (size_t)r * W;
  if (lane < n) {
    const float a = __fadd_rn(__fmul_rn(__fmul_rn(zr[lane], inv), scale[0]), base[lane]);
    const float b = __fadd_rn(__fmul_rn(__fmul_rn(zr[n + lane], inv), scale[1]), base[n + lane]);
    pre[(size_t)r * n + lane] = __fadd_rn(sigmoidf_np(a), hc_eps);
    post[(size_t)r * n + lane] = __fmul_rn(2.0f, sigmoidf_np(b));
  }
  const bool on = lane < n * n;
  const int i = lane / n, j = lane - (lane / n) * n;
  float c = on ? __fadd_rn(__fmul_rn(__fmul_rn(zr[2 * n + lane], inv), scale[2]), base[2 * n + lane]) : 0.f;
  // softmax over the row (max subtracted), then + hc_eps
  float m = __shfl_sync(FULL_MASK, c, (i * n) & 31);
  for (int k = 1; k < n; k++) m = fmaxf(m, __shfl_sync(FULL_MASK, c, (i * n + k) & 31));
  c = expf(__fsub_rn(c, m));
  c = __fadd_rn(__fdiv_rn(c, lane_sum(c, i * n, 1, n)), hc_eps);
  c = __fdiv_rn(c, __fadd_rn(lane_sum(c, j, n, n), hc_eps));
  for (int it = 1; it < iters; it++) {
    c = __fdiv_rn(c, __fadd_rn(lane_sum(c, i * n, 1, n), hc_eps));
    c = __fdiv_rn(c, __fadd_rn(lane_sum(c, j, n, n), hc_eps));
  }
  if (on) comb[(size_t)r * n * n + lane] = c;
}
