"""The bands of specs/bands.yaml can fail on the regressions they name: every metric says what it
catches, mean bands sit below their max bands, and the lossy bf16 prompt mode (emulated here on
the CPU: prompt-chunk linears with activations rounded to BF16, as BLOOMERY_PREFILL_GEMM=bf16 does
on the GPU) fails the default cuda_vs_oracle gate that issue 5's bands alone let through."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from bloomery.tools import gates, models

def test_every_band_says_what_it_catches_and_means_sit_below_maxes():
    for kind in gates.load_bands().values():
        lim = kind.limits
        for metric, b in lim.items():
            assert b.get("catches"), f"{kind.kind}.{metric}: no 'catches' (which regression it is there for)"
        for mean, mx in (("kl_mean", "kl_max"), ("rel_l2_mean", "rel_l2_max")):
            if mean in lim and mx in lim:
                assert lim[mean]["max"] < lim[mx]["max"], f"{kind.kind}.{mean} can never trip before {mx}"


def test_cuda_oracle_band_holds_issue_5s_and_more():
    lim = gates.load_bands()["cuda_vs_oracle"].limits
    assert lim["argmax_agreement"]["min"] >= 0.995 and lim["kl_mean"]["max"] <= 1e-3
    assert {"kl_max", "rel_l2_mean", "rel_l2_max"} <= set(lim)


def _bf16_prompt_linears(monkeypatch):
    """The bf16 lever's arithmetic in the NumPy executor: a linear of more than 8 rows (a prompt
    chunk) takes its activations rounded to BF16; decode rows stay float32."""
    from bloomery.runtime.ops import IMPL

    orig = IMPL["linear"].run

    def run(op, buf, w):
        x = buf[op["x"]]
        if x.shape[0] <= 8:
            return orig(op, buf, w)
        pq = w.pre_quant.get(op["weight"])
        if pq is not None:
            x = x * pq
        xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        buf[op["out"]][...] = xb @ np.asarray(w[op["weight"]], np.float32).T
    monkeypatch.setattr(IMPL["linear"], "run", run)


@pytest.mark.models
def test_bf16_prompt_mode_fails_the_default_cuda_oracle_gate(monkeypatch):
    from bloomery.tools import gpu_gates
    from runtime_artifacts import artifact

    name = "tiny-qwen3_moe/nvfp4"
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    folder, art = models.model_dir(name), artifact(name)
    good = gpu_gates.oracle_gate(folder, art, device="cpu", limit=64)
    assert good["pass"], good
    _bf16_prompt_linears(monkeypatch)
    bad = gpu_gates.oracle_gate(folder, art, device="cpu", limit=64)
    assert not bad["pass"], bad
    # issue 5's KL band (mean <= 1e-3) let it through; argmax sits at the 0.995 edge here (2 to
    # 3 flips in 576 on a near-flat random model), so it is no reliable catch either
    assert bad["kl_mean"] < 1e-3, bad
    tripped = {f.split()[0] for f in bad["fails"]}
    assert {"kl_mean", "rel_l2_mean"} <= tripped, bad["fails"]


def _flip_router(monkeypatch, where):
    """The NumPy router picking its (k+1)-th expert instead of its k-th on the rows `where(margin)`
    selects (margin: (s_k - s_(k+1)) / max|s| of the row's logits): a tie decided the other way
    (what the H200's rounding did on tiny-qwen3_moe/mxfp8), or a real routing defect."""
    from bloomery.runtime.ops import IMPL

    orig = IMPL["moe_router"].run

    def run(op, buf, w):
        orig(op, buf, w)
        x = buf[op["x"]]
        lg = x @ w[op["weight"]].T
        k = op["top_k"]
        order = np.argsort(-lg, axis=-1, kind="stable")
        s = np.take_along_axis(lg, order, axis=-1)
        margin = (s[:, k - 1] - s[:, k]) / np.maximum(np.abs(lg).max(axis=-1), 1e-30)
        for r in np.nonzero(where(margin))[0]:
            p = np.exp(lg[r] - lg[r].max())
            p /= p.sum()
            ids = list(order[r, : k - 1]) + [order[r, k]]
            top = p[ids]
            buf[op["ids"]][r] = ids
            buf[op["weights"]][r] = top / top.sum() if op["norm"] else top
    monkeypatch.setattr(IMPL["moe_router"], "run", run)


@pytest.mark.models
def test_router_ties_are_left_out_and_counted_but_hide_no_defect(monkeypatch):
    from bloomery.tools import gpu_gates
    from runtime_artifacts import artifact

    name = "tiny-qwen3_moe/mxfp8"
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    folder, art = models.model_dir(name), artifact(name)
    exact = gpu_gates.oracle_gate(folder, art, device="cpu")
    # the prompt set's two positions under the margin (6.9e-6, the one the H200 flipped, and 1.5e-5)
    assert exact["pass"] and exact["ties_excluded"] == 2, exact
    _flip_router(monkeypatch, lambda m: m < 1e-5)                     # the tie decided the other way
    tie = gpu_gates.oracle_gate(folder, art, device="cpu")
    assert tie["pass"] and tie["ties_excluded"] == 2, tie
    monkeypatch.setattr(gates, "TIE_MARGIN", 0.0)                     # without the rule: the H200's failure
    raw = gpu_gates.oracle_gate(folder, art, device="cpu")
    assert not raw["pass"] and raw["rel_l2_max"] > 0.05, raw
    monkeypatch.undo()
    _flip_router(monkeypatch, lambda m: (m >= 1e-5) & (m < 2e-3))     # flips where the reference is no tie
    bad = gpu_gates.oracle_gate(folder, art, device="cpu")
    assert not bad["pass"], bad


def test_too_many_ties_is_an_error():
    a = np.zeros((1000, 4), np.float32)
    m = np.full(1000, 1.0)
    limit = int(gates.MAX_TIES * 1000)
    m[:limit] = 0.0                              # at MAX_TIES (1%): left out
    assert gates.compare([a], [a], [m])["ties_excluded"] == limit
    m[:limit + 1] = 0.0
    with pytest.raises(gates.GateError, match=f"{limit + 1} of 1000 positions are router ties"):
        gates.compare([a], [a], [m])
