// hc_inject: the contract of runtime/ops/hc_inject.py (qwen4_exp's hyper-connection residual):
//     out[r, i*D + d] = x[r, i*D + d] + w[r, i] * y[r, d],
// the product rounded, then the add (NumPy's order: bit for bit). Elementwise over rows x n x D, a
// grid-stride loop: out may be x (out must not overlap y or w).

__global__ void hc_inject_k(const float *x, const float *__restrict__ y, const float *__restrict__ w, float *out,
                            int rows, int n, int D) {
  const long long nd = (long long)n * D, total = rows * nd;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / nd, c = i - r * nd, s = c / D;
    out[i] = __fadd_rn(x[i], __fmul_rn(y[r * D + (c - s * D)], w[r * n + s]));
  }
}
