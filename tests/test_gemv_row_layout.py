"""The one-row NVFP4 layout's NumPy twins (runtime/cuda/gemv_row.py) against an independent decoder: the
weights the kernel multiplies, read back from the layout as the kernel extracts them, are the GGML blocks'
values as gguf-py dequantizes them, bit for bit, padding included; and the kernel's fragment bookkeeping
(which lane holds which A and B values of which mma, which D values take which scale), played in float64,
gives x @ W^T."""

import gguf
import numpy as np
import pytest

from bloomery.runtime.cuda import gemv_row
from tests.test_gemv_tile_layout import blocks

GQ = gguf.GGMLQuantizationType


@pytest.mark.parametrize("out,inn", [(16, 64), (8, 128), (100, 192), (40, 576), (33, 1024)])
def test_row_layout_decodes_to_the_ggml_values(out, inn):
    rng = np.random.default_rng(out * 1000 + inn)
    blk = blocks(out, inn, rng)
    wa, sa = gemv_row.repack(blk, out, inn)
    nt, ng = -(-out // 16), gemv_row.groups(inn)
    assert ng * 64 == inn
    assert wa.shape == (nt, ng, 32, 4) and wa.dtype == np.uint32
    assert sa.shape == (nt, -(-ng // 8), 32, 16) and sa.dtype == np.uint8
    pad = sa.reshape(nt, -1, 32, 8, 2)[:, -1, :, ng % 8 or 8:]     # the last scale word past in / 64 k-groups
    assert not pad.any()
    want = gguf.quants.dequantize(blk, GQ.NVFP4).astype(np.float64)
    got = gemv_row.decode(wa, sa, out, inn)
    assert got.shape == (out, inn)
    bad = got != want                                       # GGML has no -0; +0 == -0 here
    assert not bad.any(), f"first mismatch at {tuple(np.argwhere(bad)[0])}: {got[bad][0]} != {want[bad][0]}"
    full = gemv_row.decode(wa, sa, nt * 16, inn)            # the padding rows hold zero weights and zero scales
    assert not full[out:].any()


def f16_pairs(words):
    """uint32 f16x2 registers -> float64 (low half, high half)."""
    w = np.asarray(words, np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def emulate(wa, sa, x, out, inn, plant=0):
    """The kernel's arithmetic with its fragment bookkeeping, in float64 (x not split: part 1 is zero): the
    shared x fragments as stage 1 writes them, each lane's A registers (row_a), B registers (its two 16-byte
    shared loads when g / 2 == t), the m16n8k16 fragment placement of A, B and D, and the scale bytes. plant 1:
    the lanes with g / 2 == t + 1 hold B instead (a defect the product must show)."""
    import ml_dtypes
    nt, ng = wa.shape[0], wa.shape[1]
    xp = np.zeros(ng * 64)
    xp[:inn] = x
    xs = np.zeros((ng, 8, 16))                              # [G, column 2j + p, element]: stage 1's slots
    xs[:, 0::2, :] = xp.reshape(ng, 4, 16)                  # part 0 (high) of sub-block j; part 1 zero
    y = np.zeros(nt * 16)
    for r in range(nt):
        for G in range(ng):
            D = np.zeros((16, 8))
            for i in range(4):
                A, B = np.zeros((16, 16)), np.zeros((16, 8))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    q = wa[r, G, lane, i]
                    regs = [(gemv_row._rotr(np.uint32(q), ra) & gemv_row.SIGN) |
                            (gemv_row._rotr(np.uint32(q), rb) & gemv_row.MAG) for ra, rb in gemv_row.ROT]
                    for o, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                        lo, hi = f16_pairs(regs[o])
                        A[row, col], A[row, col + 1] = lo * 16384.0, hi * 16384.0
                    if g >> 1 == (t + plant) % 4:            # lane (g, t) holds column g of B
                        col = xs[G, g]                       # 16 elements; mma i takes 4i .. 4i + 3
                        B[2 * t, g], B[2 * t + 1, g] = col[4 * i], col[4 * i + 1]
                        B[2 * t + 8, g], B[2 * t + 9, g] = col[4 * i + 2], col[4 * i + 3]
                D += A @ B
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                sb = sa[r, G // 8, lane, 2 * (G % 8): 2 * (G % 8) + 2].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
                y[16 * r + g] += (D[g, 2 * t] + D[g, 2 * t + 1]) * sb[0]
                y[16 * r + g + 8] += (D[g + 8, 2 * t] + D[g + 8, 2 * t + 1]) * sb[1]
    return y[:out]


@pytest.mark.parametrize("out,inn", [(16, 64), (24, 576)])
def test_row_fragments_give_the_product(out, inn):
    rng = np.random.default_rng(3)
    blk = blocks(out, inn, rng)
    wa, sa = gemv_row.repack(blk, out, inn)
    x = rng.standard_normal(inn)
    want = gguf.quants.dequantize(blk, GQ.NVFP4).astype(np.float64) @ x
    got = emulate(wa, sa, x, out, inn)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9 * np.abs(want).max())


def test_row_fragments_catch_a_wrong_b_column():
    """A planted defect: B held by the lanes of the next sub-block must fail the product."""
    rng = np.random.default_rng(5)
    blk = blocks(16, 64, rng)
    wa, sa = gemv_row.repack(blk, 16, 64)
    x = rng.standard_normal(64)
    want = gguf.quants.dequantize(blk, GQ.NVFP4).astype(np.float64) @ x
    np.testing.assert_allclose(emulate(wa, sa, x, 16, 64), want, rtol=1e-12, atol=1e-9 * np.abs(want).max())
    assert not np.allclose(emulate(wa, sa, x, 16, 64, plant=1), want)


def test_row_plan_covers_the_groups():
    for out, inn in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (576, 576), (1536, 576)):
        (ctas, ks), sl, cuts = gemv_row.plan([out], inn)
        ng = gemv_row.groups(inn)
        assert sl % 8 == 0 and (ks - 1) * sl < ng <= ks * sl, (out, inn, ks, sl)
        assert ctas * gemv_row.RowConfig().W * 16 >= out and cuts == [ctas, ctas]
    (ctas, ks), sl, (c1, c2) = gemv_row.plan([4096, 1024, 1024], 4096)     # q / k / v: members' CTA columns
    assert (c1, c2, ctas) == (64, 80, 96)
    (ctas, ks), sl, _ = gemv_row.plan([14336, 14336], 4096, pair=True)    # gate / up: W / 2 tiles of each a CTA
    assert ctas == 448
