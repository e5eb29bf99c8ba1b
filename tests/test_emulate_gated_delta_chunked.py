"""CPU: a NumPy emulation of the chunked CUDA prefill path of gated_delta (runtime/cuda/gated_delta.cu:
gated_delta_plan_k, gated_delta_chunk_a_k, gated_delta_chunk_b_k; the token-by-token
gated_delta_run_k where the plan says the rows are not one run) with the kernels' blocking and
order of operations (every reduction a sequential float32 chain in the kernel's order; NumPy
cannot fuse a multiply-add, so each FMA rounds twice here), against the NumPy op
(runtime/ops/gated_delta.py, "prefill": the contract) on the cases of tests/test_cuda_hybrid.py's
prefill tests. Vectorised over the independent axes (v heads, columns, rows of a block) only.

Then the kernels' own source: the chunked section of gated_delta.cu compiled for the host with g++
(C++20) and a thread shim (one std::thread per CUDA thread, std::barrier for __syncthreads; float4
and the fast-math intrinsics as plain C++), fed the prep kernel's outputs (from `prep` here), against
the NumPy op: indexing, masking, barriers and the device-side plan checked without a GPU (not the
GPU's expf, alignment or memory model). Skipped without g++."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bloomery.runtime.ops import IMPL

CH = 64
f = np.float32


class HostW(dict):
    pre_quant: dict = {}


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    n = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / n) if n else float(np.abs(got).max() if got.size else 0.0)


def plan(pos, slot, nslots):
    """gated_delta_plan_k: (ok, n, slot, first position)."""
    rows = len(pos)
    live = (pos >= 0) & (slot >= 0) & (slot < nslots)
    dead = np.nonzero(~live)[0]
    n = int(dead[0]) if dead.size else rows
    if n <= 0:
        return False, n, -1, -1
    s0, p0 = int(slot[0]), int(pos[0])
    ok = bool((slot[:n] == s0).all() and (pos[:n] == p0 + np.arange(n)).all() and not live[n:].any())
    return ok, n, s0, p0


def prep(op, buf, w, n):
    """gated_delta_prep_k's q (times 1/sqrt(dk)), k per k head, beta per v head; chunk_a's g."""
    Hk, dk = op["k_heads"], op["k_dim"]
    x = buf[op["qkv"]][:n]
    q = x[:, :Hk * dk].reshape(n, Hk, dk)
    k = x[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk)
    eps = f(1e-6)
    q = q * (f(1) / np.sqrt(np.sum(q * q, axis=-1, keepdims=True, dtype=f) + eps))
    k = k * (f(1) / np.sqrt(np.sum(k * k, axis=-1, keepdims=True, dtype=f) + eps))
    q = (q * f(1 / np.sqrt(dk))).astype(f)
    xa = (buf[op["a"]][:n] + w[op["dt_bias"]]).astype(f)
    sp = np.where(xa > 20, xa, np.log1p(np.exp(np.minimum(xa, f(20))))).astype(f)
    g = (-np.exp(w[op["A_log"]].astype(f)) * sp).astype(f)                   # [n, Hv]
    beta = (f(1) / (f(1) + np.exp(-buf[op["b"]][:n]))).astype(f)
    return q, k, g, beta


def chunk_a(op, buf, q, k, g, beta, n):
    """gated_delta_chunk_a_k for every (block, v head): u, w [Hv, n, dv|dk], P [Hv, n, CH], cum [Hv, n]."""
    Hk, Hv, dk, dv = op["k_heads"], op["v_heads"], op["k_dim"], op["v_dim"]
    rep = Hv // Hk
    v = buf[op["qkv"]][:n, 2 * Hk * dk:].reshape(n, Hv, dv)
    U, Wm = np.zeros((Hv, n, dv), f), np.zeros((Hv, n, dk), f)
    P, CG = np.zeros((Hv, n, CH), f), np.zeros((Hv, n), f)
    for r0 in range(0, n, CH):
        m = min(CH, n - r0)
        Ks = np.repeat(k[r0:r0 + m], rep, axis=1).transpose(1, 0, 2)          # [Hv, m, dk] (head h -> k head h / rep)
        Qs = np.repeat(q[r0:r0 + m], rep, axis=1).transpose(1, 0, 2)
        bs, gs = beta[r0:r0 + m].T, g[r0:r0 + m].T                            # [Hv, m]
        cum = np.zeros((Hv, m), f)
        c = np.zeros(Hv, f)
        for r in range(m):                                                    # thread 0, sequential
            c = (c + gs[:, r]).astype(f)
            cum[:, r] = c
        CG[:, r0:r0 + m] = cum
        dec = np.exp((cum[:, :, None] - cum[:, None, :]).astype(f)).astype(f)  # [Hv, i, j]
        kb = (Ks * bs[:, :, None]).astype(f)                                 # k_i * beta_i
        sk, sq = np.zeros((Hv, m, m), f), np.zeros((Hv, m, m), f)
        for d in range(dk):                                                   # the d loop, in order
            sk = (sk + kb[:, :, None, d] * Ks[:, None, :, d]).astype(f)
            sq = (sq + Qs[:, :, None, d] * Ks[:, None, :, d]).astype(f)
        lower = np.tril(np.ones((m, m), bool), -1)
        L = np.where(lower, (sk * dec).astype(f), f(0))
        P[:, r0:r0 + m, :m] = np.where(np.tril(np.ones((m, m), bool)), (sq * dec).astype(f), f(0))
        X = np.concatenate([(v[r0:r0 + m].transpose(1, 0, 2) * bs[:, :, None]).astype(f),
                            (kb * np.exp(cum)[:, :, None]).astype(f)], axis=-1)   # [Hv, m, dv + dk]
        for i in range(1, m):                                                 # forward substitution
            x = X[:, i].copy()
            for j in range(i):
                x = (x - L[:, i, j, None] * X[:, j]).astype(f)
            X[:, i] = x
        U[:, r0:r0 + m], Wm[:, r0:r0 + m] = X[..., :dv], X[..., dv:]
    return U, Wm, P, CG


def chunk_b(op, q, k, U, Wm, P, CG, S, n):
    """gated_delta_chunk_b_k (every column tile at once: the tiles share no arithmetic): S [Hv, dk, dv]."""
    Hk, Hv, dk, dv = op["k_heads"], op["v_heads"], op["k_dim"], op["v_dim"]
    rep = Hv // Hk
    out = np.zeros((n, Hv, dv), f)
    S = S.astype(f).copy()
    for r0 in range(0, n, CH):
        m = min(CH, n - r0)
        pad = lambda a: np.concatenate([a, np.zeros(a.shape[:1] + (CH - m,) + a.shape[2:], f)], 1)  # noqa: E731
        cum = CG[:, r0:r0 + m]
        cl = cum[:, m - 1:m]
        ec = pad(np.exp(cum).astype(f))                                      # [Hv, CH]
        el = pad(np.exp((cl - cum).astype(f)).astype(f))
        e = np.exp(cl[:, 0]).astype(f)
        Ws = pad(Wm[:, r0:r0 + m])
        Qs = pad(np.repeat(q[r0:r0 + m], rep, axis=1).transpose(1, 0, 2))
        Ks = pad(np.repeat(k[r0:r0 + m], rep, axis=1).transpose(1, 0, 2))
        Ks = (Ks * el[:, :, None]).astype(f)
        Pm = pad(P[:, r0:r0 + m])
        Us = pad(U[:, r0:r0 + m])
        acc = np.zeros((Hv, CH, dv), f)                                       # v_new = u - w S
        for i in range(dk):
            acc = (acc + Ws[:, :, i, None] * S[:, None, i, :]).astype(f)
        Vn = (Us - acc).astype(f)
        aq = np.zeros((Hv, CH, dv), f)                                        # o = exp(cum) (Q S) + P v_new
        for i in range(dk):
            aq = (aq + Qs[:, :, i, None] * S[:, None, i, :]).astype(f)
        ap = np.zeros((Hv, CH, dv), f)
        for j in range(CH):
            ap = (ap + Pm[:, :, j, None] * Vn[:, None, j, :]).astype(f)
        o = (ec[:, :, None] * aq + ap).astype(f)
        out[r0:r0 + m] = o[:, :m].transpose(1, 0, 2)
        acc = np.zeros((Hv, dk, dv), f)                                       # S = e S + (K el)^T v_new
        for r in range(CH):
            acc = (acc + Ks[:, r, :, None] * Vn[:, None, r, :]).astype(f)
        S = (S * e[:, None, None] + acc).astype(f)
    return S, out


def emulate(op, buf, w):
    """The chunked binding's launches on host arrays, in place (buf["state"], buf["out"])."""
    pos, slot, state = buf[op["pos"]], buf[op["slot"]], buf[op["state"]]
    ok, n, s, p0 = plan(pos, slot, state.shape[0])
    if not ok:                                   # gated_delta_run_k: the recurrence, every layout
        IMPL["gated_delta"].run({**op, "mode": "decode"}, buf, w)
        return False
    q, k, g, beta = prep(op, buf, w, n)
    U, Wm, P, CG = chunk_a(op, buf, q, k, g, beta, n)
    S0 = np.zeros(state.shape[1:], f) if p0 == 0 else state[s]
    S, o = chunk_b(op, q, k, U, Wm, P, CG, S0, n)
    state[s] = S
    out = np.zeros(buf[op["out"]].shape, f)
    out[:n] = o.reshape(n, -1)
    buf[op["out"]][...] = out
    return True


