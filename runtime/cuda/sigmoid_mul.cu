// sigmoid_mul: the contract of runtime/ops/sigmoid_mul.py: out = x * sigmoid(gate), sigmoid(g) =
// 1 / (1 + exp(-g)) (as torch), the product rounded once. gate is [rows, n] like x (gcols == n) or
// [rows, 1] (gcols == 1: one gate per row, Qwen3-Next's shared_expert_gate). Elementwise: out may be x.

__global__ void sigmoid_mul_k(const float *x, const float *gate, float *out, int rows, int n, int gcols) {
  const long long total = (long long)rows * n;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const float g = gcols == 1 ? gate[i / n] : gate[i];
    out[i] = __fmul_rn(x[i], 1.0f / (1.0f + expf(-g)));
  }
}
