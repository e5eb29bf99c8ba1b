// Prompt-chunk attention on the tensor cores (binding: runtime/cuda/attention_chunk.py; the contract:
// runtime/ops/attention.py without `select`, as ops_src.py attn_chunk_k implements it on the CUDA cores).
// A CTA takes one (kv head, block of RB = 64 / G rows of one slot): its 64 query vectors (RB rows x the G
// query heads of the kv head; warp w the vectors 16 w .. 16 w + 15) walk the slot's cache in tiles of BN
// keys staged once in shared memory for all of them, flash-attention style (online softmax per vector,
// the scores and probabilities never leave registers).
//
// mma.sync m16n8k16, bf16 operands, float32 accumulation. Every float32 operand is split into two bf16
// parts (x = x0 + x1, x0 = bf16(x), x1 = bf16(x - x0): 16 significant bits), and the products kept are
// those above 2^-16 of the result: Q K^T = q0 k0 + q1 k0 + q0 k1, P V = p0 v0 + p1 v0 + p0 v1 (a bf16
// cache's values are exact in one part: its k1 / v1 products are not made; an f16 value is exact in two).
// So a score is float32 sums of products exact to ~2^-17 relative: the precision class of the prompt
// GEMM's bf16x2 mode, not float32's (tests/test_cuda_attention_chunk.py bounds it against float64).
//
//   A of Q K^T: the query parts, staged once [2][64][RS] (ldmatrix); B: the key parts [NK][BN][RS];
//   A of P V: the probabilities, split in registers from the score fragments; B: the value parts
//   [NV][BN][RS] (ldmatrix.trans). RS = D + 8 16-bit values: rows of an odd number of 16-byte words, so
//   ldmatrix reads them without bank conflicts.
//
// Tiles are staged through registers: each thread loads its share of the tile's keys and values as the
// cache stores them (16 or 8 bytes a load), splits them and stores the parts; with PF the next tile's raw
// words are loaded before this tile is computed. Keys past the CTA's last position are zeros (and masked:
// a key t counts for a query vector when t <= its row's position). A row with pos < 0 gives zeros; a row
// of another slot than the CTA's first active row gets NaN (the chunk kernel's contract), never its keys.

#include "numerics.cuh"
#include "pdl.cuh"

#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ void grid_dep_entry() { grid_dep_launch(); grid_dep_wait(); }

// (x0, x1) as two packed bf16 pairs: part 0 the rounding of x, part 1 of what part 0 leaves
__device__ __forceinline__ void split2(float x0, float x1, unsigned &p0, unsigned &p1) {
  p0 = bf16x2_rn(x0, x1);
  p1 = bf16x2_rn(x0 - bflo(p0), x1 - bfhi(p0));
}


__device__ __forceinline__ float f16f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
// four cache values stored as their parts: part 0 at dst[0..3], part 1 (CT != 1) at dst1[0..3]
template <int CT> __device__ __forceinline__ void store_parts(const Raw4<CT> &r, unsigned short *dst0, unsigned short *dst1) {
  if constexpr (CT == 1) {
    *reinterpret_cast<uint2 *>(dst0) = r.w;                       // bf16: exact in one part
  } else {
    float f[4];
    if constexpr (CT == 0) { f[0] = r.w.x; f[1] = r.w.y; f[2] = r.w.z; f[3] = r.w.w; }
    else {
      f[0] = f16f((unsigned short)(r.w.x & 0xFFFFu)); f[1] = f16f((unsigned short)(r.w.x >> 16));
      f[2] = f16f((unsigned short)(r.w.y & 0xFFFFu)); f[3] = f16f((unsigned short)(r.w.y >> 16));
    }
    unsigned a0, a1, b0, b1;
    split2(f[0], f[1], a0, a1);
    split2(f[2], f[3], b0, b1);
    *reinterpret_cast<uint2 *>(dst0) = make_uint2(a0, b0);
    *reinterpret_cast<uint2 *>(dst1) = make_uint2(a1, b1);
  }
}