def delta_op(dims):
    Hk, Hv, dk, dv = dims
    return {"op": "gated_delta", "qkv": "qkv", "a": "a", "b": "b", "pos": "pos", "slot": "slot", "state": "st",
            "out": "out", "A_log": "A_log", "dt_bias": "dt", "k_heads": Hk, "v_heads": Hv, "k_dim": dk,
            "v_dim": dv, "mode": "prefill"}


def feeds_of(n):
    """tests/test_cuda_hybrid.py test_gated_delta_prefill_then_decode's prompt calls (slot 1 of 2)."""
    return [(np.arange(n, dtype=np.int32), np.ones(n, np.int32)),
            (np.r_[np.arange(n, n + 7), [-1] * 3].astype(np.int32), np.ones(10, np.int32))]


DIMS = [(2, 4, 32, 32), (2, 4, 16, 32), (4, 4, 64, 64)]


def run_case(dims, feeds, slots, seed):
    rng = np.random.default_rng(seed)
    Hk, Hv, dk, dv = dims
    w = HostW({"A_log": np.log(rng.uniform(0.5, 8, Hv)).astype(f),
               "dt": (-4 + 0.5 * rng.standard_normal(Hv)).astype(f)})
    st = (0.1 * rng.standard_normal((slots, Hv, dk, dv))).astype(f)
    want_b, got_b = {"st": st.copy()}, {"st": st.copy()}
    errs, took = [], []
    op = delta_op(dims)
    for pos, slot in feeds:
        rows = len(pos)
        inp = {"qkv": rng.standard_normal((rows, 2 * Hk * dk + Hv * dv)).astype(f),
               "a": rng.standard_normal((rows, Hv)).astype(f), "b": rng.standard_normal((rows, Hv)).astype(f),
               "pos": pos, "slot": slot}
        for b in (want_b, got_b):
            b.update({k: v.copy() for k, v in inp.items()}, out=np.full((rows, Hv * dv), 7, f))
        IMPL["gated_delta"].run(op, want_b, w)
        took.append(emulate(op, got_b, w))
        errs.append((rel(got_b["out"], want_b["out"]), rel(got_b["st"], want_b["st"])))
        assert not got_b["out"][pos < 0].any()
    return errs, took


