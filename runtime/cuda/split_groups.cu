// split_groups: the contract of runtime/ops/split_groups.py, as a gather: the output columns
// [out | rest] of a row read x's columns src[0 .. nout + nrest) (the map is built at bind time from
// groups / widths / split: static). A grid-stride loop over rows x (nout + nrest) elements; the writes
// are contiguous, the reads contiguous within each field. out and rest must not overlap x.

__global__ void split_groups_k(const float *__restrict__ x, float *__restrict__ out, float *__restrict__ rest,
                               const int *__restrict__ src, int rows, int wx, int nout, int nrest) {
  const int n = nout + nrest;
  const long long total = (long long)rows * n;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const int r = (int)(idx / n), c = (int)(idx - (long long)r * n);
    const float v = x[(size_t)r * wx + src[c]];
    if (c < nout) out[(size_t)r * nout + c] = v;
    else rest[(size_t)r * nrest + (c - nout)] = v;
  }
}
