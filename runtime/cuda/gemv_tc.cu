// Decode GEMV of several activation rows on the tensor cores, reading the weight once for all rows
// (binding: runtime/cuda/gemv.py, Linear.launch_tc; design and measurements: docs/kernels.md).
//
//   y[b, row] = (add ? y[b, row] : 0) + sum_k x[b, k] * W[row, k],   b < nb <= 4 * NT
//
// W: GGML NVFP4 rows of in/64 blocks of 36 bytes (4 E4M3 sub-block scales, then 4 sub-blocks of 8
// bytes; sub-block byte j: element j in the low nibble, j + 8 in the high one); sc: scale_2 (f32).
// x, y: float32 row-major [nb, in] / [nb, out].
//
// mma.sync m16n8k16 (f16 in, float32 accumulate), the weight as A (16 rows), x as B: column 2i of
// an n-tile is batch row 4 nt + i's high f16 part, column 2i + 1 its low part (x = hi + lo to ~22
// bits, after a power of two per batch row that brings the slice's largest |x| into [2^14, 2^15)),
// so an accumulator pair (d0 + d1) is one output of one batch row. Products are exact (e2m1 * E4M3
// * 2^-6 is exact in f16); the sum is float32.
//
// Up to 3 members that read the same x (q, k and v; gate and up), each with its own W, sc, y, out, bps and
// KS: the grid is the members' CTAs one after another, member m's being its ceil(out_m / (16 MT W)) row
// tiles x KS_m k-slices (tile fastest), and each member's rows are exactly what a launch of it alone
// computes. A CTA takes 16 MT W rows (warp w: MT m-tiles) and the k-slice ks (bps blocks). Its x slice
// goes to shared memory once, already in B-fragment order (one conflict-free 16-byte load per lane and
// fragment half), read by all W warps. With KS > 1 each CTA writes its partial sums to its member's
// [KS, nb, out] of `part` (the members' one after another); the last CTA of a row tile to arrive (a
// counter per tile in `sem`, the members' one after another, left at 0 for the next launch) adds them in
// ks order: deterministic (splitk_finish). Programmatic dependent launch (pdl.cuh): the first weights are
// in flight before the wait for the kernel before; x is read after it.

#include "numerics.cuh"
#include "pdl.cuh"

template <int MT, int NT> __device__ __forceinline__ void zero_acc(float (&d)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int q = 0; q < 4; q++) d[mt][nt][q] = 0.f;
}

// U blocks of MT m-tiles' weights: thread (g, c) reads sub-block c (data words 2c, 2c+1 at byte 4 + 8c,
// scale byte c) of rows g and g + 8 of each m-tile (blocks past the slice re-read its last block)
template <int MT, int U> struct Chunk { u32 wa[U][MT][2], wb[U][MT][2], sa[U][MT], sb[U][MT]; };

template <int MT, int U>
__device__ __forceinline__ void load_chunk(Chunk<MT, U> &q, const u8 *const (&pa)[MT], const u8 *const (&pb)[MT],
                                           int jb, int nj, int c) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int o = min(jb + u, nj - 1) * 36;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const u32 *qa = reinterpret_cast<const u32 *>(pa[mt] + o + 4 + 8 * c);
      const u32 *qb = reinterpret_cast<const u32 *>(pb[mt] + o + 4 + 8 * c);
      q.wa[u][mt][0] = __ldg(qa); q.wa[u][mt][1] = __ldg(qa + 1);
      q.wb[u][mt][0] = __ldg(qb); q.wb[u][mt][1] = __ldg(qb + 1);
      q.sa[u][mt] = __ldg(pa[mt] + o + c); q.sb[u][mt] = __ldg(pb[mt] + o + c);
    }
  }
}

