// The routed experts of a prompt chunk as one grouped GEMM per stacked matrix (runtime/cuda/moe_gemm.py
// binds it; the contract is runtime/ops' moe_experts: y[p] = W[eid[p]] x[p / xdiv] for each (row, expert)
// pair p). Instead of one GEMV per pair, each reading its expert's whole matrix, the pairs are sorted by
// expert once per op (moe_route_k) and every expert's rows are multiplied in tiles of 64 on the tensor
// cores, the weights decoded from their stored layout (GGML NVFP4, FP8 per tensor) into shared memory in
// the main loop: no decoded copy of any weight exists outside a CTA.
//
// Arithmetic: mma.sync m16n8k16 bf16 with float32 accumulation. A GGML NVFP4 weight (e2m1 x E4M3
// sub-block scale, <= 6 significant bits) or an FP8 one (E4M3) is exact in bf16; the activation is split
// into hi = bf16(x) and lo = bf16(x - hi) (PARTS 2: 16 significant bits, the executor's bf16x2 prefill) or
// rounded once (PARTS 1: the bf16 lever). The per-expert factor (NVFP4 scale_2 times the 2^6 that the
// E2M1 -> E4M3 placement leaves out; the FP8 scale) multiplies the float32 result. Each output row is
// computed from its own activation row and the weight alone, in a fixed order over k, so a row's result
// does not depend on which other rows share its tile or in which order moe_route_k placed them:
// bit-identical from launch to launch.

#include "numerics.cuh"

__device__ __forceinline__ int clamp_expert(int e, int ne) { return e < 0 ? 0 : (e >= ne ? ne - 1 : e); }

// ---- routing: one CTA of 1,024 threads. ids [pairs] (the router's, out-of-range ids clamped as the GEMV
// kernels clamp them) -> perm [pairs] (the pairs grouped by expert: perm[pos] = pair) and the tile table:
// tile t of the grid takes sorted positions tile_off[t] .. min(tile_off[t] + bm, tile_end[t]) of expert
// tile_e[t] (-1: an unused tile of the grid, which has ceil(pairs / bm) + min(E, pairs) of them).
// Shared: 3 (E + 1) ints.
extern "C" __global__ void __launch_bounds__(1024)
moe_route_k(const int *__restrict__ ids, int pairs, int ne, int bm, int ntiles, int *__restrict__ perm,
            int *__restrict__ tile_e, int *__restrict__ tile_off, int *__restrict__ tile_end) {
  extern __shared__ int sm[];
  int *cnt = sm, *off = sm + (ne + 1), *tst = sm + 2 * (ne + 1);
  for (int e = threadIdx.x; e <= ne; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&cnt[clamp_expert(ids[p], ne)], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int o = 0, t = 0;
    for (int e = 0; e < ne; e++) {
      off[e] = o; tst[e] = t;
      o += cnt[e]; t += (cnt[e] + bm - 1) / bm;
      cnt[e] = off[e];                       // from here on: expert e's next free position
    }
    off[ne] = o; tst[ne] = t;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) perm[atomicAdd(&cnt[clamp_expert(ids[p], ne)], 1)] = p;
  for (int t = threadIdx.x; t < ntiles; t += blockDim.x) {
    if (t >= tst[ne]) { tile_e[t] = -1; tile_off[t] = 0; tile_end[t] = 0; continue; }
    int lo = 0, hi = ne - 1;                 // the expert e with tst[e] <= t < tst[e + 1] (and a tile)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (tst[mid] <= t) lo = mid; else hi = mid - 1;
    }
    tile_e[t] = lo;
    tile_off[t] = off[lo] + (t - tst[lo]) * bm;
    tile_end[t] = off[lo + 1];
  }
}

// ---- the grouped GEMM ----
constexpr int BN = 128, BK = 64;     // outputs a CTA, inner depth a k-step (one GGML block); rows: 32 WM

// a 64-wide row of bf16 is 8 chunks of 16 bytes; chunk c of row r lies at c ^ (r & 7) (ldmatrix: no conflicts)
__device__ __forceinline__ int swz(int r, int c) { return r * 64 + ((c ^ (r & 7)) << 3); }
__device__ __forceinline__ u32 hi16x2(float a, float b) {          // the upper halves: exact where a, b are bf16
  return __byte_perm(__float_as_uint(a), __float_as_uint(b), 0x7632);
}
// 4 E4M3 bytes times s -> 4 bf16 (exact: <= 6 significant bits)
__device__ __forceinline__ uint2 e4m3x4_bf(u32 w, float s) {
  float v[4];
  e4m3x4(w, v);
  return make_uint2(hi16x2(v[0] * s, v[1] * s), hi16x2(v[2] * s, v[3] * s));
}

// The weight layouts the kernel decodes (moe_gemm.py KINDS)
constexpr int W_NVFP4_GGML = 0;   // [E][out][in / 64 blocks of 36 bytes: 4 E4M3 sub-block scales, 32 nibble bytes]
constexpr int W_FP8_TENSOR = 1;   // [E][out][in] E4M3 bytes

