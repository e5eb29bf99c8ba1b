"""The oracle's own dequantization (tools/dequant.py) is independent of bloomery's formats, agrees
with ModelOpt's own dequantization on the real exports, and the gates built on it catch defects
planted in core/formats that a shared decoder would have hidden."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bloomery.tools import dequant, gates, models
from test_formats import _mo          # torch and ModelOpt's qtensor module, or a skip with the reason

torch = pytest.importorskip("torch")

FAST_LIMIT = 32


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} is not built (make models)")
    return models.model_dir(name)


# --------------------------------------------------------------------------- independence


@pytest.mark.models
def test_oracle_imports_nothing_of_bloomerys_decoders():
    """A whole oracle forward (weights read, dequantized, model built, logits) in a fresh process
    loads no module of bloomery's formats, compiler or runtime."""
    folder = need("tiny-llama/nvfp4")
    code = ("import sys; from bloomery.tools import oracle; "
            f"x = oracle.Oracle({str(folder)!r}, cache=False).logits([1, 2, 3, 4]); assert x.shape[0] == 4; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('bloomery')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert "bloomery.tools.dequant" in loaded
    shared = sorted(m for m in loaded if m.startswith(("bloomery.core", "bloomery.compiler", "bloomery.runtime")))
    assert not shared, shared


# --------------------------------------------------------------------------- against ModelOpt


def _bits(t: torch.Tensor) -> np.ndarray:
    return (t.to(torch.float32) + 0.0).numpy().view(np.int32)      # -0 and +0 compare equal


def _modules(folder):
    from safetensors.torch import load_file

    t = {}
    for p in sorted(folder.glob("*.safetensors")):
        t.update(load_file(str(p)))
    mods, _ = dequant.groups(t)
    return {pre: {part: t[n] for part, n in m.items()} for pre, m in mods.items() if len(m) > 1}, dequant.fp8_block(folder)


MO_EXPORTS = ["tiny-llama/nvfp4", "tiny-llama/fp8", "tiny-llama/fp8_channel", "tiny-llama/fp8_pb_wo",
              "tiny-llama/mxfp8", "tiny-llama/mxfp4", "tiny-llama/nvfp4_awq", "tiny-llama/w4a8_nvfp4_fp8",
              "tiny-qwen3_moe/nvfp4", "tiny-qwen3_next/fp8", "tiny-glm4_moe/mxfp8", "smollm2-135m/nvfp4"]


@pytest.mark.models
@pytest.mark.parametrize("name", MO_EXPORTS)
def test_dequant_matches_modelopt_on_real_exports(name):
    """Every quantized weight of the export, dequantized by the oracle and by ModelOpt's QTensor
    classes. FP8 (tensor, channel, 128x128 block), MXFP8, MXFP4: bit for bit. NVFP4: ModelOpt
    computes e2m1 * (e4m3 * scale_2), two roundings, where the oracle takes the exact product
    rounded once; so with scale_2 = 1 (both exact) they agree bit for bit, and with the stored
    scale_2 they differ by at most 1 ulp, only where |e2m1| is 1.5, 3 or 6."""
    _, qt = _mo()
    mods, block = _modules(need(name))
    seen = set()
    for pre, p in sorted(mods.items()):
        w, sc = p["weight"], p.get("weight_scale")
        base = {k: v for k, v in p.items() if k != "pre_quant_scale"}
        ours, rule = dequant.decode(pre, base, block)
        kind = rule.split("/")[0]
        seen.add(kind)
        shape = ours.shape
        if kind == "nvfp4":
            b = int(rule.split("/")[1])
            q = qt.NVFP4QTensor(shape, torch.float32, w)
            one = torch.ones_like(p["weight_scale_2"], dtype=torch.float32)
            mo1 = q.dequantize(dtype=torch.float32, scale=sc, double_scale=one, block_sizes={-1: b})
            ours1, _ = dequant.decode(pre, {**base, "weight_scale_2": one}, block)
            assert np.array_equal(_bits(ours1), _bits(mo1)), pre
            mo = q.dequantize(dtype=torch.float32, scale=sc, double_scale=p["weight_scale_2"].float(),
                              block_sizes={-1: b})
            d = np.abs(_bits(ours).astype(np.int64) - _bits(mo).astype(np.int64))
            assert d.max() <= 1, (pre, int(d.max()))
            codes = dequant.unpack_e2m1(w).abs().numpy()
            assert np.isin(codes[d > 0], [1.5, 3.0, 6.0]).all(), pre
        elif kind in ("mxfp8", "mxfp4"):
            cls = qt.MXFP8QTensor if kind == "mxfp8" else qt.MXFP4QTensor
            kw = {} if kind == "mxfp8" else {"block_sizes": {-1: 32}}
            mo = cls(shape, torch.float32, w).dequantize(dtype=torch.float32, scale=sc, **kw)
            assert np.array_equal(_bits(ours), _bits(mo)), pre
        elif kind == "fp8":
            s = sc.float()
            kw = {}
            if rule == "fp8/channel":
                s = s.reshape(-1, 1)
            elif rule.startswith("fp8/block"):
                s = s.reshape(*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
                kw = {"block_sizes": {-1: block, -2: block}}
            mo = qt.FP8QTensor(shape, torch.float32, w).dequantize(dtype=torch.float32, scale=s, **kw)
            assert np.array_equal(_bits(ours), _bits(mo)), pre
        else:
            raise AssertionError(f"{pre}: unexpected rule {rule}")
    assert seen, f"{name}: no quantized weight found"


def test_dequant_rules_on_planted_layouts():
    """The decoder's own rules on hand-made parts: nibble order (element 0 in the low nibble),
    E8M0's 2^(e-127), a 4-D ModelOpt block scale, a shape it cannot read is refused by name."""
    w = torch.tensor([[0x21, 0x7F]], dtype=torch.uint8)      # codes 1, 2, 15, 7
    sc = torch.tensor([[1.0]]).to(torch.float8_e4m3fn).repeat(1, 1)
    v, rule = dequant.decode("x", {"weight": w.repeat(1, 8), "weight_scale": sc.repeat(1, 2),
                                   "weight_scale_2": torch.tensor(0.5)})
    assert rule == "nvfp4/16" and v[0, :4].tolist() == [0.25, 0.5, -3.0, 3.0]
    v, rule = dequant.decode("x", {"weight": w.repeat(1, 16), "weight_scale": torch.tensor([[130, 130]], dtype=torch.uint8)})
    assert rule == "mxfp4/32" and v[0, :4].tolist() == [4.0, 8.0, -48.0, 48.0]
    e = torch.tensor([[1.0, 2.0], [-0.5, 448.0]]).to(torch.float8_e4m3fn)
    big = e.repeat_interleave(128, 0).repeat_interleave(128, 1)
    s4 = torch.tensor([[3.0, 5.0], [7.0, 11.0]]).reshape(2, 1, 2, 1)
    v, rule = dequant.decode("x", {"weight": big, "weight_scale": s4})
    assert rule == "fp8/block128" and v[0, 0] == 3.0 and v[0, 128] == 10.0 and v[128, 0] == -3.5 and v[255, 255] == 448 * 11
    with pytest.raises(dequant.DequantError, match="x.weight: FP8 weight .* F32 scale of shape"):
        dequant.decode("x.weight", {"weight": big, "weight_scale": torch.ones(3, 3)})
    with pytest.raises(dequant.DequantError, match="without weight_scale_2"):
        dequant.decode("x.weight", {"weight": w.repeat(1, 8), "weight_scale": sc.repeat(1, 2)})


# --------------------------------------------------------------------------- planted decoder defects


@pytest.fixture(scope="module")
def bands():
    return gates.load_bands()


def _gate(name, bands, tmp_path, monkeypatch):
    monkeypatch.setenv(gates.GATES_ENV, str(tmp_path / "gates"))
    return gates.gate_row(name, bands, "executor", limit=FAST_LIMIT)


@pytest.mark.models
def test_gate_catches_a_wrong_nibble_order(bands, tmp_path, monkeypatch):
    from bloomery.core.formats import minifloat as mf

    need("tiny-llama/nvfp4")
    orig = mf.unpack_e2m1

    def swapped(w):                      # element 0 read from the high nibble
        w = np.asarray(w)
        return orig(((w & 0x0F) << 4 | (w >> 4)).astype(np.uint8))
    monkeypatch.setattr(mf, "unpack_e2m1", swapped)
    row = _gate("tiny-llama/nvfp4", bands, tmp_path, monkeypatch)
    assert row.verdict == "FAIL", gates.table([row])


@pytest.mark.models
def test_gate_catches_an_nvfp4_scale_per_32(bands, tmp_path, monkeypatch):
    from bloomery.core.formats import common, nvfp4

    need("tiny-llama/nvfp4")
    orig = nvfp4.NVFP4.canonical_scale

    def per_32(self, parts, where=""):
        s = orig(self, parts, where)
        return np.repeat(s[..., ::2], 2, axis=-1)[..., : s.shape[-1]]     # block 2i's scale over 2i and 2i+1
    monkeypatch.setattr(nvfp4.NVFP4, "canonical_scale", per_32)
    row = _gate("tiny-llama/nvfp4", bands, tmp_path, monkeypatch)
    assert row.verdict == "FAIL", gates.table([row])


@pytest.mark.models
def test_gate_catches_one_block_scale_for_a_whole_fp8_block128_tensor(bands, tmp_path, monkeypatch):
    from bloomery.core.formats import fp8_block128

    need("tiny-llama/fp8_pb_wo")
    orig = fp8_block128.FP8Block128.canonical_scale
    monkeypatch.setattr(fp8_block128.FP8Block128, "canonical_scale",
                        lambda self, parts, where="": np.full_like(orig(self, parts, where),
                                                                   orig(self, parts, where).reshape(-1)[0]))
    row = _gate("tiny-llama/fp8_pb_wo", bands, tmp_path, monkeypatch)
    assert row.verdict == "FAIL", gates.table([row])


def _block_folder(tmp_path):
    """A Llama-shaped FP8 128x128-block checkpoint in ModelOpt's fp8_pb_wo layout whose scale
    grids are 2-D (hidden 256, intermediate 384: grids 2x2, 3x2, 2x3), so a transposed grid is a
    different tensor (tiny-llama's grids are 1-wide)."""
    import ml_dtypes
    from ckpt import bf16, write_folder

    rng = np.random.default_rng(7)
    hidden, inter, vocab = 256, 384, 128
    t = {"model.embed_tokens.weight": bf16(rng, vocab, hidden), "model.norm.weight": (1 + bf16(rng, hidden)),
         "lm_head.weight": bf16(rng, vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = 1 + bf16(rng, hidden)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + bf16(rng, hidden)
        for name, o, n in (("self_attn.q_proj", hidden, hidden), ("self_attn.k_proj", 128, hidden),
                           ("self_attn.v_proj", 128, hidden), ("self_attn.o_proj", hidden, hidden),
                           ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
                           ("mlp.down_proj", hidden, inter)):
            t[f"{p}.{name}.weight"] = rng.normal(0, 64, (o, n)).astype(ml_dtypes.float8_e4m3fn)
            grid = rng.uniform(2e-4, 2e-3, (-(-o // 128), -(-n // 128))).astype(np.float32)
            t[f"{p}.{name}.weight_scale"] = grid.reshape(grid.shape[0], 1, grid.shape[1], 1)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
           "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "vocab_size": vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "rope_theta": 10000.0}
    return write_folder(tmp_path / "fp8pb", t, {"quant_algo": "fp8_pb_wo", "exclude_modules": ["lm_head", "model.embed_tokens"]}, config=cfg)


def _executor_vs_oracle(folder, out, bands):
    from bloomery import runtime as rt
    from bloomery.compiler.prepare import prepare
    from bloomery.tools import oracle

    prepare(folder, out, progress=False)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 128, 48)]
    eng = rt.Engine(str(out), device="cpu", ctx=64)
    m = gates.compare([oracle.Oracle(folder, cache=False).logits(ids)], [np.asarray(rt.logits(eng, ids, device="cpu"))])
    return m, gates.check(m, bands["executor_vs_oracle"])


@pytest.mark.models
def test_gate_catches_a_transposed_block_scale(bands, tmp_path, monkeypatch):
    from bloomery.core.formats import fp8_block128

    folder = _block_folder(tmp_path)
    m, fails = _executor_vs_oracle(folder, tmp_path / "good", bands)
    assert not fails, m
    orig = fp8_block128.FP8Block128.canonical_scale

    def transposed(self, parts, where=""):
        s = orig(self, parts, where)
        return np.ascontiguousarray(np.swapaxes(s, -1, -2)).reshape(s.shape)   # the grid read column-major
    monkeypatch.setattr(fp8_block128.FP8Block128, "canonical_scale", transposed)
    m, fails = _executor_vs_oracle(folder, tmp_path / "bad", bands)
    assert fails, m
