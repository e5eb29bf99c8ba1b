"""CUDA C++ source of the plan's non-linear ops (compiled by NVRTC through cupy.RawModule).

Each kernel implements the contract of its NumPy op in runtime/ops/ (float32 arithmetic, the
same order of operations where it matters: products are not fused into adds where NumPy rounds
the product first). Every length, position and slot is read from device memory, so one captured
CUDA graph serves every step. Linears (and the MoE experts, the router's logits and the output
head) are the GEMV kernels of gemv_src.py.
"""

from .cu import header

# SwiGLU's arithmetic, one owner: the swiglu op's kernels below and the gate / up pair GEMV kernels
# of gemv_src.py (which fold the op into their launch) both call these, so their values agree bit for bit
SWIGLU = header("swiglu")     # runtime/cuda/swiglu.cuh

# Programmatic dependent launch (runtime/cuda/pdl.py), one owner: the kernels launched with it (the decode
# GEMVs of gemv_src.py, rope_qk_kv_k below, attention_decode.cu's copy) let the next kernel be scheduled,
# then wait for the kernel before them before they read what it wrote; no-ops in a plain launch. A kernel
# launched so reads the inputs the kernel before writes through plain pointers (not const __restrict__,
# which the compiler may turn into the read-only path, undefined for data written while the kernel runs).
GRID_DEP = header("pdl")              # grid_dep_launch / grid_dep_wait (runtime/cuda/pdl.cuh)

# moe_router's top-k choice of a row, one owner: moe_topk_k below and gemv_src.py's gemv_plain_topk
MOE_TOPK = header("moe_topk")         # runtime/cuda/moe_topk.cuh

SOURCE = SWIGLU + GRID_DEP + MOE_TOPK + r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float bf16f(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ float f16f(u16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }

// The KV cache's element type (runtime/kv_cache.py; CT 0 f32, 1 bf16, 2 f16: the embed table's codes):
// values rounded to nearest even when written, decoded to float32 when read (NumPy's astype).
template <int CT> __device__ __forceinline__ float cget(const void *p, size_t i) {
  if constexpr (CT == 0) return reinterpret_cast<const float *>(p)[i];
  else if constexpr (CT == 1) return bf16f(reinterpret_cast<const u16 *>(p)[i]);
  else return f16f(reinterpret_cast<const u16 *>(p)[i]);
}
template <int CT> __device__ __forceinline__ void cput(void *p, size_t i, float v) {
  if constexpr (CT == 0) { reinterpret_cast<float *>(p)[i] = v; }
  else {
    u16 h;
    if constexpr (CT == 1) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16 *>(p)[i] = h;
  }
}
// four consecutive values from element i (i % 4 == 0): one 16-byte or one 8-byte load
template <int CT> __device__ __forceinline__ float4 cget4(const void *p, size_t i) {
  if constexpr (CT == 0) return *reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(p) + i);
  else {
    const uint2 w = *reinterpret_cast<const uint2 *>(reinterpret_cast<const u16 *>(p) + i);
    const u16 a = (u16)(w.x & 0xFFFFu), b = (u16)(w.x >> 16), c = (u16)(w.y & 0xFFFFu), d = (u16)(w.y >> 16);
    if constexpr (CT == 1) return make_float4(bf16f(a), bf16f(b), bf16f(c), bf16f(d));
    else return make_float4(f16f(a), f16f(b), f16f(c), f16f(d));
  }
}

// block-wide sum (blockDim.x a multiple of 32, <= 1024); every thread gets the total
__device__ __forceinline__ float block_sum(float v, float *sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  return t;
}

// embed: out[r, :] = table[ids[r], :] (ids outside [0, vocab) read row 0); DT 0 f32, 1 bf16, 2 f16
template <int DT>
__global__ void embed_k(const void *__restrict__ table, const int *__restrict__ ids, float *__restrict__ out,
                        int vocab, int n) {
  const int r = blockIdx.y;
  int id = ids[r];
  if (id < 0 || id >= vocab) id = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float v;
    if (DT == 0) v = ((const float *)table)[(size_t)id * n + i];
    else if (DT == 1) v = bf16f(((const u16 *)table)[(size_t)id * n + i]);
    else v = f16f(((const u16 *)table)[(size_t)id * n + i]);
    out[(size_t)r * n + i] = v;
  }
}

