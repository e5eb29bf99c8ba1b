// Decode attention split over the context (binding: runtime/cuda/attention_decode.py; the contract:
// runtime/ops/attention.py without `select`). A CTA takes one (kv head, row, split): the G = H / KV
// query heads of the kv head over the split's share of the row's keys 0..pos, so each key and value
// row is read once per row, not once per query head, and a long context fills the GPU. Tiles of 32
// keys are staged in shared memory by coalesced 16-byte loads; the next tile's loads are issued into
// registers, as the cache's raw words, before this tile is computed, and decoded to float32 at the
// shared-memory store, so the cache read overlaps the arithmetic (tools/bench_attention.py). K rows
// are padded to a stride of an odd number of 16-byte words, so a lane reads its own key 16 bytes at
// a time without bank conflicts. Scores are float32 FMAs over d (four chains), softmax online per
// head (warp w: heads w, w + 4, ...). With S splits each CTA writes (max, sum, acc[D]) per head to
// `part`; the last CTA of a (kv head, row) to arrive (a counter in `sem`, left at 0) merges them in
// split order: deterministic. An inactive row (pos < 0) gives zeros.

#include "numerics.cuh"
#include "pdl.cuh"

#define NEG_INF __int_as_float(0xff800000u)

// Raw4 / raw4 (numerics.cuh): four consecutive cache values as the KV cache's raw words, kept so in registers
// by the prefetch, and their float32 values (decode4, at the shared-memory store); ops_src.py cget4 decodes
// the same way
template <int CT> __device__ __forceinline__ float4 decode4(const Raw4<CT> &r) {
  if constexpr (CT == 0) {
    return r.w;
  } else {
    const unsigned h[4] = {r.w.x & 0xFFFFu, r.w.x >> 16, r.w.y & 0xFFFFu, r.w.y >> 16};
    float f[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      if constexpr (CT == 1) f[k] = __uint_as_float(h[k] << 16);
      else { const unsigned short v = (unsigned short)h[k]; asm("cvt.f32.f16 %0, %1;" : "=f"(f[k]) : "h"(v)); }
    }
    return make_float4(f[0], f[1], f[2], f[3]);
  }
}

// Programmatic dependent launch (pdl.cuh): the next kernel may be scheduled at once; nothing is read before
// the kernel before has finished (q, the cache and the positions are its outputs: plain pointers, not the
// read-only path).
__device__ __forceinline__ void grid_dep_entry() { grid_dep_launch(); grid_dep_wait(); }

