"""GPU: the split-context decode attention (runtime/cuda/attention_decode.cu) against a float64
softmax attention over the same cache (the contract of runtime/ops/attention.py without `select`),
and through the executor against the per-row kernel it replaces. Skipped, visibly, without CuPy or a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from test_cuda_kernels import cp                          # skips, visibly, without CuPy or a GPU

from bloomery.runtime.cuda import attention_decode as AD  # noqa: E402

pytestmark = pytest.mark.gpu


def reference(q, ck, cv, pos, slot, H, KV, D, scale):
    G = H // KV
    out = np.zeros((len(pos), H * D))
    for r, p in enumerate(pos):
        if p < 0:
            continue
        n = min(p, ck.shape[1] - 1) + 1
        for h in range(H):
            K = ck[slot[r], :n, h // G].astype(np.float64)
            V = cv[slot[r], :n, h // G].astype(np.float64)
            s = K @ q[r, h * D:(h + 1) * D].astype(np.float64) * scale
            e = np.exp(s - s.max())
            out[r, h * D:(h + 1) * D] = (e / e.sum()) @ V
    return out


@pytest.mark.parametrize("H,KV,D", [(32, 8, 128), (16, 2, 256), (12, 1, 64), (4, 4, 80), (16, 16, 64)],
                         ids=["llama8b", "qwen3next", "g12", "mha-d80", "mha16"])
@pytest.mark.parametrize("sms", [132, 1], ids=["split", "one-split"])
def test_attention_decode_matches_float64(H, KV, D, sms):
    rng = np.random.default_rng(H * 1000 + KV * 10 + D + sms)
    slots, ctx = 5, 700
    ck = rng.standard_normal((slots, ctx, KV, D)).astype(np.float32)
    cv = rng.standard_normal((slots, ctx, KV, D)).astype(np.float32)
    pos = np.array([0, 699, -1, 31, 33, 450], np.int32)          # one key, the whole cache, idle, tile edges
    slot = np.array([0, 1, 2, 3, 4, 0], np.int32)
    rows = len(pos)
    q = (rng.standard_normal((rows, H * D)) * 0.3).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    pool = {}

    def take(key, shape, dtype=np.float32):
        return pool.setdefault((key, shape), cp.zeros(shape, dtype))
    d = {k: cp.asarray(v) for k, v in dict(q=q, ck=ck, cv=cv, pos=pos, slot=slot).items()}
    out = cp.full((rows, H * D), cp.nan, cp.float32)
    step = AD.bind(d["q"], d["ck"], d["cv"], d["pos"], d["slot"], out, rows, H, KV, D, scale, take, sms=sms)
    assert (AD.splits(KV, rows, ctx, sms) > 1) == (sms > 1)
    step()
    got = cp.asnumpy(out)
    ref = reference(q, ck, cv, pos, slot, H, KV, D, scale)
    assert (got[2] == 0).all(), "an idle row must give zeros"
    for r in range(rows):
        err = np.linalg.norm(got[r] - ref[r]) / max(np.linalg.norm(ref[r]), 1e-30)
        assert err <= 1e-5, (r, err)
    step()
    assert (cp.asnumpy(out) == got).all(), "two launches differ: the merge is not deterministic"
    assert not any(cp.asnumpy(v).any() for (k, _), v in pool.items() if k.endswith(".sem")), "counters not left at 0"
    # the launch variants (8 warps a CTA, the P.V loop unrolled): the same FMAs in the same order, so the same bits
    # and with the next linear's weights prefetched into the L2 (here: some 1.6 MB array)
    for warps, pvu, pf in ((4, 8, None), (8, 0, None), (8, 8, None), (4, 0, d["ck"])):
        other = cp.full((rows, H * D), cp.nan, cp.float32)
        AD.bind(d["q"], d["ck"], d["cv"], d["pos"], d["slot"], other, rows, H, KV, D, scale, take, sms=sms,
                warps=warps, pv_unroll=pvu, prefetch=pf)()
        assert (cp.asnumpy(other) == got).all(), f"{warps} warps, P.V unrolled by {pvu}: not the 4-warp kernel's bits"


def to16(x, code):
    """float32 -> the 16-bit cache's words (1 bf16, 2 f16; round to nearest even) and their exact values."""
    if code == 2:
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return u, (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("H,KV,D", [(32, 8, 128), (9, 3, 64), (4, 4, 80), (16, 2, 128), (8, 1, 16)],
                         ids=["llama8b", "smollm2", "mha-d80", "g8", "d16"])
@pytest.mark.parametrize("cache", [(1, 1), (2, 2), (1, 2)], ids=["bf16", "f16", "bf16-f16"])
@pytest.mark.parametrize("sms", [1056, 132, 1], ids=["split", "rule", "one-split"])
def test_attention_decode_tensor_cores_match_float64(H, KV, D, cache, sms):
    """The tensor-core form on 16-bit caches: float64 attention over the cache's exact values, within the
    FMA form's band; a query past f16's range and a tiny one (the f16 path's scaling); a split's last
    chunk cut anywhere (positions 0, 15, 16, 17, 63, 64, 699)."""
    assert AD.tc_supports(H, KV, D, cache) is None
    rng = np.random.default_rng(H * 1000 + KV * 10 + D + sms + 7 * cache[0] + cache[1])
    slots, ctx = 6, 700
    kw, kx = to16(rng.standard_normal((slots, ctx, KV, D)).astype(np.float32), cache[0])
    vw, vx = to16(rng.standard_normal((slots, ctx, KV, D)).astype(np.float32), cache[1])
    pos = np.array([0, 699, -1, 15, 16, 17, 63, 64, 450], np.int32)
    slot = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2], np.int32)
    rows = len(pos)
    q = (rng.standard_normal((rows, H * D)) * 0.3).astype(np.float32)
    q[4] *= 3e5                                           # |q| past f16's 65504
    q[5] *= 1e-6
    scale = 1.0 / np.sqrt(D)
    pool = {}

    def take(key, shape, dtype=np.float32):
        return pool.setdefault((key, shape), cp.zeros(shape, dtype))
    d = {k: cp.asarray(v) for k, v in dict(q=q, ck=kw, cv=vw, pos=pos, slot=slot).items()}
    out = cp.full((rows, H * D), cp.nan, cp.float32)
    step = AD.bind(d["q"], d["ck"], d["cv"], d["pos"], d["slot"], out, rows, H, KV, D, scale, take, sms=sms,
                   cache=cache, tc=True)
    step()
    got = cp.asnumpy(out)
    ref = reference(q.astype(np.float64), kx, vx, pos, slot, H, KV, D, scale)
    assert (got[2] == 0).all(), "an idle row must give zeros"
    for r in range(rows):
        err = np.linalg.norm(got[r] - ref[r]) / max(np.linalg.norm(ref[r]), 1e-30)
        assert err <= 1e-5, (r, int(pos[r]), err)
    step()
    assert (cp.asnumpy(out) == got).all(), "two launches differ: the merge is not deterministic"
    assert not any(cp.asnumpy(v).any() for (k, _), v in pool.items() if k.endswith(".sem")), "counters not left at 0"
    other = cp.full(out.shape, cp.nan, cp.float32)      # the next linear's weights prefetched meanwhile: the same bits
    AD.bind(d["q"], d["ck"], d["cv"], d["pos"], d["slot"], other, rows, H, KV, D, scale, take, sms=sms,
            cache=cache, tc=True, prefetch=d["cv"])()
    assert (cp.asnumpy(other) == got).all(), "the prefetching launch changed the values"
    S = AD.splits(KV, rows, ctx, sms, tc=True)       # split: several; one-split: one; rule: <= one CTA a multiprocessor
    assert S > 1 if sms == 1056 else S == 1 if sms == 1 else KV * rows * S <= max(sms, KV * rows)


