"""Speculative decoding on the NumPy executor: the verify program computes each row as a one-row
decode step does (bit for bit), a rejected draft leaves no trace (KV rows past the kept length,
recurrent states back to the last kept row), and greedy output with a draft is plain greedy
output, for every gated model and format (tools/gates.py GATED)."""

import numpy as np
import pytest

from bloomery.core import plan as P
from bloomery.runtime import generate
from bloomery.runtime.draft import NgramDraft
from bloomery.runtime.engine import Engine
from bloomery.tools.gates import GATED

from runtime_artifacts import artifact

# a prompt that repeats itself, so that the n-gram draft finds matches from the first steps
PROMPT = [1] + list(range(40, 72)) * 2 + list(range(40, 50))
STATEFUL = ("tiny-qwen3_next/nvfp4", "tiny-qwen3_next/bf16", "tiny-qwen4_exp/nvfp4", "tiny-qwen4_exp/mixed_nvfp4_mxfp8",
            "tiny-glm5_next/nvfp4", "tiny-glm5_next/bf16")


@pytest.mark.models
@pytest.mark.parametrize("name", GATED)
def test_ngram_draft_is_lossless(name):
    """256 greedy tokens (EOS masked, so that all 256 are decoded) with the n-gram draft equal
    the tokens without a draft, and the draft was used (down to 1-grams: a random tiny model may
    repeat no pair of tokens in 256)."""
    draft_is_lossless(Engine(artifact(name), ctx=512), name, NgramDraft(max_n=4, min_n=1))


def draft_is_lossless(eng, name: str, draft, steps: int = 256) -> dict:
    """`steps` greedy tokens of PROMPT (EOS masked) with `draft` equal plain decoding's on `eng`, and
    the draft was used (tests/test_cuda_speculative.py runs it on the GPU). Returns the draft's stats."""
    plain = generate(eng, ids=PROMPT, max_tokens=steps, ignore_eos=True)
    spec = generate(eng, ids=PROMPT, max_tokens=steps, ignore_eos=True, draft=draft)
    assert len(plain.token_ids) == steps
    first = next((i for i, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids)) if a != b), None)
    assert spec.token_ids == plain.token_ids, f"{name}: tokens differ from plain decoding at index {first}"
    assert spec.extra["verify_steps"] > 0 and spec.extra["drafted"] > 0, spec.extra
    return spec.extra


class Planted:
    """A draft that proposes the reference continuation with a wrong token planted at a random
    place (or none), k random: every acceptance length, every rollback, is exercised."""

    def __init__(self, ref: list[int], vocab: int, seed: int = 0):
        self.ref, self.vocab, self.rng, self.seq = ref, vocab, np.random.default_rng(seed), []

    def extend(self, ids):
        self.seq.extend(ids)

    def propose(self, k):
        n = len(self.seq) - len(PROMPT)               # tokens fed after the prompt, the one to feed now included
        d = list(self.ref[n:n + int(self.rng.integers(1, k + 1))]) if k > 0 else []
        if d and self.rng.random() < 0.6:
            i = int(self.rng.integers(0, len(d)))
            d[i] = (d[i] + 1 + int(self.rng.integers(0, self.vocab - 1))) % self.vocab
        return d


