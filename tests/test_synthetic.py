"""Synthetic checkpoints (tools/synthetic.py) read back as real ModelOpt folders with sane values."""

import numpy as np
import pytest

from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.planning import plan
from bloomery.tools import synthetic


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp8"])
def test_synthetic_smollm2_shape(tmp_path, fmt):
    ck = Checkpoint.open(synthetic.write("smollm2-135m", tmp_path / fmt, fmt, layers=1))
    norm = np.abs(ck.tensors["model.layers.0.input_layernorm.weight"].decode())
    assert norm.min() >= 2.0 ** -6 and norm.max() < 2.0 ** -5       # BF16 values are not degenerate
    q = ck.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.format.name == {"nvfp4": "nvfp4", "fp8": "fp8_tensor", "mxfp8": "mxfp8"}[fmt]
    w = q.decode()
    assert np.isfinite(w).all() and np.abs(w).max() > 0
    assert len(plan(ck, tp=2, env={})) == 2
