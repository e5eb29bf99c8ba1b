// concat: the contract of runtime/ops/concat.py: out[r] = [a[r] | b[r]] along the last axis (the MTP
// layer's eh_proj input [enorm(embed) | hnorm(hidden)]). A copy: exact.

__global__ void concat_k(const float *__restrict__ a, const float *__restrict__ b, float *__restrict__ out, int rows,
                         int na, int nb) {
  const int n = na + nb;
  const long long total = (long long)rows * n;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / n;
    const int c = (int)(i - r * n);
    out[i] = c < na ? a[r * na + c] : b[r * nb + (c - na)];
  }
}
