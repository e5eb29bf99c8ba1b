// dsa_index: glm5_next's DSA indexer selection with k-pool compression, the contract of
// runtime/ops/dsa_index.py (float32). Four kernels, launched in order (each reads what the one
// before wrote; every position, slot and count is read from device memory, so one captured graph
// serves every step):
//
//   dsa_write_k  (grid rows, 128 threads): each active row writes k | gs at cache[slot, pos].
//   dsa_pool_k   (grid (up to 256, slots), 256 threads, blocks striding over 8 pools at a time): the
//                pooled keys of every complete pool of each slot up to its longest row, into
//                pk [slots, NP, Di] (NP = ctx / kpool):
//                    pk_p = sum_j softmax_j(gs[p*kpool + j] + ape[j]) * k[p*kpool + j]   (per channel)
//                the softmax's max subtracted, its sum and the weighted sum sequential in j, every
//                product and quotient rounded (NumPy's order; exp is CUDA's expf).
//   dsa_score_k  (grid (pool blocks of 256, rows), 256 threads, a thread per pool):
//                    score_p = sum_h (hw_h * Hi^-0.5) * relu((q_h . pk_p) * Di^-0.5)
//                the head sum sequential in h (NumPy's einsum), the dots FMA chains (not NumPy's BLAS
//                order), into scores [rows, NP], for the pools the row sees ((t+1) // kpool at t).
//   dsa_topk_k   (grid rows, 512 threads): the min(top, npool) best pools (ties: the lower pool), by
//                a radix select on the scores' order-preserving 32-bit keys (4 passes of 8 bits) and
//                an ordered scan, written as their positions in ascending order, then (tail) the
//                (t+1) % kpool positions after the last complete pool, then -1 up to W.
//
// A row with a negative position (or a slot outside [0, slots), or a position >= ctx) is inactive:
// no cache write, sel all -1. -0 and +0 are one key (a tie, like NumPy's argsort).

typedef unsigned int u32;
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ bool dsa_live(int p, int s, int nslots, int ctx) {
  return p >= 0 && p < ctx && s >= 0 && s < nslots;
}

__global__ void dsa_write_k(const float *__restrict__ k, const float *__restrict__ gs, const int *__restrict__ pos,
                            const int *__restrict__ slot, float *__restrict__ cache, int nslots, int ctx, int Di) {
  const int r = blockIdx.x, p = pos[r], s = slot[r];
  if (!dsa_live(p, s, nslots, ctx)) return;
  float *dst = cache + ((size_t)s * ctx + p) * 2 * Di;
  for (int c = threadIdx.x; c < 2 * Di; c += blockDim.x)
    dst[c] = c < Di ? k[(size_t)r * Di + c] : gs[(size_t)r * Di + c - Di];
}

#define POOLS_PER_BLOCK 8

__global__ void __launch_bounds__(256) dsa_pool_k(const float *__restrict__ cache, const int *__restrict__ pos,
                                                  const int *__restrict__ slot, const float *__restrict__ ape,
                                                  float *__restrict__ pk, int rows, int nslots, int ctx, int Di,
                                                  int kpool, int NP) {
  __shared__ int last;
  const int s = blockIdx.y;
  if (threadIdx.x == 0) last = -1;
  __syncthreads();
  int mine = -1;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int p = pos[r], sr = slot[r];
    if (sr == s && dsa_live(p, sr, nslots, ctx)) mine = max(mine, p);
  }
  if (mine >= 0) atomicMax(&last, mine);
  __syncthreads();
  const int npool = (last + 1) / kpool;
  const float *cs = cache + (size_t)s * ctx * 2 * Di;
  const size_t RW = (size_t)2 * Di;                         // a cached position: k | gs
  for (int p0 = blockIdx.x * POOLS_PER_BLOCK; p0 < npool; p0 += gridDim.x * POOLS_PER_BLOCK) {
    for (int idx = threadIdx.x; idx < POOLS_PER_BLOCK * Di; idx += blockDim.x) {
      const int p = p0 + idx / Di, c = idx % Di;
      if (p >= npool) break;
      const float *base = cs + (size_t)p * kpool * RW;
      auto logit = [&](int j) { return __fadd_rn(base[j * RW + Di + c], ape[j * Di + c]); };   // gs + ape
      float m = NEG_INF;
      for (int j = 0; j < kpool; j++) m = fmaxf(m, logit(j));
      float sum = 0.f;
      for (int j = 0; j < kpool; j++) sum = __fadd_rn(sum, expf(__fsub_rn(logit(j), m)));
      float acc = 0.f;
      for (int j = 0; j < kpool; j++)
        acc = __fadd_rn(acc, __fmul_rn(__fdiv_rn(expf(__fsub_rn(logit(j), m)), sum), base[j * RW + c]));
      pk[((size_t)s * NP + p) * Di + c] = acc;
    }
  }
}