template <int MT, int NT, int U>
__device__ __forceinline__ void mma_chunk(float (&d)[MT][NT][4], const Chunk<MT, U> &q, const uint4 *xs, int jb, int nj,
                                          int lane) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int j = jb + u;
    if (j < nj) {
      uint4 q0[NT], q1[NT];
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        q0[nt] = xs[((j * NT + nt) * 2) * 32 + lane];
        q1[nt] = xs[((j * NT + nt) * 2 + 1) * 32 + lane];
      }
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        const u32 s2a = e4m3x2_h2(q.sa[u][mt] | (q.sa[u][mt] << 8)), s2b = e4m3x2_h2(q.sb[u][mt] | (q.sb[u][mt] << 8));
        u32 A0[4], A1[4], B0[4], B1[4];
        nvfp4_word_h2(q.wa[u][mt][0], s2a, A0); nvfp4_word_h2(q.wa[u][mt][1], s2a, A1);
        nvfp4_word_h2(q.wb[u][mt][0], s2b, B0); nvfp4_word_h2(q.wb[u][mt][1], s2b, B1);
        // k slots of the four mmas: elements 0..3, 8..11, 4..7, 12..15 of the sub-block
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          mma_f16(d[mt][nt], A0[0], B0[0], A0[1], B0[1], q0[nt].x, q0[nt].y);
          mma_f16(d[mt][nt], A0[2], B0[2], A0[3], B0[3], q1[nt].x, q1[nt].y);
          mma_f16(d[mt][nt], A1[0], B1[0], A1[1], B1[1], q0[nt].z, q0[nt].w);
          mma_f16(d[mt][nt], A1[2], B1[2], A1[3], B1[3], q1[nt].z, q1[nt].w);
        }
      }
    }
  }
}

// NS > 0: the weights reach the warp through its own shared-memory stages (cp.async, 16-byte pieces:
// a row's 4 blocks are 144 contiguous bytes, whole 128-byte lines per instruction), NS chunks of 4
// blocks in flight, instead of 4-byte loads that touch 8 rows' lines each. Needs 16-byte aligned
// chunks: in % 256 == 0 and slices of whole chunks (the host checks).
#define TC_ROW 160                                   // a staged row: 144 bytes + 16 (spreads the banks)
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
  const u32 d = (u32)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

template <int MT>
__device__ __forceinline__ void stage_chunk(u8 *st, const u8 *Wt, int rbase, int out, int rowbytes, size_t off, int lane) {
  for (int p = lane; p < 16 * MT * 9; p += 32) {
    const int r = p / 9, q = p - 9 * (p / 9);
    cp_async16(st + r * TC_ROW + 16 * q, Wt + (size_t)min(rbase + r, out - 1) * rowbytes + off + 16 * q);
  }
  cp_commit();
}
// the staged chunk through the tensor cores: each block's fragments read from shared memory just before
// its mmas (a few registers, so MT can grow: B fragments are reused by MT m-tiles)
template <int MT, int NT>
__device__ __forceinline__ void mma_staged(float (&d)[MT][NT][4], const u8 *st, const uint4 *xs, int jb, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int j = jb + u;
    uint4 q0[NT], q1[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      q0[nt] = xs[((j * NT + nt) * 2) * 32 + lane];
      q1[nt] = xs[((j * NT + nt) * 2 + 1) * 32 + lane];
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const u8 *a = st + (16 * mt + g) * TC_ROW + 36 * u, *b = a + 8 * TC_ROW;
      const u32 wa0 = *reinterpret_cast<const u32 *>(a + 4 + 8 * c), wa1 = *reinterpret_cast<const u32 *>(a + 8 + 8 * c);
      const u32 wb0 = *reinterpret_cast<const u32 *>(b + 4 + 8 * c), wb1 = *reinterpret_cast<const u32 *>(b + 8 + 8 * c);
      const u32 s2a = e4m3x2_h2(a[c] * 0x0101u), s2b = e4m3x2_h2(b[c] * 0x0101u);
      u32 A0[4], A1[4], B0[4], B1[4];
      nvfp4_word_h2(wa0, s2a, A0); nvfp4_word_h2(wa1, s2a, A1);
      nvfp4_word_h2(wb0, s2b, B0); nvfp4_word_h2(wb1, s2b, B1);
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        mma_f16(d[mt][nt], A0[0], B0[0], A0[1], B0[1], q0[nt].x, q0[nt].y);
        mma_f16(d[mt][nt], A0[2], B0[2], A0[3], B0[3], q1[nt].x, q1[nt].y);
        mma_f16(d[mt][nt], A1[0], B1[0], A1[1], B1[1], q0[nt].z, q0[nt].w);
        mma_f16(d[mt][nt], A1[2], B1[2], A1[3], B1[3], q1[nt].z, q1[nt].w);
      }
    }
  }
}