// rmsnorm over groups of g values: one block per group (blockIdx.x = row * groups + group). The weight is
// wg groups of g values: wg 1 (one [g] weight for every group) or the row's groups (a weight as wide as
// the row: qwen4_exp's hyper-connection norms), group j of a row reading weight group j % wg.
__global__ void rmsnorm_k(const float *__restrict__ x, float *__restrict__ out, const float *__restrict__ w,
                          int g, float eps, int wg) {
  __shared__ float sh[32];
  const float *px = x + (size_t)blockIdx.x * g;
  float *po = out + (size_t)blockIdx.x * g;
  w += (size_t)(blockIdx.x % wg) * g;
  float ss = 0.f;
  for (int i = threadIdx.x; i < g; i += blockDim.x) { const float v = px[i]; ss = fmaf(v, v, ss); }
  ss = block_sum(ss, sh);                    // every read of x is done (in place is safe)
  const float var = ss / (float)g;
  const float inv = 1.0f / sqrtf(var + eps);
  for (int i = threadIdx.x; i < g; i += blockDim.x) po[i] = __fmul_rn(__fmul_rn(px[i], inv), w[i]);
}

// rope (HF rotate_half): one thread per (row, head, i < RD/2); angle = float(max(pos, 0)) * inv_freq[i].
// Partial rotary (RD < D, the op's rotary_dim): only the first RD values of each head rotate (pairs i,
// i + RD/2), the other D - RD pass through (copied when out is not x).
__global__ void rope_k(const float *__restrict__ x, float *__restrict__ out, const int *__restrict__ pos,
                       const float *__restrict__ invf, int rows, int heads, int D, int RD) {
  const int half = RD / 2;
  const int n = rows * heads * half;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
    const int i = idx % half, rh = idx / half, r = rh / heads;
    const int p = max(pos[r], 0);
    const float a = __fmul_rn((float)p, invf[i]);
    float s, c;
    sincosf(a, &s, &c);
    const size_t b = (size_t)rh * D;
    const float x1 = x[b + i], x2 = x[b + i + half];
    out[b + i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    out[b + i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  }
  if (RD < D && out != x) {
    const int np_ = D - RD, m = rows * heads * np_;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < m; idx += gridDim.x * blockDim.x) {
      const size_t e = (size_t)(idx / np_) * D + RD + idx % np_;
      out[e] = x[e];
    }
  }
}

// rope of q and of k, then k (roped) and v written at cache[slot, pos]: three launches in one (the
// executor fuses rope q, rope k and attention's cache write when the plan has them in a row; q and k
// are roped in place). A thread per (row, head, i < D/2): i < RD/2 rotates the pair (i, i + RD/2);
// with partial rotary (RD < D) the others carry the pass-through values RD + 2(i - RD/2) and the one
// after it (D - RD is even) into the cache unchanged.
template <int CK, int CV>
__global__ void rope_qk_kv_k(float *q, float *k, const float *v, const int *pos, const int *slot,
                             const float *__restrict__ invf, void *ck, void *cv, int rows, int Hq, int Hk, int D, int RD,
                             int ctx) {
  grid_dep_launch();                                   // PDL: nothing read before the kernel before is done
  grid_dep_wait();
  const int half = D / 2, rh2 = RD / 2;
  const int nq = rows * Hq * half, n = nq + rows * Hk * half;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += gridDim.x * blockDim.x) {
    const bool isq = idx < nq;
    const int j = isq ? idx : idx - nq, H = isq ? Hq : Hk;
    const int i = j % half, rh = j / half, r = rh / H, h = rh % H;
    const int pr = pos[r];
    float *x = isq ? q : k;
    const size_t b = (size_t)rh * D;
    const bool wr = !isq && pr >= 0 && pr < ctx;
    const size_t cb = wr ? ((size_t)slot[r] * ctx + pr) * ((size_t)Hk * D) + (size_t)h * D : 0;
    if (i < rh2) {
      const int p = max(pr, 0);
      const float a = __fmul_rn((float)p, invf[i]);
      float s, c;
      sincosf(a, &s, &c);
      const float x1 = x[b + i], x2 = x[b + i + rh2];
      const float y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)), y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
      x[b + i] = y1;
      x[b + i + rh2] = y2;
      if (wr) {
        cput<CK>(ck, cb + i, y1); cput<CK>(ck, cb + i + rh2, y2);
        cput<CV>(cv, cb + i, v[b + i]); cput<CV>(cv, cb + i + rh2, v[b + i + rh2]);
      }
    } else if (wr) {
      const int e = RD + 2 * (i - rh2);
      cput<CK>(ck, cb + e, x[b + e]); cput<CK>(ck, cb + e + 1, x[b + e + 1]);
      cput<CV>(cv, cb + e, v[b + e]); cput<CV>(cv, cb + e + 1, v[b + e + 1]);
    }
  }
}

