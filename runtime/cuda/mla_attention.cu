// mla_attention: glm5_next's multi-head latent attention over a cache of the latent (NoPE), the
// contract of runtime/ops/mla_attention.py, absorbed (exact: there is no rope), float32. kv_b is
// float32 [H * (dn + dv), R] (the stored weight decoded once, pre_quant_scale applied): per head h,
// rows h*(dn+dv) .. are W_uk,h [dn, R], then W_uv,h [dv, R]. Four kernels, launched in order:
//
//   mla_write_k   (grid rows, 128 threads): each active row writes its latent c at cache[slot, pos].
//   mla_absorb_k  (grid (R / 128, H, row blocks of 8), 128 threads, a thread per latent column):
//                     qa[r, h, :] = W_uk,h^T q[r, h]                 (FMA chains over dn)
//                 the weight read once per 8 rows.
//   mla_attend_k  (grid (H / HG, rows), HG warps, a warp per head): over the row's candidates (sel's
//                 entries, or positions 0 .. pos without sel), those u with 0 <= u <= pos, in tiles of
//                 32 positions staged in shared memory (each tile read once for the HG heads):
//                     s_u = (qa . cache[u]) * scale;  p = softmax_u(s);  ctx[r, h, :] = sum_u p_u cache[u]
//                 an online softmax (running max and sum), so not NumPy's rounding order. An empty
//                 selection gives ctx = 0.
//   mla_out_k     (grid (H, row blocks of 8), 256 threads, a warp per output column):
//                     out[r, h*dv + j] = W_uv,h[j] . ctx[r, h]        (the weight row read once per 8 rows)
//
// A row with a negative position (or a slot outside [0, slots), or a position >= ctx) is inactive: no
// cache write, zeros out. sel's entries are taken as dsa_index writes them (distinct positions, -1
// padded; an entry repeated would count twice here, once in the NumPy op).

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000u)
#define ROW_BLOCK 8

__device__ __forceinline__ bool mla_live(int p, int s, int nslots, int ctx) {
  return p >= 0 && p < ctx && s >= 0 && s < nslots;
}

__global__ void mla_write_k(const float *__restrict__ c, const int *__restrict__ pos, const int *__restrict__ slot,
                            float *__restrict__ cache, int nslots, int ctx, int R) {
  const int r = blockIdx.x, p = pos[r], s = slot[r];
  if (!mla_live(p, s, nslots, ctx)) return;
  float *dst = cache + ((size_t)s * ctx + p) * R;
  for (int i = threadIdx.x; i < R; i += blockDim.x) dst[i] = c[(size_t)r * R + i];
}

// dynamic shared memory: ROW_BLOCK * dn floats
__global__ void __launch_bounds__(128) mla_absorb_k(const float *__restrict__ q, const float *__restrict__ wkv,
                                                    const int *__restrict__ pos, float *__restrict__ qa, int rows,
                                                    int H, int dn, int dv, int R) {
  extern __shared__ float qs[];
  const int h = blockIdx.y, r0 = blockIdx.z * ROW_BLOCK, col = blockIdx.x * blockDim.x + threadIdx.x;
  const int nr = min(ROW_BLOCK, rows - r0);
  for (int i = threadIdx.x; i < ROW_BLOCK * dn; i += blockDim.x) {
    const int rb = i / dn, d = i % dn;
    qs[i] = rb < nr && pos[r0 + rb] >= 0 ? q[((size_t)(r0 + rb) * H + h) * dn + d] : 0.f;
  }
  __syncthreads();
  if (col >= R) return;
  const float *w = wkv + (size_t)h * (dn + dv) * R + col;
  float acc[ROW_BLOCK];
#pragma unroll
  for (int rb = 0; rb < ROW_BLOCK; rb++) acc[rb] = 0.f;
  for (int d = 0; d < dn; d++) {
    const float wv = w[(size_t)d * R];
#pragma unroll
    for (int rb = 0; rb < ROW_BLOCK; rb++) acc[rb] = fmaf(qs[rb * dn + d], wv, acc[rb]);
  }
  for (int rb = 0; rb < nr; rb++) qa[((size_t)(r0 + rb) * H + h) * R + col] = acc[rb];
}

#define TILE 32

