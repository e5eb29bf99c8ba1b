// gated_delta: the gated delta rule of Qwen3-Next's linear attention, the contract of
// runtime/ops/gated_delta.py (float32; q, k l2-normalised, q / sqrt(k_dim), v head h reads q/k head
// h / (Hv / Hk); beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias);
// S = S * exp(g); S = S + k (x) (beta * (v - S^T k)); o = S^T q), computed token by token for both
// modes of the op (the recurrent form: the NumPy chunked form agrees with it to float32 rounding).
//
// The columns of S (one per v element) are independent: column j needs k, q and v[j] only. A warp
// owns CW = 4*QW columns of one v head of one slot; its lane (cq = lane % QW, ig = lane / QW) holds
// four consecutive columns j..j+3 for NI = k_dim / G rows i0..i0+NI-1 of S in registers (G = 32/QW
// row groups): S^T k and S^T q are per-lane FMA chains, then a butterfly over the G row groups
// (log2 G shuffles). The state is read once (float4 loads; a warp's load covers G rows x 16*QW bytes)
// and written once per op: a slot's rows are taken in row order with S kept in registers. No shared
// memory, no block barrier.
//
// Grid: x = blocks of warps over the (v head, column group) pairs, y = slot. Every warp scans the
// positions and slot ids (device memory: one captured graph serves every step) 32 rows at a time
// with a ballot. A row at position 0 resets S (no state read); a row whose position is negative or
// whose slot is outside [0, slots) is inactive: its output is zeros (written by the warps of slot
// row % slots) and no state changes.
//
// Two kernels: gated_delta_k (decode: one row per slot; each warp normalises q / k and computes the
// gates itself, one launch) and, for prompt chunks, gated_delta_prep_k (every row's normalised q, k
// and exp(g), beta, in parallel over rows) then gated_delta_run_k (the recurrence alone, the inputs
// of rows r+1 and r+2 loaded while row r is computed, three buffers in rotation, and the next tile's
// rows prefetched into L2). Opt-in for prompt chunks that are one run of one slot: the chunkwise form
// (gated_delta_plan_k, gated_delta_chunk_a_k, gated_delta_chunk_b_k: see the section at the end).

typedef unsigned int u32;
#define FULL_MASK 0xffffffffu

template <int N>
__device__ __forceinline__ void load_n(float (&d)[N], const float *__restrict__ p) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 t = *reinterpret_cast<const float4 *>(p + i);
      d[i] = t.x; d[i + 1] = t.y; d[i + 2] = t.z; d[i + 3] = t.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 t = *reinterpret_cast<const float2 *>(p + i);
      d[i] = t.x; d[i + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; i++) d[i] = p[i];
  }
}

__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// A warp's scan of the rows: the current tile of 32 rows (t0), the bits of its rows of slot s still
// to take (mine), each lane's row position (ptile).
struct Scan {
  int t0 = -32, ptile = -1;
  u32 mine = 0;
};

// What the prompt kernel prefetches into L2 for a row: its normalised q and k heads, its v columns
// of this warp, its exp(g) and beta.
struct Ahead {
  const float *qk, *qkv, *gb;
  size_t QK, W, vo;
  int q0, k0, dk, Hv, h;
};

__device__ __forceinline__ void prefetch_tile(const Ahead &A, int t, int rows) {
  const int r = t + (threadIdx.x & 31);
  if (r >= rows) return;
  const float *y = A.qk + (size_t)r * A.QK;
  for (int o = 0; o < A.dk; o += 32) { prefetch_l2(y + A.q0 + o); prefetch_l2(y + A.k0 + o); }
  prefetch_l2(A.qkv + (size_t)r * A.W + A.vo);
  prefetch_l2(A.gb + ((size_t)r * A.Hv + A.h) * 2);
}

