// act_scale: the contract of runtime/ops/act_scale.py (qwen4_exp's hyper-connection gates):
//     out = mul * act(x * scale),   act 0: silu(t) = t / (1 + exp(-t)),  act 1: sigmoid(t) = 1 / (1 + exp(-t)),
// each product rounded (x * scale first, then the activation, then * mul when mul != 1: has_mul), as
// NumPy's order. Elementwise over n values, a grid-stride loop: out may be x.

__global__ void act_scale_k(const float *x, float *out, long long n, int act, float scale, int has_mul, float mul) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float t = __fmul_rn(x[i], scale);
    float y = (act ? 1.0f : t) / (1.0f + expf(-t));
    if (has_mul) y = __fmul_rn(y, mul);
    out[i] = y;
  }
}