// The split-K ending (after a CTA has written its partial sums, slice ks of this launch's [KS, nb, out] in
// `part`): the last CTA of the row tile to arrive (a counter per tile in `sem`, left at 0 for the next launch)
// adds the KS slices in ks order (deterministic), times s, into y (+ y). Four rows a thread and eight slices'
// loads in flight where out % 4 == 0 and part, y are 16-byte aligned (one float and one slice at a time, the
// sum was 20-40% of a 16-row launch). NTH: the CTA's threads.
template <int RT, int NTH>
__device__ __forceinline__ void splitk_finish(const float *part, int *sem, float *y, int tile, int out, int nb, int KS,
                                              int add, float s, int *last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(sem + tile, 1) == KS - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  const int row0 = tile * RT;
  if ((out & 3) == 0 && ((size_t)part & 15) == 0 && ((size_t)y & 15) == 0) {
    constexpr int R4 = RT / 4;
    for (int i = threadIdx.x; i < nb * R4; i += NTH) {
      const int b = i / R4, row = row0 + 4 * (i - b * R4);
      if (row < out) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int k = 0; k < KS; k++) {
          const float4 t = __ldcg(reinterpret_cast<const float4 *>(part + ((size_t)k * nb + b) * out + row));
          v.x += t.x; v.y += t.y; v.z += t.z; v.w += t.w;
        }
        float4 *p = reinterpret_cast<float4 *>(y + (size_t)b * out + row);
        float4 r = make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
        if (add) { const float4 o = *p; r.x = o.x + r.x; r.y = o.y + r.y; r.z = o.z + r.z; r.w = o.w + r.w; }
        *p = r;
      }
    }
  } else {
    for (int i = threadIdx.x; i < nb * RT; i += NTH) {
      const int b = i / RT, row = row0 + i % RT;
      if (row < out) {
        float v = 0.f;
        for (int k = 0; k < KS; k++) v += __ldcg(part + ((size_t)k * nb + b) * out + row);
        v *= s;
        float *p = y + (size_t)b * out + row;
        *p = add ? *p + v : v;
      }
    }
  }
  if (threadIdx.x == 0) sem[tile] = 0;
}

// x's power of two, shared by the per-CTA staging (step 1 of gemv_nvfp4_tc) and gemv_tc_xfrag: the running
// largest |x| over a float4; the power of two that brings a largest |x| m into [2^14, 2^15) (e = 0: 1, for m
// zero or not finite) and its inverse
__device__ __forceinline__ float absmax4(float m, float4 v) {
  return fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
}
__device__ __forceinline__ int x_exp(float m) { return (m > 0.f && m < 3.0e38f) ? max(ilogbf(m), -100) : 0; }
__device__ __forceinline__ float x_scale(int e) { return __uint_as_float((u32)(127 + 14 - e) << 23); }
__device__ __forceinline__ float x_inv(int e) { return __uint_as_float((u32)(127 - 14 + e) << 23); }

