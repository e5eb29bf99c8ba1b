// hc_collapse: the contract of runtime/ops/hc_collapse.py (glm5_next's block input from the
// hyper-connection streams): out[r, d] = sum_i w[r, i] * x[r, i * D + d], the products rounded and
// summed in stream order (NumPy's einsum: bit for bit). A grid-stride loop over rows x D outputs;
// out must not overlap x (it is a narrower buffer).

__global__ void hc_collapse_k(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ out,
                              int rows, int n, int D) {
  const long long total = (long long)rows * D;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / D, d = i - r * D;
    const float *xr = x + r * n * D + d, *wr = w + r * n;
    float acc = __fmul_rn(wr[0], xr[0]);
    for (int s = 1; s < n; s++) acc = __fadd_rn(acc, __fmul_rn(wr[s], xr[(size_t)s * D]));
    out[i] = acc;
  }
}