// Qwen3's per-head q and k RMSNorms, then rope_qk_kv_k's rope and cache write: five launches in one (the
// executor fuses rmsnorm q, rmsnorm k, rope q, rope k and attention's cache write when the plan has them in
// a row, each norm in place over one head, a [D] weight). A CTA per (row, head), q heads first, of the
// threads rmsnorm_k takes for a group of D: the head's norm is rmsnorm_k's arithmetic (the same sums, the
// same order), kept in shared memory; then each thread writes element d of the head as rope_qk_kv_k does
// (the pair d or d - RD/2 rotated, d >= RD passed through), so q, k and the cache hold the unfused
// launches' values bit for bit. D <= 512.
template <int CK, int CV>
__global__ void norm_rope_qk_kv_k(float *q, float *k, const float *v, const int *pos, const int *slot,
                                  const float *__restrict__ invf, void *ck, void *cv, int rows, int Hq, int Hk, int D,
                                  int RD, int ctx, const float *__restrict__ wq, const float *__restrict__ wk,
                                  float eps_q, float eps_k) {
  __shared__ float sh[32];
  __shared__ float xs[512];
  grid_dep_launch();                                   // PDL: nothing read before the kernel before is done
  grid_dep_wait();
  const int nq = rows * Hq, rh = blockIdx.x;
  const bool isq = rh < nq;
  const int j = isq ? rh : rh - nq, H = isq ? Hq : Hk, r = j / H, h = j % H;
  float *px = (isq ? q : k) + (size_t)j * D;
  const float *w = isq ? wq : wk;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) { const float t = px[i]; ss = fmaf(t, t, ss); }
  ss = block_sum(ss, sh);
  const float var = ss / (float)D;
  const float inv = 1.0f / sqrtf(var + (isq ? eps_q : eps_k));
  for (int i = threadIdx.x; i < D; i += blockDim.x) xs[i] = __fmul_rn(__fmul_rn(px[i], inv), w[i]);
  __syncthreads();
  const int rh2 = RD / 2, pr = pos[r];
  const bool wr = !isq && pr >= 0 && pr < ctx;
  const size_t cb = wr ? ((size_t)slot[r] * ctx + pr) * ((size_t)Hk * D) + (size_t)h * D : 0;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float y = xs[d];
    if (d < RD) {
      const int i = d < rh2 ? d : d - rh2;
      const float a = __fmul_rn((float)max(pr, 0), invf[i]);
      float sn, c;
      sincosf(a, &sn, &c);
      const float x1 = xs[i], x2 = xs[i + rh2];
      y = d < rh2 ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn)) : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn));
    }
    px[d] = y;
    if (wr) { cput<CK>(ck, cb + d, y); cput<CV>(cv, cb + d, v[(size_t)j * D + d]); }
  }
}

// the KV-cache write of attention: every active row's k, v at cache[slot, pos] (grid: rows)
template <int CK, int CV>
__global__ void kv_write_k(const float *__restrict__ k, const float *__restrict__ v, const int *__restrict__ pos,
                           const int *__restrict__ slot, void *__restrict__ ck, void *__restrict__ cv,
                           int n, int ctx) {
  const int r = blockIdx.x, p = pos[r];
  if (p < 0 || p >= ctx) return;
  const size_t base = ((size_t)slot[r] * ctx + p) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    cput<CK>(ck, base + i, k[(size_t)r * n + i]);
    cput<CV>(cv, base + i, v[(size_t)r * n + i]);
  }
}

