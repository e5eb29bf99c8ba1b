"""GPU: the artifact's ahead-of-time kernels (compiler/cutedsl, loaded by runtime/cuda/aot.py) write
the same bits as the NVRTC kernels they stand in for, and the prompt GEMM gives the same result
with them. The cubins come from the CUTLASS DSL where it is installed, else from an artifact
prepared with --target elsewhere (BLOOMERY_AOT_ARTIFACT=path: the GPU machine needs no cutlass).
Skipped, visibly, without CuPy and a GPU, or without either source of cubins."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bloomery.compiler import cutedsl
from bloomery.core.artifact import kernels as K
from bloomery.runtime.cuda import aot
from bloomery.runtime.cuda import gemm as M
from bloomery.runtime.cuda import gemv as G

from test_cuda_kernels import artifact, cp                # skips, visibly, without CuPy or a GPU

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def launchers():
    where = os.environ.get("BLOOMERY_AOT_ARTIFACT")
    if where:
        from bloomery.core.artifact.reader import Artifact
        md = Artifact.open(where).metadata(0)
    elif cutedsl.dsl_version() is not None:
        md = {K.KEY: cutedsl.compile_record("sm_90a")}
    else:
        pytest.skip("no AOT cubins: install nvidia-cutlass-dsl, or set BLOOMERY_AOT_ARTIFACT to an artifact "
                    "prepared with --target sm_90a")
    cc = cp.cuda.Device().compute_capability
    ks, why = aot.load(md, (int(cc[:-1]), int(cc[-1])), {})
    if not ks:
        pytest.skip(why)
    return ks


def edge_floats(rng, n):
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 1, 0x807FFFFF,
                        0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x4B7FFFFF], np.uint32)   # ties, NaNs, subnormals
    k = min(n, special.size)
    bits[:k] = special[:k]
    return bits.view(np.float32)


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 132 * 16 * 256 + 77])      # past one grid-stride sweep
def test_aot_activation_split_equals_nvrtc(launchers, n):
    rng = np.random.default_rng(n)
    x = cp.asarray(edge_floats(rng, n))
    k = M.kernels()["x_to_bf16_k"]
    grid = M._grid(n)
    want_hi, want_lo = cp.zeros(n, cp.uint16), cp.zeros(n, cp.uint16)
    k(grid, (256,), (x, want_hi, want_lo, np.int64(n)))
    hi, lo = cp.full(n, 0xABCD, cp.uint16), cp.full(n, 0xABCD, cp.uint16)
    launchers["act_split"](grid, (x, hi, lo, np.int64(n)))
    cp.cuda.runtime.deviceSynchronize()
    assert cp.array_equal(hi, want_hi) and cp.array_equal(lo, want_lo)
    hi2, lo2 = cp.full(n, 0xABCD, cp.uint16), cp.full(n, 0xABCD, cp.uint16)
    launchers["act_round"](grid, (x, hi2, lo2, np.int64(n)))
    cp.cuda.runtime.deviceSynchronize()
    assert cp.array_equal(hi2, want_hi) and bool((lo2 == 0xABCD).all())          # lo untouched


@pytest.mark.parametrize("mode", M.MODES)
def test_prompt_gemm_with_aot_kernels_is_bitwise_the_nvrtc_one(launchers, mode):
    rng = np.random.default_rng(3)
    W, arrays = artifact("nvfp4", (130, 320), rng)
    lin = G.Linear("nvfp4", (130, 320), {k: cp.asarray(v) for k, v in arrays.items()})
    x = cp.asarray((rng.standard_normal((40, 320)) * 3).astype(np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    outs = []
    for ks in ({}, launchers):
        y = cp.full((40, 130), cp.nan, cp.float32)
        step = M.Matmul(stream, mode, aot=ks).bind(lin, x, y, 40)
        with stream:
            step()
        stream.synchronize()
        outs.append(cp.asnumpy(y))
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
