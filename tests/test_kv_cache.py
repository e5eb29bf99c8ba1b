"""The KV cache in the type the user picks (runtime/kv_cache.py, --cache-type-k / --cache-type-v):
each type's rounding against an independent reference (numpy, ml_dtypes, gguf-py), attention over
a typed cache equal to attention over the rounded values, the bytes it holds, and the refusals."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from bloomery.runtime import kv_cache as KV
from bloomery.runtime.engine import Engine
from bloomery.runtime.ops import attention

from runtime_artifacts import artifact


def _rounded(kind, x, scale=None):
    """The reference rounding of each type, from libraries bloomery does not own."""
    if kind == "f16":
        return x.astype(np.float16).astype(np.float32)
    if kind == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if kind == "q8_0":
        flat = x.reshape(-1, x.shape[-1])
        return quants.dequantize(quants.quantize(flat, GGMLQuantizationType.Q8_0),
                                 GGMLQuantizationType.Q8_0).reshape(x.shape)
    if kind == "fp8":
        return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale)
    return x


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0", "fp8"])
def test_store_rounds_as_the_reference(kind):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 5, 3, 64)) * rng.choice([0.01, 1, 30], (2, 5, 3, 1))).astype(np.float32)
    x[0, 0, 0, :5] = [0, -0.0, 1e-9, 500, -700]            # zeros, a tiny value, values past fp8's range
    scale = 0.7 if kind == "fp8" else None
    st = KV.KvStore(kind, (2, 5, 3, 64), scale)
    slots, pos, rows = np.array([0, 1, 1]), np.array([4, 0, 2]), x[[0, 1, 1], [0, 1, 2]]     # [3, 3, 64]
    st[slots, pos] = rows                                   # the attention op's write
    assert np.array_equal(st[slots, pos], _rounded(kind, rows, scale))
    assert np.array_equal(st[1, :3][[0, 2]], _rounded(kind, rows[1:], scale))      # its read of [slot, :L]
    assert not st[0, :4].any() and not st[1, 1].any()       # rows never written read as zeros
    st[1] = 0                                               # a slot's reset
    assert not st[1].any() and st[0, 4].any()
    assert st.nbytes == int(2 * 5 * 3 * 64 * KV.BYTES_PER_VALUE[kind])


def test_attention_over_a_typed_cache_is_attention_over_rounded_values():
    """The attention op with a bf16 / q8_0 cache gives exactly what it gives over an f32 cache fed
    the rounded k and v: the op itself is unchanged, only what the cache holds."""
    rng = np.random.default_rng(1)
    H, KVh, D, n, ctx = 4, 2, 32, 6, 16
    op = {"q": "q", "k": "k", "v": "v", "pos": "pos", "slot": "slot", "cache_k": "ck", "cache_v": "cv", "out": "o",
          "heads": H, "kv_heads": KVh, "head_dim": D, "scale": 1 / np.sqrt(D), "mode": "prefill"}
    q = rng.standard_normal((n, H * D)).astype(np.float32)
    k = rng.standard_normal((n, KVh * D)).astype(np.float32)
    v = rng.standard_normal((n, KVh * D)).astype(np.float32)
    pos, slot = np.arange(n, dtype=np.int32), np.zeros(n, np.int32)
    for kind in ("bf16", "q8_0"):
        typed = {"q": q, "k": k, "v": v, "pos": pos, "slot": slot, "o": np.zeros((n, H * D), np.float32),
                 "ck": KV.KvStore(kind, (1, ctx, KVh, D)), "cv": KV.KvStore(kind, (1, ctx, KVh, D))}
        plain = {**typed, "o": np.zeros((n, H * D), np.float32),
                 "k": _rounded(kind, k.reshape(n, KVh, D)).reshape(n, -1),
                 "v": _rounded(kind, v.reshape(n, KVh, D)).reshape(n, -1),
                 "ck": np.zeros((1, ctx, KVh, D), np.float32), "cv": np.zeros((1, ctx, KVh, D), np.float32)}
        attention.run(op, typed, None)
        attention.run(op, plain, None)
        assert np.array_equal(typed["o"], plain["o"]), kind


@pytest.mark.models
def test_engine_cache_types_bytes_and_fidelity():
    """tiny-llama/nvfp4_fp8kv (ModelOpt's FP8 KV cache, its k_scale / v_scale in the artifact): each type
    holds the KV bytes it should, moves the logits a little (never not at all), and fp8 reads the
    checkpoint's own scales; an artifact without them refuses fp8 by name."""
    art = artifact("tiny-llama/nvfp4_fp8kv")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 512, 120)]
    ref = Engine(art, ctx=128)
    x32, b32 = ref.prefill(ids), ref.memory()["state"]
    for kind in ("f16", "bf16", "q8_0", "fp8"):
        eng = Engine(art, ctx=128, cache_type_k=kind, cache_type_v=kind)
        x = eng.prefill(ids)
        assert eng.memory()["state"] == int(b32 * KV.BYTES_PER_VALUE[kind] / 4)
        d = np.abs(x - x32).max() / np.abs(x32).max()
        assert 0 < d < 0.05, (kind, d)
    eng = Engine(art, ctx=128, cache_type_k="fp8", cache_type_v="f32")
    store = eng.exec.state[0]["kv.0.k"]
    assert store.kind == "fp8" and store.scale == np.float32(eng.weights[0]["blk.0.attn_k_scale"].reshape(-1)[0])
    assert isinstance(eng.exec.state[0]["kv.0.v"], np.ndarray)
    with pytest.raises(KV.CacheTypeRefused, match="k_scale / v_scale"):
        Engine(artifact("tiny-llama/nvfp4"), ctx=16, cache_type_k="fp8")