// XG: x's fragments and powers of two come from gemv_tc_xfrag (launched just before, once for the whole
// row: xf, xig) instead of each CTA making its slice's in shared memory (steps 1 and 2 below skipped)
template <int NT>
__global__ void __launch_bounds__(256) gemv_tc_xfrag(const float *x, uint4 *xf, float *xig, int in, int nb) {
  // CTA b: batch row b (< 4 NT; rows past nb zero) as the f16 hi / lo fragments of every block, in the order of
  // step 2 below (xf[nblk][NT][2 halves][32 lanes]), after the power of two of the whole row
  __shared__ float red[8];
  grid_dep_launch();
  const int b = blockIdx.x, nt = b >> 2, bb = b & 3, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  grid_dep_wait();
  const float *xr = x + (size_t)b * in;
  float m = 0.f;
  if (b < nb)
    for (int i = threadIdx.x; i < (in >> 2); i += 256) {
      m = absmax4(m, reinterpret_cast<const float4 *>(xr)[i]);
    }
#pragma unroll
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < 8; w++) m = fmaxf(m, red[w]);
  const int e = x_exp(m);
  const float s = x_scale(e);
  if (threadIdx.x == 0) xig[b] = x_inv(e);
  // piece p: block j, half h, lane column c: elements 64 j + 16 c + 8 h .. + 7, for lanes 8 bb + 4 pt + c
  for (int p = threadIdx.x; p < (in >> 6) * 8; p += 256) {
    const int j = p >> 3, h = (p >> 2) & 1, c = p & 3;
    float4 v0 = make_float4(0.f, 0.f, 0.f, 0.f), v1 = v0;
    if (b < nb) {
      const float4 *q = reinterpret_cast<const float4 *>(xr + 64 * j + 16 * c + 8 * h);
      v0 = q[0]; v1 = q[1];
    }
    uint4 *o = xf + ((size_t)(j * NT + nt) * 2 + h) * 32 + 8 * bb + c;
#pragma unroll
    for (int pt = 0; pt < 2; pt++)
      o[4 * pt] = make_uint4(f16_part2(v0.x * s, v0.y * s, pt), f16_part2(v0.z * s, v0.w * s, pt),
                             f16_part2(v1.x * s, v1.y * s, pt), f16_part2(v1.z * s, v1.w * s, pt));
  }
}

