// qsa_index: the contract of runtime/ops/qsa_index.py (qwen4_exp's QSA indexer): every active row writes
// its raw key at cache[slot, pos]; a row at position p then scores the nb = (p+1) / R complete blocks of R
// cached keys of its slot,
//     kb_b    = rope(rmsnorm(mean_j cache[slot, b*R + j]) * (offset + k_norm), position b*R)
//     score_b = sum_h relu(q_h . kb_b) / sqrt(Di)
// keeps the top = budget / R best blocks (ties: the lower block; all of them when nb <= top) and the tail
// positions nb*R .. p, and writes them ascending into sel[row, 0..W) (W = budget + R - 1), -1 padded.
// A row is active when its position is >= 0 and its slot in [0, slots) (positions past the cache read as
// ctx - 1); an inactive row writes no key and gets all -1.
//
// Four launches, all reading positions and slots from device memory (one captured graph serves every
// step) and sized by the bound shapes (ctx, rows), never by the step's lengths:
//   qsa_write_k   grid (rows): the keys into the cache.
//   qsa_pool_k    grid (GX, slots), 8 warps: every block key kb_b of a slot up to its last row's position
//                 (scratch [slots, ctx / R, Di]), a warp per block: the mean of its R keys summed in
//                 order then divided by R (NumPy's mean, bit for bit), the RMS norm (the sum of squares
//                 a warp reduction: NumPy's is pairwise), the rope of the first RD values (rope_k's
//                 arithmetic: angle float(b*R) * inv_freq[i], sincosf).
//   qsa_score_k   grid (GX, rows), a thread per block: the scores (scratch [rows, ctx / R]); each dot an
//                 FMA chain over d (NumPy's matmul order is BLAS's), relu, the heads summed in order.
//   qsa_select_k  grid (rows), 256 threads: a fixed-size top-k: a radix select (4 passes of 8 bits) of the
//                 top-th largest score, as an order-preserving u32 key, then one ordered pass taking the
//                 keys above it and, of the keys equal to it, the lowest blocks (block-wide prefix sums).

typedef unsigned int u32;
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ bool qsa_live(int p, int s, int nslots) { return p >= 0 && s >= 0 && s < nslots; }

__global__ void qsa_write_k(const float *__restrict__ k, const int *__restrict__ pos, const int *__restrict__ slot,
                            float *__restrict__ cache, int Di, int ctx, int nslots) {
  const int r = blockIdx.x, p = pos[r], s = slot[r];
  if (!qsa_live(p, s, nslots) || p >= ctx) return;
  float *dst = cache + ((size_t)s * ctx + p) * Di;
  for (int i = threadIdx.x; i < Di; i += blockDim.x) dst[i] = k[(size_t)r * Di + i];
}

// kb[s, b, :] for b < (the slot's largest active position + 1) / R. Dynamic shared memory: Di floats a warp.
template <int DPL>
__global__ void __launch_bounds__(256) qsa_pool_k(const float *__restrict__ cache, const int *__restrict__ pos,
    const int *__restrict__ slot, const float *__restrict__ wk, const float *__restrict__ invf,
    float *__restrict__ kb, int rows, int nslots, int ctx, int Di, int R, int RD, float eps) {
  extern __shared__ float ys[];
  __shared__ int smax;
  const int s = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (threadIdx.x == 0) smax = -1;
  __syncthreads();
  int m = -1;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int p = pos[r];
    if (p >= 0 && slot[r] == s) m = max(m, min(p, ctx - 1));
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) m = max(m, __shfl_xor_sync(FULL_MASK, m, o));
  if (lane == 0 && m >= 0) atomicMax(&smax, m);
  __syncthreads();
  const int nb = (smax + 1) / R, nbmax = ctx / R, half = RD / 2;
  const float *C = cache + (size_t)s * ctx * Di;
  float *out = kb + (size_t)s * nbmax * Di;
  float *y = ys + w * Di;
  for (int b = blockIdx.x * nw + w; b < nb; b += gridDim.x * nw) {
    float v[DPL], ss = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      const int d = lane + 32 * i;
      float a = 0.f;
      if (d < Di) {
        const float *c = C + (size_t)b * R * Di + d;
        a = c[0];
        for (int j = 1; j < R; j++) a = __fadd_rn(a, c[(size_t)j * Di]);
        a = a / (float)R;
      }
      v[i] = a;
      ss = __fadd_rn(ss, __fmul_rn(a, a));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    const float inv = 1.0f / sqrtf(ss / (float)Di + eps);
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      const int d = lane + 32 * i;
      if (d < Di) y[d] = __fmul_rn(__fmul_rn(v[i], inv), wk[d]);
    }
    __syncwarp();
    const float pb = (float)(b * R);
    float *ob = out + (size_t)b * Di;
    for (int f = lane; f < half; f += 32) {              // the rotated pairs (f, f + RD/2)
      float sn, cs;
      sincosf(__fmul_rn(pb, invf[f]), &sn, &cs);
      const float x1 = y[f], x2 = y[f + half];
      ob[f] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
      ob[f + half] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
    }
    for (int d = RD + lane; d < Di; d += 32) ob[d] = y[d];   // the pass-through values
    __syncwarp();                                        // y is rewritten by the warp's next block
  }
}