def test_attention_decode_tensor_core_refusals():
    assert AD.tc_supports(32, 8, 128, (0, 0)) is not None            # float32 cache
    assert AD.tc_supports(96, 8, 128, (1, 1)) is not None            # 12 query heads a kv head
    assert AD.tc_supports(16, 2, 256, (1, 1)) is not None            # head_dim 256
    assert AD.tc_supports(4, 4, 72, (2, 2)) is not None              # head_dim not a multiple of 16
    with pytest.raises(ValueError, match="tensor cores"):
        AD.bind(None, cp.zeros((1, 8, 1, 64), cp.float32), None, None, None, None, 1, 4, 1, 64, 1.0, None, tc=True)



@pytest.mark.parametrize("cache,tc", [((0, 0), False), ((1, 1), True)], ids=["f32-fma", "bf16-tc"])
def test_attention_decode_many_splits(cache, tc):
    """Many splits of a long context: 16 query heads on one kv head at d 64 (f32: 264 splits, more (max, sum)
    pairs than the FMA kernel's shared memory holds, so its merge takes the one-pass form), d 16 on the
    tensor cores (the same); against float64, and the same bits twice."""
    H, KV, D = (16, 1, 64) if not tc else (8, 1, 16)
    rng = np.random.default_rng(99 + tc)
    ctx = 20000
    raw_k = rng.standard_normal((1, ctx, KV, D)).astype(np.float32)
    raw_v = rng.standard_normal((1, ctx, KV, D)).astype(np.float32)
    if tc:
        (kw, kx), (vw, vx) = to16(raw_k, 1), to16(raw_v, 1)
    else:
        kw, kx, vw, vx = raw_k, raw_k, raw_v, raw_v
    pos, slot = np.array([ctx - 1], np.int32), np.array([0], np.int32)
    q = (rng.standard_normal((1, H * D)) * 0.3).astype(np.float32)
    pool = {}

    def take(key, shape, dtype=np.float32):
        return pool.setdefault((key, shape), cp.zeros(shape, dtype))
    assert AD.splits(KV, 1, ctx, waves=2) == 264
    out = cp.full((1, H * D), cp.nan, cp.float32)
    step = AD.bind(cp.asarray(q), cp.asarray(kw), cp.asarray(vw), cp.asarray(pos), cp.asarray(slot), out, 1, H, KV, D,
                   1 / np.sqrt(D), take, cache=cache, tc=tc, waves=2)
    step()
    got = cp.asnumpy(out)
    ref = reference(q.astype(np.float64), kx, vx, pos, slot, H, KV, D, 1 / np.sqrt(D))
    err = np.linalg.norm(got[0] - ref[0]) / np.linalg.norm(ref[0])
    assert err <= 1e-5, err
    step()
    assert (cp.asnumpy(out) == got).all()