template <int MT, int W, int NT, int U, int NS, int XG>
__global__ void __launch_bounds__(W * 32) gemv_nvfp4_tc(const u8 *__restrict__ W0, const u8 *__restrict__ W1,
    const u8 *__restrict__ W2, const float *__restrict__ sc0, const float *__restrict__ sc1,
    const float *__restrict__ sc2, const float *x, float *y0, float *y1, float *y2, float *part, int *sem,
    int out0, int out1, int out2, int in, int nb, int add, int bps0, int bps1, int bps2, int ks0, int ks1, int ks2,
    int nm, const uint4 *xf, const float *xig) {
  extern __shared__ uint4 xs[];                      // [nj][NT][2 halves][32 lanes]
  __shared__ float xscale[4 * NT], xinv[4 * NT];
  __shared__ int last;
  grid_dep_launch();                                 // PDL: the next kernel may be scheduled now
  // the member of this CTA: members' CTAs one after another, each its tiles x KS k-slices (tile fastest);
  // its partial sums and tile counters after the members' before it
  constexpr int RT = 16 * MT * W;
  int bx = blockIdx.x, m = 0, KS = ks0, out = out0, tl = (out0 + RT - 1) / RT;
  size_t poff = 0;
  int soff = 0;
  if (nm > 1 && bx >= tl * KS) {
    bx -= tl * KS; poff += KS > 1 ? (size_t)KS * nb * out : 0; soff += tl;
    m = 1; KS = ks1; out = out1; tl = (out1 + RT - 1) / RT;
    if (nm > 2 && bx >= tl * KS) {
      bx -= tl * KS; poff += KS > 1 ? (size_t)KS * nb * out : 0; soff += tl;
      m = 2; KS = ks2; out = out2; tl = (out2 + RT - 1) / RT;
    }
  }
  const u8 *Wt = m == 0 ? W0 : m == 1 ? W1 : W2;
  const float *sc = m == 0 ? sc0 : m == 1 ? sc1 : sc2;
  float *y = m == 0 ? y0 : m == 1 ? y1 : y2;
  const int bps = m == 0 ? bps0 : m == 1 ? bps1 : bps2;
  part += poff; sem += soff;
  const int tile = bx % tl, ks = bx / tl;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nblk = in >> 6, rowbytes = nblk * 36;
  const int j0 = ks * bps, nj = min(bps, nblk - j0), k0 = j0 * 64;
  const int g = lane >> 2, c = lane & 3;
  const int rbase = (tile * W + warp) * 16 * MT;
  const float s2 = __ldg(sc) * 64.0f;                // the e2m1 -> E4M3 trick's 2^-6 undone (loaded early: its
                                                     // latency hidden by the loop, not paid after it)
  const u8 *pa[MT], *pb[MT];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    pa[mt] = Wt + (size_t)min(rbase + 16 * mt + g, out - 1) * rowbytes + (size_t)j0 * 36;
    pb[mt] = Wt + (size_t)min(rbase + 16 * mt + g + 8, out - 1) * rowbytes + (size_t)j0 * 36;
  }
  Chunk<MT, (NS > 0 ? 1 : U)> qa, qb;                // registers of the direct path only
  u8 *wst = reinterpret_cast<u8 *>(xs + (XG ? 0 : bps * NT * 64)) + warp * (NS ? NS : 1) * 16 * MT * TC_ROW;
  const int nch = nj / 4;
  if constexpr (NS > 0) {                            // the first weights in flight while x is staged
#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
      if (s < nch) stage_chunk<MT>(wst + s * 16 * MT * TC_ROW, Wt, rbase, out, rowbytes, (size_t)(j0 + 4 * s) * 36, lane);
      else cp_commit();
    }
  } else {
    load_chunk<MT, U>(qa, pa, pb, 0, nj, c);
  }
  grid_dep_wait();                                   // x, y, part and sem (the kernels before) from here on

  const uint4 *xv;                                   // the slice's fragments (shared memory, or xf: L1 / L2)
  const float *xi;                                   // and their powers of two
  if constexpr (XG) {
    xv = xf + (size_t)j0 * NT * 64; xi = xig;
  } else {
  xv = xs; xi = xinv;
  // 1. per batch row, the power of two for the slice
  for (int b = warp; b < 4 * NT; b += W) {
    float m = 0.f;
    if (b < nb)
      for (int i = lane; i < nj * 16; i += 32) {
        m = absmax4(m, reinterpret_cast<const float4 *>(x + (size_t)b * in + k0)[i]);
      }
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) {
      const int e = x_exp(m);
      xscale[b] = x_scale(e);
      xinv[b] = x_inv(e);
    }
  }
  __syncthreads();
  // 2. the x slice as f16 hi / lo parts in B-fragment order: lane (g, c) of n-tile nt, block j, half h
  //    holds elements 64 j + 16 c + 8 h .. + 7 of column g (batch row 4 nt + g / 2, part g % 2).
  //    XB pieces a thread at a time, their loads issued together (one L2 round trip per XB pieces, not one each)
  constexpr int XB = 4;
  const int nx = nj * NT * 64;
  for (int i0 = threadIdx.x; i0 < nx; i0 += XB * W * 32) {
    float4 v[XB][2];
#pragma unroll
    for (int q = 0; q < XB; q++) {
      const int i = i0 + q * W * 32;
      const int L = i & 31, h = (i >> 5) & 1, t = i >> 6, nt = t % NT, j = t / NT, b = 4 * nt + (L >> 3);
      v[q][0] = v[q][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (i < nx && b < nb) {
        const float4 *p = reinterpret_cast<const float4 *>(x + (size_t)b * in + k0 + 64 * j + 16 * (L & 3) + 8 * h);
        v[q][0] = p[0]; v[q][1] = p[1];
      }
    }
#pragma unroll
    for (int q = 0; q < XB; q++) {
      const int i = i0 + q * W * 32;
      if (i >= nx) break;
      const int L = i & 31, nt = (i >> 6) % NT, gg = L >> 2, b = 4 * nt + (gg >> 1), pt = gg & 1;
      uint4 r = make_uint4(0u, 0u, 0u, 0u);
      if (b < nb) {
        const float s = xscale[b];
        const float4 v0 = v[q][0], v1 = v[q][1];
        r.x = f16_part2(v0.x * s, v0.y * s, pt); r.y = f16_part2(v0.z * s, v0.w * s, pt);
        r.z = f16_part2(v1.x * s, v1.y * s, pt); r.w = f16_part2(v1.z * s, v1.w * s, pt);
      }
      xs[i] = r;
    }
  }
  __syncthreads();
  }

  // 3. the warp's MT m-tiles over the slice, two register buffers of U blocks: one in flight while
  //    the other goes through the tensor cores
  float d[MT][NT][4];
  zero_acc(d);
  if constexpr (NS > 0) {
    static_assert(U == 4, "a staged chunk is 4 blocks");
    for (int ch = 0; ch < nch; ch++) {
      cp_wait<NS - 2>();                             // this lane's pieces of chunk ch have landed
      __syncwarp();                                  // and every lane's; stage (ch - 1) % NS is free
      const int nx = ch + NS - 1;
      if (nx < nch) stage_chunk<MT>(wst + (nx % NS) * 16 * MT * TC_ROW, Wt, rbase, out, rowbytes, (size_t)(j0 + 4 * nx) * 36, lane);
      else cp_commit();
      mma_staged<MT, NT>(d, wst + (ch % NS) * 16 * MT * TC_ROW, xv, 4 * ch, lane);
    }
  } else
  for (int jb = 0; jb < nj; jb += 2 * U) {
    if (jb + U < nj) load_chunk<MT, U>(qb, pa, pb, jb + U, nj, c);
    mma_chunk<MT, NT, U>(d, qa, xv, jb, nj, lane);
    if (jb + U >= nj) break;
    if (jb + 2 * U < nj) load_chunk<MT, U>(qa, pa, pb, jb + 2 * U, nj, c);
    mma_chunk<MT, NT, U>(d, qb, xv, jb + U, nj, lane);
  }

  // 4. thread (g, c) holds rows g, g + 8 of each m-tile for batch row 4 nt + c: (d0 + d1), (d2 + d3)
  if (KS == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        const int b = 4 * nt + c;
        if (b >= nb) continue;
        const float f = xi[b] * s2;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int row = rbase + 16 * mt + g + 8 * hh;
          if (row < out) {
            float *p = y + (size_t)b * out + row;
            const float v = (d[mt][nt][2 * hh] + d[mt][nt][2 * hh + 1]) * f;
            *p = add ? *p + v : v;
          }
        }
      }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const int b = 4 * nt + c;
      if (b >= nb) continue;
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int row = rbase + 16 * mt + g + 8 * hh;
        if (row < out) part[((size_t)ks * nb + b) * out + row] = (d[mt][nt][2 * hh] + d[mt][nt][2 * hh + 1]) * xi[b];
      }
    }
  splitk_finish<RT, W * 32>(part, sem, y, tile, out, nb, KS, add, s2, &last);
}