// attention of one (query head, row) per block over cache[slot, 0..pos] (the length is the row's
// position, read here). A warp takes 32 keys at a time, a lane per key for the scores (q in shared
// memory), then the tile's softmax weights are broadcast lane by lane to accumulate V (a lane per
// head_dim element); online softmax per warp, then the warps are merged. Inactive rows: zeros.
// D % 4 == 0, D <= 32 * DPL. With SEL (attention_sel_k: the op's `select`), the keys are the row's
// entries of attn_select_k's compact list (list[r * lw] = n, then n ascending unique positions, each
// <= the row's position) in place of 0..pos: key j of the walk is position L[j]; n == 0 gives zeros.
template <int DPL, bool SEL, int CK, int CV>
__device__ __forceinline__ void attend_row(const float *__restrict__ q, const void *__restrict__ ck,
                                           const void *__restrict__ cv, const int *__restrict__ pos,
                                           const int *__restrict__ slot, const int *__restrict__ list, int lw,
                                           float *__restrict__ out, int H, int KV, int D, int ctx, float scale) {
  extern __shared__ float sh[];
  const int h = blockIdx.x, r = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int p = pos[r];
  float *o = out + ((size_t)r * H + h) * D;
  const int *L = SEL ? list + (size_t)r * lw + 1 : nullptr;
  const int nsel = SEL && p >= 0 ? L[-1] : 1;
  if (p < 0 || nsel <= 0) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = 0.f;
    return;
  }
  const int pe = SEL ? nsel - 1 : min(p, ctx - 1);      // the walk's last key (SEL: its index in L)
  const int s = slot[r], kvh = h / (H / KV);
  const size_t rs = (size_t)KV * D;
  const size_t K = (size_t)s * ctx * rs + (size_t)kvh * D, V = K;   // element offsets into ck, cv
  float *qs = sh, *wm = sh + D, *wl = wm + nw, *wacc = wl + nw;
  for (int i = threadIdx.x; i < D; i += blockDim.x) qs[i] = q[((size_t)r * H + h) * D + i];
  __syncthreads();
  float m = NEG_INF, l = 0.f, acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; i++) acc[i] = 0.f;
  for (int t0 = w * 32; t0 <= pe; t0 += nw * 32) {
    const int t = t0 + lane;
    float sc = NEG_INF;
    if (t <= pe) {
      const size_t kr = K + (size_t)(SEL ? L[t] : t) * rs;
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < 32 * DPL; i += 4) {      // unrolled: the row's loads are independent, all in flight
        if (i < D) {
          const float4 kv = cget4<CK>(ck, kr + i);
          d = fmaf(qs[i], kv.x, d); d = fmaf(qs[i + 1], kv.y, d); d = fmaf(qs[i + 2], kv.z, d); d = fmaf(qs[i + 3], kv.w, d);
        }
      }
      sc = d * scale;
    }
    float tm = sc;
#pragma unroll
    for (int o2 = 16; o2; o2 >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o2));
    const float mn = fmaxf(m, tm);
    const float c = expf(m - mn);
    const float e = (t <= pe) ? expf(sc - mn) : 0.f;
    float es = e;
#pragma unroll
    for (int o2 = 16; o2; o2 >>= 1) es += __shfl_xor_sync(0xffffffffu, es, o2);
    l = l * c + es;
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] *= c;
    const int nt = min(32, pe - t0 + 1);
    for (int jb = 0; jb < nt; jb += 8) {          // 8 keys' V rows loaded before they are used (in flight)
      float vv[8][DPL];
#pragma unroll
      for (int u = 0; u < 8; u++) {
        size_t vr;
        if constexpr (SEL) vr = V + (size_t)(jb + u < nt ? L[t0 + jb + u] : 0) * rs;
        else vr = V + (size_t)(t0 + jb + u) * rs;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
          const int d = lane + 32 * i;
          vv[u][i] = (jb + u < nt && d < D) ? cget<CV>(cv, vr + d) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const float pj = __shfl_sync(0xffffffffu, e, (jb + u) & 31);
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] = fmaf(pj, vv[u][i], acc[i]);
      }
    }
    m = mn;
  }
  if (lane == 0) { wm[w] = m; wl[w] = l; }
