// Decode GEMV of GGML NVFP4 weights repacked at load time into a tile layout made for the tensor cores
// (binding and the layout's NumPy twin: runtime/cuda/gemv_tile.py; design and measurements:
// docs/kernels.md "The NVFP4 tile layout").
//
//   y_m[b, n] = (add ? y_m[b, n] : 0) + sum_k x'[b, k] * W_m[n, k],   b < nb <= 16, up to 3 members m
//
// x' = x (NORM 0) or x * nw (NORM 1, an RMSNorm folded in: y then times 1/sqrt(mean(x^2) + eps)); PAIR 1:
// a gate and an up of one shape, O = swiglu(gate, up). Every weight is read once for all nb rows.
//
// The tile layout (per matrix, n padded to 64): for each 64-output column c and 16-wide k-step s, 512
// bytes of nibbles, one 16-byte word quad per lane of a warp, and 64 scale bytes:
//   wt[((c * nks + s) * 32 + lane) * 4 + j]: lane (g = lane / 4, t = lane % 4), word j holds the mma B
//     fragments of n-tiles 2j and 2j + 1 (8 outputs each, output 64 c + 8 nt + g) at k = 16 s + 2t, 2t+1,
//     2t+8, 2t+9, as four f16x2 registers o0..o3 extracted by rotations and masks (nvfp4_rot_h2, numerics.cuh);
//   st[((c * nks + s) * 8 + g) * 8 + nt]: the E4M3 scale of output 64 c + 8 nt + g over k-step s.
// A nibble s.e1e0m placed as f16 bits s at 15, e1e0m at 11..9 is e2m1 * 2^-14 exactly (f16's subnormals
// line up with E2M1's), so o_k is two weights as f16x2 with 1 or 2 integer instructions a register; times
// the scale in f16 the product is still exact (at most 6 significant bits, >= 2^-24); scale_2 * 2^14
// multiplies the float32 sum.
//
// mma.sync m16n8k16 (f16 in, float32 accumulate), x as A: row g of m-tile mt is batch row 8 mt + g's high
// f16 part, row g + 8 its low part (x = hi + lo to ~22 bits after a power of two per batch row and k-slice
// that brings the slice's largest |x'| into [2^14, 2^15)), so a lane's (d0 + d2, d1 + d3) are two outputs
// of one batch row. A warp owns one 64-output column of one member; the W warps of a CTA own W columns
// (PAIR: W / 2 columns of the gate and the same of the up); grid (CTA columns, KS k-slices). Each CTA's x
// slice is copied once into shared memory and split there in A-fragment order. A warp streams its
// column through a ring of P k-steps in shared memory (cp.async: bytes in flight without registers held;
// a lane reads back only what it copied, so no barrier). Partial sums go to `part`; the last CTA of a
// column to arrive (a counter per column in `sem`, left at 0) adds them in slice order and writes the
// outputs: deterministic, and a batch row's result does not depend on nb (the verify program).
// Programmatic dependent launch: the first P k-steps' weights are in flight before griddepcontrol.wait.

#include "numerics.cuh"
#include "pdl.cuh"
#include "swiglu.cuh"

__device__ __forceinline__ u32 prmt(u32 a, u32 sel) { u32 d; asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(a), "r"(sel)); return d; }

// One k-step of a warp: its 8 n-tiles' B fragments from one word quad and 8 scale bytes, times the MT
// m-tiles of x.
template <int MT>
__device__ __forceinline__ void tile_step(float (&d)[8][MT][4], const uint4 &w, const uint2 &sv, const uint4 (&a)[MT]) {
  const u32 q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const u32 sw = j < 2 ? sv.x : sv.y;
    const u32 s = e4m3x2_h2((j & 1) ? (sw >> 16) : (sw & 0xFFFFu));        // scales of n-tiles 2j, 2j + 1
    const u32 sa = prmt(s, 0x1010u), sb = prmt(s, 0x3232u);
    u32 o0, o1, o2, o3;
    nvfp4_rot_h2(q[j], o0, o1, o2, o3);
    const u32 b00 = hmul2(o0, sa), b01 = hmul2(o1, sa), b10 = hmul2(o2, sb), b11 = hmul2(o3, sb);
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      mma_f16(d[2 * j][mt], a[mt].x, a[mt].y, a[mt].z, a[mt].w, b00, b01);
      mma_f16(d[2 * j + 1][mt], a[mt].x, a[mt].y, a[mt].z, a[mt].w, b10, b11);
    }
  }
}