// scores[r, b] for b < (p+1) / R. Dynamic shared memory: the row's H * Di query values. Di % 4 == 0.
__global__ void __launch_bounds__(256) qsa_score_k(const float *__restrict__ q, const float *__restrict__ kb,
    const int *__restrict__ pos, const int *__restrict__ slot, float *__restrict__ scores, int nslots, int ctx,
    int H, int Di, int R, float rsd) {
  extern __shared__ float qs[];
  const int r = blockIdx.y, p = pos[r], s = slot[r];
  if (!qsa_live(p, s, nslots)) return;
  const int nb = (min(p, ctx - 1) + 1) / R, nbmax = ctx / R;
  if (blockIdx.x * blockDim.x >= nb) return;             // uniform over the block
  for (int i = threadIdx.x; i < H * Di; i += blockDim.x) qs[i] = q[(size_t)r * H * Di + i];
  __syncthreads();
  const float *K = kb + (size_t)s * nbmax * Di;
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += gridDim.x * blockDim.x) {
    const float *kr = K + (size_t)b * Di;
    float sc = 0.f;                                      // +0: an all-relu-zero score is +0, never -0
    for (int h0 = 0; h0 < H; h0 += 8) {
      float a[8];
#pragma unroll
      for (int u = 0; u < 8; u++) a[u] = 0.f;
      for (int d = 0; d < Di; d += 4) {
        const float4 kv = *reinterpret_cast<const float4 *>(kr + d);
#pragma unroll
        for (int u = 0; u < 8; u++) {
          if (h0 + u < H) {
            const float *qh = qs + (h0 + u) * Di + d;
            a[u] = fmaf(qh[0], kv.x, a[u]); a[u] = fmaf(qh[1], kv.y, a[u]);
            a[u] = fmaf(qh[2], kv.z, a[u]); a[u] = fmaf(qh[3], kv.w, a[u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 8; u++)
        if (h0 + u < H) sc = __fadd_rn(sc, fmaxf(a[u], 0.f));
    }
    scores[(size_t)r * nbmax + b] = sc / rsd;
  }
}

// An order-preserving key of a float: a < b iff key(a) < key(b) (-0 < +0; the scores are never -0).
__device__ __forceinline__ u32 okey(float f) {
  const u32 u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// block-wide exclusive prefix sum (blockDim.x a multiple of 32; sh: 32 ints); *total: the block's sum.
// Ends with a barrier, so sh may be reused at once.
__device__ __forceinline__ int qsa_scan(int v, int *sh, int *total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) { const int y = __shfl_up_sync(FULL_MASK, x, o); if (lane >= o) x += y; }
  if (lane == 31) sh[w] = x;
  __syncthreads();
  int before = 0, all = 0;
  for (int i = 0; i < nw; i++) { const int t = sh[i]; before += i < w ? t : 0; all += t; }
  __syncthreads();
  *total = all;
  return before + x - v;
}

// sel[r, 0..W) from scores[r, 0..nb). blockDim.x == 256 (one histogram bin a thread).
__global__ void __launch_bounds__(256) qsa_select_k(const float *__restrict__ scores, const int *__restrict__ pos,
    const int *__restrict__ slot, int *__restrict__ sel, int nslots, int ctx, int R, int top, int W) {
  __shared__ u32 hist[256];
  __shared__ int sh[32];
  __shared__ u32 s_digit;
  __shared__ int s_rem;
  const int r = blockIdx.x, p = pos[r], s = slot[r], tid = threadIdx.x;
  int *o = sel + (size_t)r * W;
  if (!qsa_live(p, s, nslots)) {
    for (int j = tid; j < W; j += blockDim.x) o[j] = -1;
    return;
  }
  const int pe = min(p, ctx - 1), nb = (pe + 1) / R, nbmax = ctx / R;
  if (nb <= top) {                                       // every visible position
    for (int j = tid; j < W; j += blockDim.x) o[j] = j <= pe ? j : -1;
    return;
  }
  const float *sc = scores + (size_t)r * nbmax;
  if (top > 0) {
    u32 prefix = 0u, mask = 0u;
    int rem = top;                                       // blocks still to take at or below the prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[tid] = 0u;
      __syncthreads();
      for (int i = tid; i < nb; i += blockDim.x) {
        const u32 u = okey(sc[i]);
        if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      const int h = (int)hist[255 - tid];                // digits from the top: thread t holds digit 255 - t
      int tot;
      const int above = qsa_scan(h, sh, &tot);           // keys (under the prefix) with a larger digit
      if (above < rem && above + h >= rem) { s_digit = 255u - tid; s_rem = rem - above; }
      __syncthreads();
      prefix |= s_digit << shift;
      mask |= 0xffu << shift;
      rem = s_rem;
    }
    // prefix: the top-th largest key; take the keys above it and the first rem keys equal to it
    int ceq = 0, csel = 0;
    for (int b0 = 0; b0 < nb; b0 += blockDim.x) {
      const int i = b0 + tid;
      const u32 u = i < nb ? okey(sc[i]) : 0u;
      const bool eq = i < nb && u == prefix, gt = i < nb && u > prefix;
      int te, ts;
      const int er = qsa_scan(eq, sh, &te);
      const bool take = gt || (eq && ceq + er < rem);
      const int at = csel + qsa_scan(take, sh, &ts);
      if (take)
        for (int j = 0; j < R; j++) o[at * R + j] = i * R + j;
      ceq += te;
      csel += ts;
    }
  }
  const int t0 = nb * R, nt = pe + 1 - t0, k0 = top * R;
  for (int j = k0 + tid; j < W; j += blockDim.x) o[j] = j - k0 < nt ? t0 + (j - k0) : -1;
}