// pfb bytes from pf (the weights of the linear after the attention; lever BLOOMERY_ATTN_PREFETCH) into the L2,
// each CTA of the grid its share, before anything else: a short context's launch waits on latency, and what
// no kernel writes may be read before the kernel before has finished. pfb 0: nothing.
__device__ __forceinline__ void prefetch_next(const void *pf, long long pfb) {
  if (pfb > 0)
    l2_prefetch_share(pf, pfb, (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x,
                      gridDim.x * gridDim.y * gridDim.z);
}

// The last CTA of a (kv head, row) to arrive merges the S splits' (max, sum, acc) in `part` in split order
// (deterministic) into o, the G heads' outputs; every CTA has written its split before it calls this. scr: cap
// floats of the CTA's shared memory, free by then. Where 2 G S + G fit, the merge runs in three passes: every
// (head, split)'s max and sum loaded at once; a thread a head takes the max, each split's weight
// exp(max_k - M) (-1: an empty split) and the weighted sum of the sums, in split order; then each output's
// weighted sum of the accumulators, its S loads independent. The same operations in the same order as the
// one-pass form below it (kept where the scratch is too small): the same bits.
__device__ __forceinline__ void merge_splits(const float *part, int *sem, float *o, int r, int kvh, int G, int H,
                                             int KV, int D, int S, float *scr, int cap) {
  __shared__ int last;
  const int tid = threadIdx.x, RP = 2 + D;
  __threadfence();
  __syncthreads();
  const int ti = r * KV + kvh;
  if (tid == 0) last = atomicAdd(sem + ti, 1) == S - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const float *p0 = part + ((size_t)r * H + kvh * G) * S * RP;     // head h, split k: p0 + (h S + k) RP
  if (2 * G * S + G <= cap) {
    float *wk = scr, *lk = scr + G * S, *dh = scr + 2 * G * S;
    for (int i = tid; i < G * S; i += blockDim.x) { wk[i] = __ldcg(p0 + (size_t)i * RP); lk[i] = __ldcg(p0 + (size_t)i * RP + 1); }
    __syncthreads();
    for (int h = tid; h < G; h += blockDim.x) {
      float M = NEG_INF, den = 0.f;
      for (int k = 0; k < S; k++) M = fmaxf(M, wk[h * S + k]);
      for (int k = 0; k < S; k++) {
        const float mk = wk[h * S + k];
        if (mk == NEG_INF) { wk[h * S + k] = -1.f; continue; }     // an empty split
        const float f = expf(mk - M);
        wk[h * S + k] = f;
        den = fmaf(lk[h * S + k], f, den);
      }
      dh[h] = den;
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += blockDim.x) {
      const int h = i / D, d = i - h * D;
      const float *pp = p0 + (size_t)h * S * RP + 2 + d;
      float num = 0.f;
#pragma unroll 8
      for (int k = 0; k < S; k++) {
        const float f = wk[h * S + k];
        if (f < 0.f) continue;
        num = fmaf(__ldcg(pp + (size_t)k * RP), f, num);
      }
      o[h * D + d] = num / dh[h];
    }
  } else {
    for (int i = tid; i < G * D; i += blockDim.x) {
      const int h = i / D, d = i - h * D;
      const float *pp = p0 + (size_t)h * S * RP;
      float M = NEG_INF;
#pragma unroll 8
      for (int k = 0; k < S; k++) M = fmaxf(M, __ldcg(pp + k * RP));
      float num = 0.f, den = 0.f;
#pragma unroll 8
      for (int k = 0; k < S; k++) {                  // unrolled: the loads in flight together, the sums in order
        const float mk = __ldcg(pp + k * RP);
        if (mk == NEG_INF) continue;                 // an empty split
        const float f = expf(mk - M);
        num = fmaf(__ldcg(pp + k * RP + 2 + d), f, num);
        den = fmaf(__ldcg(pp + k * RP + 1), f, den);
      }
      o[h * D + d] = num / den;
    }
  }
  if (tid == 0) sem[ti] = 0;
}

template <int DPL, int HPW, int CK = 0, int CV = 0, int NW = 4, int PVU = 0>
__global__ void __launch_bounds__(32 * NW) attention_decode_k(const float *q, const void *ck, const void *cv, const int *pos,
    const int *slot, float *__restrict__ out, float *__restrict__ part, int *__restrict__ sem, int H, int KV, int D,
    int ctx, float scale, const void *__restrict__ pf, long long pfb) {
  prefetch_next(pf, pfb);
  grid_dep_entry();
  extern __shared__ float sh[];
  const int kvh = blockIdx.x, r = blockIdx.y, s = blockIdx.z, S = gridDim.z;
  constexpr int NT = 32 * NW;                        // threads
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, G = H / KV;
  const int DP = D + ((D >> 2) & 1 ? 8 : 4);        // K row stride: 16-byte rows, DP / 4 odd (conflict-free LDS.128)
  const int p = pos[r];
  if (p < 0) {                                       // inactive: zeros, written once
    if (s == 0)
      for (int i = tid; i < G * D; i += NT) out[((size_t)r * H + kvh * G) * D + i] = 0.f;
    return;
  }
  const int n = min(p, ctx - 1) + 1, per = max((n + S - 1) / S, 64);   // splits past the keys: empty
  const int t0 = s * per, t1 = min(n, t0 + per);
  float *Qs = sh, *Ks = Qs + G * D, *Vs = Ks + 32 * DP, *Ps = Vs + 32 * D;   // Ps: [G][32]
  for (int i = tid; i < G * D; i += NT) Qs[i] = q[((size_t)r * H + kvh * G) * D + i];
  const size_t rs = (size_t)KV * D;
  const size_t K = (size_t)slot[r] * ctx * rs + (size_t)kvh * D, V = K;   // element offsets into ck, cv
  float m[HPW], l[HPW], acc[HPW][DPL];
#pragma unroll
  for (int j = 0; j < HPW; j++) {
    m[j] = NEG_INF; l[j] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[j][i] = 0.f;
  }
  const int D4 = D >> 2;                             // float4s a key row (D % 4 == 0)
  constexpr int LPT = 8 * DPL / NW;                   // float4s of a tile's keys (or values) a thread loads, at most
  Raw4<CK> kr4[LPT];                                 // the next tile, loaded while this one is computed, as
  Raw4<CV> vr4[LPT];                                 // the cache's raw words (decoded at the store)
  auto fetch = [&](int tb) {
    const int nt = min(32, t1 - tb);
#pragma unroll
    for (int u = 0; u < LPT; u++) {
      const int i = tid + NT * u, j = i / D4, d = 4 * (i - j * D4);
      kr4[u] = Raw4<CK>{};                            // zeros past the tile's keys
      vr4[u] = Raw4<CV>{};
      if (i < 32 * D4 && j < nt) {
        kr4[u] = raw4<CK>(ck, K + (size_t)(tb + j) * rs + d);
        vr4[u] = raw4<CV>(cv, V + (size_t)(tb + j) * rs + d);
      }
    }
  };
  if (t0 < t1) fetch(t0);
  for (int tb = t0; tb < t1; tb += 32) {
    const int nt = min(32, t1 - tb);
    __syncthreads();                                 // the last tile is no longer read
#pragma unroll
    for (int u = 0; u < LPT; u++) {
      const int i = tid + NT * u, j = i / D4, d = 4 * (i - j * D4);
      if (i < 32 * D4) {
        *reinterpret_cast<float4 *>(Ks + j * DP + d) = decode4<CK>(kr4[u]);
        *reinterpret_cast<float4 *>(Vs + j * D + d) = decode4<CV>(vr4[u]);
      }
    }
    __syncthreads();
    if (tb + 32 < t1) fetch(tb + 32);
#pragma unroll
    for (int jh = 0; jh < HPW; jh++) {
      const int h = w + NW * jh;
      if (h < G) {                                   // warp-uniform
        float sc = NEG_INF;
        if (lane < nt) {
          const float4 *qh = reinterpret_cast<const float4 *>(Qs + h * D);   // broadcast
          const float4 *kr = reinterpret_cast<const float4 *>(Ks + lane * DP);
          float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;     // four chains in flight (D % 4 == 0)
          for (int i = 0; i < D4; i++) {                  // two 16-byte shared loads a four FMAs
            const float4 a = qh[i], b = kr[i];
            d0 = fmaf(a.x, b.x, d0); d1 = fmaf(a.y, b.y, d1);
            d2 = fmaf(a.z, b.z, d2); d3 = fmaf(a.w, b.w, d3);
          }
          sc = ((d0 + d1) + (d2 + d3)) * scale;
        }
        float tm = sc;
#pragma unroll
        for (int o = 16; o; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
        const float mn = fmaxf(m[jh], tm);
        const float c = expf(m[jh] - mn);
        const float e = lane < nt ? expf(sc - mn) : 0.f;
        float es = e;
#pragma unroll
        for (int o = 16; o; o >>= 1) es += __shfl_xor_sync(0xffffffffu, es, o);
        l[jh] = l[jh] * c + es;
        m[jh] = mn;
        Ps[h * 32 + lane] = e;
        __syncwarp();
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[jh][i] *= c;
        auto pv = [&](int j) {                         // key j's value row into the accumulators
          const float pj = Ps[h * 32 + j];
#pragma unroll
          for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            if (d < D) acc[jh][i] = fmaf(pj, Vs[j * D + d], acc[jh][i]);
          }
        };
        if constexpr (PVU > 0) {
#pragma unroll PVU
          for (int j = 0; j < nt; j++) pv(j);
        } else {
          for (int j = 0; j < nt; j++) pv(j);
        }
        __syncwarp();
      }
    }
  }
  float *o = out + ((size_t)r * H + kvh * G) * D;
  if (S == 1) {
#pragma unroll
    for (int jh = 0; jh < HPW; jh++) {
      const int h = w + NW * jh;
      if (h < G)
#pragma unroll
        for (int i = 0; i < DPL; i++) {
          const int d = lane + 32 * i;
          if (d < D) o[h * D + d] = acc[jh][i] / l[jh];
        }
    }
    return;
  }
  // part: [rows][H][S][2 + D] (max, sum, acc); an empty split leaves max -inf, sum 0
  const int RP = 2 + D;
#pragma unroll
  for (int jh = 0; jh < HPW; jh++) {
    const int h = w + NW * jh;
    if (h < G) {
      float *pp = part + (((size_t)r * H + kvh * G + h) * S + s) * RP;
      if (lane == 0) { pp[0] = m[jh]; pp[1] = l[jh]; }
#pragma unroll
      for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        if (d < D) pp[2 + d] = acc[jh][i];
      }
    }
  }
  merge_splits(part, sem, o, r, kvh, G, H, KV, D, S, sh, G * D + 32 * DP + 32 * D + G * 32);   // smem_bytes / 4
}

