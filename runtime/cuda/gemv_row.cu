// Decode GEMV of GGML NVFP4 weights for one activation row (or a few, each as if alone) on the tensor cores, the
// weights as the mma's A operand, over a layout made at load time (binding and the layout's NumPy twins:
// runtime/cuda/gemv_row.py; design and measurements: docs/kernels.md "One row on the tensor cores, weights as A").
//
//   y_m[b, n] = (add ? y_m[b, n] : 0) + sum_k x'[b, k] * W_m[n, k]     b < NB, up to 3 members m reading one x
//
// with an RMSNorm folded in (NORM) or a gate / up pair and its SwiGLU (PAIR), as the CUDA-core kernels do.
//
// Why this shape: the CUDA-core kernel spends ~4.5 instructions a weight (nibble -> E4M3 -> f16 -> f32, an
// FFMA each) and so is issue-bound below the memory rate; here a weight costs ~1.4 integer instructions
// (its nibble lands in f16 bits by a rotation and a mask) and 1/8 of an mma, and the block scale is applied
// once per 16 weights in float32, after the mma, not to each weight.
//
// The layout (per matrix, rows padded to 16; NG = in / 64 k-groups, scale words of 8, the last padded with zero):
// for each 16-row tile r and 64-wide k-group G, one
// 16-byte word per lane of a warp (512 bytes, read by one coalesced load), and per 8 k-groups 16 scale bytes
// a lane:
//   wa[((r * NG + G) * 32 + lane) * 4 + i]  lane = 4 g + t: word i holds, as four f16x2 registers a0..a3 of
//     mma i (extracted by nvfp4_rot_h2, numerics.cuh), rows 16 r + g (a0, a2) and 16 r + g + 8 (a1, a3) at
//     k = 64 G + 16 t + 4 i + (0, 1) (a0, a1) and + (2, 3) (a2, a3);
//   sa[((r * NG8 + G / 8) * 32 + lane) * 16 + 2 (G % 8) + h]  (NG8 = NG / 8 rounded up)  the E4M3 scale of row 16 r + g + 8 h over
//     k = 64 G + 16 t .. + 15 (one sub-block).
// So A's k slots 2t, 2t+1, 2t+8, 2t+9 of every mma hold sub-block t of the k-group. B's column 2j + p holds
// part p (0 high, 1 low f16) of x over sub-block j and zeros elsewhere, so after the k-group's four mmas a
// lane's D values (rows g, g + 8; columns 2t, 2t + 1) are its two rows' sums over sub-block t, high and low
// part: they take the sub-block's scale in one FFMA each. x = hi + lo to ~22 bits after a power of two per
// k-slice that brings the slice's largest |x| into [2^14, 2^15); products are exact (at most 13 significant
// bits), the tensor cores add them in float32, scale_2 * 2^14 multiplies the sum.
//
// A CTA's W warps own W consecutive row tiles over one k-slice (grid: row tiles / W, KS k-slices); the CTA
// copies its x slice once into shared memory as B fragments (32 bytes a sub-block and part: only lanes with
// g / 2 == t hold nonzero B values, they load theirs, 2 x 16 bytes a k-group and row). A row's x scale, its
// mmas and its sums are the same whatever NB, so a row of an NB-row launch is that row launched alone. Each warp keeps U weight words
// in flight in registers. Partial sums go to `part`; the last CTA of a column of CTAs to arrive (a counter
// per column in `sem`, left at 0) adds them in slice order: deterministic. Programmatic dependent launch:
// the first U words are loaded before griddepcontrol.wait.
//
// BLOOMERY_ROW_CLAMP (a variant timed by tools/bench_gemv_row.py): the loads ahead unpredicated, their index
// clamped to the slice. BLOOMERY_PROBE_LOADS: the same loads, the words XORed together instead of the arithmetic (how fast the
// layout's access pattern alone goes; the result is garbage).

#include "numerics.cuh"
#include "pdl.cuh"
#include "swiglu.cuh"

