"""Tiny test checkpoints that carry their family's multi-token-prediction layer, in the layout the
released checkpoints store it (docs/mtp.md):

    tiny-qwen3_next-mtp/{bf16,nvfp4}     mtp.fc [H, 2H], mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
                                         mtp.norm, mtp.layers.0.* (vLLM's qwen3_next_mtp.py)
    tiny-glm4_moe-mtp/{bf16,nvfp4}       model.layers.{L}.* + eh_proj, enorm, hnorm, shared_head.norm
                                         (vLLM's glm4_moe_mtp.py), L = num_hidden_layers

transformers builds no module for these layers and drops their tensors on save, so they are made
here, beside the family's tiny export (tools/tiny.py, unchanged):

- Qwen3-Next: one Qwen3NextDecoderLayer of type full_attention (gated attention with q/k norms) with
  the MoE block (routed experts, shared expert, shared_expert_gate), as vLLM builds it; config.json
  carries no MTP key, as the release's does not (vLLM defaults num_nextn_predict_layers to 1).
- GLM-4.5, in GLM-4.6's form: no embed_tokens and no shared_head.head of its own (GLM-4.5-Air stores
  copies of the main model's there); the embedding and the head are the main model's.
  config.json: num_nextn_predict_layers 1.
- Values: seeded. The family's own initialisation (the PreTrainedModel's _init_weights: every linear
  and the experts N(0, initializer_range), as the main layers), then tiny.randomise_init: the router
  N(0, 0.3), every tensor initialised to a constant (norms, biases, the correction bias) that
  constant plus noise, so that enorm and hnorm, or the halves of eh_proj, cannot be swapped unseen.

bf16: the tiny export's model.safetensors, byte for byte, as model-00001-of-00002.safetensors, and
the MTP tensors in BF16 in model-00002-of-00002.safetensors, with an index, as a sharded release.
nvfp4: the main model quantized by ModelOpt as tiny-<family>/nvfp4 is (the same recipe and
calibration batches), and the MTP layer as NVIDIA's NVFP4 releases store it:
- Qwen3-Next: every MTP tensor BF16, through ModelOpt's own path for MTP weights it does not
  calibrate (its llm_ptq example): export_hf_checkpoint(extra_state_dict=...), with
  model._mtp_layer_prefixes = ["mtp"], which writes "mtp*" into exclude_modules.
- GLM-4.5: the NextN layer attached to the model, calibrated with it (its forward run through
  transformers' MtpModel on the main model's hidden states, tools/oracle.py mtp_hidden) and exported
  by ModelOpt: routed experts NVFP4 like the main model's, its attention, shared experts and eh_proj
  BF16 (their quantizers off: ModelOpt lists them in exclude_modules), its router and correction
  bias F32 (held as transformers holds the main ones, _keep_in_fp32_modules_strict).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from . import tiny

FAMILIES = ("qwen3_next", "glm4_moe")
FORMATS = ("nvfp4",)
SEED = tiny.SEED + 14
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")    # main, MTP
_BF16_OFF = ("self_attn", "mlp.shared_experts", "eh_proj")     # the GLM NextN layer's parts kept BF16


def prefix(cfg) -> str:
    """Where a family stores its MTP layer."""
    return "mtp" if cfg.model_type == "qwen3_next" else f"model.layers.{cfg.num_hidden_layers}"


def build_layer(model):
    """The MTP layer of `model`'s family, as a module whose state-dict names below prefix() are the
    stored ones (fused experts aside), initialised as the module docstring says; float32."""
    import torch
    from torch import nn

    cfg = model.config
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    if cfg.model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm as Norm

        from .oracle import mtp_config

        m = nn.Module()
        m.fc = nn.Linear(2 * H, H, bias=False)
        m.pre_fc_norm_embedding, m.pre_fc_norm_hidden, m.norm = Norm(H, eps), Norm(H, eps), Norm(H, eps)
        m.layers = nn.ModuleList([Qwen3NextDecoderLayer(mtp_config(copy.deepcopy(cfg), 1), 0)])
    elif cfg.model_type == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm as Norm

        m = Glm4MoeDecoderLayer(cfg, cfg.num_hidden_layers)
        m.eh_proj = nn.Linear(2 * H, H, bias=False)
        m.enorm, m.hnorm = Norm(H, eps), Norm(H, eps)
        m.shared_head = nn.Module()
        m.shared_head.norm = Norm(H, eps)
    else:
        raise KeyError(cfg.model_type)
    m.float()
    torch.manual_seed(SEED)
    for sub in m.modules():
        model._init_weights(sub)
    tiny.randomise_init(m, SEED + 1)
    return m


def stored_tensors(model, layer) -> dict:
    """The layer's tensors under their stored names (transformers' own reverse conversion of the
    family: fused experts back to one tensor per expert), BF16."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    p = prefix(model.config)
    sd = {f"{p}.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in layer.state_dict().items()}
    return {k: v.contiguous() for k, v in sorted(revert_weight_conversion(model, sd).items())}


def build_bf16(family: str, out: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tiny.build_bf16(family, out)
    if family == "glm4_moe":
        cfg_p = out / "config.json"
        cfg = json.loads(cfg_p.read_text())
        cfg["num_nextn_predict_layers"] = 1
        cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model = AutoModelForCausalLM.from_config(tiny.family_config(family))
    mtp = stored_tensors(model, build_layer(model))
    (out / "model.safetensors").rename(out / SHARDS[0])
    save_file(mtp, str(out / SHARDS[1]), metadata={"format": "pt"})
    shards = [load_file(str(out / s)) for s in SHARDS]
    weight_map = {k: s for s, t in zip(SHARDS, shards) for k in t}
    size = sum(t.numel() * t.element_size() for sh in shards for t in sh.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")


def _mtp_view(model, layer):
    """transformers' MtpModel over `model` whose layer runs `layer` (the stored GLM layout attached to
    the model): its enorm, hnorm, eh_proj, the decoder block and shared_head.norm as post_norm."""
    from transformers.modeling_layers import MtpModel

    from .oracle import mtp_config

    mtp_config(model.config, 1)
    view = MtpModel(model, 1)
    ml = view.layers[0]
    ml.enorm, ml.hnorm, ml.eh_proj, ml.post_norm = layer.enorm, layer.hnorm, layer.eh_proj, layer.shared_head.norm
    ml.mtp_block = layer
    return view.eval()


def build_quant(family: str, fmt: str, out: Path, bf16_dir: Path) -> dict:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from .modelopt_export import FORMATS as RECIPES, finish_folder, format_config, install_cpu_block_quant
    from .oracle import mtp_hidden

    if RECIPES[fmt][1]:
        install_cpu_block_quant()
    cls = tiny.model_class(AutoConfig.from_pretrained(str(bf16_dir)))
    model = cls.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).eval()     # the MTP tensors dropped
    layer = build_layer(model)
    mtp = stored_tensors(model, layer)
    saved = load_file(str(bf16_dir / SHARDS[1]))
    if saved.keys() != mtp.keys() or not all(torch.equal(saved[k], mtp[k]) for k in mtp):
        raise RuntimeError(f"{bf16_dir / SHARDS[1]}: not the MTP layer this recipe draws; rebuild the bf16 folder")
    cfg = format_config(fmt)
    batches = tiny.calib_batches()
    extra = None
    if family == "glm4_moe":
        keep = re.compile("|".join(model._keep_in_fp32_modules_strict or ["$^"]))
        for name, t in layer.state_dict(keep_vars=True).items():    # the bf16 folder's values, held as
            t.data = t.data.to(torch.bfloat16).to(torch.float32 if keep.search(name) else torch.bfloat16)
            # transformers loads the main layers in BF16 (its _keep_in_fp32_modules_strict in F32)
        model.model.layers.append(layer)           # run only by the view below (forward: layers[:L])
        p = prefix(model.config)
        cfg["quant_cfg"] += [{"quantizer_name": f"*{p}.{part}*", "enable": False} for part in _BF16_OFF]

        def forward_loop(m):
            view = _mtp_view(m, m.model.layers[-1])
            with torch.no_grad():
                for ids in batches:
                    mtp_hidden(m, view, ids)
    else:
        model._mtp_layer_prefixes = [prefix(model.config)]       # ModelOpt: exclude_modules "mtp*"
        extra = mtp

        def forward_loop(m):
            with torch.no_grad():
                for ids in batches:
                    m(input_ids=ids)
    model = mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=out, extra_state_dict=extra)
    finish_folder(out, bf16_dir)
    return json.loads((out / "hf_quant_config.json").read_text())