#pragma unroll
  for (int i = 0; i < DPL; i++) {
    const int d = lane + 32 * i;
    if (d < D) wacc[w * D + d] = acc[i];
  }
  __syncthreads();
  float M = NEG_INF;
  for (int i = 0; i < nw; i++) M = fmaxf(M, wm[i]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int i = 0; i < nw; i++) {
      const float f = expf(wm[i] - M);
      num = fmaf(wacc[i * D + d], f, num);
      den = fmaf(wl[i], f, den);
    }
    o[d] = num / den;
  }
}

template <int DPL, int CK, int CV>
__global__ void attention_k(const float *__restrict__ q, const void *__restrict__ ck, const void *__restrict__ cv,
                            const int *__restrict__ pos, const int *__restrict__ slot, float *__restrict__ out,
                            int H, int KV, int D, int ctx, float scale) {
  attend_row<DPL, false, CK, CV>(q, ck, cv, pos, slot, nullptr, 0, out, H, KV, D, ctx, scale);
}

template <int DPL, int CK, int CV>
__global__ void attention_sel_k(const float *__restrict__ q, const void *__restrict__ ck, const void *__restrict__ cv,
                                const int *__restrict__ pos, const int *__restrict__ slot,
                                const int *__restrict__ list, int lw, float *__restrict__ out,
                                int H, int KV, int D, int ctx, float scale) {
  attend_row<DPL, true, CK, CV>(q, ck, cv, pos, slot, list, lw, out, H, KV, D, ctx, scale);
}