def verify_rows_equal_decode_steps(eng, name: str, steps: int = 64) -> dict:
    """Verify passes of planted drafts on `eng`: the logits of every row up to the first rejected one
    equal the plain decode step's logits at that position bit for bit, and the tokens are plain
    decoding's. Returns the pass counts and the most rows compared in one pass (tests/test_cuda_speculative.py runs it on the GPU)."""
    row = eng.prefill(PROMPT, last_only=True)
    ref, logits = [int(np.argmax(row))], []
    for _ in range(steps):
        lg, nx = eng.decode([ref[-1]])
        logits.append(lg[0])
        ref.append(int(nx[0]))
    eng.reset(0)
    eng.prefill(PROMPT)
    draft = Planted(ref, eng.vocab_size, seed=len(name))
    draft.extend(PROMPT)
    n, passes, rejected, longest = 0, 0, 0, 0        # ref[n] is the next token to feed
    while n < steps:
        draft.extend([ref[n]])
        d = draft.propose(min(eng.draft_max, steps - n - 1))
        lg, nx = eng.verify([ref[n], *d])
        a = 0
        while a < len(d) and int(nx[a]) == d[a]:
            a += 1
        for i in range(a + 1):
            assert np.array_equal(lg[i], logits[n + i]), f"{name}: verify row {i} at token {n + i}"
            assert int(nx[i]) == ref[n + i + 1]
        kept = getattr(eng.exec, "verified_keep", None)      # the CUDA executor decides it on the device
        assert kept is None or kept == a + 1, f"{name}: the device kept {kept} rows, the greedy rule {a + 1}"
        eng.accept(a + 1)
        draft.extend(d[:a])
        passes += 1
        rejected += a < len(d)
        longest = max(longest, a + 1)
        n += a + 1
    assert passes < steps and rejected > 5, (passes, rejected)
    return {"passes": passes, "rejected": rejected, "longest": longest}


@pytest.mark.models
@pytest.mark.parametrize("name", ("tiny-llama/nvfp4", "tiny-qwen3_moe/fp8", "tiny-glm4_moe/nvfp4") + STATEFUL)
def test_verify_rows_equal_decode_steps(name):
    """Every kept verify row equals the one-row decode step, bit for bit (verify_rows_equal_decode_steps)."""
    verify_rows_equal_decode_steps(Engine(artifact(name), ctx=256), name)


def test_ngram_draft_proposes_the_latest_longest_match():
    d = NgramDraft(max_n=3, min_n=1)
    d.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert d.propose(2) == [9, 2]            # "6 7" last seen before the end at index 5: followed by 9, 2
    d.extend([9])
    assert d.propose(4) == [2, 6, 7, 9]      # the 3-gram "6 7 9"
    d = NgramDraft(max_n=4, min_n=2)
    d.extend([1, 2, 3, 4])
    assert d.propose(3) == []                # no repeated n-gram of 2 or more
    d.extend([2, 3])
    assert d.propose(3) == [4, 2, 3]
    assert d.propose(0) == []


@pytest.mark.models
def test_verify_refusals():
    eng = Engine(artifact("tiny-llama/nvfp4"), ctx=64, draft_max=2)
    eng.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="1 to 3 tokens"):
        eng.verify([4, 5, 6, 7])
    eng.verify([4, 5])
    with pytest.raises(ValueError, match="accept"):
        eng.accept(3)
    eng.accept(2)
    assert eng.lengths[0] == 5
    with pytest.raises(ValueError, match="accept"):
        eng.accept(1)                        # only once per verify pass


@pytest.mark.models
def test_plan_holds_verify_with_state_history():
    """The verify program is the decode op list with mode verify and a history on each state op."""
    from bloomery.core.artifact import Artifact
    from bloomery.runtime.engine import read_plans
    plan = read_plans(Artifact.open(artifact("tiny-qwen3_next/nvfp4")))[0]
    dec, ver = plan["programs"]["decode"]["ops"], plan["programs"]["verify"]["ops"]
    assert plan["programs"]["verify"]["rows"] == "verify" and len(dec) == len(ver)
    hist = 0
    for a, b in zip(dec, ver):
        extra = {k: v for k, v in b.items() if a.get(k) != v}
        if "history" in b:
            hist += 1
            st = plan["buffers"][b["state"]]
            assert plan["buffers"][b["history"]]["shape"] == ["rows", *st["shape"][1:]]
            extra.pop("history")
        assert extra in ({}, {"mode": "verify"}), extra
    assert hist == 2 * 3                     # conv window and delta-rule state of 3 delta-net layers
    assert P.buffers_used(plan, "decode").isdisjoint({b["history"] for b in ver if "history" in b})