// asynchronous copies global -> shared (cp.async: no registers held while in flight), to a shared address
__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16s(u32 dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8s(u32 dst, const void *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp16(void *dst, const void *src) { cp16s(smem_addr(dst), src); }
__device__ __forceinline__ void cp8(void *dst, const void *src) { cp8s(smem_addr(dst), src); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// shared-memory loads that stay after the cp.async wait before them (volatile asm keeps their order)
__device__ __forceinline__ uint4 lds128(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ uint2 lds64(u32 a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
  return v;
}
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

template <int W, int MT, int P, int NORM, int PAIR>
__global__ void __launch_bounds__(W * 32) gemv_tile(
    const uint4 *__restrict__ W0, const uint4 *__restrict__ W1, const uint4 *__restrict__ W2,
    const uint2 *__restrict__ S0, const uint2 *__restrict__ S1, const uint2 *__restrict__ S2,
    const float *__restrict__ sc0, const float *__restrict__ sc1, const float *__restrict__ sc2,
    float *y0, float *y1, float *y2, int n0, int n1, int n2, int c1, int c2,
    const float *x, int in, int nb, int add, float *part, int *sem, int sl,
    const float *nw, float eps, int lim, float L) {
  // shared: the x slice as A fragments [MT][sl][G][4] (first its raw float32 values in the same slots),
  // NORM: the norm weight's slice [sl * 16]; each warp's P-stage ring of weight words and scale bytes
  extern __shared__ uint4 smem[];
  __shared__ float xinv[16], xsq[16];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int bx = blockIdx.x, KS = gridDim.y, ks = blockIdx.y;
  const int nks = in >> 4, s0 = ks * sl, ns = min(sl, nks - s0);
  const int G = min(nb, 8);
  uint4 *xs = smem;
  float *nws = reinterpret_cast<float *>(xs + MT * sl * G * 4);
  uint4 *ring_w = xs + MT * sl * G * 4 + (NORM ? sl * 4 : 0) + warp * P * 32 + lane;
  uint2 *ring_s = reinterpret_cast<uint2 *>(xs + MT * sl * G * 4 + (NORM ? sl * 4 : 0) + W * P * 32) + warp * P * 32 + lane;
  // this warp's member and 64-output column within it
  int m, col;
  if (PAIR) { m = warp & 1; col = bx * (W / 2) + (warp >> 1); }
  else { m = bx >= c2 ? 2 : bx >= c1 ? 1 : 0; col = (bx - (m == 2 ? c2 : m == 1 ? c1 : 0)) * W + warp; }
  const int nm = m == 0 ? n0 : m == 1 ? n1 : n2;
  const bool live = col * 64 < nm;
  const uint4 *wp = (m == 0 ? W0 : m == 1 ? W1 : W2) + ((size_t)col * nks + s0) * 32 + lane;
  const uint2 *sp = (m == 0 ? S0 : m == 1 ? S1 : S2) + ((size_t)col * nks + s0) * 8 + g;

  // the first P k-steps' weights in flight before the kernel before is waited for (they are no one's output)
  grid_dep_launch();
#pragma unroll
  for (int p = 0; p < P; p++) {
    if (live && p < ns) { cp16(ring_w + p * 32, wp + p * 32); cp8(ring_s + p * 32, sp + p * 8); }
    cp_commit();
  }
  grid_dep_wait();                                   // x (written by the kernel before) from here on

  // 1. the raw x slice into the fragment slots (x[k], x[k+1], x[k+8], x[k+9] of lane t's k = 16 s + 2t)
  const int k0 = s0 * 16, per_row = ns * 4;
  for (int i = threadIdx.x; i < nb * per_row; i += W * 32) {
    const int b = i / per_row, r = i - b * per_row, s = r >> 2, tt = r & 3;
    const float *src = x + (size_t)b * in + k0 + 16 * s + 2 * tt;
    uint4 *dst = xs + (((b >> 3) * sl + s) * G + (b & 7)) * 4 + tt;
    cp8(dst, src);
    cp8(reinterpret_cast<char *>(dst) + 8, src + 8);
  }
  if (NORM)
    for (int i = threadIdx.x; i < ns * 4; i += W * 32) cp16(nws + 4 * i, nw + k0 + 4 * i);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  // 2. a warp a batch row: the slice's largest |x'| (and NORM: its sum of x^2, lane order then a fixed
  //    tree: the same for any nb), then the slots rewritten as A fragments of x' times a power of two
  //    that brings the largest into [2^14, 2^15): (hi, lo) pairs of f16x2
  for (int b = warp; b < nb; b += W) {
    float mx = 0.f, sq = 0.f;
    uint4 *row = xs + ((b >> 3) * sl * G + (b & 7)) * 4;
    for (int j = lane; j < per_row; j += 32) {
      const int s = j >> 2, tt = j & 3;
      float4 v = *reinterpret_cast<const float4 *>(row + s * G * 4 + tt);
      if (NORM) {
        sq = fmaf(v.x, v.x, sq); sq = fmaf(v.y, v.y, sq); sq = fmaf(v.z, v.z, sq); sq = fmaf(v.w, v.w, sq);
        const float *w = nws + 16 * s + 2 * tt;
        v.x *= w[0]; v.y *= w[1]; v.z *= w[8]; v.w *= w[9];
      }
      mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (NORM) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    }
    const int e = (mx > 0.f && mx < 3.0e38f) ? max(ilogbf(mx), -100) : 0;
    const float f = __uint_as_float((u32)(127 + 14 - e) << 23);
    if (lane == 0) { xinv[b] = __uint_as_float((u32)(127 - 14 + e) << 23); xsq[b] = sq; }
    for (int j = lane; j < per_row; j += 32) {
      const int s = j >> 2, tt = j & 3;
      uint4 *slot = row + s * G * 4 + tt;
      float4 v = *reinterpret_cast<const float4 *>(slot);
      if (NORM) {
        const float *w = nws + 16 * s + 2 * tt;
        v.x *= w[0]; v.y *= w[1]; v.z *= w[8]; v.w *= w[9];
      }
      v.x *= f; v.y *= f; v.z *= f; v.w *= f;
      *slot = make_uint4(f16_part2(v.x, v.y, 0), f16_part2(v.x, v.y, 1), f16_part2(v.z, v.w, 0), f16_part2(v.z, v.w, 1));
    }
  }
  __syncthreads();

  // 3. the warp's column over the slice, its ring P k-steps deep (a lane reads back only what it copied),
  //    four k-steps an iteration (sl and so ns are multiples of 4; P of 4), shared addresses made once
  float d[8][MT][4];
#pragma unroll
  for (int nt = 0; nt < 8; nt++)
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int e = 0; e < 4; e++) d[nt][mt][e] = 0.f;
  if (live) {
    const u32 rw = smem_addr(ring_w), rs = smem_addr(ring_s);
    // A rows past the batch rows hold whatever a valid slot holds: they only reach D rows never stored
    u32 xa[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) xa[mt] = smem_addr(xs + ((mt * sl) * G + min(g, G - 1)) * 4 + t);
    const u32 xstep = G * 64;                          // bytes of one k-step's fragments of an m-tile
    const uint4 *gw = wp + P * 32;
    const uint2 *gs = sp + P * 8;
    for (int s = 0; s < ns; s += 4) {
      const u32 ow = rw + (u32)(s & (P - 1)) * 512u, os = rs + (u32)(s & (P - 1)) * 256u;
#pragma unroll
      for (int u = 0; u < 4; u++) {
        cp_wait<P - 1>();
        const uint4 w = lds128(ow + u * 512u);
        const uint2 sv = lds64(os + u * 256u);
        uint4 a[MT];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) a[mt] = lds128(xa[mt] + u * xstep);
        tile_step<MT>(d, w, sv, a);
        if (s + u + P < ns) { cp16s(ow + u * 512u, gw + u * 32); cp8s(os + u * 256u, gs + u * 8); }
        cp_commit();
      }
      gw += 4 * 32;
      gs += 4 * 8;
#pragma unroll
      for (int mt = 0; mt < MT; mt++) xa[mt] += 4 * xstep;
    }
  }

  // 4. partial sums: lane (g, t) holds batch row 8 mt + g's outputs 8 nt + 2t, + 1 of the column
  const int UT = gridDim.x * W, slot = bx * W + warp;
  float *sqp = part + (size_t)KS * nb * UT * 64;     // NORM: [columns][KS][nb] sums of x^2
  if (live) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const int b = 8 * mt + g;
      if (b >= nb) continue;
      const float f = xinv[b];
#pragma unroll
      for (int nt = 0; nt < 8; nt++)
        *reinterpret_cast<float2 *>(part + ((size_t)(ks * nb + b) * UT + slot) * 64 + 8 * nt + 2 * t) =
            make_float2((d[nt][mt][0] + d[nt][mt][2]) * f, (d[nt][mt][1] + d[nt][mt][3]) * f);
    }
  }
  if (NORM && threadIdx.x < nb) sqp[((size_t)bx * KS + ks) * nb + threadIdx.x] = xsq[threadIdx.x];
  if (KS > 1) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(sem + bx, 1) == KS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
  } else {
    __syncthreads();
  }

  // 5. the last CTA of the column: the slices' sums in order (loads eight at a time), the scales, the epilogue
  if (NORM && threadIdx.x < nb) {
    float ss = 0.f;
    for (int k = 0; k < KS; k++) ss += __ldcg(sqp + ((size_t)bx * KS + k) * nb + threadIdx.x);
    xsq[threadIdx.x] = 1.0f / sqrtf(ss / (float)in + eps);
  }
  if (NORM) __syncthreads();
  const size_t kstride = (size_t)nb * UT * 64;
  const int units = PAIR ? W / 2 : W;
  for (int i = threadIdx.x; i < units * nb * 64; i += W * 32) {
    const int f = i & 63, r = i >> 6, b = r % nb, w = r / nb;
    if (PAIR) {
      const int n = (bx * (W / 2) + w) * 64 + f;
      if (n >= n0) continue;
      const float *pg = part + ((size_t)b * UT + bx * W + 2 * w) * 64 + f;
      float gv = 0.f, uv = 0.f;
      int k = 0;
      for (; k + 4 <= KS; k += 4) {
        float tg[4], tu[4];
#pragma unroll
        for (int j = 0; j < 4; j++) { tg[j] = __ldcg(pg + (k + j) * kstride); tu[j] = __ldcg(pg + (k + j) * kstride + 64); }
#pragma unroll
        for (int j = 0; j < 4; j++) { gv += tg[j]; uv += tu[j]; }
      }
      for (; k < KS; k++) { gv += __ldcg(pg + k * kstride); uv += __ldcg(pg + k * kstride + 64); }
      gv *= __ldg(sc0) * 16384.0f;
      uv *= __ldg(sc1) * 16384.0f;
      if (NORM) { gv *= xsq[b]; uv *= xsq[b]; }
      y0[(size_t)b * n0 + n] = lim ? swiglu1_limit(gv, uv, L) : swiglu1(gv, uv);
    } else {
      const int mm = bx >= c2 ? 2 : bx >= c1 ? 1 : 0;
      const int n = ((bx - (mm == 2 ? c2 : mm == 1 ? c1 : 0)) * W + w) * 64 + f;
      const int nn = mm == 0 ? n0 : mm == 1 ? n1 : n2;
      if (n >= nn) continue;
      const float *pv = part + ((size_t)b * UT + bx * W + w) * 64 + f;
      float v = 0.f;
      int k = 0;
      for (; k + 8 <= KS; k += 8) {
        float tv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) tv[j] = __ldcg(pv + (k + j) * kstride);
#pragma unroll
        for (int j = 0; j < 8; j++) v += tv[j];
      }
      for (; k < KS; k++) v += __ldcg(pv + k * kstride);
      v *= __ldg(mm == 0 ? sc0 : mm == 1 ? sc1 : sc2) * 16384.0f;
      if (NORM) v *= xsq[b];
      float *p = (mm == 0 ? y0 : mm == 1 ? y1 : y2) + (size_t)b * nn + n;
      *p = add ? *p + v : v;
    }
  }
  if (KS > 1 && threadIdx.x == 0) sem[bx] = 0;
}

