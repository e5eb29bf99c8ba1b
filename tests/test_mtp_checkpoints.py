"""The test checkpoints with an MTP / NextN layer (tools/tiny_mtp.py: tiny-qwen3_next-mtp,
tiny-glm4_moe-mtp; docs/mtp.md) and the oracle of that layer's logits (tools/oracle.py mtp_logits):

- each folder holds its layer under the names and in the formats the released checkpoints use, its
  main model is the tiny export's, byte for byte, and its quantization config says what is stored;
- `bloomery prepare` carries every MTP tensor into the artifact in its stored format, decoding bit
  for bit to the oracle's own dequantization (tools/dequant.py), at tp 1 and 2;
- the oracle's MTP logits are finite, deterministic, cached, of shape [n - 1, vocab], causal, and
  row i reads the hidden state of ids[i] and the embedding of ids[i + 1] only;
- GLM-4.5: they are the logits transformers' own generate(..., use_mtp=True) drafts from (the same
  values, loaded by from_pretrained and MtpModel.from_pretrained, not by the oracle);
- Qwen3-Next (transformers refuses assisted generation for its stateful layers): they equal the
  wiring of vLLM's qwen3_next_mtp.py written out here with transformers' Qwen3Next modules, at
  vLLM's positions."""

import functools
import json

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from bloomery.cli import main
from bloomery.compiler.prepare import prepare
from bloomery.core.artifact.reader import Artifact
from bloomery.tools import dequant, models, oracle
from runtime_artifacts import need

pytestmark = pytest.mark.models

NAMES = [n for n in models.SPECS if n.split("/")[0] in ("tiny-qwen3_next-mtp", "tiny-glm4_moe-mtp")]
GLM = [n for n in NAMES if n.startswith("tiny-glm4_moe-mtp/")]
QWEN = [n for n in NAMES if n.startswith("tiny-qwen3_next-mtp/")]


def cfg_of(folder):
    return json.loads((folder / "config.json").read_text())


