"""The int4 weight-only peer of tools/bench_decode.py (tools/peer_int4.py): gpt-fast's group
quantization, checked against torch's own int4 kernel (its CPU twin here) and inside a transformers
model, and bench_peer's int4 leg run end to end on the CPU (eager: no compile)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bloomery.tools import peer_int4 as P   # noqa: E402


def test_group_quantize_is_torchs_int4_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 512, generator=g) * torch.rand(96, 1, generator=g) * 3
    q, sz = P.group_quantize(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (4, 96, 2)
    deq = P.dequantize(q, sz)
    scale = sz[:, :, 0].transpose(0, 1).float().repeat_interleave(128, dim=1)
    assert ((deq - w).abs() <= 0.5 * scale + 0.02 * scale + 1e-6).all()       # half a step (+ bf16 scale / zero)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, wp, 128, sz).float()
    ref = x.float() @ deq.T
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()                      # bf16 output rounding


def test_quantize_model_keeps_the_head_and_matches_the_dequantized_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ref = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ref.load_state_dict(m.state_dict())
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(P.dequantize(*P.group_quantize(mod.weight)).to(torch.bfloat16))
    head = m.lm_head.weight.clone()
    before = P.nbytes(m)
    assert P.quantize_model(m) == 2 * 7                                        # q k v o gate up down a layer
    assert isinstance(m.lm_head, torch.nn.Linear) and torch.equal(m.lm_head.weight, head)
    assert P.nbytes(m) < before
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        a, b = m(ids).logits.float(), ref(ids).logits.float()
    assert (a - b).abs().max() <= 0.03 * b.abs().max()
    assert bool((a.argmax(-1) == b.argmax(-1)).all())


def test_bench_peer_int4_leg_runs(tmp_path):
    from bloomery.tools import bench_decode as B
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    r = B.bench_peer(tmp_path, steps=12, prompt_len=8, compiled=False, device="cpu", int4=True)
    assert r["int4_linears"] == 14 and r["int4_bytes"] < r["peer_bytes"]
    assert r["eager_s_per_tok"] > 0 and r["int4_s_per_tok"] > 0 and "compiled_s_per_tok" not in r
