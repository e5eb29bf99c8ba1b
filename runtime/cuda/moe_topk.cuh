#pragma once
// moe_router's choice for one token row, by one warp (one owner: ops_src.py moe_topk_k after the router's
// GEMV launch, and gemv_src.py gemv_plain_topk, whose last CTA chooses in the GEMV's launch): the softmax of
// the E logits lg (max subtracted), the top k (largest first, ties to the lower index) into ids[0..k) and
// wts[0..k), renormalised when norm (runtime/ops/moe_router.py). pr: E floats of the warp's own shared
// memory. The logits are read through the L2 (__ldcg): in gemv_plain_topk other CTAs of the launch wrote them.
__device__ __forceinline__ void moe_topk_warp(const float *lg, float *pr, int *ids, float *wts, int E, int k, int norm) {
  const int lane = threadIdx.x & 31;
  float mx = __int_as_float(0xff800000u);
  for (int i = lane; i < E; i += 32) mx = fmaxf(mx, __ldcg(lg + i));
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  for (int i = lane; i < E; i += 32) { const float e = expf(__ldcg(lg + i) - mx); pr[i] = e; sum += e; }
#pragma unroll
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  for (int i = lane; i < E; i += 32) pr[i] = pr[i] / sum;
  __syncwarp();
  float tot = 0.f;
  for (int j = 0; j < k; j++) {
    float bv = -1.f; int bi = 0x7fffffff;
    for (int i = lane; i < E; i += 32) { const float v = pr[i]; if (v > bv) { bv = v; bi = i; } }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { ids[j] = bi; wts[j] = bv; pr[bi] = -2.f; }
    tot += bv;
    __syncwarp();
  }
  if (norm && lane == 0)
    for (int j = 0; j < k; j++) wts[j] = wts[j] / tot;
}
