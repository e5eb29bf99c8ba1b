// causal_conv1d: the contract of runtime/ops/causal_conv1d.py. A causal depthwise conv over each
// slot's input sequence followed by SiLU, dilated by DIL (1: Qwen3-Next's conv; qwen4_exp's PLE conv:
// ngram_size), the slot's last W = (K-1)*DIL inputs kept as state [slots, W, C] (oldest first):
//     out[t, c] = silu(sum_j w[c, j] * u[t - (K - 1 - j) * DIL, c])   (w[c, K-1]: the current row),
// the products rounded and summed in j order (NumPy's order), silu(x) = x / (1 + exp(-x)) (silu_nb).
//
// One thread per (slot, channel): grid x = channel blocks of 64, y = slot. The thread keeps the
// channel's K weights and its W window in registers and walks the rows in order (the positions and
// slot ids are read from device memory, 32 rows per tile with a ballot: the slot is uniform over a
// warp), so out may be x (in place: a thread reads x[r, c] before it writes out[r, c], and no other
// thread reads them). A tile's inputs are loaded before the previous tile is computed and stored (a
// tile's rows are not another tile's, so this is safe in place too); within a tile, rows go in groups
// of 8 with no branch (selects), so their exp / divide chains overlap. A row at position 0 starts a
// new sequence (zero window); a row whose position is negative or whose slot is outside [0, slots)
// is inactive: zeros out (written by the threads of slot row % slots), no state change. The window
// before the op is read once (W floats a thread), the final one written by the slots that had rows.
// hist (the verify program's `history`, else null): [rows, W, C], the window after each active row.

typedef unsigned int u32;
#define FULL_MASK 0xffffffffu

// silu(x) = x / (1 + exp(-x)) with a branch-free division (IEEE division's slow-path branch would cut
// the 8-row groups into one basic block per row, serialising their exp / divide chains): the
// reciprocal refined by one Newton step, then the quotient corrected once by its residual (the
// correctly rounded quotient but in rare ties, against IEEE division: within an ulp). exp's argument
// is clamped at 88 (x < -88: x / (1 + e^88), some 1e-37, where NumPy gives -0).
__device__ __forceinline__ float silu_nb(float x) {
  const float d = 1.0f + expf(fminf(-x, 88.0f));
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = fmaf(fmaf(-d, r, 1.0f), r, r);
  const float q = x * r;
  return fmaf(fmaf(-q, d, x), r, q);
}

template <int K, int DIL = 1>
__global__ void __launch_bounds__(64) causal_conv1d_k(const float *x, float *out, const int *__restrict__ pos,
                                                       const int *__restrict__ slot, const float *__restrict__ w,
                                                       float *__restrict__ state, float *__restrict__ hist,
                                                       int rows, int nslots, int C) {
  static_assert(K >= 2 && DIL >= 1, "kernel >= 2, dilation >= 1");
  constexpr int W = (K - 1) * DIL;                       // the window's length
  const int lane = threadIdx.x & 31, s = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (blockIdx.x * blockDim.x + (threadIdx.x & ~31) >= C) return;      // whole warps only (ballots below)
  const bool on = c < C;
  float wt[K], win[W];
  float *st = state + (size_t)s * W * C + c;
#pragma unroll
  for (int j = 0; j < K; j++) wt[j] = on ? w[(size_t)c * K + j] : 0.f;
#pragma unroll
  for (int j = 0; j < W; j++) win[j] = on ? st[(size_t)j * C] : 0.f;
  bool any = false;                                     // the slot had rows: its window is written back

  // a tile of 32 rows at t0: its rows of this slot (m), each lane's row position (pt), their inputs
  auto fetch = [&](int t0, float (&xv)[32], u32 &m, int &pt) {
    const int r = t0 + lane;
    int pr = -1, sr = -1;
    if (r < rows) { pr = pos[r]; sr = slot[r]; }
    const bool live = pr >= 0 && sr >= 0 && sr < nslots;
    m = __ballot_sync(FULL_MASK, live && sr == s);
    const u32 dead = __ballot_sync(FULL_MASK, r < rows && !live && r % nslots == s);
    pt = pr;
#pragma unroll
    for (int u = 0; u < 32; u++)
      if ((dead >> u) & 1u) { if (on) out[(size_t)(t0 + u) * C + c] = 0.f; }
#pragma unroll
    for (int u = 0; u < 32; u++) xv[u] = ((m >> u) & 1u) && on ? x[(size_t)(t0 + u) * C + c] : 0.f;
  };
  auto tile = [&](int t0, const float (&xc)[32], u32 m, int pt) {
    any |= m != 0;
#pragma unroll
    for (int g = 0; g < 32; g += 8) {
      if (!((m >> g) & 0xffu)) continue;                 // warp-uniform
#pragma unroll
      for (int u = g; u < g + 8; u++) {
        const bool take = (m >> u) & 1u;
        const bool reset = take && __shfl_sync(FULL_MASK, pt, u) == 0;
        float wz[W];
#pragma unroll
        for (int j = 0; j < W; j++) wz[j] = reset ? 0.f : win[j];
        float acc = __fmul_rn(wz[0], wt[0]);           // tap j reads u[t - (K-1-j)*DIL] = win[j*DIL]
#pragma unroll
        for (int j = 1; j < K - 1; j++) acc = __fadd_rn(acc, __fmul_rn(wz[j * DIL], wt[j]));
        acc = __fadd_rn(acc, __fmul_rn(xc[u], wt[K - 1]));
        if (take && on) out[(size_t)(t0 + u) * C + c] = silu_nb(acc);
#pragma unroll
        for (int j = 0; j < W - 1; j++) win[j] = take ? wz[j + 1] : win[j];
        win[W - 1] = take ? xc[u] : win[W - 1];
        if (hist && take && on) {                        // the verify program: the window after row t0 + u
#pragma unroll
          for (int j = 0; j < W; j++) hist[((size_t)(t0 + u) * W + j) * C + c] = win[j];
        }
      }
    }
  };
  // two tiles' buffers, alternating: the next tile's loads are in flight while this one is computed
  float xa[32], xb[32];
  u32 ma, mb;
  int pa, pb;
  fetch(0, xa, ma, pa);
  for (int t0 = 0; t0 < rows; t0 += 64) {
    if (t0 + 32 < rows) fetch(t0 + 32, xb, mb, pb);
    tile(t0, xa, ma, pa);
    if (t0 + 32 >= rows) break;
    if (t0 + 64 < rows) fetch(t0 + 64, xa, ma, pa);
    tile(t0 + 32, xb, mb, pb);
  }
  if (any && on) {
#pragma unroll
    for (int j = 0; j < W; j++) st[(size_t)j * C] = win[j];
  }
}