// ---- BF16 weights (the output heads ModelOpt leaves unquantized, tied embeddings included) ----------------
//
//   y[b, row] = (add ? y[b, row] : 0) + sum_k x[b, k] * W[row, k],   b < nb <= 8 * NT
//
// W: bf16 bits [out, in] row-major (in % 32 == 0); x, y float32 as above. mma.sync m16n8k16 bf16, float32
// accumulate, the weight as it is stored (A) and x = hi + mid + lo, three bf16 (round to nearest each: ~24
// bits), each its own mma (B), so the products are exact and the sum float32. Column n of n-tile nt is batch
// row 8 nt + n. Lane (g, c) loads 8 consecutive weights of rows g and g + 8 of each m-tile (16 bytes each)
// and the same 8 k of x's batch row 8 nt + g; its data words are its A registers: word 2j holds k 8c + 4j,
// + 1 (the mma's k 2c, 2c + 1), word 2j + 1 holds k 8c + 4j + 2, + 3 (its k 2c + 8, 2c + 9), for the two
// mmas j of a 32-k chunk (the dot product does not care which k meets which, only that A and B agree). Each
// warp streams MT m-tiles over its k-slice (cps chunks), the next chunk's weights and x in flight while one
// goes through the tensor cores; x is read through L1 (every warp of a CTA reads the same chunk). KS > 1:
// split-K as above (splitk_finish). PDL: the first chunk's weights are loaded before the wait, x after it.
// XS: x's three bf16 parts come from gemv_bf16_xsplit (launched just before, once for the launch's 8 NT rows:
// xw) instead of each warp splitting the x it loads (the same words: the same arithmetic, bit for bit).
template <int MT, int NT> struct Bf16Chunk { uint4 wa[MT], wb[MT]; float4 x[NT][2]; uint4 xw[NT][3]; };

