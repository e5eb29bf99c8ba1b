"""Prompt-chunk linear (prefill, more than 8 activation rows) on the tensor cores.

    from bloomery.runtime.cuda import gemm
    mm = gemm.Matmul(stream, mode="bf16")             # one per executor: scratch + cuBLAS handle
    step = mm.bind(lin, x, y, rows, accumulate)       # lin: a gemv.Linear (the weight as uploaded)
    step()                                            # enqueues on `stream`; capturable into a graph

Each call decodes the weight from its artifact layout into a BF16 scratch matrix (gemm_src.py:
exact for NVFP4, MXFP8, MXFP4, FP8 tensor and BF16 weights, whose per-tensor factor becomes
cuBLAS's alpha; BF16 weights are read in place, not copied), rounds the activations to BF16,
and runs one cuBLAS BF16 GEMM with float32 accumulation and float32 output (y = alpha W x, or
y += for the fused residual add). No dequantized copy of the model is kept: the scratch holds
one matrix, the largest the program multiplies, and is reused by every linear in turn.

mode "bf16x2" (the default): activations split as hi + lo BF16 and two GEMMs accumulate (16
significant bits of each activation; weights BF16 cannot hold exactly are split the same way, a
third GEMM): float32-level agreement with the NumPy executor at two to three times the
tensor-core work. mode "bf16": activations rounded to BF16, one GEMM (what inference engines do;
relative error ~2^-9 per activation); the MoE router still runs exact. Lever BLOOMERY_PREFILL_GEMM (specs/levers.yaml) picks the mode, or "off"
(the decode GEMV kernels over 8-row groups, float32 throughout).
"""

from __future__ import annotations

import numpy as np

try:                                    # importable without CuPy (CPU machines, test collection)
    import cupy as cp
except Exception:                        # pragma: no cover - depends on the machine
    cp = None

from . import cublas
from . import gemv as G
from .gemm_src import SOURCE as GEMM_SOURCE
from .gemv_src import SOURCE as GEMV_SOURCE

MODES = ("bf16", "bf16x2")
ROUNDED = ("fp8_channel", "fp8_block128", "q8_0", "f32")      # kinds BF16 does not hold exactly
KINDS = ("nvfp4_ggml", "nvfp4_stored", "mxfp8", "fp8_tensor", "fp8_channel", "fp8_block128", "bf16", "f32",
         "q8_0", "mxfp4")

_NAMES = ("x_to_bf16_k", "deq_nvfp4_ggml_k", "deq_q8_0_k", "deq_mxfp4_ggml_k",
          *(f"deq_plain_k<{G.FMT_ID[k]}>" for k in ("f32", "fp8_tensor", "fp8_channel", "fp8_block128", "mxfp8",
                                                   "nvfp4_stored")))
_K: dict = {}


def kernels() -> dict:
    if not _K:
        mod = cp.RawModule(code=GEMV_SOURCE + GEMM_SOURCE, options=G.OPTIONS, name_expressions=list(_NAMES))
        _K.update({n: mod.get_function(n) for n in _NAMES})
        _K["_module"] = mod
    return _K


def alpha_of(lin: G.Linear) -> float:
    """The per-tensor factor the BF16 tile leaves out (cuBLAS's alpha); read once, at bind time."""
    if lin.kind in ("nvfp4_ggml", "nvfp4_stored"):
        return float(cp.asnumpy(lin.sc[:1])[0]) * 64.0      # the decoders' e2m1 -> E4M3 trick carries 2^-6
    if lin.kind == "fp8_tensor":
        return float(cp.asnumpy(lin.sc[:1])[0])
    return 1.0