// The next row of slot s (-1: none left), its position in p. Inactive rows met on the way whose
// index % nslots == s get zeros at out[row * os + oo .. +3] (lanes with writer). With ahead, entering
// a tile prefetches the next tile's rows into L2 (and this one's, at the first tile).
__device__ __forceinline__ int next_row(Scan &sc, int &p, const int *__restrict__ pos, const int *__restrict__ slot,
                                        int rows, int nslots, int s, float *__restrict__ out, size_t os, size_t oo,
                                        bool writer, const Ahead *ahead) {
  const int lane = threadIdx.x & 31;
  while (!sc.mine) {
    sc.t0 += 32;
    if (sc.t0 >= rows) return -1;
    const int r = sc.t0 + lane;
    int pr = -1, sr = -1;
    if (r < rows) { pr = pos[r]; sr = slot[r]; }
    const bool live = pr >= 0 && sr >= 0 && sr < nslots;
    sc.mine = __ballot_sync(FULL_MASK, live && sr == s);
    u32 dead = __ballot_sync(FULL_MASK, r < rows && !live && r % nslots == s);
    while (dead) {
      const int rr = sc.t0 + __ffs(dead) - 1;
      dead &= dead - 1;
      if (writer) *reinterpret_cast<float4 *>(out + (size_t)rr * os + oo) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    sc.ptile = pr;
    if (ahead) {
      if (sc.t0 == 0) prefetch_tile(*ahead, 0, rows);
      prefetch_tile(*ahead, sc.t0 + 32, rows);
    }
  }
  const int bit = __ffs(sc.mine) - 1;
  sc.mine &= sc.mine - 1;
  p = __shfl_sync(FULL_MASK, sc.ptile, bit);
  return sc.t0 + bit;
}

template <int NI>
struct Prep {                                                // a row ready for the state update
  float q[NI], k[NI], v[4], eg, beta;
};

// S at the start of a row: zero for a new sequence (position 0), else the state before the op (read once)
template <int NI>
__device__ __forceinline__ void begin_row(float (&S)[NI][4], bool &have, int p, const float *__restrict__ st, int dv) {
  if (p == 0) {
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
      for (int c = 0; c < 4; c++) S[i][c] = 0.f;
    have = true;
  } else if (!have) {
#pragma unroll
    for (int i = 0; i < NI; i++) {
      const float4 t = *reinterpret_cast<const float4 *>(st + (size_t)i * dv);
      S[i][0] = t.x; S[i][1] = t.y; S[i][2] = t.z; S[i][3] = t.w;
    }
    have = true;
  }
}

// One row: kv = (S exp(g))^T k = exp(g) (S^T k); S = S exp(g) + k (x) delta, one FMA per element (NumPy
// rounds S exp(g) and the product first: the same to an ulp of each element); o = S^T q, stored.
template <int NI, int QW>
__device__ __forceinline__ void step_row(float (&S)[NI][4], const Prep<NI> &P, float *__restrict__ o, bool writer) {
  float kv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < NI; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) kv[c] = fmaf(P.k[i], S[i][c], kv[c]);
#pragma unroll
  for (int m = QW; m < 32; m <<= 1)
#pragma unroll
    for (int c = 0; c < 4; c++) kv[c] += __shfl_xor_sync(FULL_MASK, kv[c], m);
  float d[4];
#pragma unroll
  for (int c = 0; c < 4; c++) d[c] = __fmul_rn(__fsub_rn(P.v[c], __fmul_rn(kv[c], P.eg)), P.beta);
  float ov[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < NI; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      S[i][c] = fmaf(S[i][c], P.eg, __fmul_rn(P.k[i], d[c]));
      ov[c] = fmaf(P.q[i], S[i][c], ov[c]);
    }
#pragma unroll
  for (int m = QW; m < 32; m <<= 1)
#pragma unroll
    for (int c = 0; c < 4; c++) ov[c] += __shfl_xor_sync(FULL_MASK, ov[c], m);
  if (writer) *reinterpret_cast<float4 *>(o) = make_float4(ov[0], ov[1], ov[2], ov[3]);
}

__device__ __forceinline__ float softplus_gate(float a, float dtb, float nA) {   // exp(g)
  const float x = __fadd_rn(a, dtb);
  const float sp = x > 20.0f ? x : log1pf(expf(fminf(x, 20.0f)));
  return expf(__fmul_rn(nA, sp));
}

