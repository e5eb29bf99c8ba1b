// The device-side number formats every kernel source shares: one owner of each conversion. cu.source()
// pastes this file where a .cu file says #include "numerics.cuh" (so NVRTC's source, and CuPy's cache key,
// hold it whole); gemv_src.py's SOURCE starts with it. nvcc compiles a .cu file as it stands with
// -I runtime/cuda.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// ---- f16, E4M3, E2M1, E8M0 ----
__device__ __forceinline__ u32 e4m3x2_h2(u32 v16) {
  u32 r; u16 v = (u16)v16;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}
__device__ __forceinline__ void h2f2(u32 h, float &a, float &b) {
  u16 lo, hi;
  asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(h));
  asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(lo));
  asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(hi));
}
// 4 E4M3 bytes (byte i = element i) -> 4 floats
__device__ __forceinline__ void e4m3x4(u32 w, float *v) {
  h2f2(e4m3x2_h2(w & 0xFFFFu), v[0], v[1]);
  h2f2(e4m3x2_h2(w >> 16), v[2], v[3]);
}
__device__ __forceinline__ float e4m3_1(u32 byte) {
  float a, b; h2f2(e4m3x2_h2(byte & 0xFFu), a, b); return a;
}
// E2M1 nibbles in the low half of each byte of (w >> sh) -> E4M3 bytes (value * 2^-6)
__device__ __forceinline__ u32 lo_nib_e4m3(u32 w) {   // low nibbles of w's bytes
  return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
}
__device__ __forceinline__ u32 hi_nib_e4m3(u32 w) {   // high nibbles of w's bytes
  return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}
__device__ __forceinline__ float e8m0_f(u32 e) {
  return e ? __uint_as_float(e << 23) : __uint_as_float(0x00400000u);
}
__device__ __forceinline__ u32 f2h2(float lo, float hi) {     // lo -> the low half (the even k)
  u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) { u32 r; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
// one GGML NVFP4 data word's 8 values times the sub-block scale s2 (f16x2), as f16x2: (el 0,1), (el 2,3) of
// its low nibbles, then of its high nibbles (e2m1 * E4M3 * 2^-6 is exact in f16)
__device__ __forceinline__ void nvfp4_word_h2(u32 w, u32 s2, u32 (&h)[4]) {
  const u32 lo = lo_nib_e4m3(w), hi = hi_nib_e4m3(w);
  h[0] = hmul2(e4m3x2_h2(lo & 0xFFFFu), s2); h[1] = hmul2(e4m3x2_h2(lo >> 16), s2);
  h[2] = hmul2(e4m3x2_h2(hi & 0xFFFFu), s2); h[3] = hmul2(e4m3x2_h2(hi >> 16), s2);
}
// E2M1 nibbles as f16 (the tensor-core NVFP4 layouts made at load: gemv_tile.cu, gemv_row.cu). A nibble s.e1e0m at f16
// bits 15 and 11..9 is e2m1 * 2^-14 exactly (f16's subnormals line up with E2M1's). A layout word q holds eight such
// fields, read as four f16x2 registers o_k = (rotr(q, a_k) & signs) | (rotr(q, b_k) & magnitudes) with (a, b) =
// (0, 0), (1, 3), (2, 12), (9, 9) (gemv_tile.py ROT): each of q's 32 bits lands once.
__device__ __forceinline__ u32 rotr(u32 q, u32 r) { u32 d; asm("shf.r.wrap.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(q), "r"(r)); return d; }
#define NVFP4_ROT_SIGN 0x80008000u
#define NVFP4_ROT_MAG 0x0E000E00u
__device__ __forceinline__ void nvfp4_rot_h2(u32 q, u32 &o0, u32 &o1, u32 &o2, u32 &o3) {
  o0 = q & (NVFP4_ROT_SIGN | NVFP4_ROT_MAG);
  o1 = (rotr(q, 1) & NVFP4_ROT_SIGN) | (rotr(q, 3) & NVFP4_ROT_MAG);
  o2 = (rotr(q, 2) & NVFP4_ROT_SIGN) | (rotr(q, 12) & NVFP4_ROT_MAG);
  o3 = rotr(q, 9) & (NVFP4_ROT_SIGN | NVFP4_ROT_MAG);
}
// a pair of floats as f16x2: their high parts (part 0), or what the high parts leave (part 1): a = hi + lo to
// ~22 bits where |a| is scaled into f16's range (the tensor-core GEMVs' x, gemv_tc.cu and gemv_tile.cu)
__device__ __forceinline__ u32 f16_part2(float a, float b, int part) {
  const u32 h = f2h2(a, b);
  if (!part) return h;
  float ha, hb;
  h2f2(h, ha, hb);
  return f2h2(a - ha, b - hb);
}

// ---- bf16 ----
// (lo, hi) -> a packed bf16 pair, each rounded to nearest even
__device__ __forceinline__ unsigned bf16x2_rn(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bflo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bfhi(unsigned v) { return __uint_as_float(v & 0xFFFF0000u); }

// ---- tensor cores ----
// mma.sync m16n8k16, f16 in, float32 accumulate (d += A B; A four f16x2 registers, B two)
__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]),
                 "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], const void *p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm4t(unsigned (&r)[4], const void *p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// ---- the KV cache's raw words ----
// four consecutive cache values from element i (i % 4 == 0) as stored (type CT 0 f32: one 16-byte load;
// 1 bf16, 2 f16: one 8-byte load)
template <int CT> struct Raw4 { uint2 w; };
template <> struct Raw4<0> { float4 w; };
template <int CT> __device__ __forceinline__ Raw4<CT> raw4(const void *p, size_t i) {
  Raw4<CT> r;
  if constexpr (CT == 0) r.w = *reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(p) + i);
  else r.w = *reinterpret_cast<const uint2 *>(reinterpret_cast<const unsigned short *>(p) + i);
  return r;
}

// ---- L2 prefetch of a later kernel's bytes ----
// a byte range shared out over `parts` cooperating CTAs (part: this CTA's index among them): each thread
// issues prefetch.global.L2 for some of the CTA's 128-byte lines; no register is written and nothing waits
// for it, so a kernel that waits on latency brings the next kernel's weights into the L2 meanwhile
__device__ __forceinline__ void l2_prefetch_share(const void *base, long long bytes, int part, int parts) {
  const int lines = (int)((bytes + 127) >> 7), per = (lines + parts - 1) / parts;   // a range below 256 GB
  const int l0 = part * per, l1 = min(lines, l0 + per);
  for (int l = l0 + (int)threadIdx.x; l < l1; l += blockDim.x)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char *>(base) + ((size_t)l << 7)));
}
