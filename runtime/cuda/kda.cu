// kda: the Kimi delta attention of glm5_next's linear-attention layers, the contract of
// runtime/ops/kda.py (float32), computed row by row for both modes of the op (the recurrent form: the
// NumPy chunked form agrees with it to float32 rounding). Per row and head h, over key channels i
// (state S [d key, d value], d = head_dim):
//     q = q / sqrt(sum(q^2) + 1e-6) * d^-0.5;  k = k / sqrt(sum(k^2) + 1e-6)
//     u = g + dt_bias;  a = exp(A_log[h]);  gate = lb * sigmoid(a * u)   (unbounded: -a * softplus(u))
//     beta = sigmoid(b);  S[i, :] *= exp(gate[i]);  S += k (x) (beta * (v - S^T k));  o = S^T q
// The decay and the update are rounded element by element as NumPy does (S * exp(gate), then
// + k * delta); the sums S^T k, S^T q and sum(q^2) are FMA chains plus a butterfly (not NumPy's BLAS
// order).
//
// The columns of S are independent (column c needs k, q, the decay and v[c]). A warp owns CW = 4*QW
// columns of one head of one slot; its lane (cq = lane % QW, ig = lane / QW) holds four consecutive
// columns for NI = d / G consecutive rows of S in registers (G = 32/QW row groups), with those rows'
// dt_bias and the rows' decays computed in the lane. The state is read once (at the slot's first row,
// unless that row is at position 0: then S starts at zero) and written once, the slot's rows taken
// in row order (prompt chunks: the next row's inputs loaded while this row is computed, PIPE). No
// shared memory, no block barrier.
//
// Grid: x = blocks of warps over the (head, column group) pairs, y = slot. Every warp scans the
// positions and slot ids (device memory: one captured graph serves every step) 32 rows at a time with
// a ballot. A row whose position is negative or whose slot is outside [0, slots) is inactive: its
// output is zeros (written by the warps of slot row % slots) and no state changes.

typedef unsigned int u32;
#define FULL_MASK 0xffffffffu

template <int N>
__device__ __forceinline__ void kda_load(float (&d)[N], const float *__restrict__ p) {
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

// A warp's scan of the rows: the current tile of 32 rows (t0), the bits of its rows of slot s still
// to take (mine), each lane's row position (ptile).
struct KdaScan {
  int t0 = -32, ptile = -1;
  u32 mine = 0;
};

// The next row of slot s (-1: none left), its position in p. Inactive rows met on the way whose index
// % nslots == s get zeros at out[row * os + oo .. +3] (lanes with writer).
__device__ __forceinline__ int kda_next_row(KdaScan &sc, int &p, const int *__restrict__ pos,
                                            const int *__restrict__ slot, int rows, int nslots, int s,
                                            float *__restrict__ out, size_t os, size_t oo, bool writer) {
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
  }
  const int bit = __ffs(sc.mine) - 1;
  sc.mine &= sc.mine - 1;
  p = __shfl_sync(FULL_MASK, sc.ptile, bit);
  return sc.t0 + bit;
}

__device__ __forceinline__ float kda_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// a row's inputs: q, k and the raw decay of the lane's NI rows, v of its 4 columns, b of the head
template <int NI>
struct KdaRow {
  float q[NI], k[NI], g[NI], v[4], b;
};

template <int NI>
__device__ __forceinline__ void kda_load_row(KdaRow<NI> &R, int r, const float *__restrict__ q,
                                             const float *__restrict__ k, const float *__restrict__ v,
                                             const float *__restrict__ g, const float *__restrict__ b, size_t os,
                                             size_t ro, size_t oo, int H, int h) {
  const size_t rr = (size_t)r * os;
  kda_load<NI>(R.q, q + rr + ro);
  kda_load<NI>(R.k, k + rr + ro);
  kda_load<NI>(R.g, g + rr + ro);
  kda_load<4>(R.v, v + rr + oo);
  R.b = b[(size_t)r * H + h];
}

// one row: the gates, then S <- S exp(gate) (per row); kv = S^T k; delta = (v - kv) beta;
// S <- S + k (x) delta; o = S^T q, stored by the writer lanes at o
template <int NI, int QW>
__device__ __forceinline__ void kda_step(float (&S)[NI][4], KdaRow<NI> &R, const float (&dtb)[NI], float a,
                                         float qscale, float lb, int bounded, float *__restrict__ o, bool writer) {
  const float beta = kda_sigmoid(R.b);
  // l2 norms (each row's value is held by the QW lanes of its row group: sum over the groups)
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int i = 0; i < NI; i++) { sq = fmaf(R.q[i], R.q[i], sq); sk = fmaf(R.k[i], R.k[i], sk); }
#pragma unroll
  for (int m = QW; m < 32; m <<= 1) {
    sq += __shfl_xor_sync(FULL_MASK, sq, m);
    sk += __shfl_xor_sync(FULL_MASK, sk, m);
  }
  const float nq = sqrtf(sq + 1e-6f), nk = sqrtf(sk + 1e-6f);
  float qv[NI], kv_[NI], eg[NI];
