// mhc_inject: the contract of runtime/ops/mhc_inject.py (glm5_next's residual after a block):
//     out[r, j*D + d] = post[r, j] * y[r, d] + sum_i comb[r, i*n + j] * x[r, i*D + d]
// the mix's products rounded and summed in stream order i, then the injection added (NumPy's einsum
// and its elementwise add: bit for bit). One thread per (row, d) reads the N stream values at d
// into registers before it writes the N outputs at d, so out may be x (the lowering writes the
// streams in place). A grid-stride loop over rows x D.

template <int N>
__global__ void mhc_inject_k(const float *x, const float *__restrict__ y, const float *__restrict__ post,
                             const float *__restrict__ comb, float *out, int rows, int D) {
  const long long total = (long long)rows * D;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / D, d = i - r * D;
    const float *xr = x + r * N * D + d, *cr = comb + r * N * N, *pr = post + r * N;
    float xs[N];
#pragma unroll
    for (int s = 0; s < N; s++) xs[s] = xr[(size_t)s * D];
    const float yv = y[i];
    float *o = out + r * N * D + d;
#pragma unroll
    for (int j = 0; j < N; j++) {
      float acc = __fmul_rn(cr[j], xs[0]);
#pragma unroll
      for (int s = 1; s < N; s++) acc = __fadd_rn(acc, __fmul_rn(cr[s * N + j], xs[s]));
      o[(size_t)j * D] = __fadd_rn(__fmul_rn(pr[j], yv), acc);
    }
  }
}
