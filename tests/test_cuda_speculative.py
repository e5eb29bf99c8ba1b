"""Speculative decoding on the CUDA executor (the verify program's graphs, runtime/cuda/executor.py
_bind_verify, runtime/cuda/verify_keep.py): each verify row equals the one-row decode step bit for
bit, the kept count the device decides is the greedy rule's, a caller that keeps fewer rows gets
the states of its last kept row, and greedy output with the n-gram draft is plain greedy output for
every gated model and format. Skips, visibly, without CuPy or a CUDA GPU."""

from __future__ import annotations

import numpy as np
import pytest

from bloomery.runtime import device as devices
from bloomery.runtime.draft import NgramDraft, choose
from bloomery.runtime.engine import Engine
from bloomery.tools.gates import GATED

from runtime_artifacts import artifact
from test_speculative import MTP, PROMPT, STATEFUL, draft_is_lossless, verify_rows_equal_decode_steps

WHY = devices.cuda_unavailable()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"CUDA speculative-decoding tests need CuPy and a GPU: {WHY}"),
              pytest.mark.gpu, pytest.mark.models]

ROWS = ("tiny-llama/nvfp4", "tiny-llama/bf16", "tiny-llama/fp8", "tiny-llama/mxfp8", "tiny-llama/nvfp4_awq",
        "tiny-qwen3_moe/nvfp4", "tiny-qwen3_moe/fp8", "tiny-glm4_moe/nvfp4", "tiny-glm4_moe/mxfp8") + STATEFUL


@pytest.mark.parametrize("name", ROWS)
def test_cuda_verify_rows_equal_decode_steps(name):
    """Planted drafts (every acceptance length, every rollback): each kept verify row's logits are
    the CUDA decode step's bit for bit, and verified_keep is the greedy rule's count."""
    verify_rows_equal_decode_steps(Engine(artifact(name), device="cuda", ctx=256), name)


@pytest.mark.parametrize("name", ("tiny-llama/nvfp4", "tiny-llama/fp8", "tiny-qwen3_next/nvfp4"))
def test_cuda_verify_rows_past_eight_equal_decode_steps(name):
    """--draft-max 12: the verify program's 13 rows run in launches of up to 8 rows (the GEMV's most);
    each row still the 1-row decode step's bit for bit, through the grouped and norm-folded linears."""
    got = verify_rows_equal_decode_steps(Engine(artifact(name), device="cuda", ctx=384, draft_max=12), name, steps=128)
    assert got["longest"] > 8, f"{name}: no pass compared a row past the eighth: {got}"


@pytest.mark.parametrize("name", GATED)
def test_cuda_ngram_draft_is_lossless(name):
    """256 greedy tokens (EOS masked) with the n-gram draft on the GPU equal the GPU's plain tokens."""
    draft_is_lossless(Engine(artifact(name), device="cuda", ctx=512), name, NgramDraft(max_n=4, min_n=1))


@pytest.mark.parametrize("name", ("tiny-llama/nvfp4", "tiny-qwen3_next/nvfp4"))
def test_cuda_drafts_over_a_typed_cache(name):
    """The verify graphs over an f16 / bf16 KV cache: the n-gram draft still lossless."""
    draft_is_lossless(Engine(artifact(name), device="cuda", ctx=512, cache_type_k="f16", cache_type_v="bf16"), name,
                      NgramDraft(max_n=4, min_n=1))


@pytest.mark.parametrize("name", ("tiny-qwen3_next/nvfp4", "tiny-glm5_next/bf16", "tiny-qwen4_exp/nvfp4"))
def test_cuda_keep_fewer_than_the_device_decided(name):
    """A caller that keeps fewer rows than the device's greedy count (a pick of masked logits) gets
    the states of its last kept row: decoding on from there equals decoding with no verify pass."""
    eng = Engine(artifact(name), device="cuda", ctx=256)
    row = eng.prefill(PROMPT, last_only=True)
    ref = [int(np.argmax(row))]
    for _ in range(6):
        _, nx = eng.decode([ref[-1]])
        ref.append(int(nx[0]))
    want, after = eng.decode([ref[-1]])
    eng.reset(0)
    eng.prefill(PROMPT)
    eng.verify(ref[:4])                                  # the true continuation: the device keeps all 4
    assert eng.exec.verified_keep == 4
    eng.accept(2)                                        # the caller keeps 2
    for t in ref[2:]:
        lg, nx = eng.decode([t])
    assert int(nx[0]) == int(after[0])
    assert np.array_equal(lg, want), f"{name}: decoding after accept(2) of a 4-row pass differs"


@pytest.mark.parametrize("name", MTP)
def test_cuda_mtp_program_matches_numpy(name):
    """The mtp program's graphs (a prompt chunk of 16 rows, then the rows left) against the NumPy
    executor on the same hidden rows: relative L2 within the executors' 1e-3 band, the same argmax
    wherever the top two logits are apart."""
    art = artifact(name)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 1000, 40)]
    out = []
    for dev in ("cpu", "cuda"):
        eng = Engine(art, device=dev, ctx=128, ubatch=16)
        ids = [i % eng.vocab_size for i in ids]
        hid = []
        eng.prefill(ids, on_chunk=lambda c, n: hid.append(eng.hidden("prefill", n)))
        H = np.concatenate(hid)
        out.append(np.concatenate([eng.mtp(ids[1 + c:1 + c + m], np.arange(c, c + m), H[c:c + m])[0]
                                   for c, m in ((c, min(16, 39 - c)) for c in range(0, 39, 16))]))
    ref, got = out
    rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel.max() <= 1e-3, f"{name}: relative L2 {rel.max():.2e} at row {int(rel.argmax())}"
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3 * np.abs(top2[:, 1])
    assert np.array_equal(got.argmax(1)[clear], ref.argmax(1)[clear])


@pytest.mark.parametrize("name", MTP)
def test_cuda_mtp_draft_is_lossless(name):
    """256 greedy tokens on the GPU with the MTP draft (random-weight layers: its acceptance is noise)
    equal the GPU's plain tokens."""
    eng = Engine(artifact(name), device="cuda", ctx=512)
    x = draft_is_lossless(eng, name, "mtp")
    assert x["verify_steps"] >= 256 // (eng.draft_max + 1), x


def test_cuda_draft_auto():
    """--draft auto on the GPU: the n-gram draft (measured faster, docs/PERF.md), off when sampling."""
    eng = Engine(artifact("tiny-llama/nvfp4"), device="cuda", ctx=128)
    assert eng.draft_max > 0
    assert choose(eng, "auto", 0.0)[0] == "ngram"
    assert choose(eng, "auto", 0.7)[0] == "off"