#define WARP_SETUP                                                                                        \
  constexpr int CW = 4 * QW;                                                                              \
  const int lane = threadIdx.x & 31, cq = lane % QW, ig = lane / QW;                                      \
  const int wph = dv / CW;                                                                                \
  const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                                   \
  if (warp >= Hv * wph) return;                                                                           \
  const int h = warp / wph, j = (warp % wph) * CW + 4 * cq, i0 = ig * NI, s = blockIdx.y;                 \
  const int hk = h / (Hv / Hk);                                                                           \
  const size_t W = (size_t)2 * Hk * dk + (size_t)Hv * dv, os = (size_t)Hv * dv, oo = (size_t)h * dv + j; \
  const size_t vo = (size_t)2 * Hk * dk + oo;                                                             \
  float *st = state + (((size_t)s * Hv + h) * dk + i0) * dv + j;                                          \
  const bool writer = ig == 0;

// decode (and verify: hist, else null, gets S after each row): q / k norms and the gates computed by
// each warp for its row (one launch)
template <int NI, int QW>
__global__ void __launch_bounds__(128) gated_delta_k(
    const float *__restrict__ qkv, const float *__restrict__ a, const float *__restrict__ b,
    const int *__restrict__ pos, const int *__restrict__ slot, const float *__restrict__ A_log,
    const float *__restrict__ dt_bias, float *__restrict__ state, float *__restrict__ out,
    float *__restrict__ hist, int rows, int nslots, int Hk, int Hv, int dk, int dv, float qscale) {
  WARP_SETUP
  const size_t qo = (size_t)hk * dk + i0, ko = (size_t)(Hk + hk) * dk + i0;
  const float nA = -expf(A_log[h]), dtb = dt_bias[h];
  float S[NI][4];
  bool have = false;
  Scan sc;
  int p;
  for (int r = next_row(sc, p, pos, slot, rows, nslots, s, out, os, oo, writer, nullptr); r >= 0;
       r = next_row(sc, p, pos, slot, rows, nslots, s, out, os, oo, writer, nullptr)) {
    const float *x = qkv + (size_t)r * W;
    Prep<NI> P;
    load_n<NI>(P.q, x + qo);
    load_n<NI>(P.k, x + ko);
    load_n<4>(P.v, x + vo);
    const float ar = a[(size_t)r * Hv + h], br = b[(size_t)r * Hv + h];
    begin_row<NI>(S, have, p, st, dv);
    // l2 norms (each value is held by the QW lanes of its row group: sum over the groups)
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int i = 0; i < NI; i++) { sq = fmaf(P.q[i], P.q[i], sq); sk = fmaf(P.k[i], P.k[i], sk); }
#pragma unroll
    for (int m = QW; m < 32; m <<= 1) {
      sq += __shfl_xor_sync(FULL_MASK, sq, m);
      sk += __shfl_xor_sync(FULL_MASK, sk, m);
    }
    const float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
#pragma unroll
    for (int i = 0; i < NI; i++) {
      P.q[i] = __fmul_rn(__fmul_rn(P.q[i], iq), qscale);
      P.k[i] = __fmul_rn(P.k[i], ik);
    }
    P.eg = softplus_gate(ar, dtb, nA);
    P.beta = 1.0f / (1.0f + expf(-br));
    step_row<NI, QW>(S, P, out + (size_t)r * os + oo, writer);
    if (hist) {                          // the verify program: S after row r, [rows, Hv, dk, dv]
      float *hr = hist + (((size_t)r * Hv + h) * dk + i0) * dv + j;
#pragma unroll
      for (int i = 0; i < NI; i++)
        *reinterpret_cast<float4 *>(hr + (size_t)i * dv) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
    }
  }
  if (have) {
#pragma unroll
    for (int i = 0; i < NI; i++)
      *reinterpret_cast<float4 *>(st + (size_t)i * dv) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
  }
}