MTP = ("tiny-glm4_moe-mtp/bf16", "tiny-glm4_moe-mtp/nvfp4", "tiny-qwen3_next-mtp/bf16", "tiny-qwen3_next-mtp/nvfp4")


@pytest.mark.models
@pytest.mark.parametrize("name", MTP)
def test_mtp_program_matches_the_oracle(name):
    """The plan's mtp program, teacher-forced (row i: the main model's final-norm hidden of ids[i],
    the embedding of ids[i+1]), against transformers' MtpModel over the same values in float32
    (tools/oracle.py mtp_logits): the same argmax at every row, relative L2 within 1e-5."""
    from bloomery.tools import models, oracle
    art = artifact(name)
    eng = Engine(art, ctx=128, ubatch=16)                # chunks of 16: the MTP cache across chunks
    ids = [int(i) for i in np.random.default_rng(3).integers(0, eng.vocab_size, 40)]
    hid = []
    eng.prefill(ids, on_chunk=lambda c, n: hid.append(eng.hidden("prefill", n)))
    H = np.concatenate(hid)
    ours = np.concatenate([eng.mtp(ids[1 + c:1 + c + m], np.arange(c, c + m), H[c:c + m])[0]
                           for c, m in ((c, min(16, 39 - c)) for c in range(0, 39, 16))])
    ref = oracle.artifact_oracle(models.model_dir(name), art).mtp_logits(ids)
    assert ours.shape == ref.shape == (39, eng.vocab_size)
    rel = np.linalg.norm(ours - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel.max() <= 1e-5, f"{name}: relative L2 {rel.max():.2e} at row {int(rel.argmax())}"
    assert np.array_equal(ours.argmax(1), ref.argmax(1))


@pytest.mark.models
@pytest.mark.parametrize("name", MTP)
def test_mtp_draft_is_lossless(name):
    """256 greedy tokens with the MTP draft (random-weight layers: its acceptance is noise) equal
    plain decoding's; every step after the prompt is a verify pass of drafted tokens."""
    eng = Engine(artifact(name), ctx=512)
    x = draft_is_lossless(eng, name, "mtp")
    assert x["verify_steps"] >= 256 // (eng.draft_max + 1), x


@pytest.mark.models
def test_run_draft_mtp_cli(tmp_path):
    """run --draft mtp gives the text of --draft off; asked of an artifact with no MTP layer it is
    refused by name."""
    import json
    import subprocess
    import sys
    art = str(artifact("tiny-qwen3_next-mtp/nvfp4"))
    cmd = [sys.executable, "-m", "bloomery.cli", "run", art, "-p", "Hello there", "-n", "24", "--ignore-eos", "--json"]
    out = [json.loads(subprocess.run(cmd + ["--draft", d], capture_output=True, text=True, check=True).stdout)
           for d in ("off", "mtp")]
    assert out[0]["token_ids"] == out[1]["token_ids"] and out[1]["verify_steps"] > 0
    r = subprocess.run([sys.executable, "-m", "bloomery.cli", "run", str(artifact("tiny-llama/nvfp4")), "-p", "Hi",
                        "--draft", "mtp"], capture_output=True, text=True)
    assert r.returncode != 0 and "NoDraft" in r.stderr and "no MTP / NextN layer" in r.stderr, r.stderr


@pytest.mark.models
@pytest.mark.parametrize("name", ["tiny-qwen3_next/nvfp4", "tiny-glm5_next/nvfp4", "smollm2-135m/nvfp4"])
def test_drafts_are_lossless_at_tp2(name):
    """The verify program of every rank in lockstep (the collectives on one-row views): 96 greedy
    tokens at tp 2 with the n-gram draft equal plain decoding's at tp 2."""
    eng = Engine(artifact(name, tp=2), ctx=256)
    plain = generate(eng, ids=PROMPT, max_tokens=96, ignore_eos=True)
    spec = generate(eng, ids=PROMPT, max_tokens=96, ignore_eos=True, draft=NgramDraft(max_n=4, min_n=1))
    assert spec.token_ids == plain.token_ids and spec.extra["verify_steps"] > 0
