"""tools/emulate_prefill.tc_matmul: the model of the tensor cores' truncating accumulation."""

import numpy as np

from bloomery.tools.emulate_prefill import tc_matmul


def test_wide_accumulator_is_the_plain_product():
    rng = np.random.default_rng(0)
    x, W = rng.standard_normal((3, 40)), rng.standard_normal((5, 40))
    got = tc_matmul(x, W, kblock=16, bits=60)
    np.testing.assert_allclose(got, (x @ W.T).astype(np.float32), rtol=2e-7, atol=1e-6)


def test_small_terms_beside_a_large_one_are_truncated():
    # 2^24 and fifteen 1s in one k-block: aligned to 2^24 with 24 bits the ulp is 2, every 1 drops out
    x = np.array([[2.0 ** 24] + [1.0] * 15])
    W = np.ones((1, 16))
    assert tc_matmul(x, W, kblock=16, bits=24)[0, 0] == 2.0 ** 24
    # with 30 bits they count; the block's sum is then rounded to float32 (spacing 2 there)
    assert tc_matmul(x, W, kblock=16, bits=30)[0, 0] == np.float32(2.0 ** 24 + 15) == 2.0 ** 24 + 16
    # one term per block: the running sum 2^24 sets the alignment, the 1s still drop out
    assert tc_matmul(x, W, kblock=1, bits=24)[0, 0] == 2.0 ** 24
    # toward zero, whatever the sign: each 3 becomes 2 beside -2^24
    neg = np.array([[-(2.0 ** 24)] + [3.0] * 15])
    assert tc_matmul(neg, W, kblock=16, bits=24)[0, 0] == -(2.0 ** 24) + 30