// y[perm[pos]] = W[e] x[perm[pos] / xdiv] for the sorted positions pos of tile blockIdx.y, outputs
// blockIdx.x * BN ... + BN. W in layout FMT, expert e at W + e * wst bytes; sc: the per-tensor factor
// (NVFP4 scale_2, FP8 scale), expert e's at sc[e * scst]. in % 64 == 0. A tile is BM = 32 WM pairs (WM 1, 2
// or 4; the route's bm), 64 WM threads: warp (wm, wn) = (warp % WM, warp / WM) computes rows 32 wm .. + 32 by
// outputs 64 wn .. + 64. Shared: one stage of the x parts and the decoded weight tile (PARTS * 4 WM KB +
// 16 KB); the next k-step's words are loaded into registers while this one's mmas run.
// x: its bf16 parts [PARTS][nx][in] (gemm_src.py x_to_bf16_k, moe_gemm.py split), copied as they lie.
// ST 1: one shared-memory stage, two barriers a k-step (the decode of the next step waits for every warp's
// mmas); ST 2: two stages, the next step decoded into the other while slower warps still read this one, one
// barrier a k-step. Dynamic shared memory: ST x (PARTS BM + BN) x 64 x 2 bytes (moe_gemm.py smem_bytes).
template <int FMT, int PARTS, int WM, int ST>
__global__ void __launch_bounds__(64 * WM)
moe_gemm_k(const u8 *__restrict__ W, const float *__restrict__ sc, long long wst, long long scst,
                 const void *__restrict__ xv_, long long nx, int xdiv, float *__restrict__ y, int out, int in,
                 const int *__restrict__ perm, const int *__restrict__ tile_e, const int *__restrict__ tile_off,
                 const int *__restrict__ tile_end) {
  const int t = blockIdx.y, e = tile_e[t];
  if (e < 0) return;
  constexpr int BM = 32 * WM, NT = 64 * WM;
  const int pos0 = tile_off[t], nrow = min(BM, tile_end[t] - pos0), n0 = blockIdx.x * BN;
  extern __shared__ __align__(16) u16 smem_g[];
  constexpr int SS = (PARTS * BM + BN) * BK;          // elements a stage: the x parts, then the weight tile
  u16 *As[PARTS], *Bs;                                 // the stage being written (store) / read (the mmas)
  auto stage = [&](int st) {
#pragma unroll
    for (int pp = 0; pp < PARTS; pp++) As[pp] = smem_g + st * SS + pp * BM * BK;
    Bs = smem_g + st * SS + PARTS * BM * BK;
  };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp % WM, wn = warp / WM;
  const int nblk = in / BK, rowbytes = nblk * 36;
  const u8 *We = W + e * wst;

  // x: thread (q = tid & 7, r = tid >> 3) loads 16-byte chunk q of each part of rows r + NT / 8 i (i < 4)
  const u16 *xb = reinterpret_cast<const u16 *>(xv_);
  constexpr int XI = 4, XR = NT / 8;
  const int xq = tid & 7, xr = tid >> 3;
  long long xoff[XI];               // the element offset of the thread's piece of each row, -1: no row
#pragma unroll
  for (int i = 0; i < XI; i++) {
    const int m = xr + XR * i;
    xoff[i] = m < nrow ? (long long)(perm[pos0 + m] / xdiv) * in + 8 * xq : -1;
  }
  // W, NVFP4: thread (wt = tid & 7, wr = tid >> 3) loads data word wt (and the scale word) of rows wr + NT / 8 j
  // (j < 16 / WM); FP8: thread (wt = tid & 3, wr = tid >> 2) loads 16-byte word wt of rows wr + NT / 4 j (j < 8 / WM)
  constexpr int WJ = FMT == W_NVFP4_GGML ? 16 / WM : 8 / WM, WS = FMT == W_NVFP4_GGML ? NT / 8 : NT / 4;
  const int wt = FMT == W_NVFP4_GGML ? tid & 7 : tid & 3, wr = FMT == W_NVFP4_GGML ? tid >> 3 : tid >> 2;
  const int rowb = FMT == W_NVFP4_GGML ? rowbytes : in;
  const u8 *wrow[WJ];
#pragma unroll
  for (int j = 0; j < WJ; j++) {
    const int n = n0 + wr + WS * j;
    wrow[j] = n < out ? We + (size_t)n * rowb : nullptr;
  }

  float4 xv[PARTS * XI];            // the raw 16-byte chunks, XI of each part
  constexpr int WR = FMT == W_NVFP4_GGML ? WJ : 2 * WJ;
  u32 wd[WR], ws[WR];               // NVFP4: a data word and its block's scale word a row; FP8: 16 bytes in two
  auto load = [&](int kb) {
#pragma unroll
    for (int i = 0; i < XI; i++) {
#pragma unroll
      for (int pp = 0; pp < PARTS; pp++)
        xv[pp * XI + i] = xoff[i] >= 0 ? *reinterpret_cast<const float4 *>(xb + pp * nx * in + xoff[i] + kb * BK)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < WJ; j++) {
      if constexpr (FMT == W_NVFP4_GGML) {
        if (wrow[j]) {
          const u32 *p = reinterpret_cast<const u32 *>(wrow[j] + kb * 36);
          ws[j] = __ldg(p);
          wd[j] = __ldg(p + 1 + wt);
        } else {
          ws[j] = 0u; wd[j] = 0u;
        }
      } else {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (wrow[j]) v = __ldg(reinterpret_cast<const uint4 *>(wrow[j] + kb * BK) + wt);
        wd[2 * j] = v.x; wd[2 * j + 1] = v.y; ws[2 * j] = v.z; ws[2 * j + 1] = v.w;
      }
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int i = 0; i < XI; i++)
#pragma unroll
      for (int pp = 0; pp < PARTS; pp++)
        *reinterpret_cast<float4 *>(&As[pp][swz(xr + XR * i, xq)]) = xv[pp * XI + i];
    if constexpr (FMT == W_NVFP4_GGML) {
      const int sb = wt >> 1, half = 4 * (wt & 1);
#pragma unroll
      for (int j = 0; j < WJ; j++) {
        const int n = wr + WS * j;
        float s, s_unused;
        h2f2(e4m3x2_h2(ws[j] >> (8 * sb)), s, s_unused);
        *reinterpret_cast<uint2 *>(&Bs[swz(n, 2 * sb) + half]) = e4m3x4_bf(lo_nib_e4m3(wd[j]), s);
        *reinterpret_cast<uint2 *>(&Bs[swz(n, 2 * sb + 1) + half]) = e4m3x4_bf(hi_nib_e4m3(wd[j]), s);
      }
    } else {                        // 16 E4M3 bytes: elements 16 wt .. + 16, chunks 2 wt and 2 wt + 1
#pragma unroll
      for (int j = 0; j < WJ; j++) {
        const int n = wr + WS * j;
        const uint2 a = e4m3x4_bf(wd[2 * j], 1.0f), b = e4m3x4_bf(wd[2 * j + 1], 1.0f);
        const uint2 c = e4m3x4_bf(ws[2 * j], 1.0f), d = e4m3x4_bf(ws[2 * j + 1], 1.0f);
        *reinterpret_cast<uint4 *>(&Bs[swz(n, 2 * wt)]) = make_uint4(a.x, a.y, b.x, b.y);
        *reinterpret_cast<uint4 *>(&Bs[swz(n, 2 * wt + 1)]) = make_uint4(c.x, c.y, d.x, d.y);
      }
    }
  };

  float acc[2][8][4];
#pragma unroll
  for (int a = 0; a < 2; a++)
#pragma unroll
    for (int b = 0; b < 8; b++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[a][b][c] = 0.f;

  stage(0);
  load(0);
  store();
  __syncthreads();
  for (int kb = 0; kb < nblk; kb++) {
    if (kb + 1 < nblk) load(kb + 1);
    stage(ST == 2 ? kb & 1 : 0);
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) {
      u32 af[PARTS][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; mt++) {
        const int r = wm * 32 + mt * 16 + (lane & 15), c = 2 * ks + (lane >> 4);
#pragma unroll
        for (int pp = 0; pp < PARTS; pp++)
          ldsm4(af[pp][mt], &As[pp][swz(r, c)]);
      }
#pragma unroll
      for (int np = 0; np < 4; np++) {
        const int n = wn * 64 + np * 16 + (lane & 7) + ((lane >> 4) << 3), c = 2 * ks + ((lane >> 3) & 1);
        u32 b[4];
        ldsm4(b, &Bs[swz(n, c)]);
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
          for (int pp = 0; pp < PARTS; pp++) {
            mma_bf16(acc[mt][2 * np], af[pp][mt], b[0], b[1]);
            mma_bf16(acc[mt][2 * np + 1], af[pp][mt], b[2], b[3]);
          }
      }
    }
    if constexpr (ST == 2) {
      if (kb + 1 < nblk) {
        stage((kb + 1) & 1);       // last read in step kb - 1, which every warp left at the barrier below
        store();
      }
      __syncthreads();
    } else {
      __syncthreads();
      if (kb + 1 < nblk) {
        store();
        __syncthreads();
      }
    }
  }

  const float alpha = __ldg(sc + e * scst) * (FMT == W_NVFP4_GGML ? 64.0f : 1.0f);
  const int g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int m = wm * 32 + mt * 16 + g + 8 * h;
      if (m >= nrow) continue;
      float *yr = y + (size_t)perm[pos0 + m] * out;
#pragma unroll
      for (int nt = 0; nt < 8; nt++) {
        const int n = n0 + wn * 64 + nt * 8 + c2;
        const float v0 = acc[mt][nt][2 * h] * alpha, v1 = acc[mt][nt][2 * h + 1] * alpha;
        if (n + 1 < out && !(out & 1)) *reinterpret_cast<float2 *>(yr + n) = make_float2(v0, v1);
        else {
          if (n < out) yr[n] = v0;
          if (n + 1 < out) yr[n + 1] = v1;
        }
      }
    }
}