#pragma unroll
  for (int i = 0; i < NI; i++) {
    qv[i] = __fmul_rn(__fdiv_rn(R.q[i], nq), qscale);
    kv_[i] = __fdiv_rn(R.k[i], nk);
    const float u = __fadd_rn(R.g[i], dtb[i]);
    float gate;
    if (bounded) {
      gate = __fmul_rn(lb, kda_sigmoid(__fmul_rn(a, u)));
    } else {
      const float sp = u > 20.0f ? u : log1pf(expf(fminf(u, 20.0f)));
      gate = __fmul_rn(-a, sp);
    }
    eg[i] = expf(gate);
  }
  float kvs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < NI; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      S[i][c] = __fmul_rn(S[i][c], eg[i]);
      kvs[c] = fmaf(kv_[i], S[i][c], kvs[c]);
    }
#pragma unroll
  for (int m = QW; m < 32; m <<= 1)
#pragma unroll
    for (int c = 0; c < 4; c++) kvs[c] += __shfl_xor_sync(FULL_MASK, kvs[c], m);
  float dl[4];
#pragma unroll
  for (int c = 0; c < 4; c++) dl[c] = __fmul_rn(__fsub_rn(R.v[c], kvs[c]), beta);
  float ov[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < NI; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) {
      S[i][c] = __fadd_rn(S[i][c], __fmul_rn(kv_[i], dl[c]));
      ov[c] = fmaf(qv[i], S[i][c], ov[c]);
    }
#pragma unroll
  for (int m = QW; m < 32; m <<= 1)
#pragma unroll
    for (int c = 0; c < 4; c++) ov[c] += __shfl_xor_sync(FULL_MASK, ov[c], m);
  if (writer) *reinterpret_cast<float4 *>(o) = make_float4(ov[0], ov[1], ov[2], ov[3]);
}

// hist (the verify program's history, else null; decode form only): S after each row.
// PIPE (prompt chunks): the next row of the slot is found and its inputs loaded before this row is
// computed, so the loads of row r+1 are in flight during row r's math (two rows' inputs in registers:
// NI <= 8).
template <int NI, int QW, bool PIPE>
__global__ void kda_k(const float *__restrict__ q, const float *__restrict__ k,
                      const float *__restrict__ v, const float *__restrict__ g,
                      const float *__restrict__ b, const int *__restrict__ pos,
                      const int *__restrict__ slot, const float *__restrict__ A_log,
                      const float *__restrict__ dt_bias, float *__restrict__ state,
                      float *__restrict__ out, float *__restrict__ hist, int rows, int nslots, int H,
                      int d, float qscale, float lb, int bounded) {
  constexpr int CW = 4 * QW;
  const int lane = threadIdx.x & 31, cq = lane % QW, ig = lane / QW;
  const int wph = d / CW;
  const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (warp >= H * wph) return;                             // whole warps only
  const int h = warp / wph, j = (warp % wph) * CW + 4 * cq, i0 = ig * NI, s = blockIdx.y;
  const bool writer = ig == 0;
  const size_t os = (size_t)H * d, ho = (size_t)h * d, oo = ho + j, ro = ho + i0;
  float *st = state + (((size_t)s * H + h) * d + i0) * d + j;
  float dtb[NI];
  kda_load<NI>(dtb, dt_bias + ro);
  const float a = expf(A_log[h]);
  float S[NI][4];
  bool have = false;
  KdaScan sc;
  // S at the start of a row at position p: zero for a new sequence, else the state before the op (read once)
  auto begin = [&](int p) {
    if (p == 0) {
#pragma unroll
      for (int i = 0; i < NI; i++)
#pragma unroll
        for (int c = 0; c < 4; c++) S[i][c] = 0.f;
      have = true;
    } else if (!have) {
#pragma unroll
      for (int i = 0; i < NI; i++) {
        const float4 t = *reinterpret_cast<const float4 *>(st + (size_t)i * d);
        S[i][0] = t.x; S[i][1] = t.y; S[i][2] = t.z; S[i][3] = t.w;
      }
      have = true;
    }
  };
  KdaRow<NI> A;
  int p;
  int r = kda_next_row(sc, p, pos, slot, rows, nslots, s, out, os, oo, writer);
  if constexpr (PIPE) {
    KdaRow<NI> N;
    if (r >= 0) kda_load_row<NI>(A, r, q, k, v, g, b, os, ro, oo, H, h);
    while (r >= 0) {
      int pn;
      const int rn = kda_next_row(sc, pn, pos, slot, rows, nslots, s, out, os, oo, writer);
      if (rn >= 0) kda_load_row<NI>(N, rn, q, k, v, g, b, os, ro, oo, H, h);
      begin(p);
      kda_step<NI, QW>(S, A, dtb, a, qscale, lb, bounded, out + (size_t)r * os + oo, writer);
      A = N;
      r = rn;
      p = pn;
    }
  } else {
    for (; r >= 0; r = kda_next_row(sc, p, pos, slot, rows, nslots, s, out, os, oo, writer)) {
      kda_load_row<NI>(A, r, q, k, v, g, b, os, ro, oo, H, h);
      begin(p);
      kda_step<NI, QW>(S, A, dtb, a, qscale, lb, bounded, out + (size_t)r * os + oo, writer);
      if (hist) {                        // the verify program: S after row r, [rows, H, d, d]
        float *hr = hist + (((size_t)r * H + h) * d + i0) * d + j;
#pragma unroll
        for (int i = 0; i < NI; i++)
          *reinterpret_cast<float4 *>(hr + (size_t)i * d) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
      }
    }
  }
  if (have) {
#pragma unroll
    for (int i = 0; i < NI; i++)
      *reinterpret_cast<float4 *>(st + (size_t)i * d) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
  }
}
