// ple_gate: the contract of runtime/ops/ple_gate.py (qwen4_exp's per-layer-embedding stream gate):
//     g_i = sum_d kn[r, i*D + d] * qn[r, i*D + d] / sqrt(D);   g_i = sign(g_i) * sqrt(max(|g_i|, 1e-6))
//     out[r, i*D + d] = sigmoid(g_i) * v[r, d],   sigmoid(g) = 1 / (1 + exp(-g))
// One block per (stream i, row r): grid (n, rows), blockDim a multiple of 32. The dot product's rounded
// products are summed per thread (stride blockDim) and then over the block (NumPy sums pairwise: the
// order differs, float32 rounding), divided by rsd = float32(sqrt(D)) as NumPy divides. out must not
// overlap kn, qn or v.

__global__ void ple_gate_k(const float *__restrict__ kn, const float *__restrict__ qn, const float *__restrict__ v,
                           float *__restrict__ out, int n, int D, float rsd) {
  __shared__ float sh[32];
  __shared__ float gate;
  const int i = blockIdx.x, r = blockIdx.y, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const size_t b = ((size_t)r * n + i) * D;
  float s = 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) s = __fadd_rn(s, __fmul_rn(kn[b + d], qn[b + d]));
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) sh[wid] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int k = 0; k < (int)(blockDim.x >> 5); k++) t += sh[k];
    float g = t / rsd;
    const float sg = g > 0.f ? 1.f : g < 0.f ? -1.f : 0.f;
    g = __fmul_rn(sqrtf(fmaxf(fabsf(g), 1e-6f)), sg);
    gate = 1.0f / (1.0f + expf(-g));
  }
  __syncthreads();
  const float sg = gate;
  for (int d = threadIdx.x; d < D; d += blockDim.x) out[b + d] = __fmul_rn(sg, v[(size_t)r * D + d]);
}