// streamed weights: the read-only path, not kept in L1
__device__ __forceinline__ uint4 ldw(const uint4 *p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 lds(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
// x (the kernel before writes it): plain loads after griddepcontrol.wait
__device__ __forceinline__ float4 ldx(const float *p) {
  float4 r;
  asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}

// one k-group of a lane, its A fragments made once for the NB rows: weight word w (four mmas), the rows' x
// fragments xa (mmas 0, 1) and xb (2, 3), the two scale bytes s16 (rows g, g + 8) -> each row's sums over
// sub-block t, scaled, into acc0[b] / acc1[b]
template <int NB>
__device__ __forceinline__ void row_group(const uint4 &w, const uint4 (&xa)[NB], const uint4 (&xb)[NB], u32 s16,
                                          float (&acc0)[NB], float (&acc1)[NB]) {
  u32 a[4][4];
  nvfp4_rot_h2(w.x, a[0][0], a[0][1], a[0][2], a[0][3]);
  nvfp4_rot_h2(w.y, a[1][0], a[1][1], a[1][2], a[1][3]);
  nvfp4_rot_h2(w.z, a[2][0], a[2][1], a[2][2], a[2][3]);
  nvfp4_rot_h2(w.w, a[3][0], a[3][1], a[3][2], a[3][3]);
  float s0, s1;
  h2f2(e4m3x2_h2(s16), s0, s1);
#pragma unroll
  for (int b = 0; b < NB; b++) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_f16(d, a[0][0], a[0][1], a[0][2], a[0][3], xa[b].x, xa[b].y);
    mma_f16(d, a[1][0], a[1][1], a[1][2], a[1][3], xa[b].z, xa[b].w);
    mma_f16(d, a[2][0], a[2][1], a[2][2], a[2][3], xb[b].x, xb[b].y);
    mma_f16(d, a[3][0], a[3][1], a[3][2], a[3][3], xb[b].z, xb[b].w);
    acc0[b] = fmaf(d[0] + d[1], s0, acc0[b]);
    acc1[b] = fmaf(d[2] + d[3], s1, acc1[b]);
  }
}

// y_m[b, n] = (add ? y_m[b, n] : 0) + sum_k x'[b, k] W_m[n, k] for NB rows b and up to 3 members m (CTA columns
// [0, c1), [c1, c2), [c2, grid) own members 0, 1, 2); NORM 1: x' = x * nw and y times 1/sqrt(mean(x^2) + eps)
// (an RMSNorm folded in); PAIR 1: a gate (warps [0, W/2)) and an up (warps [W/2, W)) of one shape over the same
// row tiles, O = swiglu(gate, up) into y0. A row's arithmetic is the same for every NB (the verify program's
// rows are each what a 1-row launch computes).
template <int W, int U, int NB, int NORM, int PAIR>
__global__ void __launch_bounds__(W * 32) gemv_row(
    const uint4 *__restrict__ wa0, const uint4 *__restrict__ wa1, const uint4 *__restrict__ wa2,
    const uint4 *__restrict__ sa0, const uint4 *__restrict__ sa1, const uint4 *__restrict__ sa2,
    const float *__restrict__ sc0, const float *__restrict__ sc1, const float *__restrict__ sc2,
    float *y0, float *y1, float *y2, int n0, int n1, int n2, int c1, int c2,
    const float *x, int in, int ng, int add, float *part, int *sem, int sl,
    const float *nw, float eps, int lim, float L) {
  static_assert(U == 2 || U == 4 || U == 8, "U divides the 8 k-groups of a scale word");
  static_assert(!PAIR || W % 2 == 0, "a gate / up pair takes W / 2 warps each");
  extern __shared__ uint4 xs[];                      // [NB][sl k-groups][8 columns: sub-block j, part p][2] (32 B)
  __shared__ float wred[W][NB], wsq[W][NB], xinv[NB], xsq[NB], red[W][NB][16];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int bx = blockIdx.x, KS = gridDim.y, ks = blockIdx.y;
  const int g0 = ks * sl, ns = min(sl, ng - g0);     // this slice's k-groups (it starts at a multiple of 8)
  // this warp's member and 16-row tile within it
  int m, tile;
  if (PAIR) { m = warp / (W / 2); tile = bx * (W / 2) + warp % (W / 2); }
  else { m = bx >= c2 ? 2 : bx >= c1 ? 1 : 0; tile = (bx - (m == 2 ? c2 : m == 1 ? c1 : 0)) * W + warp; }
  const int nm = m == 0 ? n0 : m == 1 ? n1 : n2, ntile = (nm + 15) >> 4;
  const bool live = tile < ntile;
  const int tc = min(tile, ntile - 1);
  const uint4 *wp = (m == 0 ? wa0 : m == 1 ? wa1 : wa2) + ((size_t)tc * ng + g0) * 32 + lane;
  const uint4 *sp = (m == 0 ? sa0 : m == 1 ? sa1 : sa2) + ((size_t)tc * ((ng + 7) >> 3) + (g0 >> 3)) * 32 + lane;

  grid_dep_launch();
  uint4 buf[U];
#pragma unroll
  for (int u = 0; u < U; u++) buf[u] = u < ns ? ldw(wp + u * 32) : make_uint4(0u, 0u, 0u, 0u);
  uint4 sv = ldw(sp);
  grid_dep_wait();                                   // x (written by the kernel before) from here on

  // 1. each row's largest |x'| over the slice (NORM: its sum of x^2, a fixed order), then its B fragments
  //    times the power of two that brings the largest into [2^14, 2^15)
  const int k0 = g0 * 64, nk = ns * 64;
  float mx[NB], sq[NB];
#pragma unroll
  for (int b = 0; b < NB; b++) { mx[b] = 0.f; sq[b] = 0.f; }
  for (int i = threadIdx.x * 4; i < nk; i += W * 128) {
    float4 wv = make_float4(1.f, 1.f, 1.f, 1.f);
    if (NORM) wv = ldx(nw + k0 + i);
#pragma unroll
    for (int b = 0; b < NB; b++) {
      float4 v = ldx(x + (size_t)b * in + k0 + i);
      if (NORM) {
        sq[b] = fmaf(v.x, v.x, sq[b]); sq[b] = fmaf(v.y, v.y, sq[b]); sq[b] = fmaf(v.z, v.z, sq[b]); sq[b] = fmaf(v.w, v.w, sq[b]);
        v.x *= wv.x; v.y *= wv.y; v.z *= wv.z; v.w *= wv.w;
      }
      mx[b] = fmaxf(mx[b], fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
  }
#pragma unroll
  for (int b = 0; b < NB; b++) {
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      mx[b] = fmaxf(mx[b], __shfl_xor_sync(0xffffffffu, mx[b], o));
      if (NORM) sq[b] += __shfl_xor_sync(0xffffffffu, sq[b], o);
    }
    if (lane == 0) { wred[warp][b] = mx[b]; wsq[warp][b] = sq[b]; }
  }
  __syncthreads();
  float f[NB];
#pragma unroll
  for (int b = 0; b < NB; b++) {
    float v = wred[0][b], q = wsq[0][b];
#pragma unroll
    for (int w = 1; w < W; w++) { v = fmaxf(v, wred[w][b]); q += wsq[w][b]; }
    const int e = (v > 0.f && v < 3.0e38f) ? max(ilogbf(v), -100) : 0;
    f[b] = __uint_as_float((u32)(127 + 14 - e) << 23);
    if (threadIdx.x == 0) { xinv[b] = __uint_as_float((u32)(127 - 14 + e) << 23); xsq[b] = q; }
  }
  for (int i = threadIdx.x * 4; i < nk; i += W * 128) {
    float4 wv = make_float4(1.f, 1.f, 1.f, 1.f);
    if (NORM) wv = ldx(nw + k0 + i);
    // element i of the slice: k-group i / 64, sub-block (i / 16) % 4, its elements i % 16 .. + 3
    const int G = i >> 6, j = (i >> 4) & 3, el = i & 15;
#pragma unroll
    for (int b = 0; b < NB; b++) {
      float4 v = ldx(x + (size_t)b * in + k0 + i);
      if (NORM) { v.x *= wv.x; v.y *= wv.y; v.z *= wv.z; v.w *= wv.w; }
      v.x *= f[b]; v.y *= f[b]; v.z *= f[b]; v.w *= f[b];
      uint4 *col = xs + ((size_t)(b * sl + G) * 8 + 2 * j) * 2;
      reinterpret_cast<uint2 *>(col)[el >> 2] = make_uint2(f16_part2(v.x, v.y, 0), f16_part2(v.z, v.w, 0));
      reinterpret_cast<uint2 *>(col + 2)[el >> 2] = make_uint2(f16_part2(v.x, v.y, 1), f16_part2(v.z, v.w, 1));
    }
  }
  __syncthreads();

  // 2. the warp's tile over the slice: U words in flight, a scale word per 8 k-groups
  float acc0[NB], acc1[NB];
  uint4 xa[NB], xb[NB];
#pragma unroll
  for (int b = 0; b < NB; b++) { acc0[b] = acc1[b] = 0.f; xa[b] = xb[b] = make_uint4(0u, 0u, 0u, 0u); }
  const bool bl = (g >> 1) == t;                     // this lane holds column g = 2t + p of B: part p of sub-block t
  const u32 xaddr = (u32)__cvta_generic_to_shared(xs) + (u32)g * 32u;
  if (live) {
    for (int G = 0; G < ns; G += 8) {
      const uint4 scur = sv;
      if (G + 8 < ns) sv = ldw(sp + ((G >> 3) + 1) * 32);
      const u32 sw[4] = {scur.x, scur.y, scur.z, scur.w};
      const uint4 *wn = wp + (size_t)(G + U) * 32;   // the words U k-groups ahead (offsets j * 512 bytes)
#pragma unroll
      for (int j = 0; j < 8; j++) {
        if (G + j >= ns) break;                        // the last scale word of a row past in / 64 k-groups
        const uint4 w = buf[j % U];
#ifdef BLOOMERY_ROW_CLAMP
        buf[j % U] = ldw(wp + min(G + j + U, ns - 1) * 32);   // past the slice: its last word again (from L2)
#else
        if (G + j + U < ns) buf[j % U] = ldw(wn + j * 32);
#endif
#ifdef BLOOMERY_PROBE_LOADS
        acc0[0] = __uint_as_float(__float_as_uint(acc0[0]) ^ w.x ^ w.y ^ w.z ^ w.w ^ sw[j >> 1]);
#else
        if (bl) {
#pragma unroll
          for (int b = 0; b < NB; b++) {
            const u32 ad = xaddr + (u32)((b * sl + G + j) * 256);
            xa[b] = lds(ad);
            xb[b] = lds(ad + 16u);
          }
        }
        row_group<NB>(w, xa, xb, (j & 1) ? (sw[j >> 1] >> 16) : (sw[j >> 1] & 0xFFFFu), acc0, acc1);
#endif
      }
    }
  }
  // the lane's two rows over sub-block t -> over the slice (lanes t = 0..3 of a row, a fixed tree)
#pragma unroll
  for (int b = 0; b < NB; b++) {
    acc0[b] += __shfl_xor_sync(0xffffffffu, acc0[b], 1);
    acc1[b] += __shfl_xor_sync(0xffffffffu, acc1[b], 1);
    acc0[b] += __shfl_xor_sync(0xffffffffu, acc0[b], 2);
    acc1[b] += __shfl_xor_sync(0xffffffffu, acc1[b], 2);
    if (t == 0) { red[warp][b][g] = acc0[b] * xinv[b]; red[warp][b][g + 8] = acc1[b] * xinv[b]; }
  }
  __syncthreads();
  float *rf = &red[0][0][0];
  constexpr int NR = W * NB * 16;
  if (KS > 1) {
    // 3. split over k: the CTA's sums to part [KS][CTAs][NR] (NORM: its sums of x^2 after them), the last CTA
    //    of the column adds them in slice order
    const int CT = gridDim.x;
    float *sqp = part + (size_t)KS * CT * NR;
    for (int i = threadIdx.x; i < NR; i += W * 32) part[((size_t)ks * CT + bx) * NR + i] = rf[i];
    if (NORM && threadIdx.x < NB) sqp[((size_t)bx * KS + ks) * NB + threadIdx.x] = xsq[threadIdx.x];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(sem + bx, 1) == KS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < NR; i += W * 32) {
      const float *pv = part + (size_t)bx * NR + i;
      float v = 0.f;
      int k = 0;
      for (; k + 8 <= KS; k += 8) {
        float tv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) tv[j] = __ldcg(pv + (size_t)(k + j) * CT * NR);
#pragma unroll
        for (int j = 0; j < 8; j++) v += tv[j];
      }
      for (; k < KS; k++) v += __ldcg(pv + (size_t)k * CT * NR);
      rf[i] = v;
    }
    if (NORM && threadIdx.x < NB) {
      float q = 0.f;
      for (int k = 0; k < KS; k++) q += __ldcg(sqp + ((size_t)bx * KS + k) * NB + threadIdx.x);
      xsq[threadIdx.x] = q;
    }
    __syncthreads();
  }
  // 4. the epilogue: scale_2 * 2^14 (NORM: times the row's 1/sqrt(mean(x^2) + eps)), then add / SwiGLU
  for (int i = threadIdx.x; i < (PAIR ? NR / 2 : NR); i += W * 32) {
    const int fo = i & 15, b = (i >> 4) % NB, w = i / (16 * NB);
    const float inv = NORM ? 1.0f / sqrtf(xsq[b] / (float)in + eps) : 1.0f;
    if (PAIR) {
      const int n = (bx * (W / 2) + w) * 16 + fo;
      if (n >= n0) continue;
      const float gv = red[w][b][fo] * (__ldg(sc0) * 16384.0f) * inv;
      const float uv = red[w + W / 2][b][fo] * (__ldg(sc1) * 16384.0f) * inv;
      y0[(size_t)b * n0 + n] = lim ? swiglu1_limit(gv, uv, L) : swiglu1(gv, uv);
    } else {
      const int n = (tile - warp + w) * 16 + fo;    // the CTA's tiles within its member
      if (n >= nm) continue;
      const float v = red[w][b][fo] * (__ldg(m == 0 ? sc0 : m == 1 ? sc1 : sc2) * 16384.0f) * inv;
      float *p = (m == 0 ? y0 : m == 1 ? y1 : y2) + (size_t)b * nm + n;
      *p = add ? *p + v : v;
    }
  }
  if (KS > 1 && threadIdx.x == 0) sem[bx] = 0;
}

