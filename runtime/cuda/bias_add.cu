// bias_add: the contract of runtime/ops/bias_add.py: out[r, i] = x[r, i] + bias[i] (float32; GLM-4.5's
// q/k/v bias). Elementwise: out may be x.

__global__ void bias_add_k(const float *x, const float *__restrict__ bias, float *out, int rows, int n) {
  const long long total = (long long)rows * n;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x)
    out[i] = __fadd_rn(x[i], bias[i % n]);
}
