"""The prompt GEMM's activation split in the CuTe DSL: x (float32 [n]) -> hi = bf16(x) and (split)
lo = bf16(x - hi), round to nearest even by the same integer arithmetic as the NVRTC kernel it
stands in for (runtime/cuda/gemm_src.py x_to_bf16_k), so the two write the same bits for every
input, NaNs included. Grid-stride over n with 256 threads a CTA.

The first kernel of the ahead-of-time path (compiler/cutedsl/__init__.py): small, so that the path
itself (compile with no GPU, carry in the artifact, load with cupy.RawModule) is what is tested."""


THREADS = 256


def build():
    """The launch function (cute.jit) and fake arguments of both variants, one kernel compiled with
    its split flag a constant: {"act_split": hi + lo, "act_round": hi only (its lo parameter
    unused)}. The kernel's parameters (x, hi, lo, n): x float32 bits, hi and lo BF16 bits, n the
    element count."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int64, Uint16, Uint32

    def bf16_bits(b):                                   # float32 bits -> BF16 bits, nearest even
        return (b + Uint32(0x7FFF) + ((b >> 16) & Uint32(1))) >> 16

    def ftz(b):             # float32 bits, a subnormal flushed to a zero of its sign: the NVRTC twin's float
        nz = (((b >> 23) & Uint32(0xFF)) + Uint32(0xFF)) >> 8            # 0 for a zero exponent, else 1
        return b & (Uint32(0x80000000) | ((Uint32(0) - nz) & Uint32(0x7FFFFFFF)))

    @cute.kernel
    def act_k(x: cute.Pointer, hi: cute.Pointer, lo: cute.Pointer, n: Int64, split: cutlass.Constexpr):
        X, H, L = (cute.make_tensor(p, cute.make_layout(n)) for p in (x, hi, lo))
        i = Int64(cute.arch.block_idx()[0]) * THREADS + Int64(cute.arch.thread_idx()[0])
        while i < n:
            b = X[i]
            h = bf16_bits(b)
            H[i] = h.to(Uint16)
            if cutlass.const_expr(split):               # as the runtime's NVRTC kernel computes it: CuPy compiles
                d = ftz(b).bitcast(Float32) - ftz(h << 16).bitcast(Float32)   # with -ftz=true (inputs and
                L[i] = bf16_bits(ftz(d.bitcast(Uint32))).to(Uint16)          # result of the subtraction flushed)
            i += Int64(cute.arch.grid_dim()[0]) * THREADS

    @cute.jit
    def launch(x: cute.Pointer, hi: cute.Pointer, lo: cute.Pointer, n: Int64, grid: cutlass.Int32,
               split: cutlass.Constexpr):
        act_k(x, hi, lo, n, split).launch(grid=(grid, 1, 1), block=(THREADS, 1, 1))

    def fake_args():
        from cutlass.cute.runtime import make_ptr
        gm = cute.AddressSpace.gmem
        return (make_ptr(Uint32, 16, gm, assumed_align=4), make_ptr(Uint16, 16, gm, assumed_align=2),
                make_ptr(Uint16, 16, gm, assumed_align=2), Int64(1), cutlass.Int32(1))

    return {"act_split": (launch, lambda: (*fake_args(), True), THREADS),
            "act_round": (launch, lambda: (*fake_args(), False), THREADS)}
