"""Artifacts of the test checkpoints for the runtime tests, prepared once per test session into a
temporary folder (removed at exit) and shared by test_runtime*.py and test_run_cli.py."""

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

from bloomery.compiler.prepare import prepare
from bloomery.tools import models

from arrays import rel  # noqa: F401  (the runtime tests import it from here)

_ROOT: list[Path] = []
_CACHE: dict = {}
# what prepare refuses (tests/test_prepare.py REFUSED): no artifact to run
REFUSED = {("tiny-llama/fp8_pb_wo", 2)}
EXPORTS = [n for n in models.SPECS if n.startswith(("smollm2-135m/", "tiny-llama/", "tiny-qwen3_moe/"))]


def need(name: str) -> Path:
    if not models.is_built(name):
        pytest.skip(f"{name} not built in {models.models_dir()} (run: make models)")
    return models.model_dir(name)


def artifact(name: str, tp: int = 1) -> Path:
    """The artifact of test model `name` at tp, prepared on first use."""
    if (name, tp) not in _CACHE:
        folder = need(name)
        if not _ROOT:
            _ROOT.append(Path(tempfile.mkdtemp(prefix="bloomery-runtime-tests-")))
            atexit.register(shutil.rmtree, _ROOT[0], True)
        out = _ROOT[0] / f"{name.replace('/', '-')}-tp{tp}"
        prepare(folder, out, tp=tp, progress=False)
        _CACHE[(name, tp)] = out
    return _CACHE[(name, tp)]




def assert_engines_agree(cand, ref, n_ids: int = 40, steps: int = 16, band: float = 1e-3, seed: int = 1) -> None:
    """Two Engines on the same artifact: prefill logits within `band` (relative L2) at every position,
    then `steps` greedy decode steps with each fed its own token: logits within `band`, the device
    argmax equal to the logits' argmax, and the same tokens."""
    import numpy as np
    ids = [int(i) for i in np.random.default_rng(seed).integers(0, ref.vocab_size, n_ids)]
    xa, xb = cand.prefill(ids), ref.prefill(ids)
    assert max(rel(xa[i], xb[i]) for i in range(len(ids))) <= band
    tok_a = tok_b = int(np.argmax(xb[-1]))
    for _ in range(steps):
        la, na = cand.decode([tok_a])
        lb, nb = ref.decode([tok_b])
        assert rel(la[0], lb[0]) <= band
        assert int(na[0]) == int(np.argmax(la[0]))
        tok_a, tok_b = int(na[0]), int(nb[0])
        assert tok_a == tok_b