// Prompt-chunk attention: one CTA per (kv head, block of RB rows). Its QN = 32 * QPT query vectors (RB
// rows x the G = H / KV query heads of the kv head) walk the cache in tiles of 32 keys staged in shared
// memory: each key and value row is read once per CTA, not once per (query head, row). Each score is
// the same float32 FMA chain over d as attention_k's; online softmax per query vector. A CTA's rows
// share one slot (a prefill chunk's do): a row of another slot gets NaN, never another slot's keys.
// With SEL (attn_chunk_sel_k: the op's `select`), each row's keys are those of its bitmap (attn_select_k:
// bits[r * nw + t / 32] bit t % 32, written for t <= the row's position) AND the causal bound: a tile's
// bit masks are staged per row (Ms, QN words after Ps) and a tile no row selects is skipped; a row
// whose list is empty (list[r * lw] == 0) gives zeros.
template <int DPL, int QPT, bool SEL, int CK, int CV>
__device__ __forceinline__ void attend_chunk(const float *__restrict__ q, const void *__restrict__ ck,
    const void *__restrict__ cv, const int *__restrict__ pos, const int *__restrict__ slot,
    const int *__restrict__ list, int lw, const unsigned *__restrict__ bits, int nwords, float *__restrict__ out,
    int rows, int H, int KV, int D, int ctx, float scale) {
  constexpr int QN = 32 * QPT, KT = 32, RW = QN / 8, PS = KT + 1;
  extern __shared__ float sh[];
  __shared__ int qpos[QN];
  __shared__ int lead, smax;
  const int DP = D + 1, G = H / KV, RB = QN / G;
  float *Qs = sh, *Ks = Qs + QN * DP, *Vs = Ks + KT * DP, *Ps = Vs + KT * D;
  u32 *Ms = reinterpret_cast<u32 *>(Ps + QN * PS);
  const int kvh = blockIdx.x, r0 = blockIdx.y * RB, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  if (tid == 0) {
    int l = -1;
    for (int i = 0; i < RB && r0 + i < rows && l < 0; i++) if (pos[r0 + i] >= 0) l = slot[r0 + i];
    lead = l; smax = -1;
  }
  __syncthreads();
  if (tid < QN) {
    const int r = r0 + tid / G;
    int p = -1;
    if (tid < RB * G && r < rows && pos[r] >= 0) p = slot[r] == lead ? min(pos[r], ctx - 1) : -2;
    if (SEL && p >= 0 && list[(size_t)r * lw] == 0) p = -1;
    qpos[tid] = p;
    atomicMax(&smax, p);
  }
  for (int i = tid; i < QN * D; i += blockDim.x) {
    const int qv = i / D, d = i - qv * D, r = r0 + qv / G, h = kvh * G + qv % G;
    Qs[qv * DP + d] = (qv < RB * G && r < rows) ? q[((size_t)r * H + h) * D + d] : 0.f;
  }
  __syncthreads();
  const int tmax = smax;
  const size_t rs = (size_t)KV * D;
  const size_t Kb = (size_t)max(lead, 0) * ctx * rs + (size_t)kvh * D, Vb = Kb;   // element offsets
  float m[RW], l[RW], acc[RW][DPL];
#pragma unroll
  for (int i = 0; i < RW; i++) {
    m[i] = NEG_INF; l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; j++) acc[i][j] = 0.f;
  }
  const int qa = (tid >> 3) * QPT, kj = tid & 7;
  for (int t0 = 0; t0 <= tmax; t0 += KT) {
    __syncthreads();                                   // the last tile's K, V and P are no longer read
    if constexpr (SEL) {                               // the tile's selected keys, per row (KT == 32: one word)
      u32 mk = 0;
      if (tid < RB && r0 + tid < rows && qpos[tid * G] >= 0) mk = bits[(size_t)(r0 + tid) * nwords + (t0 >> 5)];
      if (tid < RB) Ms[tid] = mk;
      if (!__syncthreads_or(mk != 0u)) continue;       // no row takes a key of this tile (uniform)
    }
    for (int i = tid; i < KT * D; i += blockDim.x) {
      const int j = i / D, d = i - j * D, t = t0 + j;
      const bool ok = t <= tmax;
      Ks[j * DP + d] = ok ? cget<CK>(ck, Kb + (size_t)t * rs + d) : 0.f;
      Vs[j * D + d] = ok ? cget<CV>(cv, Vb + (size_t)t * rs + d) : 0.f;
    }
    __syncthreads();
    float s[QPT][4];
#pragma unroll
    for (int a = 0; a < QPT; a++)
#pragma unroll
      for (int u = 0; u < 4; u++) s[a][u] = 0.f;
    for (int d = 0; d < D; d++) {
      float kv[4];
#pragma unroll
      for (int u = 0; u < 4; u++) kv[u] = Ks[(kj + 8 * u) * DP + d];
#pragma unroll
      for (int a = 0; a < QPT; a++) {
        const float qd = Qs[(qa + a) * DP + d];
#pragma unroll
        for (int u = 0; u < 4; u++) s[a][u] = fmaf(qd, kv[u], s[a][u]);
      }
    }
#pragma unroll
    for (int a = 0; a < QPT; a++)
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int j = kj + 8 * u;
        Ps[(qa + a) * PS + j] = (t0 + j <= qpos[qa + a] && (!SEL || ((Ms[(qa + a) / G] >> j) & 1u)))
                                    ? s[a][u] * scale : NEG_INF;
      }
    __syncthreads();
    float c[RW];
