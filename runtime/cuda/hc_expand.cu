// hc_expand: the contract of runtime/ops/hc_expand.py (qwen4_exp's first hyper-connection streams):
// out[r, i * D + d] = x[r, d] for each of the n streams i, a copy (bit for bit). A grid-stride loop over
// the rows x n x D outputs; out must not overlap x.

__global__ void hc_expand_k(const float *__restrict__ x, float *__restrict__ out, int rows, int n, int D) {
  const long long nd = (long long)n * D, total = rows * nd;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / nd;
    out[i] = x[r * D + (i - r * nd) % D];
  }
}