// ---- The tensor-core form, for 16-bit caches (CK, CV: 1 bf16, 2 f16), G <= 8 query heads a kv head,
// D % 16 == 0, D <= 128. The same CTA grid, splits, partials and merge as attention_decode_k. Each of the
// 4 warps takes every 4th chunk of 16 keys of the CTA's split, with its own online softmax, and streams
// its chunks' key and value rows into its own shared-memory stages (cp.async, ST deep; past the split's
// keys: zeros). mma.sync m16n8k16, 16-bit operands, float32 accumulation:
//   scores S = Q K^T: A = the query, split into parts of the key type (x = p0 + p1 + ..., each rounded
//     from the rest: bf16 3 parts, 24 bits; f16 2 parts after a power-of-two scaling that keeps |q| < 2^15,
//     22 bits): rows 0-7 part 0 of heads 0-7, rows 8-15 part 1; a third part in a second A's rows 0-7.
//     B = the keys as stored (ldmatrix). A lane's score is its C rows g + (g + 8): exact products, float32 sums.
//   P V: A = the probabilities, split the same way (f16: times 2^15 first) and placed as the scores were,
//     taken straight from the score fragments; B = the values as stored (ldmatrix.trans).
// Then the warps' (max, sum, acc) meet in shared memory, in warp order.
template <int CT> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
  if constexpr (CT == 1) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <int CT> __device__ __forceinline__ void unpack2(unsigned v, float &lo, float &hi) {
  if constexpr (CT == 1) { lo = __uint_as_float(v << 16); hi = __uint_as_float(v & 0xFFFF0000u); }
  else {
    const unsigned short a = (unsigned short)(v & 0xFFFFu), b = (unsigned short)(v >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
  }
}
template <int CT> struct Parts { static constexpr int n = CT == 1 ? 3 : 2; };
// (x0, x1) as NP packed 16-bit pairs, each the rounding of what the ones before left
template <int CT, int NP> __device__ __forceinline__ void split_pair(float x0, float x1, unsigned (&p)[NP]) {
#pragma unroll
  for (int i = 0; i < NP; i++) {
    p[i] = pack2<CT>(x0, x1);
    float h0, h1;
    unpack2<CT>(p[i], h0, h1);
    x0 -= h0; x1 -= h1;
  }
}
template <int CT> __device__ __forceinline__ void mma16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (CT == 1)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),
                   "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),
                   "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp16(void *dst, const void *src, bool ok) {   // !ok: 16 zero bytes
  const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(a), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