#pragma unroll
    for (int i = 0; i < RW; i++) {                     // warp w owns query vectors w*RW .. w*RW+RW-1
      const int qv = w * RW + i;
      const float sc = Ps[qv * PS + lane];
      float tm = sc;
#pragma unroll
      for (int o = 16; o; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
      const float mn = fmaxf(m[i], tm);
      const float e = (sc == NEG_INF) ? 0.f : expf(sc - mn);
      c[i] = (mn == NEG_INF) ? 1.f : expf(m[i] - mn);
      float es = e;
#pragma unroll
      for (int o = 16; o; o >>= 1) es += __shfl_xor_sync(0xffffffffu, es, o);
      l[i] = l[i] * c[i] + es;
      m[i] = mn;
      Ps[qv * PS + lane] = e;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < RW; i++)
#pragma unroll
      for (int j = 0; j < DPL; j++) acc[i][j] *= c[i];
    const int nk = min(KT, tmax - t0 + 1);
    for (int j = 0; j < nk; j++) {
      float v[DPL];
#pragma unroll
      for (int dd = 0; dd < DPL; dd++) { const int d = lane + 32 * dd; v[dd] = d < D ? Vs[j * D + d] : 0.f; }
#pragma unroll
      for (int i = 0; i < RW; i++) {
        const float pj = Ps[(w * RW + i) * PS + j];
#pragma unroll
        for (int dd = 0; dd < DPL; dd++) acc[i][dd] = fmaf(pj, v[dd], acc[i][dd]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RW; i++) {
    const int qv = w * RW + i, r = r0 + qv / G, h = kvh * G + qv % G;
    if (qv >= RB * G || r >= rows) continue;
    float *o = out + ((size_t)r * H + h) * D;
    const int p = qpos[qv];
#pragma unroll
    for (int dd = 0; dd < DPL; dd++) {
      const int d = lane + 32 * dd;
      if (d < D) o[d] = p == -1 ? 0.f : p == -2 ? __int_as_float(0x7fc00000) : acc[i][dd] / l[i];
    }
  }
}

template <int DPL, int QPT, int CK, int CV>
__global__ void __launch_bounds__(256) attn_chunk_k(const float *__restrict__ q, const void *__restrict__ ck,
    const void *__restrict__ cv, const int *__restrict__ pos, const int *__restrict__ slot, float *__restrict__ out,
    int rows, int H, int KV, int D, int ctx, float scale) {
  attend_chunk<DPL, QPT, false, CK, CV>(q, ck, cv, pos, slot, nullptr, 0, nullptr, 0, out, rows, H, KV, D, ctx, scale);
}

template <int DPL, int QPT, int CK, int CV>
__global__ void __launch_bounds__(256) attn_chunk_sel_k(const float *__restrict__ q, const void *__restrict__ ck,
    const void *__restrict__ cv, const int *__restrict__ pos, const int *__restrict__ slot,
    const int *__restrict__ list, int lw, const unsigned *__restrict__ bits, int nwords, float *__restrict__ out,
    int rows, int H, int KV, int D, int ctx, float scale) {
  attend_chunk<DPL, QPT, true, CK, CV>(q, ck, cv, pos, slot, list, lw, bits, nwords, out, rows, H, KV, D, ctx, scale);
}

// block-wide exclusive prefix sum of v (blockDim.x a multiple of 32, <= 1024; sh: 32 ints); *total gets
// the block's sum. Ends with a barrier: sh may be reused at once.
__device__ __forceinline__ int block_excl_scan(int v, int *sh, int *total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) { const int y = __shfl_up_sync(0xffffffffu, x, o); if (lane >= o) x += y; }
  if (lane == 31) sh[w] = x;
  __syncthreads();
  int before = 0, all = 0;
  for (int i = 0; i < nw; i++) { const int t = sh[i]; before += i < w ? t : 0; all += t; }
  __syncthreads();
  *total = all;
  return before + x - v;
}

// attention's `select` (qwen4_exp's QSA), once per row for every head: the row's entries sel[r, 0..W)
// that are cache positions 0..min(pos, ctx - 1) (-1 and out-of-range ones skipped, repeats counted
// once, any order), as a bitmap bits[r, 0..pe/32] (the prompt-chunk kernel's masks) and as the
// ascending list list[r] = {n, t_0 < ... < t_n-1} (the per-row kernel's keys); an inactive row: n = 0.
// One block per row; dynamic shared memory: the row's bitmap, nwords = ceil(ctx / 32) words.
__global__ void attn_select_k(const int *__restrict__ sel, int W, const int *__restrict__ pos, int ctx,
                              int *__restrict__ list, u32 *__restrict__ bits, int nwords) {
  extern __shared__ u32 bm[];
  __shared__ int sh[32];
  const int r = blockIdx.x, p = pos[r];
  int *lr = list + (size_t)r * (W + 1);
  if (p < 0) {
    if (threadIdx.x == 0) lr[0] = 0;
    return;
  }
  const int pe = min(p, ctx - 1), nw = pe / 32 + 1;
  for (int i = threadIdx.x; i < nw; i += blockDim.x) bm[i] = 0u;
  __syncthreads();
  for (int j = threadIdx.x; j < W; j += blockDim.x) {
    const int t = sel[(size_t)r * W + j];
    if (t >= 0 && t <= pe) atomicOr(&bm[t >> 5], 1u << (t & 31));
  }
  __syncthreads();
  int carry = 0;
  for (int b0 = 0; b0 < nw; b0 += blockDim.x) {
    const int i = b0 + threadIdx.x;
    u32 word = i < nw ? bm[i] : 0u;
    if (i < nw) bits[(size_t)r * nwords + i] = word;
    int tot;
    int at = carry + block_excl_scan(__popc(word), sh, &tot) + 1;
    while (word) {
      const int b = __ffs(word) - 1;
      lr[at++] = i * 32 + b;
      word &= word - 1u;
    }
    carry += tot;
  }
  if (threadIdx.x == 0) lr[0] = carry;
}

// swiglu: out = silu(gate) * up, silu(x) = x / (1 + exp(-x))
__global__ void swiglu_k(const float *__restrict__ g, const float *__restrict__ u, float *__restrict__ out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = swiglu1(g[i], u[i]);
}

// swiglu with glm5_next's clamp (the op's `limit`): out = silu(min(gate, L)) * clip(up, -L, L)
__global__ void swiglu_limit_k(const float *__restrict__ g, const float *__restrict__ u, float *__restrict__ out, int n,
                               float L) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = swiglu1_limit(g[i], u[i], L);
}

