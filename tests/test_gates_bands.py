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