// prompt chunks, 1: per active row, the normalised q (times qscale) and k of every k head into
// qk [rows, 2 * Hk * dk] (q heads, then k heads), exp(g) and beta of every v head into gb [rows, Hv, 2].
// One block per row; a warp per (q | k, head), lane-strided sums.
__global__ void __launch_bounds__(256) gated_delta_prep_k(
    const float *__restrict__ qkv, const float *__restrict__ a, const float *__restrict__ b,
    const int *__restrict__ pos, const float *__restrict__ A_log, const float *__restrict__ dt_bias,
    float *__restrict__ qk, float *__restrict__ gb, int Hk, int Hv, int dk, int dv, float qscale) {
  const int r = blockIdx.x;
  if (pos[r] < 0) return;
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const size_t W = (size_t)2 * Hk * dk + (size_t)Hv * dv;
  const float *x = qkv + (size_t)r * W;
  float *y = qk + (size_t)r * 2 * Hk * dk;
  for (int t = threadIdx.x >> 5; t < 2 * Hk; t += nw) {       // t < Hk: q head t; else k head t - Hk
    const float *xh = x + (size_t)t * dk;
    float ss = 0.f;
    for (int i = lane; i < dk; i += 32) ss = fmaf(xh[i], xh[i], ss);
#pragma unroll
    for (int m = 16; m; m >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, m);
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int i = lane; i < dk; i += 32) {
      const float v = __fmul_rn(xh[i], inv);
      y[(size_t)t * dk + i] = t < Hk ? __fmul_rn(v, qscale) : v;
    }
  }
  for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
    const float eg = softplus_gate(a[(size_t)r * Hv + h], dt_bias[h], -expf(A_log[h]));
    const float beta = 1.0f / (1.0f + expf(-b[(size_t)r * Hv + h]));
    *reinterpret_cast<float2 *>(gb + ((size_t)r * Hv + h) * 2) = make_float2(eg, beta);
  }
}

// a prepared row's inputs (r < 0 reads row 0: harmless, unused)
template <int NI>
__device__ __forceinline__ void load_prep(Prep<NI> &P, int r, const float *__restrict__ qk, const float *__restrict__ qkv,
                                          const float *__restrict__ gb, size_t QK, size_t qo, size_t ko, size_t W,
                                          size_t vo, int Hv, int h) {
  const size_t rr = (size_t)max(r, 0);
  load_n<NI>(P.q, qk + rr * QK + qo);
  load_n<NI>(P.k, qk + rr * QK + ko);
  load_n<4>(P.v, qkv + rr * W + vo);
  const float2 t = *reinterpret_cast<const float2 *>(gb + (rr * Hv + h) * 2);
  P.eg = t.x;
  P.beta = t.y;
}