__global__ void add_k(const float *__restrict__ a, const float *__restrict__ b, float *__restrict__ out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = a[i] + b[i];
}

// pre_quant_scale: out[r, i] = x[r, i] * pq[i]
__global__ void scale_cols_k(const float *__restrict__ x, const float *__restrict__ pq, float *__restrict__ out,
                             int rows, int n) {
  const int total = rows * n;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
    out[i] = __fmul_rn(x[i], pq[i % n]);
}

// the experts' pre_quant_scale: out[p, i] = x[p / xdiv, i] * pq[ids[p], i] (grid.y = pairs)
__global__ void scale_cols_e_k(const float *__restrict__ x, const float *__restrict__ pq, const int *__restrict__ ids,
                               float *__restrict__ out, int n, int xdiv, int ne) {
  const int p = blockIdx.y;
  int e = ids[p];
  e = e < 0 ? 0 : (e >= ne ? ne - 1 : e);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[(size_t)p * n + i] = __fmul_rn(x[(size_t)(p / xdiv) * n + i], pq[(size_t)e * n + i]);
}

// moe_router after its GEMV: one warp per row over E logits (moe_topk.cuh). Shared: E floats.
__global__ void moe_topk_k(const float *__restrict__ logits, int *__restrict__ ids, float *__restrict__ wts,
                           int E, int k, int norm) {
  extern __shared__ float pr[];
  const int r = blockIdx.x;
  moe_topk_warp(logits + (size_t)r * E, pr, ids + (size_t)r * k, wts + (size_t)r * k, E, k, norm);
}

// moe_experts' sum: out[r, i] = sum_j wts[r, j] * y[r * k + j, i]
__global__ void moe_combine_k(const float *__restrict__ y, const float *__restrict__ wts, float *__restrict__ out,
                              int rows, int k, int n, int add) {
  const int total = rows * n;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int r = idx / n, i = idx % n;
    float a = 0.f;
    for (int j = 0; j < k; j++) a = fmaf(wts[r * k + j], y[((size_t)r * k + j) * n + i], a);
    out[idx] = add ? out[idx] + a : a;
  }
}

// argmax: the first index of each row's largest value (one block per row)
__device__ __forceinline__ bool better(float ov, int oi, float bv, int bi) {
  return oi != 0x7fffffff && (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi));
}
__global__ void argmax_k(const float *__restrict__ x, int *__restrict__ out, int n) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const float *px = x + (size_t)blockIdx.x * n;
  float bv = NEG_INF; int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { const float v = px[i]; if (better(v, i, bv, bi)) { bv = v; bi = i; } }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  if (lane == 0) { sv[w] = bv; si[w] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    float v = sv[0]; int b = si[0];
    for (int i = 1; i < nw; i++) if (better(sv[i], si[i], v, b)) { v = sv[i]; b = si[i]; }
    out[blockIdx.x] = b == 0x7fffffff ? 0 : b;
  }
}

// the device-fed greedy step (generation without a host write per token): tokens = next_token,
// positions += 1 for active rows
__global__ void advance_k(const int *__restrict__ next, int *__restrict__ tokens, int *__restrict__ pos, int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < rows) { tokens[r] = next[r]; if (pos[r] >= 0) pos[r] += 1; }
}
"""
