"""The CUDA executor (runtime/cuda/executor.py) against the NumPy executor on the same artifacts.
The GPU tests skip, visibly, without CuPy or a CUDA GPU; the device-selection tests run anywhere.
tools/gpu_gates.py runs the full gates (256 greedy steps, teacher-forced logits) on the GPU."""

from __future__ import annotations

import pytest

from bloomery import runtime
from bloomery.runtime import device as devices
from bloomery.runtime.errors import DeviceUnavailable

from runtime_artifacts import artifact, assert_engines_agree

WHY = devices.cuda_unavailable()
needs_gpu = pytest.mark.skipif(WHY is not None, reason=f"CUDA executor tests need CuPy and a GPU: {WHY}")


def test_device_resolution():
    assert devices.resolve("cpu") == "cpu"
    assert devices.resolve("auto") == ("cpu" if WHY else "cuda")
    if WHY:
        with pytest.raises(DeviceUnavailable, match="--device cuda"):
            devices.resolve("cuda")
    with pytest.raises(DeviceUnavailable, match="unknown device"):
        devices.resolve("tpu")


def test_cuda_modules_import_without_cupy():
    from bloomery.runtime.cuda import executor, gemv, ops, ops_src   # noqa: F401
    assert "attention_k" in ops_src.SOURCE and "gemv_plain_e" in gemv.kernel_name("mxfp8", 4, 1, 1, 4, experts=True)


MODELS = ["tiny-llama/nvfp4", "tiny-llama/nvfp4_awq", "tiny-llama/mxfp8", "tiny-llama/fp8", "tiny-llama/mxfp4",
          "tiny-llama/bf16", "tiny-qwen3_moe/nvfp4", "tiny-qwen3_moe/fp8", "tiny-qwen3_moe/mxfp8"]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.models
@pytest.mark.parametrize("name", MODELS)
def test_cuda_matches_numpy(name):
    art = artifact(name)
    cu = runtime.Engine(art, device="cuda", ctx=128, ubatch=16)
    cpu = runtime.Engine(art, device="cpu", ctx=128, ubatch=16)
    assert cu.device == "cuda"
    assert_engines_agree(cu, cpu)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.models
def test_cuda_generate_and_reset():
    art = artifact("tiny-llama/nvfp4")
    eng = runtime.Engine(art, device="cuda", ctx=128)
    g1 = runtime.generate(eng, ids=[1, 5, 9], max_tokens=12)
    g2 = runtime.generate(eng, ids=[1, 5, 9], max_tokens=12)      # generate resets slot 0
    ref = runtime.generate(runtime.Engine(art, device="cpu", ctx=128), ids=[1, 5, 9], max_tokens=12)
    assert g1.token_ids == g2.token_ids == ref.token_ids and g1.device == "cuda"
