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

#define NEG_INF __int_as_float(0xff800000u)

// four consecutive cache values from element i (i % 4 == 0) as the KV cache's raw words (type CT 0 f32:
// one 16-byte load; 1 bf16, 2 f16: one 8-byte load), kept so in registers by the prefetch, and their
// float32 values (decode4, at the shared-memory store); ops_src.py cget4 decodes the same way
template <int CT> struct Raw4 { uint2 w; };
template <> struct Raw4<0> { float4 w; };
template <int CT> __device__ __forceinline__ Raw4<CT> raw4(const void *p, size_t i) {
  Raw4<CT> r;
  if constexpr (CT == 0) r.w = *reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(p) + i);
  else r.w = *reinterpret_cast<const uint2 *>(reinterpret_cast<const unsigned short *>(p) + i);
  return r;
}
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

// Programmatic dependent launch (runtime/cuda/pdl.py; the same two instructions as ops_src.py GRID_DEP, this
// file being self-contained): the next kernel may be scheduled at once; nothing is read before the kernel
// before has finished (q, the cache and the positions are its outputs: plain pointers, not the read-only path).
__device__ __forceinline__ void grid_dep_entry() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <int DPL, int HPW, int CK = 0, int CV = 0>
__global__ void __launch_bounds__(128) attention_decode_k(const float *q, const void *ck, const void *cv, const int *pos,
    const int *slot, float *__restrict__ out, float *__restrict__ part, int *__restrict__ sem, int H, int KV, int D,
    int ctx, float scale) {
  grid_dep_entry();
  extern __shared__ float sh[];
  __shared__ int last;
  const int kvh = blockIdx.x, r = blockIdx.y, s = blockIdx.z, S = gridDim.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, G = H / KV;
  const int DP = D + ((D >> 2) & 1 ? 8 : 4);        // K row stride: 16-byte rows, DP / 4 odd (conflict-free LDS.128)
  const int p = pos[r];
  if (p < 0) {                                       // inactive: zeros, written once
    if (s == 0)
      for (int i = tid; i < G * D; i += 128) out[((size_t)r * H + kvh * G) * D + i] = 0.f;
    return;
  }
  const int n = min(p, ctx - 1) + 1, per = max((n + S - 1) / S, 64);   // splits past the keys: empty
  const int t0 = s * per, t1 = min(n, t0 + per);
  float *Qs = sh, *Ks = Qs + G * D, *Vs = Ks + 32 * DP, *Ps = Vs + 32 * D;   // Ps: [G][32]
  for (int i = tid; i < G * D; i += 128) Qs[i] = q[((size_t)r * H + kvh * G) * D + i];
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
  constexpr int LPT = 2 * DPL;                        // float4s of a tile's keys (or values) a thread loads, at most
  Raw4<CK> kr4[LPT];                                 // the next tile, loaded while this one is computed, as
  Raw4<CV> vr4[LPT];                                 // the cache's raw words (decoded at the store)
  auto fetch = [&](int tb) {
    const int nt = min(32, t1 - tb);
#pragma unroll
    for (int u = 0; u < LPT; u++) {
      const int i = tid + 128 * u, j = i / D4, d = 4 * (i - j * D4);
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
      const int i = tid + 128 * u, j = i / D4, d = 4 * (i - j * D4);
      if (i < 32 * D4) {
        *reinterpret_cast<float4 *>(Ks + j * DP + d) = decode4<CK>(kr4[u]);
        *reinterpret_cast<float4 *>(Vs + j * D + d) = decode4<CV>(vr4[u]);
      }
    }
    __syncthreads();
    if (tb + 32 < t1) fetch(tb + 32);
#pragma unroll
    for (int jh = 0; jh < HPW; jh++) {
      const int h = w + 4 * jh;
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
        for (int j = 0; j < nt; j++) {
          const float pj = Ps[h * 32 + j];
#pragma unroll
          for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            if (d < D) acc[jh][i] = fmaf(pj, Vs[j * D + d], acc[jh][i]);
          }
        }
        __syncwarp();
      }
    }
  }
  float *o = out + ((size_t)r * H + kvh * G) * D;
  if (S == 1) {
#pragma unroll
    for (int jh = 0; jh < HPW; jh++) {
      const int h = w + 4 * jh;
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
    const int h = w + 4 * jh;
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
  __threadfence();
  __syncthreads();
  const int ti = r * KV + kvh;
  if (tid == 0) last = atomicAdd(sem + ti, 1) == S - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = tid; i < G * D; i += 128) {
    const int h = i / D, d = i - h * D;
    const float *pp = part + ((size_t)r * H + kvh * G + h) * S * RP;
    float M = NEG_INF;
#pragma unroll 8
    for (int k = 0; k < S; k++) M = fmaxf(M, __ldcg(pp + k * RP));
    float num = 0.f, den = 0.f;
#pragma unroll 8
    for (int k = 0; k < S; k++) {                    // unrolled: the loads in flight together, the sums in order
      const float mk = __ldcg(pp + k * RP);
      if (mk == NEG_INF) continue;                   // an empty split
      const float f = expf(mk - M);
      num = fmaf(__ldcg(pp + k * RP + 2 + d), f, num);
      den = fmaf(__ldcg(pp + k * RP + 1), f, den);
    }
    o[h * D + d] = num / den;
  }
  if (tid == 0) sem[ti] = 0;
}
