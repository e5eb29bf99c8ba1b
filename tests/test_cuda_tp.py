"""Tensor parallelism on the CUDA executor (runtime/cuda/tp.py): one process per rank over NCCL.
The CPU tests drive the spawn / pipe / lockstep / error paths with fake ranks; the GPU tests skip,
visibly, without CuPy and 2 CUDA GPUs. tools/gpu_gates.py --tp 2 runs the full gates."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from bloomery import runtime
from bloomery.runtime import device as devices
from bloomery.runtime.cuda import tp as T
from bloomery.runtime.errors import DeviceUnavailable

from runtime_artifacts import artifact, assert_engines_agree

NGPU = devices.gpu_count()
WHY = devices.cuda_unavailable() or (None if NGPU >= 2 else f"{NGPU} CUDA GPU(s), 2 needed")
needs_2gpu = pytest.mark.skipif(WHY is not None, reason=f"CUDA TP tests need CuPy and 2 GPUs: {WHY}")
FAKE = "bloomery.runtime.cuda.tp:fake_rank"


def test_tp_module_imports_without_cupy():
    from bloomery.runtime.cuda import executor  # noqa: F401
    assert T.NCCL_ENV["NCCL_NVLS_ENABLE"] == "0"


def test_fake_ranks_lockstep():
    ex = T.TpCudaExecutor("nowhere", 2, {"slots": 1, "ubatch": 4, "ctx": 16}, factory=FAKE)
    try:
        assert [i["rank"] for i in ex.info] == [0, 1] and ex.weight_nbytes() == 2001
        res = ex.run("decode", {"tokens": np.array([5], np.int32), "positions": np.array([0], np.int32),
                                "slot_ids": np.array([0], np.int32)}, ("logits", "next_token"))
        assert int(res["next_token"][0]) == (5 + 5 + 1) % 97 and res["logits"].shape == (1, 97)
        res = ex.run("decode", {"tokens": np.array([3], np.int32)}, ("next_token",))
        assert set(res) == {"next_token"} and int(res["next_token"][0]) == (3 + 3 + 2) % 97
        ex.reset()
        assert int(ex.run("decode", {"tokens": np.array([3], np.int32)})["next_token"][0]) == (3 + 3 + 1) % 97
        res = ex.run("prefill", {"tokens": np.array([1, 2, 3, 4], np.int32)}, ("logits",), rows=(2, 3))
        assert res["logits"].shape == (1, 97) and int(np.argmax(res["logits"][0])) == (3 + 10 + 2) % 97
        assert ex.disagreements == 0 and ex.call("weight_nbytes") == [1000, 1001]
    finally:
        ex.close()
    assert ex.procs == []


def test_fake_rank_init_error_is_reported():
    with pytest.raises(DeviceUnavailable, match="rank 1: ValueError: fake rank 1: init failure"):
        T.TpCudaExecutor("nowhere", 2, {"fail_init": 1}, factory=FAKE)


def test_fake_rank_run_error_is_reported():
    ex = T.TpCudaExecutor("nowhere", 2, {"fail_at": 2}, factory=FAKE)
    ex.run("decode", {"tokens": np.array([1], np.int32)})
    with pytest.raises(DeviceUnavailable, match="failure at run 2"):
        ex.run("decode", {"tokens": np.array([1], np.int32)})
    assert ex.procs == []                     # closed after an error


def test_engine_tp_branch(monkeypatch):
    art = artifact("tiny-llama/nvfp4", tp=2)
    monkeypatch.setattr(devices, "resolve", lambda d: "cuda")
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    with pytest.raises(DeviceUnavailable, match="tp=2: the CUDA executor runs one rank per GPU and 1 GPU"):
        runtime.Engine(art, device="cuda")
    assert runtime.Engine(art, device="auto").device == "cpu"
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.setattr(T, "TpCudaExecutor", functools.partial(T.TpCudaExecutor, factory=FAKE))
    eng = runtime.Engine(art, device="cuda", ctx=32)
    try:
        assert eng.device == "cuda" and eng.exec.tp == 2
        lg, nt = eng.decode([7])
        assert lg.shape == (1, 97) and int(nt[0]) == (7 + 7 + 1) % 97
    finally:
        eng.exec.close()


@needs_2gpu
@pytest.mark.gpu
@pytest.mark.models
@pytest.mark.parametrize("name", ["tiny-llama/nvfp4", "tiny-qwen3_moe/nvfp4"])
def test_cuda_tp2_matches_numpy_tp2(name):
    art = artifact(name, tp=2)
    cu = runtime.Engine(art, device="cuda", ctx=128, ubatch=16)
    cpu = runtime.Engine(art, device="cpu", ctx=128, ubatch=16)
    try:
        assert cu.device == "cuda" and cu.art.tp == 2
        assert_engines_agree(cu, cpu)
        assert cu.exec.disagreements == 0
    finally:
        cu.exec.close()
