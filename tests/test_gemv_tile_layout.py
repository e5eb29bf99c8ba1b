"""The NVFP4 tile layout's NumPy twins (runtime/cuda/gemv_tile.py) against an independent decoder: the
weights the tensor-core kernel multiplies, read back from the layout as the kernel extracts them, are the
GGML blocks' values as gguf-py dequantizes them, bit for bit, padding outputs included."""

import gguf
import ml_dtypes
import numpy as np
import pytest

from bloomery.runtime.cuda import gemv_tile

GQ = gguf.GGMLQuantizationType


def blocks(out, inn, rng):
    """Random GGML NVFP4 bytes with every nibble and every scale the formats accept (E4M3 0 .. 448 and -0;
    a negative scale is refused at prepare, core/formats/common.py) planted."""
    b = rng.integers(0, 256, size=(out, inn // 64, 36), dtype=np.uint8)
    e4m3 = np.arange(256, dtype=np.uint8)
    v = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    valid = e4m3[(v >= 0) & ~np.isnan(v)]
    b[:, :, :4] = rng.choice(valid, size=(out, inn // 64, 4))
    b[0, 0, :4] = [0x00, 0x01, 0x7E, 0x80]                 # 0, the least subnormal, 448, -0
    b[0, 0, 4:] = [(i % 16) | (i * 7 % 16) << 4 for i in range(32)]   # every nibble, both halves
    return b.reshape(out, inn // 64 * 36)


@pytest.mark.parametrize("out,inn", [(64, 64), (8, 128), (100, 192), (200, 512)])
def test_tile_layout_decodes_to_the_ggml_values(out, inn):
    rng = np.random.default_rng(out * 1000 + inn)
    blk = blocks(out, inn, rng)
    wt, st = gemv_tile.repack(blk, out, inn)
    ncol, nks = -(-out // 64), inn // 16
    assert wt.shape == (ncol, nks, 32, 4) and wt.dtype == np.uint32
    assert st.shape == (ncol, nks, 8, 8) and st.dtype == np.uint8
    want = gguf.quants.dequantize(blk, GQ.NVFP4).astype(np.float64)
    got = gemv_tile.decode(wt, st, out, inn)
    assert got.shape == (out, inn)
    bad = got != want                                       # GGML has no -0; +0 == -0 here
    assert not bad.any(), f"first mismatch at {tuple(np.argwhere(bad)[0])}: {got[bad][0]} != {want[bad][0]}"
    # the padding outputs of the last column hold zero weights and zero scales
    full = gemv_tile.decode(wt, st, ncol * 64, inn)
    assert not full[out:].any()
    assert not st.reshape(ncol, nks, 8, 8).transpose(0, 3, 2, 1).reshape(ncol * 64, nks)[out:].any()


def test_tile_layout_uses_every_bit_once():
    """The four registers of a word take disjoint bits of it, all 32 (the rotations in ROT are a bijection
    onto the sign and magnitude fields), so no weight is read twice or lost."""
    seen = np.zeros(32, int)
    for ra, rb in gemv_tile.ROT:
        for mask, r in ((gemv_tile.SIGN, ra), (gemv_tile.MAG, rb)):
            for bit in range(32):
                if mask >> bit & 1:
                    seen[(bit + r) % 32] += 1
    assert (seen == 1).all(), seen


def test_tile_layout_catches_a_wrong_rotation(monkeypatch):
    """A planted defect: the decoder's rotations off by one from the packer's must fail the comparison."""
    rng = np.random.default_rng(7)
    blk = blocks(64, 128, rng)
    wt, st = gemv_tile.repack(blk, 64, 128)
    want = gguf.quants.dequantize(blk, GQ.NVFP4).astype(np.float64)
    monkeypatch.setattr(gemv_tile, "ROT", ((0, 0), (1, 3), (2, 12), (9, 10)))
    assert (gemv_tile.decode(wt, st, 64, 128) != want).any()
