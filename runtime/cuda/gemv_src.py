"""CUDA C++ source of the decode GEMV kernels (compiled by NVRTC through cupy.RawModule).

Kept as a Python string so it ships inside the package with no package-data rule.
See docs/kernels.md for the design and the measurements.

y[b, row] = (add ? y[b, row] : 0) + sum_k x[b, k] * W[row, k], b < nb <= BMAX.
x, y: float32, row-major [nb, in] / [nb, out]. Accumulation: float32.

One CTA computes R consecutive output rows; its threads split the row's K range
(consecutive threads read consecutive 16-byte chunks: coalesced), each thread keeps
R x BMAX float32 partial sums (x is loaded once per chunk and reused for the R rows),
then a warp-shuffle + shared-memory reduction. U chunks per thread are loaded before
any is used (bytes in flight).

Dequantization (values exact in float32):
  FP8 E4M3 (all FP8 formats, MXFP8): cvt.rn.f16x2.e4m3x2 (sm_89+), then f16 -> f32.
  E2M1 (NVFP4): each nibble s.e1.e0.m becomes the E4M3 byte s000.0e1e0m.00 = e2m1 * 2^-6
      (E4M3's subnormals line up with E2M1's), then as FP8; the 2^6 goes into scale_2.
  BF16: a shift / a mask. Q8_0: int8 through the 2^23 magic (PRMT + FADD).
Block scales multiply a per-block partial sum (one FMA per block and batch row).
"""

from .cu import header
from .ops_src import GRID_DEP, MOE_TOPK, SWIGLU