// RPL latent values per lane (R <= 32 * RPL); dynamic shared memory: TILE * (R + 1) + HG * R floats + TILE ints
template <int RPL>
__global__ void mla_attend_k(const float *__restrict__ qa, const float *__restrict__ cache, const int *__restrict__ pos,
                             const int *__restrict__ slot, const int *__restrict__ sel, float *__restrict__ ctxo,
                             int nslots, int ctx, int H, int R, int W, int has_sel, float scale) {
  extern __shared__ float sm[];
  const int HG = blockDim.x >> 5, lane = threadIdx.x & 31, w = threadIdx.x >> 5, tid = threadIdx.x;
  const int r = blockIdx.y, h = blockIdx.x * HG + w, p = pos[r], s = slot[r];
  const int RS = R + 1;
  float *Cs = sm, *Qs = sm + TILE * RS;
  int *idx = reinterpret_cast<int *>(Qs + HG * R);
  float *o = ctxo + ((size_t)r * H + h) * R;
  if (!mla_live(p, s, nslots, ctx)) {
    for (int k = lane; k < R; k += 32) o[k] = 0.f;
    return;
  }
  for (int i = tid; i < HG * R; i += blockDim.x) Qs[i] = qa[((size_t)r * H + blockIdx.x * HG) * R + i];
  const float *cs = cache + (size_t)s * ctx * R;
  const int n = has_sel ? W : p + 1;
  float m = NEG_INF, l = 0.f, acc[RPL];
#pragma unroll
  for (int i = 0; i < RPL; i++) acc[i] = 0.f;
  const float *qh = Qs + w * R;
  for (int t0 = 0; t0 < n; t0 += TILE) {
    int u = -1;
    if (tid < TILE && t0 + tid < n) {
      u = has_sel ? sel[(size_t)r * W + t0 + tid] : t0 + tid;
      if (u < 0 || u > p) u = -1;
    }
    if (tid < TILE) idx[tid] = u;
    if (!__syncthreads_or(u >= 0)) continue;               // no candidate in this tile (block-uniform)
    for (int e = tid; e < TILE * R; e += blockDim.x) {
      const int tt = e / R, kk = e - tt * R, uu = idx[tt];
      Cs[tt * RS + kk] = uu >= 0 ? cs[(size_t)uu * R + kk] : 0.f;
    }
    __syncthreads();
    const bool valid = idx[lane] >= 0;
    float sc = NEG_INF;
    if (valid) {
      const float *cr = Cs + lane * RS;
      float dot = 0.f;
      for (int k = 0; k < R; k++) dot = fmaf(qh[k], cr[k], dot);
      sc = __fmul_rn(dot, scale);
    }
    float mt = sc;
#pragma unroll
    for (int off = 16; off; off >>= 1) mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, off));
    const float mn = fmaxf(m, mt);                          // finite: the tile has a valid candidate
    const float corr = expf(m - mn);                        // 0 at the first tile (m = -inf)
    const float pe = valid ? expf(sc - mn) : 0.f;
    float ps = pe;
#pragma unroll
    for (int off = 16; off; off >>= 1) ps += __shfl_xor_sync(FULL_MASK, ps, off);
    l = fmaf(l, corr, ps);
#pragma unroll
    for (int i = 0; i < RPL; i++) acc[i] *= corr;
    for (int tt = 0; tt < TILE; tt++) {
      const float pt = __shfl_sync(FULL_MASK, pe, tt);
      if (pt == 0.f) continue;                              // warp-uniform
      const float *cr = Cs + tt * RS;
#pragma unroll
      for (int i = 0; i < RPL; i++) {
        const int k = lane + 32 * i;
        if (k < R) acc[i] = fmaf(pt, cr[k], acc[i]);
      }
    }
    m = mn;
    __syncthreads();                                        // Cs and idx are rewritten by the next tile
  }
#pragma unroll
  for (int i = 0; i < RPL; i++) {
    const int k = lane + 32 * i;
    if (k < R) o[k] = l > 0.f ? __fdiv_rn(acc[i], l) : 0.f;
  }
}

// dynamic shared memory: ROW_BLOCK * R floats
__global__ void __launch_bounds__(256) mla_out_k(const float *__restrict__ ctxb, const float *__restrict__ wkv,
                                                 const int *__restrict__ pos, float *__restrict__ out, int rows,
                                                 int H, int dn, int dv, int R) {
  extern __shared__ float cs[];
  const int h = blockIdx.x, r0 = blockIdx.y * ROW_BLOCK, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int nw = blockDim.x >> 5, nr = min(ROW_BLOCK, rows - r0);
  for (int i = threadIdx.x; i < ROW_BLOCK * R; i += blockDim.x) {
    const int rb = i / R, k = i % R;
    cs[i] = rb < nr ? ctxb[((size_t)(r0 + rb) * H + h) * R + k] : 0.f;
  }
  __syncthreads();
  for (int j = w; j < dv; j += nw) {
    const float *wr = wkv + ((size_t)h * (dn + dv) + dn + j) * R;
    float acc[ROW_BLOCK];
#pragma unroll
    for (int rb = 0; rb < ROW_BLOCK; rb++) acc[rb] = 0.f;
    for (int k = lane; k < R; k += 32) {
      const float wv = wr[k];
#pragma unroll
      for (int rb = 0; rb < ROW_BLOCK; rb++) acc[rb] = fmaf(cs[rb * R + k], wv, acc[rb]);
    }
#pragma unroll
    for (int rb = 0; rb < ROW_BLOCK; rb++)
#pragma unroll
      for (int off = 16; off; off >>= 1) acc[rb] += __shfl_xor_sync(FULL_MASK, acc[rb], off);
    if (lane == 0)
      for (int rb = 0; rb < nr; rb++) out[((size_t)(r0 + rb) * H + h) * dv + j] = pos[r0 + rb] >= 0 ? acc[rb] : 0.f;
  }
}