// the split gemv_bf16_tc's bf16_mma makes of the 8 x values of a lane: hi, mid, lo words of 4 k pairs
__device__ __forceinline__ void bf16_split8(u32 (&xp)[3][4], const float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 4; e++) {
    float a = v[2 * e], b = v[2 * e + 1];
#pragma unroll
    for (int pt = 0; pt < 3; pt++) {
      const u32 h = bf16x2_rn(a, b);
      xp[pt][e] = h;
      a -= bflo(h); b -= bfhi(h);
    }
  }
}

// thread t of CTA (bx, b): batch row b (< 8 NT; rows past nb zero), k group q = 256 bx + t (8 values) as
// xw[(b * in / 8 + q) * 3 + part]: the words a lane of gemv_bf16_tc<.., XS = 1> reads for its 8 k
__global__ void __launch_bounds__(256) gemv_bf16_xsplit(const float *x, uint4 *xw, int in, int nb) {
  grid_dep_launch();
  const int b = blockIdx.y, q = blockIdx.x * 256 + threadIdx.x;
  grid_dep_wait();
  if (q >= (in >> 3)) return;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (b < nb) {
    const float4 *p = reinterpret_cast<const float4 *>(x + (size_t)b * in + 8 * q);
    const float4 a = p[0], c = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
  }
  u32 xp[3][4];
  bf16_split8(xp, v);
  uint4 *o = xw + ((size_t)b * (in >> 3) + q) * 3;
#pragma unroll
  for (int pt = 0; pt < 3; pt++) o[pt] = make_uint4(xp[pt][0], xp[pt][1], xp[pt][2], xp[pt][3]);
}

template <int MT, int NT>
__device__ __forceinline__ void bf16_load_w(Bf16Chunk<MT, NT> &q, const u16 *const (&pa)[MT], const u16 *const (&pb)[MT],
                                            int i) {
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    q.wa[mt] = __ldg(reinterpret_cast<const uint4 *>(pa[mt] + 32 * i));
    q.wb[mt] = __ldg(reinterpret_cast<const uint4 *>(pb[mt] + 32 * i));
  }
}
template <int MT, int NT>
__device__ __forceinline__ void bf16_load_x(Bf16Chunk<MT, NT> &q, const float *const (&xr)[NT], int i) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    const float4 *p = reinterpret_cast<const float4 *>(xr[nt] + 32 * i);
    q.x[nt][0] = p[0]; q.x[nt][1] = p[1];
  }
}
template <int MT, int NT>
__device__ __forceinline__ void bf16_load_xs(Bf16Chunk<MT, NT> &q, const uint4 *const (&xw)[NT], int i) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int pt = 0; pt < 3; pt++) q.xw[nt][pt] = xw[nt][12 * i + pt];
}
template <int MT, int NT, int XS>
__device__ __forceinline__ void bf16_mma(float (&d)[MT][NT][4], const Bf16Chunk<MT, NT> &q, const bool (&xok)[NT]) {
  u32 xp[NT][3][4];                                  // [n-tile][part][pair k (2e, 2e + 1)]
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    if constexpr (XS) {
#pragma unroll
      for (int pt = 0; pt < 3; pt++) {
        xp[nt][pt][0] = q.xw[nt][pt].x; xp[nt][pt][1] = q.xw[nt][pt].y;
        xp[nt][pt][2] = q.xw[nt][pt].z; xp[nt][pt][3] = q.xw[nt][pt].w;
      }
    } else {
      const bool ok = xok[nt];
      const float v[8] = {ok ? q.x[nt][0].x : 0.f, ok ? q.x[nt][0].y : 0.f, ok ? q.x[nt][0].z : 0.f,
                          ok ? q.x[nt][0].w : 0.f, ok ? q.x[nt][1].x : 0.f, ok ? q.x[nt][1].y : 0.f,
                          ok ? q.x[nt][1].z : 0.f, ok ? q.x[nt][1].w : 0.f};
      bf16_split8(xp[nt], v);
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    const u32 wa[4] = {q.wa[mt].x, q.wa[mt].y, q.wa[mt].z, q.wa[mt].w};
    const u32 wb[4] = {q.wb[mt].x, q.wb[mt].y, q.wb[mt].z, q.wb[mt].w};
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const u32 A[4] = {wa[2 * j], wb[2 * j], wa[2 * j + 1], wb[2 * j + 1]};
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int pt = 0; pt < 3; pt++) mma_bf16(d[mt][nt], A, xp[nt][pt][2 * j], xp[nt][pt][2 * j + 1]);
    }
  }
}