@pytest.mark.models
def test_run_cache_type_flags():
    art = str(artifact("tiny-qwen3_next/nvfp4"))
    cmd = [sys.executable, "-m", "bloomery.cli", "run", art, "-p", "Hi", "-n", "8", "--json", "--draft", "off"]
    a = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    b = json.loads(subprocess.run(cmd + ["-ctk", "q8_0", "-ctv", "bf16"], capture_output=True, text=True,
                                  check=True).stdout)
    assert len(a["token_ids"]) == len(b["token_ids"]) == 8
    r = subprocess.run(cmd + ["--cache-type-k", "fp8"], capture_output=True, text=True)
    assert r.returncode != 0 and "CacheTypeRefused" in r.stderr and art in r.stderr, r.stderr
    import os
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "BLOOMERY_CACHE_TYPE_V": "fp8"})
    assert r.returncode != 0 and "v_scale" in r.stderr, r.stderr       # the lever's variable is the default


@pytest.mark.models
@pytest.mark.parametrize("name,kind", [("tiny-qwen3_next/nvfp4", "q8_0"), ("tiny-llama/nvfp4_fp8kv", "fp8"),
                                       ("tiny-glm4_moe-mtp/nvfp4", "bf16")])
def test_drafts_stay_lossless_over_a_typed_cache(name, kind):
    """A verify row writes and reads the typed cache as a decode step does: 96 greedy tokens with the
    n-gram draft (and the MTP draft, whose layer's cache is typed too) equal plain decoding's."""
    from bloomery.runtime import generate
    from bloomery.runtime.draft import NgramDraft
    eng = Engine(artifact(name), ctx=256, cache_type_k=kind, cache_type_v=kind)
    ids = [1] + list(range(40, 72)) * 2
    plain = generate(eng, ids=ids, max_tokens=96, ignore_eos=True)
    spec = generate(eng, ids=ids, max_tokens=96, ignore_eos=True, draft=NgramDraft(min_n=1))
    assert spec.token_ids == plain.token_ids and spec.extra["verify_steps"] > 0
    if "mtp" in name:
        assert isinstance(eng.exec.state[0]["kv.3.k"], KV.KvStore)          # the NextN layer's own cache
        assert generate(eng, ids=ids, max_tokens=96, ignore_eos=True, draft="mtp").token_ids == plain.token_ids