#define SCORE_THREADS 256
#define HEAD_CHUNK 8

// dynamic shared memory: Hi * Di + Hi floats (q of the row, then hw * Hi^-0.5)
__global__ void dsa_score_k(const float *__restrict__ q, const float *__restrict__ hw,
                            const int *__restrict__ pos, const int *__restrict__ slot,
                            const float *__restrict__ pk, float *__restrict__ scores,
                            int nslots, int ctx, int Hi, int Di, int kpool, int NP,
                            float hsc, float dsc) {
  extern __shared__ float smem[];
  const int r = blockIdx.y, t = pos[r], s = slot[r];
  if (!dsa_live(t, s, nslots, ctx)) return;
  const int npool = (t + 1) / kpool, p0 = blockIdx.x * SCORE_THREADS;
  if (p0 >= npool) return;
  float *Qs = smem, *Ws = smem + Hi * Di;
  for (int i = threadIdx.x; i < Hi * Di; i += blockDim.x) Qs[i] = q[(size_t)r * Hi * Di + i];
  for (int i = threadIdx.x; i < Hi; i += blockDim.x) Ws[i] = __fmul_rn(hw[(size_t)r * Hi + i], hsc);
  __syncthreads();
  const int p = p0 + threadIdx.x;
  if (p >= npool) return;
  const float *kp = pk + ((size_t)s * NP + p) * Di;
  float score = 0.f;
  for (int h0 = 0; h0 < Hi; h0 += HEAD_CHUNK) {
    float acc[HEAD_CHUNK];
#pragma unroll
    for (int u = 0; u < HEAD_CHUNK; u++) acc[u] = 0.f;
    for (int c = 0; c < Di; c += 4) {
      const float4 kv = *reinterpret_cast<const float4 *>(kp + c);
#pragma unroll
      for (int u = 0; u < HEAD_CHUNK; u++) {
        if (h0 + u < Hi) {
          const float *qh = Qs + (h0 + u) * Di + c;
          acc[u] = fmaf(qh[0], kv.x, acc[u]);
          acc[u] = fmaf(qh[1], kv.y, acc[u]);
          acc[u] = fmaf(qh[2], kv.z, acc[u]);
          acc[u] = fmaf(qh[3], kv.w, acc[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < HEAD_CHUNK; u++) {
      const int h = h0 + u;
      if (h < Hi) {
        const float term = __fmul_rn(Ws[h], fmaxf(__fmul_rn(acc[u], dsc), 0.f));
        score = h == 0 ? term : __fadd_rn(score, term);
      }
    }
  }
  scores[(size_t)r * NP + p] = score;
}

#define TOPK_THREADS 512

// the order-preserving key of a score (larger score, larger key; -0 and +0 one key)
__device__ __forceinline__ u32 dsa_key(float v) {
  const u32 u = __float_as_uint(__fadd_rn(v, 0.0f));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exclusive prefix sum of v over the block (blockDim TOPK_THREADS) in thread order; *total gets the sum.
// sh: 32 ints. Every thread of the block must call it.
__device__ __forceinline__ int dsa_scan(int v, int *sh, int *total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();                                          // sh free
  if (lane == 31) sh[w] = x;
  __syncthreads();
  int before = 0, all = 0;
  for (int i = 0; i < nw; i++) {
    const int t = sh[i];
    if (i < w) before += t;
    all += t;
  }
  *total = all;
  return before + x - v;
}

__global__ void dsa_topk_k(const float *__restrict__ scores, const int *__restrict__ pos,
                           const int *__restrict__ slot, int *__restrict__ sel,
                           int nslots, int ctx, int NP, int kpool, int top, int W,
                           int tail) {
  __shared__ u32 hist[256];
  __shared__ int sh[32];
  __shared__ u32 s_prefix;
  __shared__ int s_rem;
  const int r = blockIdx.x, t = pos[r], s = slot[r], tid = threadIdx.x;
  int *out = sel + (size_t)r * W;
  if (!dsa_live(t, s, nslots, ctx)) {
    for (int i = tid; i < W; i += blockDim.x) out[i] = -1;
    return;
  }
  const int npool = (t + 1) / kpool, K = min(top, npool);
  const float *sc = scores + (size_t)r * NP;
  if (K == npool) {                                         // every complete pool: positions 0 .. npool*kpool - 1
    for (int i = tid; i < npool * kpool; i += blockDim.x) out[i] = i;
  } else if (K > 0) {
    // radix select of the K-th largest key T, 8 bits at a time from the top; rem: how many keys equal
    // to T are taken (the lowest pools)
    u32 prefix = 0, mask = 0;
    int rem = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
      __syncthreads();
      for (int p = tid; p < npool; p += blockDim.x) {
        const u32 key = dsa_key(sc[p]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (tid < 32) {                                       // lane l: bins 255 - 8l down to 248 - 8l
        u32 local = 0;
#pragma unroll
        for (int b = 0; b < 8; b++) local += hist[255 - 8 * tid - b];
        u32 inc = local;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const u32 y = __shfl_up_sync(FULL_MASK, inc, o);
          if (tid >= o) inc += y;
        }
        const u32 before = inc - local;                     // keys in higher bins than this lane's
        if (before < (u32)rem && (u32)rem <= inc) {         // exactly one lane
          u32 cum = before;
          for (int b = 0; b < 8; b++) {
            const int bin = 255 - 8 * tid - b;
            if (cum + hist[bin] >= (u32)rem) {
              s_prefix = prefix | ((u32)bin << shift);
              s_rem = rem - (int)cum;
              break;
            }
            cum += hist[bin];
          }
        }
      }
      __syncthreads();
      prefix = s_prefix;
      rem = s_rem;
      mask |= 255u << shift;
    }
    // the chosen pools in ascending order: every key > T, and the first rem keys == T
    int eq_seen = 0, taken = 0;
    for (int p0 = 0; p0 < npool; p0 += blockDim.x) {
      const int p = p0 + tid;
      const u32 key = p < npool ? dsa_key(sc[p]) : 0u;
      const bool in = p < npool;
      const int eq = in && key == prefix, gt = in && key > prefix;
      int n_eq, n_take;
      const int eq_rank = eq_seen + dsa_scan(eq, sh, &n_eq);
      const int take = gt || (eq && eq_rank < rem);
      const int at = taken + dsa_scan(take, sh, &n_take);
      if (take)
        for (int j = 0; j < kpool; j++) out[at * kpool + j] = p * kpool + j;
      eq_seen += n_eq;
      taken += n_take;
    }
  }
  int n = K * kpool;
  if (tail) {
    const int from = npool * kpool, cnt = t + 1 - from;
    for (int i = tid; i < cnt; i += blockDim.x) out[n + i] = from + i;
    n += cnt;
  }
  for (int i = n + tid; i < W; i += blockDim.x) out[i] = -1;
}