template <int D, int BN, int PF, int CK, int CV>
__global__ void __launch_bounds__(128) attention_chunk_tc(const float *q, const void *ck, const void *cv,
    const int *pos, const int *slot, float *__restrict__ out, int rows, int H, int KV, int ctx, float scale) {
  static_assert(D % 16 == 0 && D <= 128 && (BN == 32 || BN == 64), "head_dim, keys a tile");
  constexpr int BM = 64, RS = D + 8, NK = CK == 1 ? 1 : 2, NV = CV == 1 ? 1 : 2;
  constexpr int NT = D / 8, NS = BN / 8;              // n-tiles of the output, of a tile's scores
  constexpr int D4 = D / 4, LPT = BN * D4 / 128;      // 4-value pieces of a key row; a thread's pieces a tile
  static_assert((BN * D4) % 128 == 0, "pieces a thread");
  grid_dep_entry();
  extern __shared__ __align__(16) unsigned short sm[];
  unsigned short *Qs = sm;                            // [2][BM][RS]
  unsigned short *Ks = Qs + 2 * BM * RS;              // [NK][BN][RS]
  unsigned short *Vs = Ks + NK * BN * RS;             // [NV][BN][RS]
  __shared__ int qpos[BM];
  __shared__ int lead, smax;
  const int kvh = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, c = lane & 3;
  const int G = H / KV, RB = BM / G, r0 = blockIdx.y * RB;
  if (tid == 0) {
    int l = -1;
    for (int i = 0; i < RB && r0 + i < rows && l < 0; i++) if (pos[r0 + i] >= 0) l = slot[r0 + i];
    lead = l; smax = -1;
  }
  __syncthreads();
  if (tid < BM) {
    const int r = r0 + tid / G;
    int p = -1;
    if (tid < RB * G && r < rows && pos[r] >= 0) p = slot[r] == lead ? min(pos[r], ctx - 1) : -2;
    qpos[tid] = p;
    atomicMax(&smax, p);
  }
  // the query parts: vector qv = row r0 + qv / G, head kvh G + qv % G (zeros past the block's rows)
  for (int i = tid; i < BM * D / 2; i += 128) {
    const int qv = i / (D / 2), d = 2 * (i - qv * (D / 2)), r = r0 + qv / G, h = kvh * G + qv % G;
    float x0 = 0.f, x1 = 0.f;
    if (qv < RB * G && r < rows) {
      const float2 v = *reinterpret_cast<const float2 *>(q + ((size_t)r * H + h) * D + d);
      x0 = v.x; x1 = v.y;
    }
    unsigned p0, p1;
    split2(x0, x1, p0, p1);
    *reinterpret_cast<unsigned *>(Qs + qv * RS + d) = p0;
    *reinterpret_cast<unsigned *>(Qs + (BM + qv) * RS + d) = p1;
  }
  __syncthreads();
  const int tmax = smax;
  // this warp's rows g and g + 8: their positions, the last key any of its vectors takes
  const int pa = qpos[16 * w + g], pb = qpos[16 * w + g + 8];
  int wmax = -1;
#pragma unroll
  for (int i = 0; i < 16; i++) wmax = max(wmax, qpos[16 * w + i]);
  const size_t rs = (size_t)KV * D;
  const size_t kv0 = (size_t)max(lead, 0) * ctx * rs + (size_t)kvh * D;   // element offsets into ck, cv
  Raw4<CK> kr[LPT];
  Raw4<CV> vr[LPT];
  auto fetch = [&](int tb) {                          // tile tb's raw words (zeros past tmax)
#pragma unroll
    for (int u = 0; u < LPT; u++) {
      const int e = tid + 128 * u, j = e / D4, d = 4 * (e - j * D4);
      kr[u] = Raw4<CK>{};
      vr[u] = Raw4<CV>{};
      if (tb + j <= tmax) {
        kr[u] = raw4<CK>(ck, kv0 + (size_t)(tb + j) * rs + d);
        vr[u] = raw4<CV>(cv, kv0 + (size_t)(tb + j) * rs + d);
      }
    }
  };
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // rows g, g + 8: running max, this lane's share of the sum
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const int lr = lane & 7, lm = lane >> 3;            // ldmatrix: this lane's row, of matrix lm
  if (PF && tmax >= 0) fetch(0);
  for (int tb = 0; tb <= tmax; tb += BN) {
    if (!PF) fetch(tb);
    __syncthreads();                                  // the last tile is no longer read
#pragma unroll
    for (int u = 0; u < LPT; u++) {
      const int e = tid + 128 * u, j = e / D4, d = 4 * (e - j * D4);
      store_parts<CK>(kr[u], Ks + j * RS + d, Ks + (BN + j) * RS + d);
      store_parts<CV>(vr[u], Vs + j * RS + d, Vs + (BN + j) * RS + d);
    }
    __syncthreads();
    if (PF && tb + BN <= tmax) fetch(tb + BN);
    if (tb > wmax) continue;                          // no vector of this warp takes a key of this tile (uniform)
    // scores of the warp's 16 vectors x the tile's BN keys
    float sc[NS][4];
#pragma unroll
    for (int j = 0; j < NS; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
      unsigned qa[2][4];
#pragma unroll
      for (int a = 0; a < 2; a++) ldsm4(qa[a], Qs + (a * BM + 16 * w + lr + 8 * (lm & 1)) * RS + 16 * ks + 8 * (lm >> 1));
#pragma unroll
      for (int j2 = 0; j2 < NS / 2; j2++) {
#pragma unroll
        for (int kp = 0; kp < NK; kp++) {
          unsigned b[4];                              // keys 16 j2 + 0-7 (b0 b1), + 8-15 (b2 b3) of part kp
          ldsm4(b, Ks + (kp * BN + 16 * j2 + lr + 8 * (lm >> 1)) * RS + 16 * ks + 8 * (lm & 1));
          mma_bf16(sc[2 * j2], qa[0], b[0], b[1]);
          mma_bf16(sc[2 * j2 + 1], qa[0], b[2], b[3]);
          if (kp == 0) {                              // q1 k0 (q1 k1 is below 2^-16)
            mma_bf16(sc[2 * j2], qa[1], b[0], b[1]);
            mma_bf16(sc[2 * j2 + 1], qa[1], b[2], b[3]);
          }
        }
      }
    }
    // masks and the online softmax of rows g (e 0, 1) and g + 8 (e 2, 3): key tb + 8 j + 2 c + (e & 1)
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int t = tb + 8 * j + 2 * c + (e & 1);
        const float x = t <= ((e & 2) ? pb : pa) ? sc[j][e] * scale : NEG_INF;
        sc[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float mn = fmaxf(m[h], mx[h]);
      corr[h] = mn == NEG_INF ? 1.f : expf(m[h] - mn);
      m[h] = mn;
    }
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const float x = sc[j][e];
        const float p = x == NEG_INF ? 0.f : expf(x - m[e >> 1]);
        sc[j][e] = p;
        ls[e >> 1] += p;
      }
    l[0] = l[0] * corr[0] + ls[0];
    l[1] = l[1] * corr[1] + ls[1];
#pragma unroll
    for (int j = 0; j < NT; j++) { acc[j][0] *= corr[0]; acc[j][1] *= corr[0]; acc[j][2] *= corr[1]; acc[j][3] *= corr[1]; }
    // P V over the tile's keys in k-steps of 16: A from the probabilities (rows g / g + 8, keys 2c.., 2c+8..)
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      unsigned pa0[4], pa1[4];
      split2(sc[2 * kk][0], sc[2 * kk][1], pa0[0], pa1[0]);
      split2(sc[2 * kk][2], sc[2 * kk][3], pa0[1], pa1[1]);
      split2(sc[2 * kk + 1][0], sc[2 * kk + 1][1], pa0[2], pa1[2]);
      split2(sc[2 * kk + 1][2], sc[2 * kk + 1][3], pa0[3], pa1[3]);
#pragma unroll
      for (int j2 = 0; j2 < D / 16; j2++) {
#pragma unroll
        for (int vp = 0; vp < NV; vp++) {
          unsigned b[4];                              // d 16 j2 + 0-7 (b0 b1), + 8-15 (b2 b3), keys 16 kk ..
          ldsm4t(b, Vs + (vp * BN + 16 * kk + lr + 8 * (lm & 1)) * RS + 16 * j2 + 8 * (lm >> 1));
          mma_bf16(acc[2 * j2], pa0, b[0], b[1]);
          mma_bf16(acc[2 * j2 + 1], pa0, b[2], b[3]);
          if (vp == 0) {                              // p1 v0 (p1 v1 is below 2^-16)
            mma_bf16(acc[2 * j2], pa1, b[0], b[1]);
            mma_bf16(acc[2 * j2 + 1], pa1, b[2], b[3]);
          }
        }
      }
    }
  }
  // the sums over the quad's lanes, then each vector's outputs
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int qv = 16 * w + g + 8 * h, r = r0 + qv / G, hd = kvh * G + qv % G;
    if (qv >= RB * G || r >= rows) continue;
    const int p = h ? pb : pa;
    float *o = out + ((size_t)r * H + hd) * D;
    const float inv = 1.f / l[h];
#pragma unroll
    for (int j = 0; j < NT; j++) {
      float2 v;
      if (p == -1) v = make_float2(0.f, 0.f);
      else if (p == -2) v = make_float2(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
      else v = make_float2(acc[j][2 * h] * inv, acc[j][2 * h + 1] * inv);
      *reinterpret_cast<float2 *>(o + 8 * j + 2 * c) = v;
    }
  }
}