def _grid(n: int) -> tuple:
    return (max(1, min(132 * 16, -(-n // 256))),)


class Matmul:
    """The executor's prefill GEMM: one cuBLAS handle on its stream, one weight scratch, one
    activation scratch (grown while binding, fixed before the first launch)."""

    def __init__(self, stream, mode: str = "bf16x2", split_k: int = 0, aot: dict | None = None):
        """split_k: the main product (BF16 weight times the activations' hi part) runs as GEMMs over
        slices of the inner dimension this deep (a multiple of 64), each slice's float32 result added by
        cuBLAS's beta = 1 epilogue, so the tensor cores' truncating accumulation runs over split_k
        products at most (0: the whole depth at once). bf16x2's lo products, 2^-8 of it, run whole.
        aot: the artifact's ahead-of-time kernels (runtime/cuda/aot.py); its act_split / act_round
        replace x_to_bf16_k where present (the same bits, tests/test_cuda_aot.py)."""
        if mode not in MODES:
            raise ValueError(f"prefill GEMM mode {mode!r}; known: {', '.join(MODES)}")
        if split_k < 0 or split_k % 64:
            raise ValueError(f"prefill GEMM split_k {split_k}: 0 or a positive multiple of 64")
        self.mode, self.stream, self.split_k = mode, stream, int(split_k)
        self.aot = dict(aot or {})
        self.k = kernels()
        self.handle = cublas.create(stream.ptr)
        self.w = cp.empty(0, cp.uint16)
        self.wlo = cp.empty(0, cp.uint16)
        self.xhi = cp.empty(0, cp.uint16)
        self.xlo = cp.empty(0, cp.uint16)
        self._scalars: list = []          # host alpha / beta values, alive as long as the bound steps

    def __del__(self):
        h, self.handle = getattr(self, "handle", None), None
        if h is not None:
            try:
                cublas.destroy(h)
            except Exception:
                pass

    @staticmethod
    def supports(lin: G.Linear) -> bool:
        return lin.kind in KINDS and not lin.experts

    def _grow(self, name: str, n: int) -> None:
        if getattr(self, name).size < n:
            setattr(self, name, cp.empty(n, cp.uint16))

    def _scalar(self, v: float) -> int:
        a = np.array([v], np.float32)
        self._scalars.append(a)
        return a.ctypes.data

    def bind(self, lin: G.Linear, x, y, rows: int, accumulate: bool = False, exact: bool = False):
        """A step computing y[:rows] = W x[:rows] (+ y). x float32 [rows, in], y float32 [rows, out].
        exact=True: the bf16x2 arithmetic whatever the mode (the MoE router: a rounded router logit
        can change which experts run)."""
        out, inn = lin.out, lin.inn
        split = exact or self.mode == "bf16x2"
        wsplit = split and lin.kind in ROUNDED
        if lin.kind != "bf16":
            self._grow("w", out * inn)
        if wsplit:
            self._grow("wlo", out * inn)
        self._grow("xhi", rows * inn)
        if split:
            self._grow("xlo", rows * inn)
        alpha, one = self._scalar(alpha_of(lin)), self._scalar(1.0)
        beta = one if accumulate else self._scalar(0.0)
        deq = self._dequant(lin, wsplit)
        conv = self.k["x_to_bf16_k"]
        fast = self.aot.get("act_split" if split else "act_round")
        n = rows * inn
        T, N, B16, F32 = cublas.OP_T, cublas.OP_N, cublas.CUDA_R_16BF, cublas.CUDA_R_32F

        step_k = self.split_k if 0 < self.split_k < inn else inn
        slices = [(c, min(step_k, inn - c)) for c in range(0, inn, step_k)]   # (first column, depth)

        def step():
            xhi, xlo = self.xhi, self.xlo
            if fast is not None:                      # act_round leaves its lo argument unused
                fast(_grid(n), (x, xhi, xlo if split else xhi, np.int64(n)))
            else:
                conv(_grid(n), (256,), (x, xhi, xlo if split else np.uint64(0), np.int64(n)))
            a, alo = deq()
            h = self.handle
            # y = alpha (W_hi + W_lo)(x_hi + x_lo) (+ y), dropping W_lo x_lo (2^-16 of 2^-16). The W_hi x_hi
            # product runs over the slices (a slice of columns c..c+k of W and x starts 2c bytes in, BF16;
            # the leading dimensions stay inn); the lo products, 2^-8 of it, run over the whole depth
            # once: their truncation errors are 2^-8 of the hi product's
            for i, (c, k) in enumerate(slices):
                o = 2 * c
                cublas.gemm_ex(h, T, N, out, rows, k, alpha, a.data.ptr + o, B16, inn, xhi.data.ptr + o, B16, inn,
                               beta if i == 0 else one, y.data.ptr, F32, out)
            if split:
                cublas.gemm_ex(h, T, N, out, rows, inn, alpha, a.data.ptr, B16, inn, xlo.data.ptr, B16, inn, one,
                               y.data.ptr, F32, out)
            if wsplit:
                cublas.gemm_ex(h, T, N, out, rows, inn, alpha, alo.data.ptr, B16, inn, xhi.data.ptr, B16, inn, one,
                               y.data.ptr, F32, out)
        return step

    def _dequant(self, lin: G.Linear, wsplit: bool = False):
        """A function enqueuing the weight's decode into the scratch and returning the BF16 matrix
        (the stored array itself for BF16 weights) and, when wsplit, its lo tile (else None)."""
        out, inn, kind = lin.out, lin.inn, lin.kind
        if kind == "bf16":
            return lambda: (lin.w, None)
        i32 = np.int32
        takes_lo = kind not in ("nvfp4_ggml", "mxfp4")       # the kernels with a lo tile argument
        if kind == "nvfp4_ggml":
            kern, n, scales = self.k["deq_nvfp4_ggml_k"], out * (inn // 64) * 8, ()
        elif kind == "q8_0":
            kern, n, scales = self.k["deq_q8_0_k"], out * (inn // 32) * 8, ()
        elif kind == "mxfp4":
            kern, n, scales = self.k["deq_mxfp4_ggml_k"], out * (inn // 32) * 16, ()
        else:
            kern, n = self.k[f"deq_plain_k<{G.FMT_ID[kind]}>"], out * (inn // G.EPW[kind])
            scales = (lin.s if lin.s is not None else lin.w, lin.sc if lin.sc is not None else lin.w)
        grid = _grid(n)

        def run():
            w, wlo = self.w, (self.wlo if wsplit else None)
            lo_arg = (wlo if wsplit else np.uint64(0),) if takes_lo else ()
            kern(grid, (256,), (lin.w, *scales, w, *lo_arg, i32(out), i32(inn)))
            return w, wlo
        return run
