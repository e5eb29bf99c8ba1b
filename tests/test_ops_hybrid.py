"""The small ops the hybrid families add (rmsnorm's offset, partial rotary, split_groups,
sigmoid_mul, bias_add) against transformers' own functions in float32."""

from __future__ import annotations

import numpy as np
import pytest

from bloomery.runtime.ops import IMPL
from arrays import rel

torch = pytest.importorskip("torch")
q3n = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def test_rmsnorm_offset_is_qwen3_nexts_norm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    wt = (0.1 * rng.standard_normal(64)).astype(np.float32)
    m = q3n.Qwen3NextRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(wt))
        ref = m(torch.from_numpy(x)).numpy()
    buf = {"x": x, "out": np.zeros_like(x)}
    IMPL["rmsnorm"].run({"x": "x", "out": "out", "weight": "w", "eps": 1e-6, "group": 64, "offset": 1.0}, buf, {"w": wt})
    assert rel(buf["out"], ref) < 1e-6
    IMPL["rmsnorm"].run({"x": "x", "out": "out", "weight": "w", "eps": 1e-6, "group": 64}, buf, {"w": wt})
    assert rel(buf["out"], ref) > 0.5                  # without the offset: weight alone


@pytest.mark.parametrize("rotary_dim", [16, 32, 64])
def test_partial_rotary_is_hfs(rotary_dim):
    rng = np.random.default_rng(1)
    rows, heads, hd, theta = 7, 3, 64, 1e7
    x = rng.standard_normal((rows, heads * hd)).astype(np.float32)
    pos = np.array([0, 1, 2, 5, 100, 4095, -1], np.int32)
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    ang = torch.from_numpy(np.maximum(pos, 0).astype(np.float32))[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    xt = torch.from_numpy(x).reshape(rows, heads, hd).transpose(0, 1)[None]     # [1, heads, rows, hd]
    q, _ = q3n.apply_rotary_pos_emb(xt, xt, emb.cos()[None], emb.sin()[None])
    ref = q[0].transpose(0, 1).reshape(rows, heads * hd).numpy()
    buf = {"x": x, "pos": pos, "out": np.zeros_like(x)}
    IMPL["rope"].run({"x": "x", "pos": "pos", "out": "out", "heads": heads, "head_dim": hd, "theta": theta,
                      "rotary_dim": rotary_dim}, buf, {})
    # float32 noise: inv_freq's pow and cos/sin of angles up to ~4000 rad differ by an ulp between
    # NumPy and torch (the whole-rotary rope test in test_runtime_ops.py uses 1e-5 too)
    assert rel(buf["out"], ref) < 3e-5
    if rotary_dim < hd:   # the pass-through part is untouched, bit for bit
        y = buf["out"].reshape(rows, heads, hd)
        assert np.array_equal(y[..., rotary_dim:], x.reshape(rows, heads, hd)[..., rotary_dim:])


def test_split_groups_lays_fields_out_group_major():
    groups, widths = 3, [2, 1, 4]
    x = np.arange(2 * groups * 7, dtype=np.float32).reshape(2, -1)
    buf = {"x": x, "out": np.zeros((2, groups * 3), np.float32), "rest": np.zeros((2, groups * 4), np.float32)}
    IMPL["split_groups"].run({"x": "x", "out": "out", "rest": "rest", "groups": groups, "widths": widths, "split": 2},
                             buf, {})
    xr = x.reshape(2, groups, 7)
    want = np.concatenate([xr[:, :, 0:2].reshape(2, -1), xr[:, :, 2:3].reshape(2, -1)], axis=-1)
    assert np.array_equal(buf["out"], want)
    assert np.array_equal(buf["rest"], xr[:, :, 3:].reshape(2, -1))
    assert buf["out"][0].tolist() == [0, 1, 7, 8, 14, 15, 2, 9, 16]


def test_sigmoid_mul_and_bias_add():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    g = (5 * rng.standard_normal((4, 8))).astype(np.float32)
    g[0, 0], g[0, 1] = -200.0, 200.0
    buf = {"x": x, "g": g, "g1": g[:, :1].copy(), "out": np.zeros_like(x)}
    IMPL["sigmoid_mul"].run({"x": "x", "gate": "g", "out": "out"}, buf, {})
    ref = (torch.from_numpy(x) * torch.sigmoid(torch.from_numpy(g))).numpy()
    assert rel(buf["out"], ref) < 1e-6 and np.isfinite(buf["out"]).all()
    IMPL["sigmoid_mul"].run({"x": "x", "gate": "g1", "out": "out"}, buf, {})
    assert rel(buf["out"], (torch.from_numpy(x) * torch.sigmoid(torch.from_numpy(g[:, :1]))).numpy()) < 1e-6
    b = rng.standard_normal(8).astype(np.float32)
    IMPL["bias_add"].run({"x": "x", "bias": "b", "out": "out"}, buf, {"b": b})
    assert np.array_equal(buf["out"], x + b)
