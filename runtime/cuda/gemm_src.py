"""CUDA C++ source of the prompt-chunk (prefill) GEMM's helpers: weight tiles decoded from the
artifact layout into a BF16 scratch matrix, and activations rounded to BF16 (compiled with
gemv_src.SOURCE, whose decoders they share: one owner of each format's device-side decoding).

Every kernel writes row-major BF16 [out, in] (W) or [rows, in] (x); cuBLAS multiplies them on the
tensor cores (runtime/cuda/gemm.py). Which values are exact in BF16:
  NVFP4 (e2m1 x E4M3 block scale: <= 6 significant bits), MXFP8 (E4M3 x 2^k), MXFP4, FP8 tensor
  (E4M3) and BF16: exact; the per-tensor factor (NVFP4 scale_2, FP8 scale) is cuBLAS's alpha.
  FP8 per-channel and 128x128-block scales, Q8_0's f16 scale and F32 weights are multiplied in
  float32 and rounded to BF16 once (relative error <= 2^-9 per weight); in the exact mode they are
  written as two BF16 tiles, hi + lo (16 significant bits), multiplied by two GEMMs.
Rounding: round to nearest even (the same as ml_dtypes' float32 -> bfloat16 cast).
"""

SOURCE = r"""
__device__ __forceinline__ u32 f2bf(float f) {            // float32 -> BF16 bits, round to nearest even
  const u32 b = __float_as_uint(f);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ u32 bf2(float a, float b) { return f2bf(a) | (f2bf(b) << 16); }

// x (float32 [n]) -> hi = bf16(x) and, when lo != 0, lo = bf16(x - hi): hi + lo carries 16
// significant bits of x (the "bf16x2" prefill keeps float32-level activations on the tensor cores).
// Its CuTe DSL twin, compiled ahead of time into artifacts: compiler/cutedsl/act_split.py (the same bits).
__global__ void x_to_bf16_k(const float *__restrict__ x, u16 *__restrict__ hi, u16 *__restrict__ lo, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float f = x[i];
    const u32 h = f2bf(f);
    hi[i] = (u16)h;
    if (lo) lo[i] = (u16)f2bf(f - __uint_as_float(h << 16));
  }
}

// plain word formats (gemv_src's FMT ids): one thread per stored 32-bit word (EPW values)
// Each decoder writes BF16 tiles; where `lo` is given (the formats BF16 does not hold exactly, in
// the exact mode) it also writes lo = bf16(w - hi): hi + lo carries 16 significant bits of w.
__device__ __forceinline__ void put_lo(u16 *lo, size_t i, float v, u32 h) {
  if (lo) lo[i] = (u16)f2bf(v - __uint_as_float(h << 16));
}

template <int FMT>
__global__ void deq_plain_k(const u32 *__restrict__ W, const void *__restrict__ S, const float *__restrict__ sc,
                            u16 *__restrict__ out, u16 *__restrict__ lo, int rows, int in) {
  constexpr int EPW = EPWof<FMT>::v;
  const int wpr = in / EPW;
  const long long nw = (long long)rows * wpr;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nw; i += (long long)gridDim.x * blockDim.x) {
    const int row = (int)(i / wpr), k0 = (int)(i % wpr) * EPW;
    float v[EPW];
    dequant_word<FMT>(__ldg(W + i), v);
    float s = 1.0f;
    if constexpr (FMT == FMT_MXFP8) s = e8m0_f(__ldg((const u8 *)S + (size_t)row * (in / 32) + k0 / 32));
    else if constexpr (FMT == FMT_NVFP4S) s = e4m3_1(__ldg((const u8 *)S + (size_t)row * (in / 16) + k0 / 16));
    else if constexpr (FMT == FMT_FP8B128) s = __ldg((const float *)S + (size_t)(row / 128) * ((in + 127) / 128) + k0 / 128);
    else if constexpr (FMT == FMT_FP8C) s = __ldg(sc + row);
    u16 *o = out + (size_t)row * in + k0;
    if constexpr (FMT == FMT_F32 || FMT == FMT_FP8C || FMT == FMT_FP8B128) {    // the rounded formats
      if (lo) {
#pragma unroll
        for (int e = 0; e < EPW; e++) {
          const float f = v[e] * s;
          const u32 h = f2bf(f);
          o[e] = (u16)h;
          put_lo(lo, (size_t)row * in + k0 + e, f, h);
        }
        continue;
      }
    }
    if constexpr (FMT == FMT_F32) { o[0] = (u16)f2bf(v[0] * s); }
    else if constexpr (FMT == FMT_BF16) { *reinterpret_cast<u32 *>(o) = bf2(v[0], v[1]); }
    else if constexpr (FMT == FMT_NVFP4S) {                  // v: elements 0,2,4,6 then 1,3,5,7
      *reinterpret_cast<uint4 *>(o) = make_uint4(bf2(v[0] * s, v[4] * s), bf2(v[1] * s, v[5] * s),
                                                 bf2(v[2] * s, v[6] * s), bf2(v[3] * s, v[7] * s));
    } else {
      *reinterpret_cast<uint2 *>(o) = make_uint2(bf2(v[0] * s, v[1] * s), bf2(v[2] * s, v[3] * s));
    }
  }
}

// GGML NVFP4 (36-byte blocks of 64): one thread per data word, gemv_nvfp4_ggml_body's mapping
__global__ void deq_nvfp4_ggml_k(const u8 *__restrict__ W, u16 *__restrict__ out, int rows, int in) {
  const int nblk = in / 64, rowbytes = nblk * 36;
  const long long n = (long long)rows * nblk * 8;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(i & 7);
    const long long rb = i >> 3;
    const int row = (int)(rb / nblk), blk = (int)(rb % nblk);
    const u8 *p = W + (size_t)row * rowbytes + (size_t)blk * 36;
    const u32 w = __ldg(reinterpret_cast<const u32 *>(p + 4 + 4 * t));
    const float s = e4m3_1(__ldg(p + (t >> 1)));
    float lo[4], hi[4];
    e4m3x4(lo_nib_e4m3(w), lo);
    e4m3x4(hi_nib_e4m3(w), hi);
    u16 *o = out + (size_t)row * in + blk * 64 + 16 * (t >> 1) + 4 * (t & 1);
    *reinterpret_cast<uint2 *>(o) = make_uint2(bf2(lo[0] * s, lo[1] * s), bf2(lo[2] * s, lo[3] * s));
    *reinterpret_cast<uint2 *>(o + 8) = make_uint2(bf2(hi[0] * s, hi[1] * s), bf2(hi[2] * s, hi[3] * s));
  }
}

// GGML Q8_0 (34-byte blocks of 32): one thread per 4 values (bytes 2+4t..5+4t, 2-byte aligned)
__global__ void deq_q8_0_k(const u8 *__restrict__ W, u16 *__restrict__ out, u16 *__restrict__ lo, int rows, int in) {
  const int nblk = in / 32, rowbytes = nblk * 34;
  const long long n = (long long)rows * nblk * 8;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(i & 7);
    const long long rb = i >> 3;
    const int row = (int)(rb / nblk), blk = (int)(rb % nblk);
    const u16 *p = reinterpret_cast<const u16 *>(W + (size_t)row * rowbytes + (size_t)blk * 34);
    const u32 w = (u32)__ldg(p + 1 + 2 * t) | ((u32)__ldg(p + 2 + 2 * t) << 16);
    float d; asm("cvt.f32.f16 %0, %1;" : "=f"(d) : "h"(__ldg(p)));
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = (float)(signed char)((w >> (8 * j)) & 0xFFu) * d;
    u16 *o = out + (size_t)row * in + blk * 32 + 4 * t;
    *reinterpret_cast<uint2 *>(o) = make_uint2(bf2(v[0], v[1]), bf2(v[2], v[3]));
#pragma unroll
    for (int j = 0; j < 4; j++) put_lo(lo, (size_t)row * in + blk * 32 + 4 * t + j, v[j], f2bf(v[j]));
  }
}

// GGML MXFP4 (17-byte blocks of 32: E8M0, then byte j = element j low nibble, j+16 high)
__global__ void deq_mxfp4_ggml_k(const u8 *__restrict__ W, u16 *__restrict__ out, int rows, int in) {
  const int nblk = in / 32;
  const long long n = (long long)rows * nblk * 16;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const int j = (int)(i & 15);
    const long long rb = i >> 4;
    const int row = (int)(rb / nblk), blk = (int)(rb % nblk);
    const u8 *p = W + ((size_t)row * nblk + blk) * 17;
    const float s = e8m0_f(__ldg(p));
    const u32 b = __ldg(p + 1 + j);
    u16 *o = out + (size_t)row * in + blk * 32 + j;
    o[0] = (u16)f2bf(E2M1_TAB[b & 15u] * s);
    o[16] = (u16)f2bf(E2M1_TAB[b >> 4] * s);
  }
}
"""