// prompt chunks, 2: the recurrence over the prepared rows
template <int NI, int QW>
__global__ void __launch_bounds__(128) gated_delta_run_k(
    const float *__restrict__ qkv, const float *__restrict__ qk, const float *__restrict__ gb,
    const int *__restrict__ pos, const int *__restrict__ slot, float *__restrict__ state, float *__restrict__ out,
    int rows, int nslots, int Hk, int Hv, int dk, int dv, const int *__restrict__ skip) {
  if (skip[0]) return;                                       // the chunked path takes this call (gated_delta_plan_k)
  WARP_SETUP
  const size_t QK = (size_t)2 * Hk * dk, qo = (size_t)hk * dk + i0, ko = (size_t)(Hk + hk) * dk + i0;
  const Ahead ahead{qk, qkv, gb, QK, W, vo - 4 * cq, (int)(hk * dk), (int)((Hk + hk) * dk), dk, Hv, h};
  float S[NI][4];
  bool have = false;
  Scan sc;
  // rows r, r+1, r+2 in three buffers, rotating (named, not an array: registers, no copies)
  Prep<NI> B0, B1, B2;
  int R0, R1, R2, P0, P1, P2;
#define NEXT(P) next_row(sc, P, pos, slot, rows, nslots, s, out, os, oo, writer, &ahead)
  R0 = NEXT(P0);
  load_prep<NI>(B0, R0, qk, qkv, gb, QK, qo, ko, W, vo, Hv, h);
  R1 = R0 >= 0 ? NEXT(P1) : -1;
  load_prep<NI>(B1, R1, qk, qkv, gb, QK, qo, ko, W, vo, Hv, h);
// B##U: this row; B##N1: loaded; B##N2: free, gets the row after B##N1's
#define RUN_STEP(U, N1, N2)                                                                    \
  R##N2 = R##N1 >= 0 ? NEXT(P##N2) : -1;                                                       \
  load_prep<NI>(B##N2, R##N2, qk, qkv, gb, QK, qo, ko, W, vo, Hv, h);                          \
  begin_row<NI>(S, have, P##U, st, dv);                                                        \
  step_row<NI, QW>(S, B##U, out + (size_t)R##U * os + oo, writer);                             \
  if (R##N1 < 0) break;
  if (R0 >= 0) {
    while (true) {
      RUN_STEP(0, 1, 2)
      RUN_STEP(1, 2, 0)
      RUN_STEP(2, 0, 1)
    }
  }
#undef RUN_STEP
#undef NEXT
  if (have) {
#pragma unroll
    for (int i = 0; i < NI; i++)
      *reinterpret_cast<float4 *>(st + (size_t)i * dv) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
  }
}

// ---------------------------------------------------------------------------------------------------
// Prompt chunks, the chunkwise (WY) form: the NumPy op's "prefill" form (runtime/ops/gated_delta.py
// _chunked), blocks of CH = 64 rows counted from the run's first row, float32 on the CUDA cores.
//
// It takes a call only when its rows are one run: rows [0, n) active, all of slot s, positions p0,
// p0+1, ..., and rows [n, rows) inactive (the layout of a prompt chunk with padding at the end). The
// layout lives in device memory (one captured graph serves every call), so the choice is made on the
// device: gated_delta_plan_k writes meta = {ok, n, s, p0}; gated_delta_run_k (the token-by-token
// recurrence, every layout) returns at once when ok, gated_delta_chunk_a_k / _b_k return at once
// when not. After gated_delta_prep_k (normalised q, k; exp(g), beta):
//  a: per (block, v head): cum = cumsum(g) (sequential, as np.cumsum), the masked attentions
//     L = tril(K beta K^T * decay, -1) and P = tril(Q K^T * decay) (P to scratch), then the unit-lower-
//     triangular solve (I + L) [u | w] = [V beta | K beta exp(cum)] by forward substitution (a thread
//     per column); u, w, cum to scratch.
//  b: per (32 v columns, v head), the blocks in order with S [dk, 32] in shared memory (and each
//     thread's rows of it in registers): v_new = u - w S; o = exp(cum) (Q S) + P v_new;
//     S = exp(cum_last) S + (K exp(cum_last - cum))^T v_new. Rows [n, rows) get zeros.

#define CH 64
#define CB_COLS 32
#define CB_THREADS 512

// meta[0] = the rows are one run (see above), meta[1] = n, meta[2] = its slot, meta[3] = its first position
__global__ void __launch_bounds__(1024) gated_delta_plan_k(const int *__restrict__ pos, const int *__restrict__ slot,
                                                          int rows, int nslots, int *__restrict__ meta) {
  __shared__ int first_dead;
  if (threadIdx.x == 0) first_dead = rows;
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int p = pos[r], s = slot[r];
    if (!(p >= 0 && s >= 0 && s < nslots)) atomicMin(&first_dead, r);
  }
  __syncthreads();
  const int n = first_dead;
  const int s0 = n > 0 ? slot[0] : -1, p0 = n > 0 ? pos[0] : -1;
  int bad = n <= 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int p = pos[r], s = slot[r];
    const bool live = p >= 0 && s >= 0 && s < nslots;
    if (r < n) bad |= s != s0 || p != p0 + r;
    else bad |= live;
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) { meta[0] = !bad; meta[1] = n; meta[2] = s0; meta[3] = p0; }
}

__device__ __forceinline__ float gate_g(float a, float dtb, float nA) {    // g (softplus_gate: exp(g))
  const float x = __fadd_rn(a, dtb);
  const float sp = x > 20.0f ? x : log1pf(expf(fminf(x, 20.0f)));
  return __fmul_rn(nA, sp);
}

// a: grid (blocks of CH rows, Hv), 256 threads; dynamic shared memory
// (2 * CH * (dk + 1) + CH * (dv + dk) + CH * (CH + 1) + 3 * CH) floats.
// Scratch: uw [Hv, rows, dv + dk] (u then w), pm [Hv, rows, CH] (P, row i of a block: columns j <= i of
// the block), cg [Hv, rows] (cum, within the block).
__global__ void __launch_bounds__(256) gated_delta_chunk_a_k(
    const float *__restrict__ qkv, const float *__restrict__ qk, const float *__restrict__ gb,
    const float *__restrict__ a, const float *__restrict__ A_log, const float *__restrict__ dt_bias,
    const int *__restrict__ meta, float *__restrict__ uw, float *__restrict__ pm, float *__restrict__ cg,
    int rows, int Hk, int Hv, int dk, int dv) {
  if (!meta[0]) return;
  const int n = meta[1], r0 = blockIdx.x * CH, h = blockIdx.y, hk = h / (Hv / Hk);
  if (r0 >= n) return;
  const int m = min(CH, n - r0), t = threadIdx.x, NT = blockDim.x;
  const int ks = dk + 1, xw = dv + dk;
  extern __shared__ float sm[];
  float *Ks = sm, *Qs = Ks + CH * ks, *X = Qs + CH * ks, *L = X + CH * xw, *cum = L + CH * (CH + 1),
        *bs = cum + CH, *gs = bs + CH;
  const size_t QK = (size_t)2 * Hk * dk, W = (size_t)2 * Hk * dk + (size_t)Hv * dv;
  for (int idx = t; idx < m * dk; idx += NT) {
    const int r = idx / dk, d = idx % dk;
    const float *y = qk + (size_t)(r0 + r) * QK;
    Qs[r * ks + d] = y[(size_t)hk * dk + d];
    Ks[r * ks + d] = y[(size_t)(Hk + hk) * dk + d];
  }
  if (t < m) {
    const size_t rr = (size_t)(r0 + t);
    gs[t] = gate_g(a[rr * Hv + h], dt_bias[h], -expf(A_log[h]));
    bs[t] = gb[(rr * Hv + h) * 2 + 1];
  }
  __syncthreads();
  if (t == 0) {                                                // np.cumsum: sequential, float32
    float c = 0.f;
    for (int r = 0; r < m; r++) { c = __fadd_rn(c, gs[r]); cum[r] = c; }
  }
  __syncthreads();
  if (t < m) cg[(size_t)h * rows + r0 + t] = cum[t];
  // L (strictly lower, in shared) and P (lower with the diagonal, to scratch)
  for (int idx = t; idx < m * m; idx += NT) {
    const int i = idx / m, j = idx % m;
    float l = 0.f, p = 0.f;
    if (j <= i) {
      const float dec = expf(__fsub_rn(cum[i], cum[j]));
      const float bi = bs[i];
      float sk = 0.f, sq = 0.f;
      for (int d = 0; d < dk; d++) {
        const float kj = Ks[j * ks + d];
        sk = fmaf(__fmul_rn(Ks[i * ks + d], bi), kj, sk);
        sq = fmaf(Qs[i * ks + d], kj, sq);
      }
      if (j < i) l = __fmul_rn(sk, dec);
      p = __fmul_rn(sq, dec);
    }
    L[i * (CH + 1) + j] = l;
    pm[((size_t)h * rows + r0 + i) * CH + j] = p;
  }
  // right-hand sides: [v beta | (k beta) exp(cum)]
  for (int idx = t; idx < m * xw; idx += NT) {
    const int r = idx / xw, c = idx % xw;
    const float b = bs[r];
    X[r * xw + c] = c < dv ? __fmul_rn(qkv[(size_t)(r0 + r) * W + (size_t)2 * Hk * dk + (size_t)h * dv + c], b)
                           : __fmul_rn(__fmul_rn(Ks[r * ks + c - dv], b), expf(cum[r]));
  }
  __syncthreads();
  // forward substitution, a thread per column: x_i = rhs_i - sum_{j<i} L_ij x_j
  for (int c = t; c < xw; c += NT) {
    for (int i = 1; i < m; i++) {
      float x = X[i * xw + c];
      for (int j = 0; j < i; j++) x = fmaf(-L[i * (CH + 1) + j], X[j * xw + c], x);
      X[i * xw + c] = x;
    }
    for (int i = 0; i < m; i++) uw[((size_t)h * rows + r0 + i) * xw + c] = X[i * xw + c];
  }
}

// b: grid (dv / 32, Hv), CB_THREADS threads (lane = column, warp = row group); DK = k_dim, dynamic
// shared memory (3 * CH * DK + CH * CH + 2 * CH * 32 + DK * 32 + 2 * CH) floats.
template <int DK>
__global__ void __launch_bounds__(CB_THREADS, 1) gated_delta_chunk_b_k(
    const float *__restrict__ qk, const float *__restrict__ uw, const float *__restrict__ pm,
    const float *__restrict__ cg, const int *__restrict__ meta, float *__restrict__ state,
    float *__restrict__ out, int rows, int Hk, int Hv, int dv) {
  if (!meta[0]) return;
  constexpr int NW = CB_THREADS / 32, NR = DK / NW, RR = CH / NW;   // S rows per thread, block rows per thread
  static_assert(DK % NW == 0, "k_dim a multiple of 16");
  const int n = meta[1], s = meta[2], p0 = meta[3];
  const int c = threadIdx.x & 31, rg = threadIdx.x >> 5, t = threadIdx.x, h = blockIdx.y, hk = h / (Hv / Hk);
  const int j0 = blockIdx.x * CB_COLS;                        // this block's first v column
  const int xw = dv + DK;
  extern __shared__ __align__(16) float sm[];
  float *Ws = sm, *Qs = Ws + CH * DK, *Ks = Qs + CH * DK, *Pm = Ks + CH * DK, *Us = Pm + CH * CH,
        *Vn = Us + CH * CB_COLS, *Ss = Vn + CH * CB_COLS, *ec = Ss + DK * CB_COLS, *el = ec + CH;
  const size_t QK = (size_t)2 * Hk * DK, os = (size_t)Hv * dv;
  float *st = state + ((size_t)s * Hv + h) * DK * dv + j0 + c;
  float S[NR];
#pragma unroll
  for (int k = 0; k < NR; k++) {
    const int i = rg * NR + k;
    S[k] = p0 == 0 ? 0.f : st[(size_t)i * dv];
    Ss[i * CB_COLS + c] = S[k];
  }
  for (int r0 = 0; r0 < n; r0 += CH) {
    const int m = min(CH, n - r0);
    __syncthreads();                                           // the last block's readers are done
    if (t < CH) {
      const float cl = cg[(size_t)h * rows + r0 + m - 1];
      const float cr = t < m ? cg[(size_t)h * rows + r0 + t] : 0.f;
      ec[t] = t < m ? expf(cr) : 0.f;
      el[t] = t < m ? expf(__fsub_rn(cl, cr)) : 0.f;          // exp(cum_last - cum_r)
      if (t == 0) el[CH] = expf(cl);
    }
    for (int idx = t; idx < CH * DK; idx += CB_THREADS) {
      const int r = idx / DK, d = idx % DK;
      float w = 0.f, q = 0.f, k = 0.f;
      if (r < m) {
        const size_t rr = (size_t)(r0 + r);
        w = uw[((size_t)h * rows + rr) * xw + dv + d];
        q = qk[rr * QK + (size_t)hk * DK + d];
        k = qk[rr * QK + (size_t)(Hk + hk) * DK + d];
      }
      Ws[idx] = w; Qs[idx] = q; Ks[idx] = k;
    }
    for (int idx = t; idx < CH * CH; idx += CB_THREADS) {
      const int i = idx / CH, j = idx % CH;
      Pm[idx] = i < m && j <= i ? pm[((size_t)h * rows + r0 + i) * CH + j] : 0.f;
    }
    for (int idx = t; idx < CH * CB_COLS; idx += CB_THREADS) {
      const int r = idx / CB_COLS, cc = idx % CB_COLS;
      Us[idx] = r < m ? uw[((size_t)h * rows + r0 + r) * xw + j0 + cc] : 0.f;
    }
    __syncthreads();
    for (int idx = t; idx < CH * DK; idx += CB_THREADS) Ks[idx] = __fmul_rn(Ks[idx], el[idx / DK]);   // k exp(last - cum)
    // v_new = u - w S: rows rg + NW * k of the block, column c
    {
      float acc[RR];
#pragma unroll
      for (int k = 0; k < RR; k++) acc[k] = 0.f;
#pragma unroll 2
      for (int i = 0; i < DK; i += 4) {
        const float s0 = Ss[i * CB_COLS + c], s1 = Ss[(i + 1) * CB_COLS + c], s2 = Ss[(i + 2) * CB_COLS + c],
                    s3 = Ss[(i + 3) * CB_COLS + c];
#pragma unroll
        for (int k = 0; k < RR; k++) {
          const float4 w = *reinterpret_cast<const float4 *>(Ws + (rg + NW * k) * DK + i);
          acc[k] = fmaf(w.x, s0, acc[k]); acc[k] = fmaf(w.y, s1, acc[k]);
          acc[k] = fmaf(w.z, s2, acc[k]); acc[k] = fmaf(w.w, s3, acc[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < RR; k++) {
        const int r = rg + NW * k;
        Vn[r * CB_COLS + c] = __fsub_rn(Us[r * CB_COLS + c], acc[k]);
      }
    }
    __syncthreads();
    // o = exp(cum) (Q S) + P v_new
    {
      float aq[RR], ap[RR];
#pragma unroll
      for (int k = 0; k < RR; k++) aq[k] = ap[k] = 0.f;
#pragma unroll 2
      for (int i = 0; i < DK; i += 4) {
        const float s0 = Ss[i * CB_COLS + c], s1 = Ss[(i + 1) * CB_COLS + c], s2 = Ss[(i + 2) * CB_COLS + c],
                    s3 = Ss[(i + 3) * CB_COLS + c];
#pragma unroll
        for (int k = 0; k < RR; k++) {
          const float4 q = *reinterpret_cast<const float4 *>(Qs + (rg + NW * k) * DK + i);
          aq[k] = fmaf(q.x, s0, aq[k]); aq[k] = fmaf(q.y, s1, aq[k]);
          aq[k] = fmaf(q.z, s2, aq[k]); aq[k] = fmaf(q.w, s3, aq[k]);
        }
      }
#pragma unroll 2
      for (int j = 0; j < CH; j += 4) {
        const float v0 = Vn[j * CB_COLS + c], v1 = Vn[(j + 1) * CB_COLS + c], v2 = Vn[(j + 2) * CB_COLS + c],
                    v3 = Vn[(j + 3) * CB_COLS + c];
#pragma unroll
        for (int k = 0; k < RR; k++) {
          const float4 p = *reinterpret_cast<const float4 *>(Pm + (rg + NW * k) * CH + j);
          ap[k] = fmaf(p.x, v0, ap[k]); ap[k] = fmaf(p.y, v1, ap[k]);
          ap[k] = fmaf(p.z, v2, ap[k]); ap[k] = fmaf(p.w, v3, ap[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < RR; k++) {
        const int r = rg + NW * k;
        if (r < m) out[(size_t)(r0 + r) * os + (size_t)h * dv + j0 + c] = fmaf(ec[r], aq[k], ap[k]);
      }
    }
    // S = exp(last) S + (K exp(last - cum))^T v_new: this thread's rows rg * NR .. + NR - 1
    {
      float acc[NR];
#pragma unroll
      for (int k = 0; k < NR; k++) acc[k] = 0.f;
#pragma unroll 4
      for (int r = 0; r < CH; r++) {
        const float v = Vn[r * CB_COLS + c];
        float kk[NR];
        load_n<NR>(kk, Ks + r * DK + rg * NR);
#pragma unroll
        for (int k = 0; k < NR; k++) acc[k] = fmaf(kk[k], v, acc[k]);
      }
      const float e = el[CH];
#pragma unroll
      for (int k = 0; k < NR; k++) S[k] = fmaf(S[k], e, acc[k]);
    }
    __syncthreads();                                           // every read of Ss (v_new, o) is done
#pragma unroll
    for (int k = 0; k < NR; k++) Ss[(rg * NR + k) * CB_COLS + c] = S[k];
  }
#pragma unroll
  for (int k = 0; k < NR; k++) st[(size_t)(rg * NR + k) * dv] = S[k];
  for (int r = n + rg; r < rows; r += CB_THREADS / 32) out[(size_t)r * os + (size_t)h * dv + j0 + c] = 0.f;
}