// ---- the repack: GGML NVFP4 rows (in / 64 blocks of 36 bytes: 4 E4M3 scales, then 4 sub-blocks of 8 bytes,
// byte j of sub-block c = element 16 c + j low nibble, + 8 high) -> the tile layout; outputs past `out` zero.
__device__ __forceinline__ u32 ggml_nib(const u8 *Wg, int out, int rowbytes, int n, int k) {
  if (n >= out) return 0u;
  const u8 v = Wg[(size_t)n * rowbytes + (k >> 6) * 36 + 4 + 8 * ((k & 63) >> 4) + (k & 7)];
  return (k & 8) ? (u32)(v >> 4) : (u32)(v & 15u);
}
// target bit of a nibble's bit i (0 m, 1 e0, 2 e1, 3 s) in half h: m 9, e0 10, e1 11, s 15 (+16 h)
__global__ void tile_repack_w(const u8 *__restrict__ Wg, u32 *__restrict__ wt, int out, int in, long long words) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= words) return;
  const int nks = in >> 4, rowbytes = (in >> 6) * 36;
  const int j = (int)(i & 3), lane = (int)((i >> 2) & 31);
  const long long cs = i >> 7;
  const int s = (int)(cs % nks), c = (int)(cs / nks), g = lane >> 2, t = lane & 3;
  const u32 ra[4] = {0u, 1u, 2u, 9u}, rb[4] = {0u, 3u, 12u, 9u};
  u32 q = 0u;
#pragma unroll
  for (int o = 0; o < 4; o++) {
    const int nt = 2 * j + (o >> 1), reg = o & 1, n = 64 * c + 8 * nt + g;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const u32 v = ggml_nib(Wg, out, rowbytes, n, 16 * s + 2 * t + h + 8 * reg);
      q |= ((v >> 3) & 1u) << ((15u + 16u * h + ra[o]) & 31u);
#pragma unroll
      for (int bit = 0; bit < 3; bit++) q |= ((v >> bit) & 1u) << ((9u + bit + 16u * h + rb[o]) & 31u);
    }
  }
  wt[i] = q;
}
__global__ void tile_repack_s(const u8 *__restrict__ Wg, u8 *__restrict__ st, int out, int in, long long bytes) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= bytes) return;
  const int nks = in >> 4, rowbytes = (in >> 6) * 36;
  const int nt = (int)(i & 7), g = (int)((i >> 3) & 7);
  const long long cs = i >> 6;
  const int s = (int)(cs % nks), c = (int)(cs / nks), n = 64 * c + 8 * nt + g;
  st[i] = n < out ? Wg[(size_t)n * rowbytes + (s >> 2) * 36 + (s & 3)] : (u8)0;
}
