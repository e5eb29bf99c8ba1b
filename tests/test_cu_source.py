"""CPU: the CUDA sources as the runtime hands them to NVRTC (runtime/cuda/cu.py source()): every shared
header a .cu file includes is pasted in whole, once, and nothing is left for NVRTC to find on a path."""

from __future__ import annotations

import re

import pytest

from bloomery.runtime.cuda import cu

STEMS = sorted(p.stem for p in cu.HERE.glob("*.cu"))
INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)


@pytest.mark.parametrize("stem", STEMS)
def test_source_is_self_contained(stem):
    raw = (cu.HERE / f"{stem}.cu").read_text()
    src = cu.source(stem)
    assert not INCLUDE.search(src), f"{stem}.cu: an #include left for NVRTC to resolve"
    for name in INCLUDE.findall(raw):
        assert name.endswith(".cuh") and (cu.HERE / name).exists(), f"{stem}.cu includes {name}: not a header here"
        body = cu.header(name[:-4])
        assert body.strip() and src.count(body) == 1, f"{stem}.cu: {name} not pasted exactly once"
        assert "#pragma once" not in body


def test_the_shared_conversions_have_one_owner():
    """numerics.cuh defines the format conversions; the sources that include it (and the GEMV source) do not
    define them again."""
    from bloomery.runtime.cuda import gemv_src
    owned = re.findall(r"__device__ __forceinline__ \S+ (\w+)\(", cu.header("numerics"))
    assert {"e4m3x2_h2", "h2f2", "lo_nib_e4m3", "bf16x2_rn", "mma_bf16"} <= set(owned)
    users = {s: cu.source(s) for s in STEMS if "numerics.cuh" in (cu.HERE / f"{s}.cu").read_text()}
    assert {"moe_gemm", "attention_chunk", "attention_decode", "gemv_tc", "gemv_tile", "gemv_row"} <= set(users)
    for name, src in [*users.items(), ("gemv_src.SOURCE", gemv_src.SOURCE)]:
        for fn in owned:
            n = len(re.findall(rf"__device__ __forceinline__ \S+ {fn}\(", src))
            assert n == 1, f"{name}: {fn} defined {n} times"


def test_attention_kernel_names_leave_out_the_defaults():
    """The decode attention kernel's name at the default launch (4 warps, the compiler's P.V loop) is the name
    the kernel had before those template arguments; the variants name theirs."""
    from bloomery.runtime.cuda import attention_decode as AD
    assert AD.kernel_name(8, 128) == "attention_decode_k<4, 2>"
    assert AD.kernel_name(3, 64) == "attention_decode_k<2, 1>"
    assert AD.kernel_name(4, 128, (1, 2)) == "attention_decode_k<4, 1, 1, 2>"
    assert AD.kernel_name(8, 128, (0, 0), 8) == "attention_decode_k<4, 1, 0, 0, 8>"
    assert AD.kernel_name(8, 128, (1, 1), 4, 8) == "attention_decode_k<4, 2, 1, 1, 4, 8>"
    with pytest.raises(ValueError, match="6 warps"):
        AD.kernel_name(8, 128, warps=6)


def test_prefetch_arguments_fill_their_slots():
    import numpy as np

    class Arr:
        nbytes = 4096
    a = Arr()
    assert cu.prefetch_args([a], 3, "unused") == (a, np.int64(4096), "unused", np.int64(0), "unused", np.int64(0))
    assert cu.prefetch_args([], 1, "unused") == ("unused", np.int64(0))
    with pytest.raises(ValueError, match="at most 3"):
        cu.prefetch_args([a] * 4, 3, "unused")