@pytest.mark.parametrize("dims", DIMS, ids=["gqa-small", "dk<dv", "no-gqa"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_chunked_emulation_prefill(dims, n):
    errs, took = run_case(dims, feeds_of(n), 2, n + 1000 * dims[2])
    assert took == [True, True], "both calls are one run: the chunked path must take them"
    for i, (eo, es) in enumerate(errs):
        assert eo <= 1e-5 and es <= 1e-5, f"call {i}: out {eo:.2e}, state {es:.2e}"


def test_chunked_emulation_plan_falls_back():
    """Interleaved slots, a reset inside the call, idle rows in the middle: the plan refuses (the
    recurrence runs); a run at the start with idle padding after it: the plan takes it."""
    pos = np.array([0, 1, 0, 2], np.int32)
    assert not plan(pos, np.array([1, 1, 0, 1], np.int32), 2)[0]          # two slots
    assert not plan(np.array([3, 4, 0, 1], np.int32), np.ones(4, np.int32), 2)[0]   # reset mid-call
    assert not plan(np.array([3, -1, 4], np.int32), np.ones(3, np.int32), 2)[0]     # idle row inside
    assert not plan(np.array([3, 5], np.int32), np.ones(2, np.int32), 2)[0]         # a gap
    assert not plan(np.array([-1, 0], np.int32), np.ones(2, np.int32), 2)[0]        # idle first row
    assert not plan(np.array([0, 1, 2], np.int32), np.array([1, 2, 1], np.int32), 2)[0]   # an idle row inside
    assert plan(np.array([0, 1], np.int32), np.array([1, 2], np.int32), 2) == (True, 1, 1, 0)   # slot 2: idle
    assert plan(np.array([3, 4, -1, -1], np.int32), np.array([1, 1, 0, 5], np.int32), 2) == (True, 2, 1, 3)


def test_chunked_emulation_qwen_dims():
    """Qwen3-Next dims (16 k heads, 32 v heads, 128 x 128), 200 rows then 7 (+3 idle) continuing."""
    errs, took = run_case((16, 32, 128, 128), feeds_of(200), 2, 7)
    assert took == [True, True]
    for i, (eo, es) in enumerate(errs):
        assert eo <= 1e-5 and es <= 1e-5, f"call {i}: out {eo:.2e}, state {es:.2e}"


# -- the CUDA source itself, on the host ---------------------------------------------------------------

CU = Path(__file__).resolve().parents[1] / "runtime" / "cuda" / "gated_delta.cu"
SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <thread>
#include <barrier>
#include <mutex>
#include <atomic>
#include <algorithm>
#include <functional>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __align__(x)
struct D3 { int x = 0, y = 0, z = 0; };
thread_local D3 threadIdx, blockIdx;
D3 blockDim, gridDim;
float g_smem[80000];
int g_first_dead;
std::barrier<> *g_bar;
std::mutex g_mu;
std::atomic<int> g_or;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline int __syncthreads_or(int p) {
  g_bar->arrive_and_wait();
  if (p) g_or.store(1);
  g_bar->arrive_and_wait();
  int r = g_or.load();
  g_bar->arrive_and_wait();
  if (threadIdx.x == 0) g_or.store(0);
  g_bar->arrive_and_wait();
  return r;
}
inline int atomicMin(int *p, int v) { std::lock_guard<std::mutex> l(g_mu); int o = *p; *p = std::min(o, v); return o; }
inline float fmaf_(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
using std::min; using std::max;
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
"""
MAIN = r"""template <class F> void launch(int gx, int gy, int nt, F f) {
  blockDim.x = nt; gridDim.x = gx; gridDim.y = gy;
  for (int by = 0; by < gy; by++) for (int bx = 0; bx < gx; bx++) {
    std::barrier<> bar(nt); g_bar = &bar; g_or.store(0);
    std::vector<std::thread> th;
    for (int t = 0; t < nt; t++) th.emplace_back([&, t] { threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; f(); });
    for (auto &x : th) x.join();
  }
}
std::vector<float> rd(const char *p, size_t n) { std::vector<float> v(n); FILE *f = fopen(p, "rb"); if (fread(v.data(), 4, n, f) != n) exit(2); fclose(f); return v; }
std::vector<int> rdi(const char *p, size_t n) { std::vector<int> v(n); FILE *f = fopen(p, "rb"); if (fread(v.data(), 4, n, f) != n) exit(2); fclose(f); return v; }
void wr(const char *p, const std::vector<float> &v) { FILE *f = fopen(p, "wb"); fwrite(v.data(), 4, v.size(), f); fclose(f); }
int main(int argc, char **argv) {
  int rows = atoi(argv[1]), nslots = atoi(argv[2]), Hk = atoi(argv[3]), Hv = atoi(argv[4]), dk = atoi(argv[5]), dv = atoi(argv[6]);
  size_t W = 2 * Hk * dk + Hv * dv;
  auto qkv = rd("qkv", rows * W), a = rd("a", rows * Hv), qk = rd("qk", rows * 2 * Hk * dk), gb = rd("gb", rows * Hv * 2);
  auto Al = rd("A_log", Hv), dt = rd("dt", Hv), st = rd("st", (size_t)nslots * Hv * dk * dv), out = rd("out", rows * Hv * dv);
  auto pos = rdi("pos", rows), slot = rdi("slot", rows);
  std::vector<int> meta(4, 0);
  std::vector<float> uw((size_t)Hv * rows * (dv + dk)), pm((size_t)Hv * rows * CH), cg((size_t)Hv * rows);
  launch(1, 1, 1024, [&] { gated_delta_plan_k(pos.data(), slot.data(), rows, nslots, meta.data()); });
  printf("meta %d %d %d %d\n", meta[0], meta[1], meta[2], meta[3]);
  launch((rows + CH - 1) / CH, Hv, 256, [&] { gated_delta_chunk_a_k(qkv.data(), qk.data(), gb.data(), a.data(), Al.data(), dt.data(), meta.data(), uw.data(), pm.data(), cg.data(), rows, Hk, Hv, dk, dv); });
  auto fb = [&] {
    if (dk == 16) gated_delta_chunk_b_k<16>(qk.data(), uw.data(), pm.data(), cg.data(), meta.data(), st.data(), out.data(), rows, Hk, Hv, dv);
    if (dk == 32) gated_delta_chunk_b_k<32>(qk.data(), uw.data(), pm.data(), cg.data(), meta.data(), st.data(), out.data(), rows, Hk, Hv, dv);
    if (dk == 128) gated_delta_chunk_b_k<128>(qk.data(), uw.data(), pm.data(), cg.data(), meta.data(), st.data(), out.data(), rows, Hk, Hv, dv);
    if (dk == 64) gated_delta_chunk_b_k<64>(qk.data(), uw.data(), pm.data(), cg.data(), meta.data(), st.data(), out.data(), rows, Hk, Hv, dv);
  };
  launch(dv / CB_COLS, Hv, CB_THREADS, fb);
  wr("out_got", out); wr("st_got", st);
  return 0;
}
"""


def host_source() -> str:
    s = CU.read_text()
    sec = s[s.index("#define CH 64"):]
    sec = sec.replace("extern __shared__ __align__(16) float sm[];", "float *sm = g_smem;")
    sec = sec.replace("extern __shared__ float sm[];", "float *sm = g_smem;")
    sec = sec.replace("__shared__ int first_dead;", "int &first_dead = g_first_dead;")
    helper = s[s.index("template <int N>\n__device__ __forceinline__ void load_n"):
               s.index("__device__ __forceinline__ void prefetch_l2")]
    return SHIM + helper + sec.replace("fmaf(", "fmaf_(") + MAIN


@pytest.fixture(scope="module")
def host_binary(tmp_path_factory):
    if not shutil.which("g++"):
        pytest.skip("no g++: the host build of the chunked kernels needs it")
    d = tmp_path_factory.mktemp("gd_host")
    (d / "emu.cpp").write_text(host_source())
    p = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", "-o", str(d / "emu"), str(d / "emu.cpp")],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"g++ could not build the host shim (C++20 <barrier>?): {p.stderr[-400:]}")
    return d


def host_call(d, op, inp, w, pos, slot, st):
    """The plan and the chunked kernels of gated_delta.cu on the host: (meta, out, state)."""
    Hk, Hv, dk, dv = op["k_heads"], op["v_heads"], op["k_dim"], op["v_dim"]
    rows = len(pos)
    q, k, g, beta = prep(op, inp, w, rows)
    qk = np.concatenate([q.reshape(rows, -1), k.reshape(rows, -1)], 1).astype(f)
    gb = np.stack([np.exp(g), beta], -1).astype(f)
    for name, arr in [("qkv", inp["qkv"]), ("a", inp["a"]), ("qk", qk), ("gb", gb), ("A_log", w["A_log"]),
                      ("dt", w["dt"]), ("st", st), ("out", np.full((rows, Hv * dv), 7, f)),
                      ("pos", pos.astype(np.int32)), ("slot", slot.astype(np.int32))]:
        np.ascontiguousarray(arr).tofile(d / name)
    r = subprocess.run(["./emu", str(rows), str(st.shape[0]), str(Hk), str(Hv), str(dk), str(dv)], cwd=d,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    meta = [int(x) for x in r.stdout.split()[1:5]]
    return meta, np.fromfile(d / "out_got", f).reshape(rows, Hv * dv), np.fromfile(d / "st_got", f).reshape(st.shape)


HOST_CASES = [((2, 4, 32, 32), n) for n in (1, 63, 64, 65, 200)] + [((2, 4, 16, 32), 65), ((4, 4, 64, 64), 65)]


@pytest.mark.parametrize("dims,n", HOST_CASES, ids=[f"{d[2]}x{d[3]}-n{n}" for d, n in HOST_CASES])
def test_chunked_cuda_source_on_host(host_binary, dims, n):
    """The prefill tests' two prompt calls (n rows from position 0, then 7 continuing + 3 idle) through
    the kernels' source, then an interleaved call (two slots, a reset inside): the plan refuses it and
    the chunked kernels leave out and state alone (the recurrence would take it)."""
    rng = np.random.default_rng(n + 1000 * dims[2])
    Hk, Hv, dk, dv = dims
    w = HostW({"A_log": np.log(rng.uniform(0.5, 8, Hv)).astype(f),
               "dt": (-4 + 0.5 * rng.standard_normal(Hv)).astype(f)})
    st = (0.1 * rng.standard_normal((2, Hv, dk, dv))).astype(f)
    hb, got = {"st": st.copy()}, st.copy()
    op = delta_op(dims)
    feeds = feeds_of(n) + [(np.array([0, n + 7, 1, -1], np.int32), np.array([0, 1, 0, 1], np.int32))]
    for i, (pos, slot) in enumerate(feeds):
        rows = len(pos)
        inp = {"qkv": rng.standard_normal((rows, 2 * Hk * dk + Hv * dv)).astype(f),
               "a": rng.standard_normal((rows, Hv)).astype(f), "b": rng.standard_normal((rows, Hv)).astype(f)}
        meta, out, st_new = host_call(host_binary, op, inp, w, pos, slot, got)
        if i == 2:
            assert meta[0] == 0, f"interleaved rows taken as one run: {meta}"
            assert (out == 7).all() and np.array_equal(st_new, got), "the chunked kernels must not touch a refused call"
            continue
        assert meta == [1, n if i == 0 else 7, 1, 0 if i == 0 else n], meta
        hb.update({k: v.copy() for k, v in inp.items()}, pos=pos, slot=slot, out=np.full((rows, Hv * dv), 7, f))
        IMPL["gated_delta"].run(op, hb, w)
        got = st_new
        eo, es = rel(out, hb["out"]), rel(got, hb["st"])
        assert eo <= 1e-5 and es <= 1e-5, f"call {i}: out {eo:.2e}, state {es:.2e}"
        assert not out[pos < 0].any(), "idle rows must give zeros"


if __name__ == "__main__":                     # the agreement figures
    for dims in DIMS + [(16, 32, 128, 128)]:
        for n in ([1, 63, 64, 65, 200] if dims[2] < 128 else [65, 200]):
            errs, took = run_case(dims, feeds_of(n), 2, n + 1000 * dims[2])
            print(dims, n, took, " ".join(f"out {a:.2e} state {b:.2e}" for a, b in errs), flush=True)
