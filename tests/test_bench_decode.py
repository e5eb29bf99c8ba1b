"""CPU: bench_decode's --ab (a lever's values timed alternating in one process): the specs it takes and refuses,
the order it runs them in, the environment it leaves."""

from __future__ import annotations

import os

import pytest

from bloomery.tools import bench_decode as B


def test_ab_specs_name_real_levers_and_values():
    assert B.parse_ab(["BLOOMERY_MOE_PREFETCH=off,on", "BLOOMERY_MOE_ROUTER=two,fused"]) == {
        "BLOOMERY_MOE_PREFETCH": ["off", "on"], "BLOOMERY_MOE_ROUTER": ["two", "fused"]}
    for bad, why in (("BLOOMERY_NO_SUCH=a,b", "no lever BLOOMERY_NO_SUCH"), ("BLOOMERY_MOE_PREFETCH=on", "two values"),
                     ("BLOOMERY_MOE_PREFETCH=off,maybe", "one of on, off")):
        with pytest.raises(ValueError, match=why):
            B.parse_ab([bad])


def test_ab_alternates_and_puts_the_environment_back(monkeypatch, tmp_path):
    seen = []

    def fake(art, steps):
        seen.append(os.environ.get("BLOOMERY_MOE_PREFETCH"))
        t = 1e-3 if seen[-1] == "off" else 5e-4
        return {"replay_s": t, "s_per_tok": 2 * t, "kernels": 10, "bytes_per_tok": 1}
    monkeypatch.setattr(B, "bench_cuda", fake)
    monkeypatch.setenv("BLOOMERY_MOE_PREFETCH", "off")
    freed = []
    out = B.run_ab(tmp_path, 8, {"BLOOMERY_MOE_PREFETCH": ["off", "on"]}, 3, lambda: freed.append(1))
    assert seen == ["off", "on", "on", "off", "off", "on"]
    assert [q["replay_s"] for q in out["BLOOMERY_MOE_PREFETCH"]["on"]] == [5e-4] * 3 and len(freed) == 6
    assert os.environ["BLOOMERY_MOE_PREFETCH"] == "off"
    monkeypatch.delenv("BLOOMERY_MOE_PREFETCH")
    B.run_ab(tmp_path, 8, {"BLOOMERY_MOE_PREFETCH": ["on", "off"]}, 1, lambda: None)
    assert "BLOOMERY_MOE_PREFETCH" not in os.environ