def stored(folder) -> dict[str, tuple[str, tuple]]:
    """name -> (safetensors dtype, shape) of every tensor of a folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "np") as sf:
            for k in sf.keys():
                s = sf.get_slice(k)
                out[k] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def arrays(path) -> dict:
    """The tensors of a shard (torch: safetensors' NumPy reader has no float8)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def same(a, b) -> bool:
    """Two torch tensors of one dtype and shape, bit for bit."""
    import torch

    raw = [x.contiguous().reshape(-1).view(torch.uint8) for x in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*raw)


def bits(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def mtp_layout(name) -> dict[str, tuple[str, tuple]]:
    """The MTP tensors a folder must hold, written out from the released layouts and the config:
    {stored name: (dtype, shape)}. nvfp4: GLM's routed experts NVFP4 (+ input_scale, ModelOpt's
    calibrated form) and its router F32 (as ModelOpt stores the main model's); everything else BF16."""
    folder = models.model_dir(name)
    c = cfg_of(folder)
    H, V, heads, kv = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"]
    quant = name.endswith("/nvfp4")
    if c["model_type"] == "qwen3_next":
        d, E, I, Is = c["head_dim"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        p = "mtp.layers.0."
        t = {"mtp.fc.weight": (2 * H,), "mtp.pre_fc_norm_embedding.weight": (), "mtp.pre_fc_norm_hidden.weight": (),
             "mtp.norm.weight": (), p + "input_layernorm.weight": (), p + "post_attention_layernorm.weight": ()}
        t = {k: (H, *v) for k, v in t.items()}
        t.update({p + "self_attn.q_proj.weight": (2 * heads * d, H), p + "self_attn.k_proj.weight": (kv * d, H),
                  p + "self_attn.v_proj.weight": (kv * d, H), p + "self_attn.o_proj.weight": (H, heads * d),
                  p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                  p + "mlp.gate.weight": (E, H), p + "mlp.shared_expert_gate.weight": (1, H),
                  p + "mlp.shared_expert.gate_proj.weight": (Is, H), p + "mlp.shared_expert.up_proj.weight": (Is, H),
                  p + "mlp.shared_expert.down_proj.weight": (H, Is)})
        experts = {f"{p}mlp.experts.{e}.{w}.weight": ((I, H) if w != "down_proj" else (H, I))
                   for e in range(E) for w in ("gate_proj", "up_proj", "down_proj")}
        return {k: ("BF16", s) for k, s in {**t, **experts}.items()}
    d = c.get("head_dim") or H // heads
    E, I, n_sh = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"]
    p = f"model.layers.{c['num_hidden_layers']}."
    t = {p + n: (H,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight",
                               "post_attention_layernorm.weight")}
    t.update({p + "eh_proj.weight": (H, 2 * H), p + "self_attn.q_proj.weight": (heads * d, H),
              p + "self_attn.q_proj.bias": (heads * d,), p + "self_attn.k_proj.weight": (kv * d, H),
              p + "self_attn.k_proj.bias": (kv * d,), p + "self_attn.v_proj.weight": (kv * d, H),
              p + "self_attn.v_proj.bias": (kv * d,), p + "self_attn.o_proj.weight": (H, heads * d),
              p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
              p + "mlp.shared_experts.gate_proj.weight": (I * n_sh, H),
              p + "mlp.shared_experts.up_proj.weight": (I * n_sh, H),
              p + "mlp.shared_experts.down_proj.weight": (H, I * n_sh)})
    out = {k: ("BF16", s) for k, s in t.items()}
    router = "F32" if quant else "BF16"
    out[p + "mlp.gate.weight"] = (router, (E, H))
    out[p + "mlp.gate.e_score_correction_bias"] = (router, (E,))
    for e in range(E):
        for w in ("gate_proj", "up_proj", "down_proj"):
            o, i = (I, H) if w != "down_proj" else (H, I)
            q = f"{p}mlp.experts.{e}.{w}."
            if quant:
                out.update({q + "weight": ("U8", (o, i // 2)), q + "weight_scale": ("F8_E4M3", (o, i // 16)),
                            q + "weight_scale_2": ("F32", ()), q + "input_scale": ("F32", ())})
            else:
                out[q + "weight"] = ("BF16", (o, i))
    return out


_hf_config = functools.lru_cache(maxsize=None)(oracle.hf_config)


def is_mtp(name, folder) -> bool:
    return oracle.is_mtp_tensor(_hf_config(folder), name)


# -- the folders ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_folder_holds_the_released_layout(name):
    """The MTP tensors are exactly the released layout's (names, dtypes, shapes); the config
    says as the releases do how many layers there are (GLM: num_nextn_predict_layers 1; Qwen3-Next:
    no key, vLLM's default of 1); the quantization config covers them as they are stored."""
    from bloomery.compiler import quant_config

    folder = need(name)
    c = cfg_of(folder)
    got = {k: v for k, v in stored(folder).items() if is_mtp(k, folder)}
    assert got == mtp_layout(name)
    if c["model_type"] == "glm4_moe":
        assert c["num_nextn_predict_layers"] == 1
    else:
        assert not {"num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "mtp_layer_types"} & set(c)
    q = quant_config.load(folder, c)
    modules = {k.rsplit(".", 1)[0] for k, (dt, s) in got.items() if k.endswith(".weight") and len(s) == 2}
    for m in sorted(modules):
        packed = got[m + ".weight"][0] == "U8"
        assert (q.format_for(m) == "nvfp4") == packed, (m, q.format_for(m))
    if name.endswith("/nvfp4"):
        exclude = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
        ignore = c["quantization_config"]["ignore"]
        assert sorted(exclude) == sorted(ignore)
        if c["model_type"] == "qwen3_next":
            assert "mtp*" in exclude                       # ModelOpt's own entry for the MTP weights it copies


@pytest.mark.parametrize("name", NAMES)
def test_main_model_is_the_tiny_export(name):
    """Beside its MTP layer a folder is the family's tiny export: the bf16 folder's first shard is
    its model.safetensors byte for byte; the nvfp4 folder's main tensors are those of
    tiny-<family>/nvfp4 bit for bit (the same ModelOpt recipe and calibration), its BF16 MTP tensors
    those of the bf16 folder, its NVFP4 experts a quantization of the bf16 folder's (dequantized by
    tools/dequant.py: within NVFP4's error)."""
    from bloomery.tools import tiny_mtp

    family, fmt = name.split("/")
    folder = need(name)
    base = need(family[: -len(models.MTP_SUFFIX)] + "/" + fmt)
    if fmt == "bf16":
        assert (folder / tiny_mtp.SHARDS[0]).read_bytes() == (base / "model.safetensors").read_bytes()
        assert not (folder / "model.safetensors").exists()
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert index == {k: tiny_mtp.SHARDS[int(is_mtp(k, folder))] for k in stored(folder)}
        return
    got, main = arrays(folder / "model.safetensors"), arrays(base / "model.safetensors")
    assert {k for k in got if not is_mtp(k, folder)} == set(main)
    assert all(same(got[k], main[k]) for k in main)
    ref = arrays(need(f"{family}/bf16") / tiny_mtp.SHARDS[1])
    deq = dequant.folder_weights(folder)
    for k, w in ref.items():
        if got[k].is_floating_point():                 # kept BF16 (the routers F32 of the same values)
            assert same(got[k].to(w.dtype), w) and got[k].float().equal(w.float()), k
        else:                                          # NVFP4: a quantization of the BF16 expert
            x, r = deq[k].numpy(), w.float().numpy()
            assert ".mlp.experts." in k
            assert 0 < np.linalg.norm(x - r) / np.linalg.norm(r) < 0.2, k


# -- prepared -------------------------------------------------------------------------------------


# stored name (below the layer's prefix) -> artifact name (below its prefix), for the names both share
ART = {"qwen3_next": {"fc.weight": "mtp.nextn.eh_proj", "pre_fc_norm_embedding.weight": "mtp.nextn.enorm",
                      "pre_fc_norm_hidden.weight": "mtp.nextn.hnorm", "norm.weight": "mtp.nextn.shared_head_norm"},
       "glm4_moe": {"eh_proj.weight": "nextn.eh_proj", "enorm.weight": "nextn.enorm", "hnorm.weight": "nextn.hnorm",
                    "shared_head.norm.weight": "nextn.shared_head_norm"}}
BLOCK = {"self_attn.q_proj.weight": "attn_q", "self_attn.o_proj.weight": "attn_output",
         "mlp.experts.0.gate_proj.weight": "ffn_gate_exps", "mlp.experts.0.down_proj.weight": "ffn_down_exps",
         "mlp.gate.weight": "ffn_gate_inp", "input_layernorm.weight": "attn_norm"}


def rank_slice(full, cut, tp, rank):
    """The slice of a tensor a rank holds (the tiny configs cut every MTP tensor into equal halves)."""
    if tp == 1 or cut == "replicated":
        return full
    axis = {"column": -2 if full.ndim >= 2 else 0, "row": -1}[cut]
    return np.split(full, tp, axis=axis)[rank]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_prepare_carries_the_mtp_layer_as_stored(name, tp, tmp_path):
    """Every MTP tensor is in the artifact, once, in its stored format, under llama.cpp's names (the
    specs' MTP / NextN entries), and every rank's piece decodes bit for bit to the oracle's own
    dequantization of the checkpoint; `bloomery inspect --json` lists them so."""
    folder = need(name)
    c = cfg_of(folder)
    prepare(folder, tmp_path / "art", tp=tp, progress=False)
    art = Artifact.open(tmp_path / "art", verify=True)
    deq = {k: v.numpy() for k, v in dequant.folder_weights(folder).items()}
    want = {k for k in deq if is_mtp(k, folder)}
    layout = mtp_layout(name)
    fam = c["model_type"]
    pre = "mtp." if fam == "qwen3_next" else f"model.layers.{c['num_hidden_layers']}."
    blk = "mtp.blk.0." if fam == "qwen3_next" else f"blk.{c['num_hidden_layers']}."
    names = {**{pre + k: (v if fam == "qwen3_next" else blk + v) for k, v in ART[fam].items()},
             **{(pre + "layers.0." if fam == "qwen3_next" else pre) + k: blk + v for k, v in BLOCK.items()}}
    for rank in range(tp):
        seen = set()
        for base, t in art.tensors(rank).items():
            if not set(t.sources) & want:
                continue
            assert set(t.sources) <= want, base
            seen.update(t.sources)
            full = np.stack([deq[s] for s in t.sources]) if t.role.endswith("_exps") else deq[t.sources[0]]
            piece = rank_slice(full, t.cut, tp, rank)
            got = art.decode(base, rank)
            assert got.shape == piece.shape and np.array_equal(bits(got.astype(np.float32)), bits(piece)), (base, rank)
            dt = layout[t.sources[0]][0]
            assert t.format == {"BF16": "bf16", "F32": "f32", "U8": "nvfp4"}[dt], (base, t.format, dt)
            for s in t.sources:
                if s in names:
                    assert base == names[s], (s, base)
        assert seen == want
    res = CliRunner().invoke(main, ["inspect", str(tmp_path / "art"), "--json"])
    assert res.exit_code == 0, res.output
    listed = {t["name"]: t for t in json.loads(res.output)["tensors"]}
    for hf, base in names.items():
        assert listed[base]["sources"][0] == hf
        assert listed[base]["format"] == {"BF16": "bf16", "F32": "f32", "U8": "nvfp4"}[layout[hf][0]]


# -- the oracle -----------------------------------------------------------------------------------


def ids_of(folder, n=24, seed=3):
    return [int(i) for i in np.random.default_rng(seed).integers(3, cfg_of(folder)["vocab_size"], n)]


@pytest.mark.parametrize("name", NAMES)
def test_mtp_logits_shape_cache_and_what_each_row_reads(name, tmp_path, monkeypatch):
    """[n - 1, vocab] float32, finite, the same on a second build (bit for bit) and from the cache;
    causal (a prefix gives the prefix's rows); row i reads ids[i] (through the main model's hidden
    state) and ids[i + 1] (its embedding) and nothing later: changing the last id changes only the
    last row, changing ids[-2] the last two. They are not the main model's logits."""
    monkeypatch.setenv(oracle.CACHE_ENV, str(tmp_path / "cache"))
    folder = need(name)
    ids = ids_of(folder)
    V = cfg_of(folder)["vocab_size"]
    o = oracle.Oracle(folder)
    a = o.mtp_logits(ids)
    assert a.shape == (len(ids) - 1, V) and a.dtype == np.float32 and np.isfinite(a).all()
    assert o.computed == 1
    again = oracle.Oracle(folder)
    assert np.array_equal(again.mtp_logits(ids), a) and again.computed == 0                   # the cache
    fresh = oracle.mtp_logits(folder, ids, cache=False)
    assert np.array_equal(bits(fresh), bits(a))
    head = oracle.mtp_logits(folder, ids[:10], cache=False)
    np.testing.assert_allclose(head, a[:9], rtol=0, atol=1e-5 * np.abs(a).max())
    main_logits = o.logits(ids)
    assert min(np.linalg.norm(a[i] - main_logits[i + 1]) / np.linalg.norm(a[i]) for i in range(len(a))) > 0.1
    for k, rows in ((1, 1), (2, 2)):
        alt = list(ids)
        alt[-k] = (alt[-k] + 7) % V
        b = oracle.mtp_logits(folder, alt, cache=False)
        same = [bool(np.allclose(a[i], b[i], rtol=0, atol=1e-5 * np.abs(a).max())) for i in range(len(a))]
        assert same == [True] * (len(a) - rows) + [False] * rows, (k, same)


def f32_folder(folder, dst):
    """The folder's weights as the oracle decodes them (tools/dequant.py), in a plain float32 folder
    that transformers loads itself (no quantization config)."""
    import torch
    from safetensors.torch import save_file

    dst.mkdir()
    c = cfg_of(folder)
    c.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(c))
    w = {k: v.to(torch.float32).contiguous() for k, v in dequant.folder_weights(folder).items()}
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", GLM)
def test_glm_mtp_logits_are_what_generate_use_mtp_drafts_from(name, tmp_path):
    """transformers' own MTP decoding (generate(..., use_mtp=True): MTPCandidateGenerator over
    MtpModel.from_pretrained, its cache, its slicing of hidden states and positions) on the same
    values, loaded by transformers itself: at every step the drafted token is the argmax of the
    oracle's row for that position, and the drafted logits are that row (float32 rounding); the
    output is plain greedy decoding's."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation import candidate_generator as cg

    folder = need(name)
    plain = f32_folder(folder, tmp_path / "f32")
    model = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32, attn_implementation="eager").eval()
    model.config._experts_implementation = "eager"
    L = model.config.num_hidden_layers
    # the class lists the released checkpoints' NextN layers (92, 46) for MtpModel to find; the tiny one is L
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}.*"]
    drafts = []
    get = cg.MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *a, **kw):
        cand, logits = get(self, input_ids, *a, **kw)
        if logits is not None:
            drafts.append((input_ids.shape[1], int(cand[0, -1]), logits[0, -1].float().numpy().copy()))
        return cand, logits

    prompt = torch.tensor([ids_of(folder, 12, seed=1)])
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=cfg_of(folder)["pad_token_id"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cg.MTPCandidateGenerator, "get_candidates", record)
        out = model.generate(prompt, use_mtp=True, **kw)
    assert torch.equal(out, model.generate(prompt, **kw))
    rows = oracle.mtp_logits(folder, out[0].tolist(), cache=False)
    assert len(drafts) >= 10
    for n, token, logits in drafts:              # n ids so far: the draft is for id n, MTP row n - 2
        row = rows[n - 2]
        assert token == int(np.argmax(row)), n
        assert np.linalg.norm(logits - row) / np.linalg.norm(row) < 1e-5, n


def vllm_mtp_logits(folder, ids):
    """Qwen3-Next's MTP as vLLM's qwen3_next_mtp.py wires it, written out from the stored names:
    x = fc([pre_fc_norm_embedding(embed(ids[i+1])), pre_fc_norm_hidden(h_i)]), h_i the target model's
    output (Qwen3NextModel.forward: its final norm's), one Qwen3NextDecoderLayer of type full_attention
    at the hidden state's positions i (the proposer keeps target_positions), then mtp.norm and the
    target's lm_head; the norms Qwen3NextRMSNorm (1 + weight), the embedding the target's."""
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as q3

    w = {k: v.to(torch.float32) for k, v in dequant.folder_weights(folder).items()}
    cfg = oracle.hf_config(folder)
    model = oracle.Oracle(folder, cache=False).model
    layer_cfg = cfg.__class__(**{**cfg.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
    layer = q3.Qwen3NextDecoderLayer(layer_cfg, 0).float().eval()
    p = "mtp.layers.0."
    sd = {k[len(p):]: v for k, v in w.items() if k.startswith(p) and ".mlp.experts." not in k}
    E = cfg.num_experts
    ex = [[w[f"{p}mlp.experts.{e}.{n}.weight"] for e in range(E)] for n in ("gate_proj", "up_proj", "down_proj")]
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(ex[0], ex[1])])
    sd["mlp.experts.down_proj"] = torch.stack(ex[2])
    layer.load_state_dict(sd, strict=True)

    def norm(name, x):
        n = q3.Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.data = w[name]
        return n(x)
    t = torch.tensor([ids])
    with torch.no_grad():
        h = model.model(input_ids=t).last_hidden_state[:, :-1]
        e = torch.nn.functional.embedding(t[:, 1:], w["model.embed_tokens.weight"])
        x = torch.cat([norm("mtp.pre_fc_norm_embedding.weight", e), norm("mtp.pre_fc_norm_hidden.weight", h)], -1)
        x = x @ w["mtp.fc.weight"].T
        pos = torch.arange(len(ids) - 1)[None]
        rope = model.model.rotary_emb(x, position_ids=pos)
        mask = torch.full((len(ids) - 1,) * 2, -torch.inf).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        return (norm("mtp.norm.weight", x) @ w["lm_head.weight"].T)[0].numpy()


@pytest.mark.parametrize("name", QWEN)
def test_qwen3_next_mtp_logits_follow_vllm_wiring(name):
    """The oracle (transformers' MtpModel, the Mellum renames onto Qwen3-Next's mtp.* layout) equals
    vLLM's Qwen3-Next MTP wiring, written out independently: every row within float32 rounding
    (the two also differ by the one-position offset of the rotary positions, which attention does
    not see), the same argmax."""
    folder = need(name)
    ids = ids_of(folder)
    a, ref = oracle.mtp_logits(folder, ids, cache=False), vllm_mtp_logits(folder, ids)
    assert a.shape == ref.shape
    for i in range(len(a)):
        assert np.linalg.norm(a[i] - ref[i]) / np.linalg.norm(ref[i]) < 1e-5, i
        assert int(np.argmax(a[i])) == int(np.argmax(ref[i])), i


def test_mtp_oracle_refuses_a_folder_without_its_layer():
    """A checkpoint with no MTP tensors is refused by name, not run on an empty layer."""
    folder = need("tiny-qwen3_next/bf16")
    with pytest.raises(oracle.OracleError, match="stores 0 MTP / NextN layers"):
        oracle.mtp_logits(folder, [5, 6, 7], cache=False)