template <int MT, int W, int NT, int XS>
__global__ void __launch_bounds__(W * 32) gemv_bf16_tc(const u16 *__restrict__ Wt, const float *x, float *y, float *part,
                                                        int *sem, int out, int in, int nb, int add, int cps, int KS,
                                                        const uint4 *xs) {
  __shared__ int last;
  grid_dep_launch();
  constexpr int RT = 16 * MT * W;
  const int tl = (out + RT - 1) / RT, tile = blockIdx.x % tl, ks = blockIdx.x / tl;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int c0 = ks * cps, cn = min(cps, (in >> 5) - c0);
  const int rbase = (tile * W + warp) * 16 * MT;
  const u16 *pa[MT], *pb[MT];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    pa[mt] = Wt + (size_t)min(rbase + 16 * mt + g, out - 1) * in + 32 * c0 + 8 * c;
    pb[mt] = Wt + (size_t)min(rbase + 16 * mt + g + 8, out - 1) * in + 32 * c0 + 8 * c;
  }
  const float *xr[NT];
  const uint4 *xw[NT];
  bool xok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    xok[nt] = 8 * nt + g < nb;
    xr[nt] = x + (size_t)min(8 * nt + g, nb - 1) * in + 32 * c0 + 8 * c;
    xw[nt] = xs + ((size_t)(8 * nt + g) * (in >> 3) + 4 * c0 + c) * 3;
  }
  auto load_x = [&](Bf16Chunk<MT, NT> &q, int i) {
    if constexpr (XS) bf16_load_xs(q, xw, i); else bf16_load_x(q, xr, i);
  };
  Bf16Chunk<MT, NT> qa, qb;
  if (cn > 0) bf16_load_w(qa, pa, pb, 0);
  grid_dep_wait();                                   // x, y, part and sem from here on
  float d[MT][NT][4];
  zero_acc(d);
  if (cn > 0) load_x(qa, 0);
  for (int i = 0; i < cn; i += 2) {
    if (i + 1 < cn) { bf16_load_w(qb, pa, pb, i + 1); load_x(qb, i + 1); }
    bf16_mma<MT, NT, XS>(d, qa, xok);
    if (i + 1 >= cn) break;
    if (i + 2 < cn) { bf16_load_w(qa, pa, pb, i + 2); load_x(qa, i + 2); }
    bf16_mma<MT, NT, XS>(d, qb, xok);
  }
  // thread (g, c) holds rows g (d0, d1) and g + 8 (d2, d3) of each m-tile, batch rows 8 nt + 2c, + 1
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int row = rbase + 16 * mt + g + 8 * (q >> 1), b = 8 * nt + 2 * c + (q & 1);
        if (row >= out || b >= nb) continue;
        if (KS == 1) {
          float *p = y + (size_t)b * out + row;
          *p = add ? *p + d[mt][nt][q] : d[mt][nt][q];
        } else {
          part[((size_t)ks * nb + b) * out + row] = d[mt][nt][q];
        }
      }
  if (KS > 1) splitk_finish<RT, W * 32>(part, sem, y, tile, out, nb, KS, add, 1.0f, &last);
}