template <int D, int ST, int CK, int CV>
__global__ void __launch_bounds__(128) attention_decode_tc(const float *q, const void *ck, const void *cv, const int *pos,
    const int *slot, float *__restrict__ out, float *__restrict__ part, int *__restrict__ sem, int H, int KV, int ctx,
    float scale, const void *__restrict__ pf, long long pfb) {
  static_assert(D % 16 == 0 && D <= 128, "head_dim");
  constexpr int NQ = Parts<CK>::n, NP = Parts<CV>::n, AQ = (NQ + 1) / 2, AP = (NP + 1) / 2;
  constexpr int RS = D + 8;                           // a staged row: D 16-bit values + 16 bytes (ldmatrix: no conflicts)
  constexpr int NT = D / 8;                           // n-tiles of the output
  prefetch_next(pf, pfb);
  grid_dep_entry();
  extern __shared__ __align__(16) unsigned short sm[];
  unsigned short *Qs = sm;                            // [AQ][16][RS]
  const int kvh = blockIdx.x, r = blockIdx.y, s = blockIdx.z, S = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, G = H / KV;
  const int g = lane >> 2, c = lane & 3;
  unsigned short *Ws = sm + AQ * 16 * RS + w * (ST * 2 * 16 * RS);   // this warp's stages: [ST][K 16 rows, V 16 rows]
  float *o = out + ((size_t)r * H + kvh * G) * D;
  const int p = pos[r];
  if (p < 0) {                                        // inactive: zeros, written once
    if (s == 0)
      for (int i = tid; i < G * D; i += 128) o[i] = 0.f;
    return;
  }
  const int n = min(p, ctx - 1) + 1, per = max((n + S - 1) / S, 64);
  const int t0 = s * per, t1 = min(n, t0 + per);
  // the query, in parts (f16: times 2^qe, |q| < 2^15; the scores times 2^-qe)
  const float *qg = q + ((size_t)r * H + kvh * G) * D;
  float qsc = 1.f, qun = 1.f;
  if constexpr (CK == 2) {
    __shared__ float wm[4];
    float m = 0.f;
    for (int i = tid; i < G * D; i += 128) m = fmaxf(m, fabsf(qg[i]));
#pragma unroll
    for (int k = 16; k; k >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, k));
    if (lane == 0) wm[w] = m;
    __syncthreads();
    m = fmaxf(fmaxf(wm[0], wm[1]), fmaxf(wm[2], wm[3]));
    const int e = (m > 0.f && m < 3.0e38f) ? max(ilogbf(m), -100) : 0;
    qsc = __uint_as_float((unsigned)(127 + 14 - e) << 23);
    qun = __uint_as_float((unsigned)(127 - 14 + e) << 23);
  }
  for (int i = tid; i < AQ * 16 * RS / 2; i += 128) reinterpret_cast<unsigned *>(Qs)[i] = 0u;
  __syncthreads();
  for (int i = tid; i < G * D / 2; i += 128) {
    const int h = i / (D / 2), d = 2 * (i - h * (D / 2));
    unsigned pq[NQ];
    split_pair<CK, NQ>(qg[h * D + d] * qsc, qg[h * D + d + 1] * qsc, pq);
#pragma unroll
    for (int k = 0; k < NQ; k++)
      *reinterpret_cast<unsigned *>(Qs + ((k >> 1) * 16 + (k & 1) * 8 + h) * RS + d) = pq[k];
  }
  const float ssc = scale * qun;
  const size_t rs = (size_t)KV * D, kv0 = (size_t)slot[r] * ctx * rs + (size_t)kvh * D;
  __syncthreads();                                    // the parts staged
  const unsigned short *Kg = reinterpret_cast<const unsigned short *>(ck) + kv0;
  const unsigned short *Vg = reinterpret_cast<const unsigned short *>(cv) + kv0;
  // chunk i of this warp: keys t0 + 16 (w + 4 i) ..
  const int nch = t1 > t0 + 16 * w ? (t1 - t0 - 16 * w + 63) / 64 : 0;
  auto issue = [&](int i) {                           // chunk i into stage i % ST (nothing past the chunks)
    if (i < nch) {
      unsigned short *Kd = Ws + (i % ST) * 2 * 16 * RS, *Vd = Kd + 16 * RS;
      const int kb = t0 + 16 * (w + 4 * i);
#pragma unroll
      for (int u = 0; u < 16 * D / 8 / 32; u++) {     // 16-byte pieces a lane
        const int e = lane + 32 * u, row = e / (D / 8), d = 8 * (e - row * (D / 8));
        const bool ok = kb + row < t1;
        const size_t off = (size_t)(ok ? kb + row : t0) * rs + d;
        cp16(Kd + row * RS + d, Kg + off, ok);
        cp16(Vd + row * RS + d, Vg + off, ok);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int i = 0; i < ST - 1; i++) issue(i);          // the first ST - 1 chunks in flight
  float m = NEG_INF, l = 0.f;                         // head g's running max, this lane's share of the sum
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const float pscale = CV == 2 ? 32768.f : 1.f;
  const int lr = lane & 7, lm = lane >> 3;            // ldmatrix: this lane's row address, of matrix lm
  for (int i = 0; i < nch; i++) {
    issue(i + ST - 1);                                // into the stage chunk i - 1 left (read: the __syncwarp below)
    cp_wait<ST - 1>();                                // chunk i has landed (groups complete in order)
    __syncwarp();
    const unsigned short *Kd = Ws + (i % ST) * 2 * 16 * RS, *Vd = Kd + 16 * RS;
    const int kb = t0 + 16 * (w + 4 * i);
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
      unsigned b[4];                                  // keys 0-7 d 0-7, 8-15 of the step; keys 8-15 the same
      ldsm4(b, Kd + (lr + 8 * (lm >> 1)) * RS + 16 * ks + 8 * (lm & 1));
#pragma unroll
      for (int a = 0; a < AQ; a++) {
        unsigned qa[4];
        ldsm4(qa, Qs + (a * 16 + lr + 8 * (lm & 1)) * RS + 16 * ks + 8 * (lm >> 1));
        mma16<CK>(sc[0], qa, b[0], b[1]);
        mma16<CK>(sc[1], qa, b[2], b[3]);
      }
    }
    float v[4];                                       // head g, keys kb + 8 t + 2 c + {0, 1}
#pragma unroll
    for (int t = 0; t < 2; t++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const float x = (sc[t][e] + sc[t][2 + e]) * ssc;
        v[2 * t + e] = kb + 8 * t + 2 * c + e < t1 ? x : NEG_INF;
      }
    float tm = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
    tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
    tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
    const float mn = fmaxf(m, tm), corr = expf(m - mn);
    float e4[4];
#pragma unroll
    for (int k = 0; k < 4; k++) e4[k] = expf(v[k] - mn);
    l = l * corr + ((e4[0] + e4[1]) + (e4[2] + e4[3]));
    m = mn;
#pragma unroll
    for (int j = 0; j < NT; j++) { acc[j][0] *= corr; acc[j][1] *= corr; acc[j][2] *= corr; acc[j][3] *= corr; }
    unsigned pa[AP][4];                               // the probabilities as A: rows g / g + 8 parts 2a / 2a + 1
    {
      unsigned p0[NP], p1[NP];
      split_pair<CV, NP>(e4[0] * pscale, e4[1] * pscale, p0);
      split_pair<CV, NP>(e4[2] * pscale, e4[3] * pscale, p1);
#pragma unroll
      for (int a = 0; a < AP; a++) {
        pa[a][0] = p0[2 * a]; pa[a][2] = p1[2 * a];
        pa[a][1] = 2 * a + 1 < NP ? p0[2 * a + 1] : 0u; pa[a][3] = 2 * a + 1 < NP ? p1[2 * a + 1] : 0u;
      }
    }
#pragma unroll
    for (int j2 = 0; j2 < D / 16; j2++) {
      unsigned b[4];                                  // n-tile 2 j2: keys 0-7, 8-15; n-tile 2 j2 + 1 the same
      ldsm4t(b, Vd + (lr + 8 * (lm & 1)) * RS + 16 * j2 + 8 * (lm >> 1));
#pragma unroll
      for (int a = 0; a < AP; a++) {
        mma16<CV>(acc[2 * j2], pa[a], b[0], b[1]);
        mma16<CV>(acc[2 * j2 + 1], pa[a], b[2], b[3]);
      }
    }
    __syncwarp();                                     // the stage is read; it may be refilled
  }
  cp_wait<0>();
  __syncwarp();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  // this warp's (max, sum, acc) of its heads into its own stage area: [8] max, [8] sum, [8][D] acc
  float *Wf = reinterpret_cast<float *>(Ws);
  if (c == 0) { Wf[g] = m; Wf[8 + g] = l; }
  const float un = 1.f / pscale;
#pragma unroll
  for (int j = 0; j < NT; j++) {
    Wf[16 + g * D + 8 * j + 2 * c] = (acc[j][0] + acc[j][2]) * un;
    Wf[16 + g * D + 8 * j + 2 * c + 1] = (acc[j][1] + acc[j][3]) * un;
  }
  __syncthreads();
  const int RP = 2 + D;
  for (int i = tid; i < G * D; i += 128) {            // the 4 warps, in order
    const int h = i / D, d = i - h * D;
    float M = NEG_INF;
#pragma unroll
    for (int k = 0; k < 4; k++) M = fmaxf(M, reinterpret_cast<const float *>(sm + AQ * 16 * RS + k * (ST * 2 * 16 * RS))[h]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float *Wk = reinterpret_cast<const float *>(sm + AQ * 16 * RS + k * (ST * 2 * 16 * RS));
      if (Wk[h] == NEG_INF) continue;                 // a warp with no keys
      const float f = expf(Wk[h] - M);
      num = fmaf(Wk[16 + h * D + d], f, num);
      den = fmaf(Wk[8 + h], f, den);
    }
    if (S == 1) o[h * D + d] = num / den;
    else {
      float *pp = part + (((size_t)r * H + kvh * G + h) * S + s) * RP;
      if (d == 0) { pp[0] = M; pp[1] = den; }
      pp[2 + d] = num;
    }
  }
  if (S > 1)                                          // the scratch: all of tc_smem_bytes
    merge_splits(part, sem, o, r, kvh, G, H, KV, D, S, reinterpret_cast<float *>(sm), (AQ * 16 * RS + 4 * ST * 2 * 16 * RS) / 2);
}
