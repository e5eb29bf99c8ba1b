// hc_gate_mix: the contract of runtime/ops/hc_gate_mix.py (qwen4_exp's hyper-connection block input):
//     out[r, d] = (sum_i sigmoid(w[r, i*D + d]) * xn[r, i*D + d]) / n,   sigmoid(g) = 1 / (1 + exp(-g)),
// each product rounded, the n terms summed in stream order (NumPy's sum over the stream axis), then one
// division by n. A grid-stride loop over the rows x D outputs; out must not overlap xn or w.

__global__ void hc_gate_mix_k(const float *__restrict__ xn, const float *__restrict__ w, float *__restrict__ out,
                              int rows, int n, int D) {
  const long long total = (long long)rows * D;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / D;
    const size_t b = (size_t)r * n * D + (i - r * D);
    float s = 0.f;
    for (int j = 0; j < n; j++) {
      const float g = w[b + (size_t)j * D];
      const float y = __fmul_rn(1.0f / (1.0f + expf(-g)), xn[b + (size_t)j * D]);
      s = j ? __fadd_rn(s, y) : y;
    }
    out[i] = s / (float)n;
  }
}
