// moe_router_grouped: the choice of runtime/ops/moe_router_grouped.py (GLM-4.5's sigmoid router,
// DeepSeek-V3's noaux_tc) after its GEMV (the logits, float32). One warp per row; shared memory
// holds s = sigmoid(logits) [E], c = s + bias [E] (the correction: for the choice only), the group
// scores [n_group] and the chosen ids [k].
//   group score = the sum of the group's two largest c (largest + second, as NumPy's sorted pair adds)
//   the topk_group groups of largest score are kept (ties: the lower group), other experts' c = -inf
//   ids = the k largest c, largest first (ties, -inf ones included: the lower index)
//   w = s[ids]; when norm: w / (sum(w) + 1e-20) with NumPy's pairwise sum order; then w * scale.
// A value already taken is marked NaN (c and the scores are never NaN for finite logits).

#define NEG_INF __int_as_float(0xff800000u)
#define NONE 0x7fffffff

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return i != NONE && (bi == NONE || v > bv || (v == bv && i < bi));
}

// the largest non-NaN value of a[0..n) and its index, lowest index among equals (whole warp)
__device__ __forceinline__ int warp_argmax(const float *a, int n) {
  const int lane = threadIdx.x & 31;
  float bv = NEG_INF;
  int bi = NONE;
  for (int i = lane; i < n; i += 32) {
    const float v = a[i];
    if (v == v && better(v, i, bv, bi)) { bv = v; bi = i; }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  return bi;
}

// NumPy's float32 sum of n <= 128 values (pairwise_sum: sequential below 8, else 8 accumulators)
__device__ float np_sum(const float *a, int n) {
  if (n < 8) {
    float r = -0.0f;
    for (int i = 0; i < n; i++) r = __fadd_rn(r, a[i]);
    return r;
  }
  float r[8];
#pragma unroll
  for (int j = 0; j < 8; j++) r[j] = a[j];
  int i = 8;
  for (; i < n - (n % 8); i += 8)
#pragma unroll
    for (int j = 0; j < 8; j++) r[j] = __fadd_rn(r[j], a[i + j]);
  float res = __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                        __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
  for (; i < n; i++) res = __fadd_rn(res, a[i]);
  return res;
}

__global__ void moe_router_grouped_k(const float *__restrict__ logits, const float *__restrict__ bias,
                                     int *__restrict__ ids, float *__restrict__ wts, int E, int k, int ng, int kg,
                                     int norm, float scale) {
  extern __shared__ float sh[];
  float *ps = sh, *pc = sh + E, *gs = pc + E, *pw = gs + ng;
  int *pid = reinterpret_cast<int *>(pw + k);
  const int r = blockIdx.x, lane = threadIdx.x & 31;
  const float *lg = logits + (size_t)r * E;
  for (int i = lane; i < E; i += 32) {
    const float s = 1.0f / (1.0f + expf(-lg[i]));
    ps[i] = s;
    pc[i] = __fadd_rn(s, bias[i]);
  }
  __syncwarp();
  const int per = E / ng;
  if (kg < ng) {
    for (int g = lane; g < ng; g += 32) {
      float m1 = NEG_INF, m2 = NEG_INF;
      for (int e = g * per; e < (g + 1) * per; e++) {
        const float v = pc[e];
        if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) m2 = v;
      }
      gs[g] = __fadd_rn(m1, m2);
    }
    __syncwarp();
    for (int j = 0; j < kg; j++) {
      const int bi = warp_argmax(gs, ng);
      if (lane == 0 && bi != NONE) gs[bi] = __int_as_float(0x7fc00000);     // kept: NaN
      __syncwarp();
    }
    for (int i = lane; i < E; i += 32) {
      const float v = gs[i / per];
      if (v == v) pc[i] = NEG_INF;                                          // not a kept group
    }
    __syncwarp();
  }
  for (int j = 0; j < k; j++) {
    const int bi = warp_argmax(pc, E);
    if (lane == 0) {
      const int e = bi == NONE ? 0 : bi;
      pid[j] = e;
      pw[j] = ps[e];
      pc[e] = __int_as_float(0x7fc00000);                                   // taken
    }
    __syncwarp();
  }
  if (lane == 0) {
    float d = 0.f;
    if (norm) d = __fadd_rn(np_sum(pw, k), 1e-20f);
    for (int j = 0; j < k; j++) {
      float v = pw[j];
      if (norm) v = v / d;
      ids[(size_t)r * k + j] = pid[j];
      wts[(size_t)r * k + j] = __fmul_rn(v, scale);
    }
  }
}