SOURCE = SWIGLU + GRID_DEP + MOE_TOPK + header("numerics") + r"""

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_FP8T 2
#define FMT_FP8C 3
#define FMT_FP8B128 4
#define FMT_MXFP8 5
#define FMT_NVFP4S 6

// Activation loads (x, the norm weight). Not the read-only path (ld.global.nc): under programmatic dependent
// launch (runtime/cuda/pdl.py) the kernel before may still be writing x while this kernel has started, and the
// read-only path is only defined for data no one writes during the kernel's lifetime. Plain loads after
// griddepcontrol.wait see its writes. BLOOMERY_X_NC: the read-only path (the loads before 2026-12-02, for
// timing only); BLOOMERY_X_CG: L2 only.
#if defined(BLOOMERY_X_NC)
__device__ __forceinline__ float4 ldx4(const float *p) { return __ldg(reinterpret_cast<const float4 *>(p)); }
__device__ __forceinline__ float2 ldx2(const float *p) { return __ldg(reinterpret_cast<const float2 *>(p)); }
__device__ __forceinline__ float ldx1(const float *p) { return __ldg(p); }
#else
#if defined(BLOOMERY_X_CG)
#define BLOOMERY_LDX "ld.global.cg"
#else
#define BLOOMERY_LDX "ld.global"
#endif
__device__ __forceinline__ float4 ldx4(const float *p) {
  float4 r;
  asm volatile(BLOOMERY_LDX ".v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ float2 ldx2(const float *p) {
  float2 r;
  asm volatile(BLOOMERY_LDX ".v2.f32 {%0,%1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ float ldx1(const float *p) {
  float r;
  asm volatile(BLOOMERY_LDX ".f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}
#endif

__device__ __forceinline__ uint4 ldw4(const u32 *p) {
#ifdef BLOOMERY_NA
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
#else
  return __ldg(reinterpret_cast<const uint4 *>(p));
#endif
}

// Programmatic dependent launch (runtime/cuda/pdl.py; ops_src.py GRID_DEP): a CTA lets the next kernel on the
// stream be scheduled at once (it may start once every CTA of this grid has), and waits for the kernel before
// it (its writes visible) before it reads an activation or writes an output; weights, which no kernel writes,
// may be read before.
// every row-tiled body starts so: partial sums zeroed, its R rows clamped to the matrix (a CTA past
// the last row reads the last row again and stores nothing)
template <int R, int BMAX>
__device__ __forceinline__ void start_rows(float (&acc)[R][BMAX], int (&rowc)[R], int row0, int out) {
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int b = 0; b < BMAX; b++) acc[r][b] = 0.f;
#pragma unroll
  for (int r = 0; r < R; r++) rowc[r] = min(row0 + r, out - 1);
}

// NORM 1 (an RMSNorm folded into the linear): the CTA's threads have also summed x^2 of each batch row
// (every x value is loaded once a CTA) and multiplied x by the norm weight; the row's 1/sqrt(mean(x^2) +
// eps) then scales the outputs (y = inv W (x * w): the norm's arithmetic up to float32 rounding).
// NORM's step on 4 loaded x values: their squares into the row's sum, then x times the norm weight
__device__ __forceinline__ void norm4(float4 &v, const float4 w, float &sq) {
  sq = fmaf(v.x, v.x, sq); sq = fmaf(v.y, v.y, sq); sq = fmaf(v.z, v.z, sq); sq = fmaf(v.w, v.w, sq);
  v.x *= w.x; v.y *= w.y; v.z *= w.z; v.w *= w.w;
}

template <int R, int BMAX, int NORM = 0>
__device__ __forceinline__ void reduce_store(float (&acc)[R][BMAX], float *__restrict__ y, const float *rs,
                                             int row0, int out, int nb, int add, const float *sq = nullptr,
                                             int in = 1, float eps = 0.f, float *ysm = nullptr) {
  __shared__ float red[8][R * BMAX];
  __shared__ float redq[NORM ? 8 : 1][NORM ? BMAX : 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int b = 0; b < BMAX; b++) {
      float v = acc[r][b];
#pragma unroll
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) red[warp][r * BMAX + b] = v;
    }
  if constexpr (NORM) {
#pragma unroll
    for (int b = 0; b < BMAX; b++) {
      float v = sq[b];
#pragma unroll
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) redq[warp][b] = v;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < R * BMAX; i += blockDim.x) {
    const int r = i / BMAX, b = i % BMAX, row = row0 + r;
    if (row < out && b < nb) {
      float v = 0.f;
      for (int w = 0; w < nw; w++) v += red[w][i];
      v *= rs[r];
      if constexpr (NORM) {
        float ss = 0.f;
        for (int w = 0; w < nw; w++) ss += redq[w][b];
        v *= 1.0f / sqrtf(ss / (float)in + eps);
      }
      if (ysm) { ysm[b * R + r] = v; continue; }      // a pair kernel's first half: kept for the epilogue
      float *p = y + (size_t)b * out + row;
      *p = add ? *p + v : v;
    }
  }
}

// ---- plain row-major word formats: F32, BF16, FP8 (tensor/channel/block128), MXFP8, NVFP4 stored ----
// W: u32 words, a row = in / EPW words; a chunk = WPC words (WPC 4: 16-byte loads, needs words/row % 4 == 0).
// S: block scales (MXFP8 u8 [out, in/32]; NVFP4 stored u8 E4M3 [out, in/16]; FP8 block128 f32 [cdiv(out,128), cdiv(in,128)]);
// sc: f32 per-tensor (FP8T scale, NVFP4 scale_2) or per-row (FP8C) scale.
template <int FMT> struct EPWof { static constexpr int v = FMT == FMT_F32 ? 1 : FMT == FMT_BF16 ? 2 : FMT == FMT_NVFP4S ? 8 : 4; };

// x values of one word's elements (EPW floats, in the word's element order) for every batch row
template <int FMT, int BMAX>
__device__ __forceinline__ void load_xw(const float *__restrict__ x, int k, int in, int nb, float (&xw)[BMAX][EPWof<FMT>::v]) {
#pragma unroll
  for (int b = 0; b < BMAX; b++) {
    if (b < nb) {
      const float *px = x + (size_t)b * in + k;
      if constexpr (FMT == FMT_F32) { xw[b][0] = ldx1(px); }
      else if constexpr (FMT == FMT_BF16) { const float2 v = ldx2(px); xw[b][0] = v.x; xw[b][1] = v.y; }
      else if constexpr (FMT == FMT_NVFP4S) {       // order: elements 0,2,4,6 then 1,3,5,7
        const float4 a = ldx4(px), c = ldx4(px + 4);
        xw[b][0] = a.x; xw[b][1] = a.z; xw[b][2] = c.x; xw[b][3] = c.z;
        xw[b][4] = a.y; xw[b][5] = a.w; xw[b][6] = c.y; xw[b][7] = c.w;
      } else { const float4 a = ldx4(px); xw[b][0] = a.x; xw[b][1] = a.y; xw[b][2] = a.z; xw[b][3] = a.w; }
    } else {
#pragma unroll
      for (int e = 0; e < EPWof<FMT>::v; e++) xw[b][e] = 0.f;
    }
  }
}

// one word's EPW values (unscaled), in load_xw's order
template <int FMT>
__device__ __forceinline__ void dequant_word(u32 w, float *v) {
  if constexpr (FMT == FMT_F32) { v[0] = __uint_as_float(w); }
  else if constexpr (FMT == FMT_BF16) { v[0] = __uint_as_float(w << 16); v[1] = __uint_as_float(w & 0xFFFF0000u); }
  else if constexpr (FMT == FMT_NVFP4S) { e4m3x4(lo_nib_e4m3(w), v); e4m3x4(hi_nib_e4m3(w), v + 4); }
  else { e4m3x4(w, v); }
}

template <int FMT, int R, int BMAX, int U, int WPC, int NORM = 0>
__device__ __forceinline__ void gemv_plain_body(const u32 *__restrict__ W, const void *__restrict__ S, const float *__restrict__ sc,
                           const float *__restrict__ x, float *__restrict__ y, int out, int in, int nb, int add,
                           int bx, const float *__restrict__ nw = nullptr, float eps = 0.f, float *ysm = nullptr) {
  constexpr int EPW = EPWof<FMT>::v;
  constexpr bool BLOCKED = FMT == FMT_FP8B128 || FMT == FMT_MXFP8 || FMT == FMT_NVFP4S;
  constexpr int SPW = FMT == FMT_NVFP4S ? 2 : FMT == FMT_MXFP8 ? 8 : 32;     // words per block scale
  constexpr int NS = BLOCKED ? (WPC + SPW - 1) / SPW : 1;                     // block scales per chunk
  const int wpr = in / EPW, nch = wpr / WPC;
  const int row0 = bx * R;
  float acc[R][BMAX];
  int rowc[R];
  start_rows<R, BMAX>(acc, rowc, row0, out);
  float sq[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; b++) sq[b] = 0.f;

  grid_dep_launch();                                   // PDL: x and y only after the kernel before
  grid_dep_wait();
  for (int c0 = threadIdx.x; c0 < nch; c0 += U * blockDim.x) {
    u32 wv[U][R][WPC];
    u32 sv[U][R][NS];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * blockDim.x;
#pragma unroll
      for (int r = 0; r < R; r++) {
        const u32 *p = W + (size_t)rowc[r] * wpr + (size_t)c * WPC;
        if (c < nch) {
          if constexpr (WPC == 4) { uint4 q = ldw4(p); wv[u][r][0] = q.x; wv[u][r][1] = q.y; wv[u][r][2] = q.z; wv[u][r][3] = q.w; }
          else {
#pragma unroll
            for (int i = 0; i < WPC; i++) wv[u][r][i] = __ldg(p + i);
          }
          if constexpr (BLOCKED) {                 // block scales loaded with the weights (no exposed latency)
#pragma unroll
            for (int j = 0; j < NS; j++) {
              const int sw = (c * WPC) / SPW + j;
              if constexpr (FMT == FMT_MXFP8) sv[u][r][j] = __ldg((const u8 *)S + (size_t)rowc[r] * (in / 32) + sw);
              else if constexpr (FMT == FMT_NVFP4S) sv[u][r][j] = __ldg((const u8 *)S + (size_t)rowc[r] * (in / 16) + sw);
              else sv[u][r][j] = __float_as_uint(__ldg((const float *)S + (size_t)(rowc[r] / 128) * ((in + 127) / 128) + sw));
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < WPC; i++) wv[u][r][i] = 0u;
#pragma unroll
          for (int j = 0; j < NS; j++) sv[u][r][j] = 0u;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * blockDim.x;
      if (c >= nch) break;
      float s[R][NS];
      if constexpr (BLOCKED) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
          for (int j = 0; j < NS; j++) {
            if constexpr (FMT == FMT_MXFP8) s[r][j] = e8m0_f(sv[u][r][j]);
            else if constexpr (FMT == FMT_NVFP4S) s[r][j] = e4m3_1(sv[u][r][j]);
            else s[r][j] = __uint_as_float(sv[u][r][j]);
          }
      }
#pragma unroll
      for (int i = 0; i < WPC; i++) {
        const int k = (c * WPC + i) * EPW;
        float xw[BMAX][EPW];
        load_xw<FMT, BMAX>(x, k, in, nb, xw);      // once per word, reused by the R rows
        if constexpr (NORM) {
          float nv[1][EPW];
          load_xw<FMT, 1>(nw, k, in, 1, nv);       // the norm weight, in the word's element order
#pragma unroll
          for (int b = 0; b < BMAX; b++)
#pragma unroll
            for (int e = 0; e < EPW; e++) { sq[b] = fmaf(xw[b][e], xw[b][e], sq[b]); xw[b][e] *= nv[0][e]; }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
          float v[EPW];
          dequant_word<FMT>(wv[u][r][i], v);
#pragma unroll
          for (int b = 0; b < BMAX; b++) {
            if (b < nb) {
              if constexpr (!BLOCKED) {
                float a = acc[r][b];
#pragma unroll
                for (int e = 0; e < EPW; e++) a = fmaf(v[e], xw[b][e], a);
                acc[r][b] = a;
              } else {
                float q = v[0] * xw[b][0];
#pragma unroll
                for (int e = 1; e < EPW; e++) q = fmaf(v[e], xw[b][e], q);
                acc[r][b] = fmaf(q, s[r][(i % WPC) / SPW], acc[r][b]);
              }
            }
          }
        }
      }
    }
  }
  float rs[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    if constexpr (FMT == FMT_FP8T) rs[r] = __ldg(sc);
    else if constexpr (FMT == FMT_FP8C) rs[r] = __ldg(sc + rowc[r]);
    else if constexpr (FMT == FMT_NVFP4S) rs[r] = __ldg(sc) * 64.0f;
    else rs[r] = 1.0f;
  }
  reduce_store<R, BMAX, NORM>(acc, y, rs, row0, out, nb, add, sq, in, eps, ysm);
}

// ---- GGML NVFP4: rows of in/64 blocks of 36 bytes (4 E4M3 scale bytes, then 4 sub-blocks of 8 bytes;
// sub-block byte j: element j low nibble, j+8 high). 8 threads per block: thread t reads data word t
// (bytes 4+4t, sub-block t/2, elements 4(t&1)..+3 and +8) and scale byte t/2. ----
// a thread's 8 weights of a GGML NVFP4 data word (lo: elements koff..+3, hi: koff+8..+11) times x there, the
// chain in element order (one owner: the 1-row body and the experts' combine sum it the same way)
__device__ __forceinline__ float ggml_dot8(const float (&lo)[4], const float (&hi)[4], const float4 xl, const float4 xh) {
  float q = lo[0] * xl.x;
  q = fmaf(lo[1], xl.y, q); q = fmaf(lo[2], xl.z, q); q = fmaf(lo[3], xl.w, q);
  q = fmaf(hi[0], xh.x, q); q = fmaf(hi[1], xh.y, q); q = fmaf(hi[2], xh.z, q); q = fmaf(hi[3], xh.w, q);
  return q;
}

template <int R, int BMAX, int U, int NORM = 0>
__device__ __forceinline__ void gemv_nvfp4_ggml_body(const u8 *__restrict__ W, const float *__restrict__ sc, const float *__restrict__ x,
                                float *__restrict__ y, int out, int in, int nb, int add, int bx,
                                const float *__restrict__ nw = nullptr, float eps = 0.f, float *ysm = nullptr) {
  const int nblk = in / 64, rowbytes = nblk * 36;
  const int g = threadIdx.x >> 3, t = threadIdx.x & 7, ng = blockDim.x >> 3;
  const int row0 = bx * R;
  float acc[R][BMAX];
  int rowc[R];
  start_rows<R, BMAX>(acc, rowc, row0, out);
  const int koff = 16 * (t >> 1) + 4 * (t & 1);
  float sq[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; b++) sq[b] = 0.f;

  grid_dep_launch();
#ifdef BLOOMERY_PDL_WAIT_FIRST
  grid_dep_wait();                                     // (timing variant: wait before any load)
  bool waited = true;
#else
  bool waited = false;
#endif
  for (int b0 = g; b0 < nblk; b0 += U * ng) {
    u32 wv[U][R];
    u32 sv[U][R];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = b0 + u * ng;
#pragma unroll
      for (int r = 0; r < R; r++) {
        const u8 *p = W + (size_t)rowc[r] * rowbytes + (size_t)blk * 36;
        if (blk < nblk) {
#ifdef BLOOMERY_NA
          asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(wv[u][r]) : "l"(p + 4 + 4 * t));
#else
          wv[u][r] = __ldg(reinterpret_cast<const u32 *>(p + 4 + 4 * t));
#endif
          sv[u][r] = __ldg(p + (t >> 1));
        } else { wv[u][r] = 0u; sv[u][r] = 0u; }
      }
    }
    if (!waited) { grid_dep_wait(); waited = true; }   // PDL: the first weights are on their way; now x
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = b0 + u * ng;
      if (blk >= nblk) break;
      const int k = blk * 64 + koff;
      float4 xl[BMAX], xh[BMAX];
#pragma unroll
      for (int b = 0; b < BMAX; b++) if (b < nb) { xl[b] = ldx4(x + (size_t)b * in + k); xh[b] = ldx4(x + (size_t)b * in + k + 8); }
      if constexpr (NORM) {
        const float4 wl = ldx4(nw + k), wh = ldx4(nw + k + 8);
#pragma unroll
        for (int b = 0; b < BMAX; b++) if (b < nb) { norm4(xl[b], wl, sq[b]); norm4(xh[b], wh, sq[b]); }
      }
#pragma unroll
      for (int r = 0; r < R; r++) {
#ifdef BLOOMERY_PROBE_LOADS
        acc[r][0] = __uint_as_float(__float_as_uint(acc[r][0]) ^ wv[u][r] ^ sv[u][r]);   // timing probe: loads only
        continue;
#endif
        float lo[4], hi[4];
        const u32 w = wv[u][r];
        e4m3x4(lo_nib_e4m3(w), lo);
        e4m3x4(hi_nib_e4m3(w), hi);
        const float s = e4m3_1(sv[u][r]);
#pragma unroll
        for (int b = 0; b < BMAX; b++) if (b < nb) acc[r][b] = fmaf(ggml_dot8(lo, hi, xl[b], xh[b]), s, acc[r][b]);
      }
    }
  }
  if (!waited) grid_dep_wait();
  float rs[R];
#pragma unroll
  for (int r = 0; r < R; r++) rs[r] = __ldg(sc) * 64.0f;
  reduce_store<R, BMAX, NORM>(acc, y, rs, row0, out, nb, add, sq, in, eps, ysm);
}

// ---- GGML NVFP4 on the tensor cores (batch 1): mma.sync m16n8k16, f16 in, float32 accumulate.
// A CTA computes 16 rows; its warps split the row's 64-blocks. Per block, thread (g = lane/4, c = lane%4)
// loads data words 2c, 2c+1 (sub-block c: elements 16c..16c+15) of rows g and g+8 and scale byte c.
// Each word's low / high nibbles become E4M3 bytes (value e2m1 * 2^-6), then f16x2, times the
// sub-block scale in f16 (e2m1 * E4M3 * 2^-6 is exact in f16): the A fragments of four k16 mmas,
// the k slots 2c, 2c+1, 2c+8, 2c+9 of mma j holding elements 16c + off_j + 0..3 (off = 0, 8, 4, 12),
// a permutation of the block's 64 elements (the sum does not depend on the order). B column 0 holds
// x's high f16 part, column 1 the low part (x = hi + lo to ~22 bits; x scaled by a power of two so
// |x| < 2^15, undone at the end): staged once per CTA in shared memory. Products are exact; the
// tensor cores accumulate in float32 across the whole row. ----

template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32) gemv_nvfp4_mma(const u8 *__restrict__ W, const float *__restrict__ sc,
    const float *__restrict__ x, float *__restrict__ y, int out, int in, int add) {
  extern __shared__ u32 xs[];                       // [2][in / 2]: x hi f16 pairs, then lo
  __shared__ float red[WARPS][16];
  __shared__ float wmax[WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nblk = in / 64, rowbytes = nblk * 36, row0 = blockIdx.x * 16;
  float m = 0.f;
  for (int i = threadIdx.x; i < in; i += blockDim.x) m = fmaxf(m, fabsf(x[i]));
#pragma unroll
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) wmax[warp] = m;
  __syncthreads();
  m = 0.f;
#pragma unroll
  for (int i = 0; i < WARPS; i++) m = fmaxf(m, wmax[i]);
  const int e = (m > 0.f && m < 3.0e38f) ? max(ilogbf(m), -100) : 0;     // |x| * 2^(14 - e) < 2^15
  const float xsc = __uint_as_float((u32)(127 + 14 - e) << 23), xinv = __uint_as_float((u32)(127 - 14 + e) << 23);
  for (int i = threadIdx.x; i < in / 2; i += blockDim.x) {
    const float2 v = *reinterpret_cast<const float2 *>(x + 2 * i);
    const float a = v.x * xsc, b = v.y * xsc;
    const u32 h = f2h2(a, b);
    float ha, hb;
    h2f2(h, ha, hb);
    xs[i] = h;
    xs[in / 2 + i] = f2h2(a - ha, b - hb);
  }
  __syncthreads();
  const int g = lane >> 2, c = lane & 3;
  const int ra = min(row0 + g, out - 1), rb = min(row0 + g + 8, out - 1);
  const u8 *pa = W + (size_t)ra * rowbytes + 4 + 8 * c, *pb = W + (size_t)rb * rowbytes + 4 + 8 * c;
  const u8 *sa = W + (size_t)ra * rowbytes + c, *sb = W + (size_t)rb * rowbytes + c;
  const uint4 *xb = reinterpret_cast<const uint4 *>(xs + (g & 1) * (in / 2)) + 2 * c;   // + blk * 8 per block
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  constexpr int U = 2;                               // blocks in flight per warp
  for (int b0 = warp; b0 < nblk; b0 += U * WARPS) {
    u32 wa[U][2], wb[U][2], s8a[U], s8b[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = min(b0 + u * WARPS, nblk - 1);
      const size_t o = (size_t)blk * 36;
      wa[u][0] = __ldg(reinterpret_cast<const u32 *>(pa + o)); wa[u][1] = __ldg(reinterpret_cast<const u32 *>(pa + o + 4));
      wb[u][0] = __ldg(reinterpret_cast<const u32 *>(pb + o)); wb[u][1] = __ldg(reinterpret_cast<const u32 *>(pb + o + 4));
      s8a[u] = __ldg(sa + o); s8b[u] = __ldg(sb + o);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = b0 + u * WARPS;
      if (blk >= nblk) break;
      const uint4 q0 = xb[blk * 8], q1 = xb[blk * 8 + 1];     // x elements 16c + 0..7, 8..15 of this block
      const u32 s2a = e4m3x2_h2(s8a[u] | (s8a[u] << 8)), s2b = e4m3x2_h2(s8b[u] | (s8b[u] << 8));
      u32 A0[4], A1[4], B0[4], B1[4];
      nvfp4_word_h2(wa[u][0], s2a, A0); nvfp4_word_h2(wa[u][1], s2a, A1);
      nvfp4_word_h2(wb[u][0], s2b, B0); nvfp4_word_h2(wb[u][1], s2b, B1);
      // word 0 low: elements 0..3 (off 0); word 0 high: 8..11 (off 8); word 1 low: 4..7; word 1 high: 12..15
      mma_f16(d, A0[0], B0[0], A0[1], B0[1], q0.x, q0.y);
      mma_f16(d, A0[2], B0[2], A0[3], B0[3], q1.x, q1.y);
      mma_f16(d, A1[0], B1[0], A1[1], B1[1], q0.z, q0.w);
      mma_f16(d, A1[2], B1[2], A1[3], B1[3], q1.z, q1.w);
    }
  }
  if (c == 0) { red[warp][g] = d[0] + d[1]; red[warp][g + 8] = d[2] + d[3]; }   // column 0 (hi) + 1 (lo)
  __syncthreads();
  if (threadIdx.x < 16) {
    const int row = row0 + threadIdx.x;
    if (row < out) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; w++) v += red[w][threadIdx.x];
      v *= __ldg(sc) * 64.0f * xinv;
      y[row] = add ? y[row] + v : v;
    }
  }
}

// ---- GGML Q8_0: rows of in/32 blocks of 34 bytes (F16 d, then 32 int8). 8 threads per block:
// thread t reads bytes 2+4t..5+4t (two 2-byte loads: blocks are only 2-byte aligned). ----
template <int R, int BMAX, int U, int NORM = 0>
__device__ __forceinline__ void gemv_q8_0_body(const u8 *__restrict__ W, const float *__restrict__ x, float *__restrict__ y,
                          int out, int in, int nb, int add, int bx, const float *__restrict__ nw = nullptr, float eps = 0.f,
                          float *ysm = nullptr) {
  const int nblk = in / 32, rowbytes = nblk * 34;
  const int g = threadIdx.x >> 3, t = threadIdx.x & 7, ng = blockDim.x >> 3;
  const int row0 = bx * R;
  float acc[R][BMAX];
  int rowc[R];
  start_rows<R, BMAX>(acc, rowc, row0, out);
  float sq[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; b++) sq[b] = 0.f;

  grid_dep_launch();                                   // PDL: x and y only after the kernel before
  grid_dep_wait();
  for (int b0 = g; b0 < nblk; b0 += U * ng) {
    u32 wv[U][R];
    u16 dv[U][R];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = b0 + u * ng;
#pragma unroll
      for (int r = 0; r < R; r++) {
        const u16 *p = reinterpret_cast<const u16 *>(W + (size_t)rowc[r] * rowbytes + (size_t)blk * 34);
        if (blk < nblk) {
          wv[u][r] = (u32)__ldg(p + 1 + 2 * t) | ((u32)__ldg(p + 2 + 2 * t) << 16);
          dv[u][r] = __ldg(p);
        } else { wv[u][r] = 0u; dv[u][r] = 0; }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = b0 + u * ng;
      if (blk >= nblk) break;
      const int k = blk * 32 + 4 * t;
      float4 xv[BMAX];
#pragma unroll
      for (int b = 0; b < BMAX; b++) if (b < nb) xv[b] = ldx4(x + (size_t)b * in + k);
      if constexpr (NORM) {
        const float4 wv4 = ldx4(nw + k);
#pragma unroll
        for (int b = 0; b < BMAX; b++) if (b < nb) norm4(xv[b], wv4, sq[b]);
      }
#pragma unroll
      for (int r = 0; r < R; r++) {
        const u32 w = wv[u][r] ^ 0x80808080u;
        float v[4];
        v[0] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540)) - 8388736.0f;
        v[1] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7541)) - 8388736.0f;
        v[2] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7542)) - 8388736.0f;
        v[3] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7543)) - 8388736.0f;
        float d; asm("cvt.f32.f16 %0, %1;" : "=f"(d) : "h"(dv[u][r]));
#pragma unroll
        for (int b = 0; b < BMAX; b++) if (b < nb) {
          float q = v[0] * xv[b].x;
          q = fmaf(v[1], xv[b].y, q); q = fmaf(v[2], xv[b].z, q); q = fmaf(v[3], xv[b].w, q);
          acc[r][b] = fmaf(q, d, acc[r][b]);
        }
      }
    }
  }
  float rs[R];
#pragma unroll
  for (int r = 0; r < R; r++) rs[r] = 1.0f;
  reduce_store<R, BMAX, NORM>(acc, y, rs, row0, out, nb, add, sq, in, eps, ysm);
}
// ---- GGML MXFP4: rows of in/32 blocks of 17 bytes (E8M0 byte, then 16 bytes: byte j = element j low
// nibble, j+16 high). One warp per row (R warps per CTA), a lane per block; byte loads (blocks are
// byte-aligned). value = E2M1 * 2^(e-127). Correct, not tuned (no model ships MXFP4 linears at size yet). ----
__constant__ float E2M1_TAB[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

template <int BMAX>
__device__ __forceinline__ void gemv_mxfp4_ggml_body(const u8 *__restrict__ W, const float *__restrict__ x, float *__restrict__ y,
                                                     int out, int in, int nb, int add) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int row = blockIdx.x * nw + warp;
  grid_dep_launch();                                   // PDL: x and y only after the kernel before
  grid_dep_wait();
  if (row >= out) return;
  const int nblk = in / 32;
  const u8 *wr = W + (size_t)row * nblk * 17;
  float acc[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; b++) acc[b] = 0.f;
  for (int blk = lane; blk < nblk; blk += 32) {
    const u8 *p = wr + (size_t)blk * 17;
    const float s = e8m0_f(__ldg(p));
    float q[BMAX];
#pragma unroll
    for (int b = 0; b < BMAX; b++) q[b] = 0.f;
    for (int j = 0; j < 16; j++) {
      const u32 v = __ldg(p + 1 + j);
      const float lo = E2M1_TAB[v & 15u], hi = E2M1_TAB[v >> 4];
#pragma unroll
      for (int b = 0; b < BMAX; b++) if (b < nb) {
        const float *px = x + (size_t)b * in + blk * 32;
        q[b] = fmaf(lo, ldx1(px + j), q[b]);
        q[b] = fmaf(hi, ldx1(px + j + 16), q[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < BMAX; b++) acc[b] = fmaf(q[b], s, acc[b]);
  }
#pragma unroll
  for (int b = 0; b < BMAX; b++) {
    float v = acc[b];
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && b < nb) { float *py = y + (size_t)b * out + row; *py = add ? *py + v : v; }
  }
}

// ---- entry points. The plain ones take nb activation rows; the _e ones are the MoE form: blockIdx.y
// is a (row, choice) pair p, its expert e = eid[p] (read on the device: no host round trip) offsets
// the stacked weights ([E, out, in]; strides in the pointer's units: W words or bytes, S bytes, sc
// floats), its input row is x[p / xdiv] and its output row y[p]. One activation row per pair. ----
__device__ __forceinline__ int expert_of(const int *eid, int ne) {
  const int e = eid[blockIdx.y];
  return e < 0 ? 0 : (e >= ne ? ne - 1 : e);
}

template <int FMT, int R, int BMAX, int U, int WPC>
__global__ void gemv_plain(const u32 *__restrict__ W, const void *__restrict__ S, const float *__restrict__ sc,
                           const float *__restrict__ x, float *__restrict__ y, int out, int in, int nb, int add) {
  gemv_plain_body<FMT, R, BMAX, U, WPC>(W, S, sc, x, y, out, in, nb, add, blockIdx.x);
}
template <int FMT, int R, int U, int WPC>
__global__ void gemv_plain_e(const u32 *__restrict__ W, const void *__restrict__ S, const float *__restrict__ sc,
                             const float *__restrict__ x, float *__restrict__ y, int out, int in, int add,
                             const int *__restrict__ eid, int ne, int xdiv, long long wst, long long sst, long long scst) {
  const int e = expert_of(eid, ne), p = blockIdx.y;
  gemv_plain_body<FMT, R, 1, U, WPC>(W + e * wst, (const u8 *)S + e * sst, sc + e * scst, x + (size_t)(p / xdiv) * in,
                                      y + (size_t)p * out, out, in, 1, add, blockIdx.x);
}
template <int R, int BMAX, int U>
__global__ void gemv_nvfp4_ggml(const u8 *__restrict__ W, const float *__restrict__ sc, const float *__restrict__ x,
                                float *__restrict__ y, int out, int in, int nb, int add) {
  gemv_nvfp4_ggml_body<R, BMAX, U>(W, sc, x, y, out, in, nb, add, blockIdx.x);
}
template <int R, int U>
__global__ void gemv_nvfp4_ggml_e(const u8 *__restrict__ W, const float *__restrict__ sc, const float *__restrict__ x,
                                  float *__restrict__ y, int out, int in, int add,
                                  const int *__restrict__ eid, int ne, int xdiv, long long wst, long long scst) {
  const int e = expert_of(eid, ne), p = blockIdx.y;
  gemv_nvfp4_ggml_body<R, 1, U>(W + e * wst, sc + e * scst, x + (size_t)(p / xdiv) * in, y + (size_t)p * out, out, in, 1, add, blockIdx.x);
}
template <int R, int BMAX, int U>
__global__ void gemv_q8_0(const u8 *__restrict__ W, const float *__restrict__ x, float *__restrict__ y,
                          int out, int in, int nb, int add) {
  gemv_q8_0_body<R, BMAX, U>(W, x, y, out, in, nb, add, blockIdx.x);
}
template <int R, int U>
__global__ void gemv_q8_0_e(const u8 *__restrict__ W, const float *__restrict__ x, float *__restrict__ y,
                            int out, int in, int add, const int *__restrict__ eid, int ne, int xdiv, long long wst) {
  const int e = expert_of(eid, ne), p = blockIdx.y;
  gemv_q8_0_body<R, 1, U>(W + e * wst, x + (size_t)(p / xdiv) * in, y + (size_t)p * out, out, in, 1, add, blockIdx.x);
}
// ---- grouped: up to 3 matrices that read the same x in one launch (q, k and v; gate and up). CTA
// blockIdx.x < c1 computes matrix 0's row block blockIdx.x, < c2 matrix 1's (blockIdx.x - c1), else
// matrix 2's; each member is computed exactly as a launch of it alone with the same config. An unused
// slot has its c at the grid's end. NORM 1: x is the input of an RMSNorm over the whole row (weight nw,
// eps) that the members read (reduce_store). ----
__device__ __forceinline__ int group_member(int c1, int c2) { return blockIdx.x >= c2 ? 2 : blockIdx.x >= c1 ? 1 : 0; }

template <int FMT, int R, int BMAX, int U, int WPC, int NORM>
__global__ void gemv_plain_g(const u32 *__restrict__ W0, const u32 *__restrict__ W1, const u32 *__restrict__ W2,
                             const void *S0, const void *S1, const void *S2, const float *sc0, const float *sc1, const float *sc2,
                             float *y0, float *y1, float *y2, int out0, int out1, int out2, int c1, int c2,
                             const float *__restrict__ x, int in, int nb, int add, const float *__restrict__ nw, float eps) {
  const int m = group_member(c1, c2);
  if (m == 0) gemv_plain_body<FMT, R, BMAX, U, WPC, NORM>(W0, S0, sc0, x, y0, out0, in, nb, add, blockIdx.x, nw, eps);
  else if (m == 1) gemv_plain_body<FMT, R, BMAX, U, WPC, NORM>(W1, S1, sc1, x, y1, out1, in, nb, add, blockIdx.x - c1, nw, eps);
  else gemv_plain_body<FMT, R, BMAX, U, WPC, NORM>(W2, S2, sc2, x, y2, out2, in, nb, add, blockIdx.x - c2, nw, eps);
}
// ---- moe_router in one launch (a decode step's router; lever BLOOMERY_MOE_ROUTER fused): the router's GEMV
// as gemv_plain computes it (NORM 1: as gemv_plain_g's one member with the RMSNorm before it folded in), its
// logits y [nb][out] written whole; then the last CTA to finish (a counter, sem[0], left at 0) makes
// moe_topk_k's choice for each row (warp w: rows w, w + warps, ...; pr: E floats a warp). The same logits,
// ids and weights as the GEMV launch and moe_topk_k after it, bit for bit; one launch instead of two. ----
template <int FMT, int R, int BMAX, int U, int WPC, int NORM>
__global__ void gemv_plain_topk(const u32 *__restrict__ W, const void *__restrict__ S, const float *__restrict__ sc,
                                const float *x, float *y, int out, int in, int nb, const float *__restrict__ nw,
                                float eps, int *sem, int *ids, float *wts, int k, int norm) {
  extern __shared__ float pr[];
  __shared__ int last;
  gemv_plain_body<FMT, R, BMAX, U, WPC, NORM>(W, S, sc, x, y, out, in, nb, 0, blockIdx.x, nw, eps);
  __threadfence();                                   // this CTA's logits before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(sem, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int w = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int b = w; b < nb; b += nwarps)
    moe_topk_warp(y + (size_t)b * out, pr + (size_t)w * out, ids + (size_t)b * k, wts + (size_t)b * k, out, k, norm);
  if (threadIdx.x == 0) sem[0] = 0;
}

template <int R, int BMAX, int U, int NORM>
__global__ void gemv_nvfp4_ggml_g(const u8 *__restrict__ W0, const u8 *__restrict__ W1, const u8 *__restrict__ W2,
                                  const void *S0, const void *S1, const void *S2, const float *sc0, const float *sc1, const float *sc2,
                                  float *y0, float *y1, float *y2, int out0, int out1, int out2, int c1, int c2,
                                  const float *__restrict__ x, int in, int nb, int add, const float *__restrict__ nw, float eps) {
  const int m = group_member(c1, c2);
  if (m == 0) gemv_nvfp4_ggml_body<R, BMAX, U, NORM>(W0, sc0, x, y0, out0, in, nb, add, blockIdx.x, nw, eps);
  else if (m == 1) gemv_nvfp4_ggml_body<R, BMAX, U, NORM>(W1, sc1, x, y1, out1, in, nb, add, blockIdx.x - c1, nw, eps);
  else gemv_nvfp4_ggml_body<R, BMAX, U, NORM>(W2, sc2, x, y2, out2, in, nb, add, blockIdx.x - c2, nw, eps);
}
template <int R, int BMAX, int U, int NORM>
__global__ void gemv_q8_0_g(const u8 *__restrict__ W0, const u8 *__restrict__ W1, const u8 *__restrict__ W2,
                            const void *S0, const void *S1, const void *S2, const float *sc0, const float *sc1, const float *sc2,
                            float *y0, float *y1, float *y2, int out0, int out1, int out2, int c1, int c2,
                            const float *__restrict__ x, int in, int nb, int add, const float *__restrict__ nw, float eps) {
  const int m = group_member(c1, c2);
  if (m == 0) gemv_q8_0_body<R, BMAX, U, NORM>(W0, x, y0, out0, in, nb, add, blockIdx.x, nw, eps);
  else if (m == 1) gemv_q8_0_body<R, BMAX, U, NORM>(W1, x, y1, out1, in, nb, add, blockIdx.x - c1, nw, eps);
  else gemv_q8_0_body<R, BMAX, U, NORM>(W2, x, y2, out2, in, nb, add, blockIdx.x - c2, nw, eps);
}
// ---- paired: gate and up (two matrices of one shape reading one x) and the SwiGLU after them in one
// launch. CTA i computes row block i of the gate, keeps it in shared memory, then the same block of up,
// and writes silu(gate) * up (ops_src.py SWIGLU, the swiglu op's own arithmetic; lim: glm5_next's clamp) to O.
// Each half is the body a Group launch runs for that matrix (same config): the same values bit for
// bit, so O is what the unfused launches write. NORM as the grouped kernels. ----
template <int R, int BMAX>
__device__ __forceinline__ void pair_store(const float (&gu)[2][BMAX * R], float *__restrict__ O, int out, int nb, int lim,
                                           float L) {
  __syncthreads();
  for (int i = threadIdx.x; i < R * BMAX; i += blockDim.x) {
    const int b = i / R, r = i % R, row = blockIdx.x * R + r;
    if (row < out && b < nb) O[(size_t)b * out + row] = lim ? swiglu1_limit(gu[0][i], gu[1][i], L) : swiglu1(gu[0][i], gu[1][i]);
  }
}
template <int FMT, int R, int BMAX, int U, int WPC, int NORM>
__global__ void gemv_plain_pair(const u32 *__restrict__ W0, const u32 *__restrict__ W1, const void *S0, const void *S1,
                                const float *sc0, const float *sc1, float *O, int out, const float *__restrict__ x, int in,
                                int nb, const float *__restrict__ nw, float eps, int lim, float L) {
  __shared__ float gu[2][BMAX * R];
  gemv_plain_body<FMT, R, BMAX, U, WPC, NORM>(W0, S0, sc0, x, O, out, in, nb, 0, blockIdx.x, nw, eps, gu[0]);
  __syncthreads();                                   // the first half's reduction is read (one shared scratch)
  gemv_plain_body<FMT, R, BMAX, U, WPC, NORM>(W1, S1, sc1, x, O, out, in, nb, 0, blockIdx.x, nw, eps, gu[1]);
  pair_store<R, BMAX>(gu, O, out, nb, lim, L);
}
template <int R, int BMAX, int U, int NORM>
__global__ void gemv_nvfp4_ggml_pair(const u8 *__restrict__ W0, const u8 *__restrict__ W1, const void *S0, const void *S1,
                                     const float *sc0, const float *sc1, float *O, int out, const float *__restrict__ x, int in,
                                     int nb, const float *__restrict__ nw, float eps, int lim, float L) {
  __shared__ float gu[2][BMAX * R];
  gemv_nvfp4_ggml_body<R, BMAX, U, NORM>(W0, sc0, x, O, out, in, nb, 0, blockIdx.x, nw, eps, gu[0]);
  __syncthreads();
  gemv_nvfp4_ggml_body<R, BMAX, U, NORM>(W1, sc1, x, O, out, in, nb, 0, blockIdx.x, nw, eps, gu[1]);
  pair_store<R, BMAX>(gu, O, out, nb, lim, L);
}
template <int R, int BMAX, int U, int NORM>
__global__ void gemv_q8_0_pair(const u8 *__restrict__ W0, const u8 *__restrict__ W1, const void *S0, const void *S1,
                               const float *sc0, const float *sc1, float *O, int out, const float *__restrict__ x, int in,
                               int nb, const float *__restrict__ nw, float eps, int lim, float L) {
  __shared__ float gu[2][BMAX * R];
  gemv_q8_0_body<R, BMAX, U, NORM>(W0, x, O, out, in, nb, 0, blockIdx.x, nw, eps, gu[0]);
  __syncthreads();
  gemv_q8_0_body<R, BMAX, U, NORM>(W1, x, O, out, in, nb, 0, blockIdx.x, nw, eps, gu[1]);
  pair_store<R, BMAX>(gu, O, out, nb, lim, L);
}
// ---- the MoE form's gate and up and the SwiGLU after them in one launch (a decode step's routed experts):
// blockIdx.y is the pair p (expert e = eid[p], input row x[p / xdiv]); CTA i computes row block i of
// the gate and of the up of expert e and writes silu(gate) * up to O[p]. Each half is gemv_nvfp4_ggml_e's
// body (a row's sum does not depend on R), so O is what the unfused launches and the swiglu op write,
// bit for bit, at the same thread count. Launched without PDL (as the other expert forms): with it the
// decode step was slower (docs/kernels.md), and the expert ids it reads first are the kernel before's.
// NORM 1: x is the input of the RMSNorm (weight nw) before the experts, folded in as the grouped kernels
// fold it (each half sums its x row's squares; the norm's values to float32 rounding, not bit for bit).
// PF 1: the CTAs of pair p also bring expert e's down matrix (Wd + e * wdst, wdst bytes) into the L2, each
// its share, for the combine launch after (lever BLOOMERY_MOE_PREFETCH; the values are unchanged). ----
template <int R, int U, int NORM = 0, int PF = 0>
__global__ void gemv_nvfp4_ggml_pair_e(const u8 *__restrict__ W0, const u8 *__restrict__ W1, const float *__restrict__ sc0,
                                       const float *__restrict__ sc1, float *__restrict__ O, int out,
                                       const float *__restrict__ x, int in, int xdiv, const int *__restrict__ eid, int ne,
                                       long long wst, long long scst, int lim, float L,
                                       const float *__restrict__ nw, float eps, const u8 *__restrict__ Wd, long long wdst) {
  __shared__ float gu[2][R];
  const int e = expert_of(eid, ne), p = blockIdx.y;
  if constexpr (PF) l2_prefetch_share(Wd + e * wdst, wdst, blockIdx.x, gridDim.x);
  const float *xp = x + (size_t)(p / xdiv) * in;
  float *Op = O + (size_t)p * out;
  gemv_nvfp4_ggml_body<R, 1, U, NORM>(W0 + e * wst, sc0 + e * scst, xp, Op, out, in, 1, 0, blockIdx.x, nw, eps, gu[0]);
  __syncthreads();
  gemv_nvfp4_ggml_body<R, 1, U, NORM>(W1 + e * wst, sc1 + e * scst, xp, Op, out, in, 1, 0, blockIdx.x, nw, eps, gu[1]);
  pair_store<R, 1>(gu, Op, out, 1, lim, L);
}

// ---- the MoE form's down and the weighted sum over a row's choices in one launch (moe_experts' combine,
// the residual add folded when add): blockIdx.y is the token row r; its k pairs p = r * k + j (expert
// eid[p], weight wts[p], input row d[p]) make one K range of k * in / 64 GGML blocks that the CTA's
// 8-thread groups share (a group's block v: pair v / (in / 64)), so the k experts' rows stream at once
// instead of one short row each. y[r] (+)= sum_j wts[p] * (W[e_p] d[p]): each block's sum times its scale
// byte, its expert's scale_2 and its weight (one float a pair), summed in a fixed order (deterministic;
// a row's value does not depend on the other rows). Its CTAs first bring up to three arrays (the next
// layer's first linears: lever BLOOMERY_MOE_PREFETCH) into the L2, each its share. ----
#define EC_KMAX 32
template <int R, int U>
__global__ void gemv_nvfp4_ggml_ec(const u8 *__restrict__ W, const float *__restrict__ sc, const float *__restrict__ d,
                                   const float *__restrict__ wts, float *__restrict__ y, int out, int in, int add,
                                   const int *__restrict__ eid, int ne, int k, long long wst, long long scst,
                                   const void *__restrict__ pf0, long long pb0, const void *__restrict__ pf1,
                                   long long pb1, const void *__restrict__ pf2, long long pb2) {
  __shared__ long long sw[EC_KMAX];
  __shared__ float sf[EC_KMAX];
  const int r0 = blockIdx.y;
  {                                                  // the next linears' weights into the L2 (pb 0: none)
    const int part = blockIdx.y * gridDim.x + blockIdx.x, parts = gridDim.x * gridDim.y;
    l2_prefetch_share(pf0, pb0, part, parts);
    l2_prefetch_share(pf1, pb1, part, parts);
    l2_prefetch_share(pf2, pb2, part, parts);
  }
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    int e = eid[r0 * k + j];
    e = e < 0 ? 0 : (e >= ne ? ne - 1 : e);
    sw[j] = (long long)e * wst;
    sf[j] = wts[r0 * k + j] * (__ldg(sc + (size_t)e * scst) * 64.0f);
  }
  __syncthreads();
  const int nblk = in / 64, rowbytes = nblk * 36, nv = k * nblk;
  const int g = threadIdx.x >> 3, t = threadIdx.x & 7, ng = blockDim.x >> 3;
  const int row0 = blockIdx.x * R;
  float acc[R][1];
  int rowc[R];
  start_rows<R, 1>(acc, rowc, row0, out);
  const int koff = 16 * (t >> 1) + 4 * (t & 1);
  const float *dr = d + (size_t)r0 * k * in;
  for (int v0 = g; v0 < nv; v0 += U * ng) {
    u32 wv[U][R];
    u32 sv[U][R];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int v = v0 + u * ng;
      const int j = v / nblk, blk = v - j * nblk;
#pragma unroll
      for (int r = 0; r < R; r++) {
        if (v < nv) {
          const u8 *p = W + sw[j] + (size_t)rowc[r] * rowbytes + (size_t)blk * 36;
          wv[u][r] = __ldg(reinterpret_cast<const u32 *>(p + 4 + 4 * t));
          sv[u][r] = __ldg(p + (t >> 1));
        } else { wv[u][r] = 0u; sv[u][r] = 0u; }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int v = v0 + u * ng;
      if (v >= nv) break;
      const int j = v / nblk, blk = v - j * nblk;
      const float *xp = dr + (size_t)j * in + blk * 64 + koff;
      const float4 xl = ldx4(xp), xh = ldx4(xp + 8);
      const float f = sf[j];
#pragma unroll
      for (int r = 0; r < R; r++) {
        float lo[4], hi[4];
        const u32 w = wv[u][r];
        e4m3x4(lo_nib_e4m3(w), lo);
        e4m3x4(hi_nib_e4m3(w), hi);
        acc[r][0] = fmaf(ggml_dot8(lo, hi, xl, xh), e4m3_1(sv[u][r]) * f, acc[r][0]);
      }
    }
  }
  float rs[R];
#pragma unroll
  for (int r = 0; r < R; r++) rs[r] = 1.0f;
  reduce_store<R, 1>(acc, y + (size_t)r0 * out, rs, row0, out, 1, add);
}
template <int BMAX>
__global__ void gemv_mxfp4_ggml(const u8 *__restrict__ W, const float *__restrict__ x, float *__restrict__ y,
                                int out, int in, int nb, int add) {
  gemv_mxfp4_ggml_body<BMAX>(W, x, y, out, in, nb, add);
}
__global__ void gemv_mxfp4_ggml_e(const u8 *__restrict__ W, const float *__restrict__ x, float *__restrict__ y,
                                  int out, int in, int add, const int *__restrict__ eid, int ne, int xdiv, long long wst) {
  const int e = expert_of(eid, ne), p = blockIdx.y;
  gemv_mxfp4_ggml_body<1>(W + e * wst, x + (size_t)(p / xdiv) * in, y + (size_t)p * out, out, in, 1, add);
}
"""
