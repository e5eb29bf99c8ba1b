// hc_mean: the contract of runtime/ops/hc_mean.py (glm5_next's final collapse, Glm5NextTextHyperHead):
// out[r, d] = (sum_i x[r, i * D + d]) / n, summed in stream order then divided (NumPy's mean over
// the stream axis: bit for bit). A grid-stride loop over rows x D outputs; out must not overlap x.

__global__ void hc_mean_k(const float *__restrict__ x, float *__restrict__ out, int rows, int n, int D) {
  const long long total = (long long)rows * D;
  const float fn = (float)n;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / D, d = i - r * D;
    const float *xr = x + r * n * D + d;
    float acc = xr[0];
    for (int s = 1; s < n; s++) acc = __fadd_rn(acc, xr[(size_t)s * D]);
    out[i] = __fdiv_rn(acc, fn);
  }
}