// ---- the repack: GGML NVFP4 rows (in / 64 blocks of 36 bytes: 4 E4M3 scales, then 4 sub-blocks of 8 bytes,
// byte j of sub-block c = element 16 c + j low nibble, + 8 high) -> the row layout; past the matrix zero.
__device__ __forceinline__ u32 row_nib(const u8 *Wg, int out, int in, int n, int k) {
  if (n >= out || k >= in) return 0u;
  const u8 v = Wg[(size_t)n * ((in >> 6) * 36) + (k >> 6) * 36 + 4 + 8 * ((k & 63) >> 4) + (k & 7)];
  return (k & 8) ? (u32)(v >> 4) : (u32)(v & 15u);
}
// one thread a layout word: word i of lane (g, t) of k-group G of tile r; register o's half h is
// row 16 r + g + 8 (o & 1), k = 64 G + 16 t + 4 i + 2 (o >> 1) + h
__global__ void row_repack_w(const u8 *__restrict__ Wg, u32 *__restrict__ wa, int out, int in, int ng, long long words) {
  const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (id >= words) return;
  const int i = (int)(id & 3), lane = (int)((id >> 2) & 31);
  const long long rg = id >> 7;
  const int G = (int)(rg % ng), r = (int)(rg / ng), g = lane >> 2, t = lane & 3;
  const u32 ra[4] = {0u, 1u, 2u, 9u}, rb[4] = {0u, 3u, 12u, 9u};
  u32 q = 0u;
#pragma unroll
  for (int o = 0; o < 4; o++) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const u32 v = row_nib(Wg, out, in, 16 * r + g + 8 * (o & 1), 64 * G + 16 * t + 4 * i + 2 * (o >> 1) + h);
      q |= ((v >> 3) & 1u) << ((15u + 16u * h + ra[o]) & 31u);
#pragma unroll
      for (int bit = 0; bit < 3; bit++) q |= ((v >> bit) & 1u) << ((9u + bit + 16u * h + rb[o]) & 31u);
    }
  }
  wa[id] = q;
}
// one thread a scale byte: byte b of lane (g, t) of scale word G8 of tile r = row 16 r + g + 8 (b & 1),
// k-group 8 G8 + b / 2, sub-block t
__global__ void row_repack_s(const u8 *__restrict__ Wg, u8 *__restrict__ sa, int out, int in, int ng, long long bytes) {
  const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (id >= bytes) return;
  const int b = (int)(id & 15), lane = (int)((id >> 4) & 31);
  const long long rg = id >> 9;
  const int n8 = (ng + 7) >> 3, G8 = (int)(rg % n8), r = (int)(rg / n8), g = lane >> 2, t = lane & 3;
  const int n = 16 * r + g + 8 * (b & 1), G = 8 * G8 + (b >> 1);
  sa[id] = (n < out && 64 * G < in) ? Wg[(size_t)n * ((in >> 6) * 36) + G * 36 + t] : (u8)0;
}
