"""GPU: the tensor-core prompt-chunk attention (runtime/cuda/attention_chunk.cu) against a float64 causal
attention over the same cache (the contract of runtime/ops/attention.py without `select`) and against the
CUDA-core chunk kernel it replaces (the executor's prefill through it: tests/test_cuda_executor.py, the
engines' band against NumPy). Skipped, visibly, without CuPy or a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from test_cuda_kernels import cp                          # skips, visibly, without CuPy or a GPU

from bloomery.runtime.cuda import attention_chunk as AC  # noqa: E402
from test_cuda_attention_decode import reference, to16   # noqa: E402

pytestmark = pytest.mark.gpu

BAND = 1e-4              # relative L2 of a (row, head) output against float64 (measured 1e-5 to 1.7e-5: docs/kernels.md)


def case(H, KV, D, cache, seed, rows=101, start=37):
    """A chunk of `rows` rows of slot 1 at positions start.. (its keys 0..pos in the cache: an earlier
    chunk's and its own), then a row of another slot and an idle row (both in the block of the chunk's
    last rows: a CTA takes the slot of its first active row)."""
    rng = np.random.default_rng(seed)
    slots, ctx = 3, start + rows + 16
    vals = []
    for code in cache:
        x = rng.standard_normal((slots, ctx, KV, D)).astype(np.float32)
        vals.append((x, x.astype(np.float64)) if code == 0 else to16(x, code))
    pos = np.concatenate([np.arange(start, start + rows), [5, -1]]).astype(np.int32)
    slot = np.concatenate([np.full(rows, 1), [2, 1]]).astype(np.int32)
    q = (rng.standard_normal((len(pos), H * D)) * 0.4).astype(np.float32)
    return vals, pos, slot, q


@pytest.mark.parametrize("H,KV,D", [(32, 8, 128), (9, 3, 64), (4, 4, 80), (16, 2, 128), (12, 1, 64), (8, 8, 16)],
                         ids=["llama8b", "smollm2", "mha-d80", "g8", "g12", "d16"])
@pytest.mark.parametrize("cache", [(0, 0), (1, 1), (2, 2), (1, 0)], ids=["f32", "bf16", "f16", "bf16-f32"])
@pytest.mark.parametrize("bn,pf", [(32, 1), (32, 0), (64, 0)], ids=["bn32-pf", "bn32", "bn64"])
def test_attention_chunk_matches_float64(H, KV, D, cache, bn, pf):
    vals, pos, slot, q = case(H, KV, D, cache, H * 1000 + KV * 10 + D + bn + pf)
    (kw, kref), (vw, vref) = vals
    rows = len(pos)
    scale = 1.0 / np.sqrt(D)
    d = {k: cp.asarray(v) for k, v in dict(q=q, ck=kw, cv=vw, pos=pos, slot=slot).items()}
    out = cp.full((rows, H * D), 7.0, cp.float32)
    step = AC.bind(d["q"], d["ck"], d["cv"], d["pos"], d["slot"], out, rows, H, KV, D, scale, cache=cache,
                   bn=bn, pf=pf)
    step()
    got = cp.asnumpy(out)
    ref = reference(q[:-2], kref, vref, pos[:-2], slot[:-2], H, KV, D, scale)
    assert (got[-1] == 0).all(), "an idle row must give zeros"
    assert np.isnan(got[-2]).all(), "a row of another slot must give NaN, never that slot's keys"
    g, r = got[:-2].reshape(rows - 2, H, D), ref.reshape(rows - 2, H, D)
    err = np.linalg.norm(g - r, axis=-1) / np.linalg.norm(r, axis=-1)
    assert err.max() <= BAND, (float(err.max()), np.unravel_index(err.argmax(), err.shape))
    step()
    assert np.array_equal(cp.asnumpy(out), got, equal_nan=True), "two launches differ"

    # the CUDA-core chunk kernel on the same inputs: the same zeros and NaN, values within the band
    fo = cp.full((rows, H * D), 7.0, cp.float32)
    AC.bind_fma(d["q"], d["ck"], d["cv"], d["pos"], d["slot"], fo, rows, H, KV, D, scale, cache=cache)()
    f = cp.asnumpy(fo)
    assert np.array_equal(np.isnan(f), np.isnan(got)) and (f[-1] == 0).all()
    fe = np.linalg.norm(f[:-2].reshape(rows - 2, H, D) - g, axis=-1) / np.linalg.norm(r, axis=-1)
    assert fe.max() <= 2 * BAND


def test_attention_chunk_refuses_what_it_does_not_take():
    assert AC.supports(16, 2, 256) is not None and AC.supports(130, 2, 64) is not None
    assert AC.supports(32, 8, 128) is None
    with pytest.raises(ValueError, match="head_dim 256"):
        z = cp.zeros(1, cp.float32)
        AC.bind(z, cp.zeros((1, 4, 2, 256), cp.float32), z, z, z, z, 1, 16, 2, 256, 1.0)
