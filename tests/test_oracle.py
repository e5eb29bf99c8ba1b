"""The float32 oracle (tools/oracle.py): sane on the real model, equal to an independent route
through ModelOpt's own dequantization, strict about weights, cached on disk."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bloomery.tools import models, oracle  # noqa: E402

pytestmark = pytest.mark.models

IDS = [5, 77, 301, 12, 9, 140, 33, 250, 7, 64, 401, 18, 3, 99, 200, 11]


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    return models.model_dir(name)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(oracle.CACHE_ENV, str(tmp_path / "oracle-cache"))


def test_smollm2_bf16_greedy_says_paris():
    folder = need("smollm2-135m/bf16")
    o = oracle.Oracle(folder, cache=False)
    ids = oracle.chat_ids(folder, "What is the capital of France?")
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(folder)).decode(o.greedy(ids, 8, eos=[2]))
    assert "Paris" in text, text


def _modelopt_nvfp4(qt) -> np.ndarray:
    """ModelOpt's NVFP4QTensor.dequantize of a stored tensor: e2m1 * (e4m3 * scale_2)."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    p = qt.parts
    w = torch.from_numpy(np.array(p["weight"]))
    s = torch.from_numpy(np.ascontiguousarray(p["scale"]).view(np.uint8).copy()).view(torch.float8_e4m3fn)
    s2 = torch.from_numpy(np.asarray(p["scale_2"], np.float32).copy())
    q = qtensor.NVFP4QTensor(torch.Size(qt.shape), torch.float32, w)
    return q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16}).numpy()


def test_nvfp4_oracle_equals_modelopt_route():
    """Every NVFP4 weight dequantized by ModelOpt (not by bloomery's decoder), BF16 ones cast by
    torch, loaded by name into a model made by transformers' own from_pretrained-free path: the
    logits equal the oracle's to float32 rounding (ModelOpt rounds twice: <= 1 ulp per weight)."""
    from transformers import AutoModelForCausalLM

    from bloomery.compiler.checkpoint import Checkpoint

    folder = need("tiny-llama/nvfp4")
    ck = Checkpoint.open(folder)
    sd, ours = {}, oracle.checkpoint_weights(folder)
    n_nvfp4 = 0
    for name, qt in ck.tensors.items():
        if qt.format.name == "nvfp4":
            w = _modelopt_nvfp4(qt)
            n_nvfp4 += 1
            # bloomery's decoder vs ModelOpt's: equal or 1 ulp apart (zeros by value)
            ulp = np.abs(np.spacing(ours[name]))
            assert (np.abs(w - ours[name]) <= ulp).all(), name
        else:
            assert qt.format.name == "bf16", name
            w = torch.from_numpy(np.asarray(qt.parts["weight"]).view(np.uint16).copy()).view(torch.bfloat16).float().numpy()
        sd[name] = torch.from_numpy(np.ascontiguousarray(w, np.float32))
    assert n_nvfp4 == 14
    cfg = oracle.hf_config(folder)
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ref.load_state_dict(sd, strict=True)
    with torch.inference_mode():
        want = ref(input_ids=torch.tensor([IDS]), use_cache=False).logits[0].numpy()
    got = oracle.Oracle(folder, cache=False).logits(IDS)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max() / scale
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_awq_pre_quant_scale_is_folded():
    folder = need("tiny-llama/nvfp4_awq")
    from bloomery.compiler.checkpoint import Checkpoint

    ck = Checkpoint.open(folder)
    w = oracle.checkpoint_weights(folder)
    awq = [n for n, qt in ck.tensors.items() if "pre_quant_scale" in qt.sources]
    assert awq, "the AWQ export stores no pre_quant_scale"
    for n in awq:
        qt = ck.tensors[n]
        pqs = np.asarray(qt.sources["pre_quant_scale"].array(), np.float32)
        assert not np.allclose(pqs, 1.0)
        np.testing.assert_array_equal(w[n], qt.decode() * pqs[None, :])


def test_kv_cache_scales_and_input_scales_ignored():
    """nvfp4_fp8kv holds the same NVFP4 weights as nvfp4 plus k/v scales: same logits, bit for bit."""
    a = oracle.Oracle(need("tiny-llama/nvfp4"), cache=False).logits(IDS)
    b = oracle.Oracle(need("tiny-llama/nvfp4_fp8kv"), cache=False).logits(IDS)
    np.testing.assert_array_equal(a, b)


def test_moe_experts_stacked_gate_first():
    folder = need("tiny-qwen3_moe/bf16")
    m = oracle.build_model(folder)
    w = oracle.checkpoint_weights(folder)
    gu = m.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    dn = m.model.layers[1].mlp.experts.down_proj.detach().numpy()
    e = 5
    np.testing.assert_array_equal(gu[e, :128], w[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
    np.testing.assert_array_equal(gu[e, 128:], w[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
    np.testing.assert_array_equal(dn[e], w[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])


def test_strict_about_weights():
    folder = need("tiny-llama/bf16")
    w = oracle.checkpoint_weights(folder)
    missing = dict(w)
    del missing["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(oracle.OracleError, match="down_proj.weight.*no stored tensor"):
        oracle.build_model(folder, missing)
    extra = dict(w, **{"model.layers.9.mlp.down_proj.weight": w["model.layers.1.mlp.down_proj.weight"]})
    with pytest.raises(oracle.OracleError, match="no place for: model.layers.9"):
        oracle.build_model(folder, extra)
    wrong = dict(w, **{"model.norm.weight": np.ones(7, np.float32)})
    with pytest.raises(oracle.OracleError, match="model.norm.weight"):
        oracle.build_model(folder, wrong)


def test_tied_embeddings_follow_the_config():
    m = oracle.build_model(need("smollm2-135m/nvfp4"))
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    m = oracle.build_model(need("tiny-llama/bf16"))
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()


def test_disk_cache_keyed_by_folder_and_ids(tmp_path):
    folder = need("tiny-llama/fp8")
    o = oracle.Oracle(folder)
    a = o.logits(IDS)
    assert o.computed == 1 and o.cache_path(IDS).is_file()
    o2 = oracle.Oracle(folder)
    b = o2.logits(IDS)
    assert o2.computed == 0 and o2._model is None      # read from disk, no model built
    np.testing.assert_array_equal(a, b)
    o2.logits(IDS[:-1])
    assert o2.computed == 1                              # other ids: computed
    assert oracle.Oracle(need("tiny-llama/mxfp8")).key != o.key
    assert a.dtype == np.float32 and a.shape == (len(IDS), 512)


def test_stale_entries_of_a_source_are_dropped():
    folder = need("tiny-llama/fp8")
    o = oracle.Oracle(folder)
    o.logits(IDS)
    old = o.cache_path(IDS).parent
    o2 = oracle.Oracle(folder)
    o2.key = "0" * 32                                    # as after a code change
    o2.logits(IDS)
    assert not old.exists() and o2.cache_path(IDS).is_file()
    other = oracle.Oracle(need("tiny-llama/mxfp8"))
    other.logits(IDS)
    assert o2.cache_path(IDS).is_file()                 # another source's entry is kept
