"""The model oracle: a Hugging Face transformers forward in float32 of a checkpoint folder.

    from bloomery.tools import oracle
    o = oracle.Oracle(folder)                  # nothing is built until a cache miss
    o.logits(ids)                              # float32 [n, vocab], teacher-forced
    oracle.logits(folder, ids)                 # the same, one call
    o.mtp_logits(ids)                          # the MTP / NextN layer's, [n - 1, vocab] (mtp_hidden)

    python -m bloomery.tools.oracle FOLDER --ids IDS.json --out OUT.npy [--mtp]
    python -m bloomery.tools.oracle FOLDER --prompt "What is the capital of France?" --generate 12

How the model is made (transformers cannot load ModelOpt folders itself: it skips the modelopt
quantization, see shared/notes/modelopt-cpu.md):
- the architecture comes from config.json (quantization_config dropped) through
  AutoModelForCausalLM.from_config, float32, eval, eager attention and eager experts;
- every weight is read from the safetensors shards and dequantized by the oracle's own code
  (tools/dequant.py: written from the formats' published definitions, in torch; it imports
  nothing of bloomery's formats, compiler or runtime, so a decoder defect there shows against
  it), then loaded with strict=True: a parameter nobody fills, or a stored tensor nobody uses,
  is an error;
- weight-only: input_scale is ignored; NVFP4_AWQ's pre_quant_scale (which multiplies the
  activation entering that linear) is folded into the weight, W_eff = W * pre_quant_scale[None, :];
  FP8 KV-cache scales (k_scale / v_scale) are ignored (the cache is float32);
- tied embeddings as the config says (lm_head shares embed_tokens when tie_word_embeddings);
- the MTP / NextN layer a checkpoint stores (Qwen3-Next's mtp.*, GLM-4.5's model.layers.{L}..., L =
  num_hidden_layers) is not part of that model (transformers skips it on load): mtp_logits runs it
  as transformers' MtpModel (generate(..., use_mtp=True)) over the main model, build_mtp and
  mtp_hidden state the wiring (docs/mtp.md);
- MoE experts stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) are stacked
  into transformers' fused `experts.gate_up_proj` [E, 2I, H] (gate rows first) and
  `experts.down_proj` [E, H, I];
- the flagship families (qwen4_exp, glm5_next: FROM_STORED_NAMES), whose stored names are not the
  module names (PLE shards, glm's hc_ / q,k,v_conv1d / forget-gate names, per-expert experts,
  docs/flagships.md), are loaded by transformers' own loading conversion instead, the contract:
  the decoded float32 tensors under their stored names go to the architecture's from_pretrained
  (state_dict=, dtype float32), and a missing, unexpected or mis-shaped key is an error. glm5_next is
  a Glm5NextForConditionalGeneration: its vision tower is loaded as stored and not run (the logits
  of token ids come from the language model and lm_head).

Selections that a float32 rounding can flip are measured, so that the gates can leave them out:
router_margins (MoE top-k, with the group limit) and indexer_margins (the QSA / DSA indexers'
top-k of blocks / pools); tie_margins is the smaller of the two per position.

`weights=` replaces the checkpoint's tensors with another source of HF-named float32 arrays
(e.g. an artifact's tensors decoded by core/artifact/reader: `artifact_weights(path)`), so
the same forward can run on the values an artifact holds (the Q8 lever's measurement).

Results are cached on disk under $BLOOMERY_ORACLE_CACHE (default ~/.cache/bloomery/oracle),
keyed by a content hash of the folder's weights and config, of the oracle's own code (this
file and tools/dequant.py), the torch and transformers versions, and a
hash of the token ids: repeated gates do not recompute, and a code edit never reads a stale answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

ORACLE_VERSION = "1"          # bump when the forward or the weight rules change: old cache entries go stale
CACHE_ENV = "BLOOMERY_ORACLE_CACHE"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HASHED_SUFFIXES = (".safetensors", ".json")
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
# model types loaded through transformers' own conversion of the stored names (load_stored)
FROM_STORED_NAMES = ("qwen4_exp_text", "glm5_next")


class OracleError(RuntimeError):
    pass


# --------------------------------------------------------------------------- cache keys


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bloomery" / "oracle"


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "absent"


_FILE_HASHES: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    h = _FILE_HASHES.get(key)
    if h is None:
        d = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                d.update(chunk)
        h = _FILE_HASHES[key] = d.hexdigest()
    return h


def code_key() -> str:
    """Hash of the code that makes the oracle's numbers: this file and its dequantization
    (tools/dequant.py); an edit there recomputes, never serves a stale cached answer."""
    here = Path(__file__).resolve()
    d = hashlib.sha256()
    for p in [here, here.parent / "dequant.py"]:
        d.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return d.hexdigest()


def folder_key(folder, weights_key: str | None = None) -> str:
    """Content hash of what the oracle reads from `folder` (config, quant config, shards),
    the oracle's code (code_key), the torch/transformers versions; `weights_key` names a
    replacement weight source (artifact_weights)."""
    folder = Path(folder)
    d = hashlib.sha256()
    d.update(f"oracle {ORACLE_VERSION} {code_key()} torch {_version('torch')} "
             f"transformers {_version('transformers')}\0".encode())
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name.endswith(_HASHED_SUFFIXES) and not p.name.startswith("tokenizer"):
            if weights_key is not None and p.name.endswith(".safetensors"):
                continue
            d.update(p.name.encode() + b"\0" + _file_sha256(p).encode() + b"\0")
    if weights_key is not None:
        d.update(b"weights\0" + weights_key.encode())
    return d.hexdigest()[:32]


def ids_key(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]


# --------------------------------------------------------------------------- weights


def checkpoint_weights(folder) -> dict[str, np.ndarray]:
    """HF name -> float32 weight dequantized by the oracle's own rules (tools/dequant.py),
    pre_quant_scale folded. input_scale and KV-cache scales are not weights and do not appear."""
    from bloomery.tools import dequant

    try:
        return {n: v.numpy() for n, v in dequant.folder_weights(folder).items()}
    except dequant.DequantError as e:
        raise OracleError(f"{folder}: {e}") from e


def fold_pre_quant_scale(w: np.ndarray, pqs) -> np.ndarray:
    """W_eff = W * pre_quant_scale[None, :] (pre_quant_scale multiplies the input channels)."""
    pqs = np.asarray(pqs, dtype=np.float32)
    if pqs.shape[-1] != w.shape[-1]:
        raise OracleError(f"pre_quant_scale of shape {list(pqs.shape)} does not match a weight of shape "
                          f"{list(w.shape)} (it scales the last axis, the input channels)")
    if pqs.ndim == 1:
        return w * pqs[None, :]
    return w * pqs[..., None, :]


def artifact_weights(path, rank: int = 0) -> dict[str, np.ndarray]:
    """An artifact's tensors (one rank of a tp 1 artifact) decoded by core/artifact/reader and
    split back into HF names through each tensor's `sources` (stacked experts along axis 0)."""
    from bloomery.core.artifact.reader import Artifact

    a = Artifact.open(path)
    if a.tp != 1:
        raise OracleError(f"{path}: artifact_weights reads a tp 1 artifact (this one is tp {a.tp})")
    out: dict[str, np.ndarray] = {}
    for base, info in a.tensors(rank).items():
        if all(s.endswith(_KV_SCALE_SUFFIXES) for s in info.sources):
            continue                     # FP8 KV-cache scales: ignored (the oracle's cache is float32)
        w = a.decode(base, rank)
        parts = a.parts(base, rank)
        if "pre_quant_scale" in parts:
            w = fold_pre_quant_scale(w, parts["pre_quant_scale"])
        if len(info.sources) == 1:
            out[info.sources[0]] = w
        elif w.shape[0] == len(info.sources):
            for i, s in enumerate(info.sources):
                out[s] = np.ascontiguousarray(w[i])
        else:
            raise OracleError(f"{path}: tensor {base!r} of shape {list(w.shape)} has {len(info.sources)} sources; "
                              "cannot split it back into HF tensors")
    a.close()
    return out


# --------------------------------------------------------------------------- model


def hf_config(folder):
    """The transformers config of the folder, without its quantization_config."""
    from transformers import AutoConfig

    raw = json.loads((Path(folder) / "config.json").read_text())
    raw.pop("quantization_config", None)
    model_type = raw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **raw)
    return cfg


def is_mtp_tensor(cfg, name: str) -> bool:
    """A stored tensor of the MTP / NextN layers, which the main model does not hold: Qwen3-Next's
    `mtp.*`, GLM-4.5's `model.layers.{L .. L+n-1}.*` (L = num_hidden_layers, n =
    num_nextn_predict_layers)."""
    if name.startswith("mtp."):
        return True
    m = _LAYER_RE.match(name)
    L = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    return bool(m) and L <= int(m.group(1)) < L + int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def state_dict_for(model, weights: Mapping[str, np.ndarray], tied: bool) -> dict:
    """Map HF-named float32 arrays onto the model's state dict: exact names, the fused MoE
    expert tensors, and a tied lm_head; every parameter filled, every array used."""
    import torch

    target = model.state_dict()
    # tensors transformers itself ignores on load, and the MTP / NextN layers (is_mtp_tensor: the
    # MtpModel's, mtp_logits): not the model's. Any other stray layer is still an error.
    skip = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    weights = {n: w for n, w in weights.items()
               if n in target or not (is_mtp_tensor(model.config, n) or any(r.search(n) for r in skip))}
    experts: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    plain: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        m = _EXPERT_RE.match(name)
        if m and name not in target:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = w
        else:
            plain[name] = w
    sd: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key, ref in target.items():
        if key in plain:
            arr = plain[key]
            used.add(key)
        elif key == "lm_head.weight" and tied and "model.embed_tokens.weight" in plain:
            arr = plain["model.embed_tokens.weight"]
        elif key.endswith(".gate_up_proj") and key[: -len(".gate_up_proj")] in experts:
            ex = experts[key[: -len(".gate_up_proj")]]
            n = ref.shape[0]
            arr = np.stack([np.concatenate([ex["gate_proj"][e], ex["up_proj"][e]], axis=0) for e in range(n)])
            used.update(f"{key[:-len('.gate_up_proj')]}.{e}.{p}.weight" for e in range(n) for p in ("gate_proj", "up_proj"))
        elif key.endswith(".down_proj") and key[: -len(".down_proj")] in experts:
            ex = experts[key[: -len(".down_proj")]]
            n = ref.shape[0]
            arr = np.stack([ex["down_proj"][e] for e in range(n)])
            used.update(f"{key[:-len('.down_proj')]}.{e}.down_proj.weight" for e in range(n))
        else:
            raise OracleError(f"model parameter {key!r} {list(ref.shape)} has no stored tensor")
        if tuple(arr.shape) != tuple(ref.shape):
            raise OracleError(f"model parameter {key!r} is {list(ref.shape)}, the stored tensor is {list(arr.shape)}")
        sd[key] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    unused = sorted(set(weights) - used - ({"lm_head.weight"} if tied and "lm_head.weight" in sd else set()))
    if unused:
        raise OracleError(f"stored tensors the model has no place for: {', '.join(unused[:8])}"
                          + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else ""))
    return sd


def load_stored(cfg, weights: Mapping[str, np.ndarray]):
    """The float32 model of `cfg`'s architecture from tensors under their stored names, through
    transformers' own loading conversion (from_pretrained with a state_dict): every parameter and
    persistent buffer filled, every tensor used, shapes equal."""
    import torch
    import transformers
    from transformers.utils import logging as tlog

    cls = getattr(transformers, cfg.architectures[0])
    sd = {n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in weights.items()}
    verbosity = tlog.get_verbosity()
    tlog.set_verbosity_error()      # the loading report: checked below instead
    tlog.disable_progress_bar()
    try:
        # mismatched shapes come back in the loading info (named below) instead of raising
        model, info = cls.from_pretrained(None, config=cfg, state_dict=sd, dtype=torch.float32,
                                          attn_implementation="eager", experts_implementation="eager",
                                          ignore_mismatched_sizes=True, output_loading_info=True)
    except RuntimeError as e:        # conversion errors
        raise OracleError(f"transformers cannot load the stored tensors: {e}") from e
    finally:
        tlog.set_verbosity(verbosity)
        tlog.enable_progress_bar()
    bad = [f"{what}: {', '.join(sorted(map(str, info[key]))[:8])}"
           + (f" (+{len(info[key]) - 8} more)" if len(info[key]) > 8 else "")
           for key, what in (("missing_keys", "model parameters with no stored tensor"),
                             ("unexpected_keys", "stored tensors the model has no place for"),
                             ("mismatched_keys", "stored shapes that are not the model's (name, stored, model)"),
                             ("error_msgs", "errors")) if info[key]]
    if bad:
        raise OracleError("; ".join(bad))
    return model.eval()


def build_model(folder, weights: Mapping[str, np.ndarray] | None = None):
    """The float32 transformers model of `folder` with the decoded weights (or `weights`)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(folder)
    if weights is None:
        weights = checkpoint_weights(folder)
    torch.manual_seed(0)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if cfg.model_type in FROM_STORED_NAMES:
        model = load_stored(cfg, weights)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
        if hasattr(model.config, "_experts_implementation"):
            model.config._experts_implementation = "eager"
        model.eval()
        sd = state_dict_for(model, weights, tied)
        model.load_state_dict(sd, strict=True)
        if tied:
            model.tie_weights()
    not_f32 = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if not_f32:     # load_state_dict would have rounded the decoded weights into them
        raise OracleError(f"{folder}: the model holds {', '.join(not_f32)} parameters; the oracle is float32")
    return model


def forward_logits(model, ids: Sequence[int]) -> np.ndarray:
    import torch

    if len(ids) == 0:
        raise OracleError("no token ids")
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32).numpy().copy()


# --------------------------------------------------------------------------- the MTP / NextN layer


def mtp_layer_count(cfg, names: Iterable[str]) -> int:
    """The MTP / NextN layers a checkpoint stores: GLM-4.5's config says (num_nextn_predict_layers);
    Qwen3-Next's config.json carries no count (vLLM's qwen3_next_mtp defaults
    num_nextn_predict_layers to 1): the `mtp.layers.{i}` stored."""
    if cfg.model_type == "qwen3_next":
        return len({int(m.group(1)) for n in names if (m := _MTP_LAYER_RE.match(n))})
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def mtp_config(cfg, n: int):
    """Set on the main model's config what transformers' get_mtp_config reads: num_mtp_layers (GLM's
    num_nextn_predict_layers), and, for a config with layer_types, mtp_layer_types: full attention,
    Qwen3-Next's MTP layer (vLLM's qwen3_next_mtp builds it with layer_type "full_attention"). Returns
    the MTP layers' config (get_mtp_config: layers counted from 0, MoE)."""
    cfg.num_mtp_layers = n
    if getattr(cfg, "layer_types", None) is not None and getattr(cfg, "mtp_layer_types", None) is None:
        cfg.mtp_layer_types = ["full_attention"] * n
    return cfg.get_mtp_config()


def build_mtp(model, weights: Mapping[str, np.ndarray]):
    """transformers' MtpModel (modeling_layers.py: the drafter of generate(..., use_mtp=True)) over the
    float32 main `model`, its layer loaded from the stored MTP tensors among `weights` by
    transformers' own conversion (MtpModel.get_weight_conversions: `layers.{L}.` -> `layers.0.mtp_block.`,
    the "MtpModel" renames of conversion_mapping.py, among them Qwen3-Next's `mtp.fc` /
    `mtp.pre_fc_norm_*` / `mtp.norm`, then the family's own, per-expert -> fused experts), every
    parameter filled and every tensor used. Its embedding, head and rotary embedding are the main
    model's (tie_with_main_model): a NextN layer's own embed_tokens / shared_head.head, as GLM-4.5-Air
    stores them, are not read (MtpModel._keys_to_ignore_on_load_unexpected). One layer: chained
    layers draft from their own tokens, which a teacher-forced oracle does not define."""
    import torch
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig

    cfg = model.config
    stored = {n: torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
              for n, w in weights.items() if is_mtp_tensor(cfg, n)}
    n = mtp_layer_count(cfg, stored)
    if n != 1:
        raise OracleError(f"the checkpoint stores {n} MTP / NextN layers ({len(stored)} tensors); the MTP oracle "
                          "reads exactly one")
    mtp_config(cfg, n)
    torch.manual_seed(0)
    mtp = MtpModel(model, n)
    info, _ = convert_and_load_state_dict_in_model(
        model=mtp, state_dict=stored,
        load_config=LoadStateDictConfig(weight_mapping=mtp.get_weight_conversions(model), dtype=torch.float32))
    mtp._adjust_missing_and_unexpected_keys(info)
    bad = [f"{what}: {', '.join(sorted(map(str, got))[:8])}" + (f" (+{len(got) - 8} more)" if len(got) > 8 else "")
           for what, got in (("MTP parameters with no stored tensor", info.missing_keys),
                             ("stored MTP tensors the MtpModel has no place for", info.unexpected_keys),
                             ("stored shapes that are not the MtpModel's", info.mismatched_keys),
                             ("errors", info.error_msgs), ("conversion errors", info.conversion_errors)) if got]
    if bad:
        raise OracleError("; ".join(bad))
    mtp.tie_with_main_model(model)
    not_f32 = sorted({str(p.dtype) for p in mtp.parameters() if p.dtype != torch.float32})
    if not_f32:
        raise OracleError(f"the MtpModel holds {', '.join(not_f32)} parameters; the oracle is float32")
    return mtp.eval()


def mtp_hidden(model, mtp, ids):
    """Teacher-forced MTP rows over token ids [B, n] (torch): row i feeds the main model's hidden state
    of ids[i] and the embedding of ids[i+1] at position i + 1, and predicts ids[i+2]; the rows attend
    causally over each other (the layer's own KV cache), n - 1 of them. The hidden state is the one
    generate(..., use_mtp=True) feeds, `hidden_states[-1]` (candidate_generator.py
    MTPCandidateGenerator.get_candidates), which capture_outputs ties to last_hidden_state: the output
    of the main model's final norm. Position i + 1 is the embedded token's (get_candidates slices
    position_ids with the shifted input_ids; vLLM's proposer keeps the hidden state's own, i: one
    offset for every row, which rotary attention does not see). Returns the layer's output after its
    own final norm (GLM shared_head.norm, Qwen3-Next mtp.norm) [B, n - 1, H]."""
    import torch

    n = ids.shape[1]
    if n < 2:
        raise OracleError("the MTP oracle needs two token ids or more")
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    pos = torch.arange(1, n, dtype=torch.long)[None].expand(ids.shape[0], -1)
    return mtp.forward_layer(0, out.hidden_states[-1][:, :-1], pos, None, input_ids=ids[:, 1:])


# --------------------------------------------------------------------------- selection margins


def _cut_margins(s, k: int, valid=None) -> np.ndarray:
    """Rows of scores s [R, n] (float32 torch), keeping the top k of the valid ones: the relative
    gap (s_k - s_(k+1)) / max|s| at the cut; +inf for a row with k or fewer valid entries."""
    import torch

    s = s.to(torch.float64)
    if valid is None:
        valid = torch.ones_like(s, dtype=torch.bool)
    n_valid = valid.sum(-1)
    s = s.masked_fill(~valid, -torch.inf)
    kk = min(k + 1, s.shape[-1])
    top = torch.topk(s, kk, dim=-1).values
    scale = s.abs().masked_fill(~valid, 0).amax(-1).clamp_min(1e-30)
    out = torch.full((s.shape[0],), torch.inf, dtype=torch.float64)
    cut = n_valid > k
    if kk == k + 1:
        out[cut] = ((top[:, k - 1] - top[:, k]) / scale)[cut]
    return out.numpy()


def _router_margins(model, ids, worst) -> bool:
    import torch

    routers = [m for m in model.modules() if "router" in type(m).__name__.lower() and hasattr(m, "weight")]

    def hook(mod, args):
        x = args[0].reshape(-1, mod.weight.shape[-1]).to(torch.float32)
        s = x @ mod.weight.to(torch.float32).T
        if hasattr(mod, "e_score_correction_bias"):
            s = s.sigmoid() + mod.e_score_correction_bias.to(torch.float32)
        k = int(getattr(mod, "top_k", None) or getattr(model.config, "num_experts_per_tok"))
        groups = int(getattr(mod, "num_group", 1) or 1)
        if groups > 1:               # GLM's group limit: the chosen groups, then top-k inside them
            kg = int(mod.topk_group)
            g = s.view(s.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)
            chosen = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(kg, dim=-1).indices, True)
            inside = chosen.repeat_interleave(s.shape[-1] // groups, dim=-1)
            m = np.minimum(_cut_margins(g, kg), _cut_margins(s, k, inside))
        else:
            top = torch.topk(s, k + 1, dim=-1).values
            m = ((top[:, k - 1] - top[:, k]) / s.abs().amax(dim=-1).clamp_min(1e-30)).double().numpy()
        np.minimum(worst, m[: len(ids)], out=worst)
    handles = [r.register_forward_pre_hook(hook) for r in routers]
    try:
        if routers:
            forward_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return bool(routers)


def _indexer_margins(model, ids, worst) -> bool:
    """Record every top-k an indexer module takes (TorchFunctionMode inside its forward): QSA
    takes one per position over a 1-D score vector (from the first position with a complete
    block on), DSA one over [1, positions, pools] with the unselectable pools at float32's
    lowest; either way the rows recorded are the sequence's last positions, in order."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.rows = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.topk, torch.Tensor.topk):
                s, k = args[0], int(kwargs.get("k", args[1] if len(args) > 1 else 0))
                if kwargs.get("dim", args[2] if len(args) > 2 else -1) not in (-1, s.ndim - 1):
                    raise OracleError(f"an indexer took a top-k over dim {kwargs.get('dim')} of {s.ndim}")
                s = s.detach().float().reshape(-1, s.shape[-1]) if s.ndim > 1 else s.detach().float()[None]
                self.rows.append(_cut_margins(s, k, s > torch.finfo(torch.float32).min))
            return func(*args, **kwargs)

    indexers = [m for m in model.modules() if type(m).__name__.lower().endswith("indexer")]
    records = []

    def wrap(mod):
        forward = mod.forward

        def recorded(*a, **kw):
            rec = Record()
            with rec:
                out = forward(*a, **kw)
            records.append(rec)
            return out
        mod.forward = recorded
    for m in indexers:
        wrap(m)
    try:
        if indexers:
            forward_logits(model, ids)
    finally:
        for m in indexers:
            del m.forward
    n = len(ids)
    for rec in records:
        rows = np.concatenate(rec.rows) if rec.rows else np.zeros(0)
        if rows.size > n:
            raise OracleError(f"an indexer took {rows.size} top-k rows for {n} positions")
        np.minimum(worst[n - rows.size:], rows, out=worst[n - rows.size:])
    return bool(indexers)


# --------------------------------------------------------------------------- the oracle


class Oracle:
    """Teacher-forced float32 logits of one checkpoint folder, cached on disk.

    weights: a callable returning HF-named float32 arrays (replaces the checkpoint's tensors),
    with weights_key naming it in the cache key (e.g. the artifact's SHA256SUMS hash)."""

    def __init__(self, folder, *, weights: Callable[[], Mapping[str, np.ndarray]] | None = None,
                 weights_key: str | None = None, cache: bool = True):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise OracleError(f"{self.folder}: no config.json")
        if (weights is None) != (weights_key is None):
            raise OracleError("weights and weights_key go together")
        self._weights = weights
        self._weights_key = weights_key
        self.key = folder_key(self.folder, weights_key)
        self.cache = cache
        self._model = None
        self._mtp = None
        self.computed = 0      # forwards run (cache misses)

    @property
    def model(self):
        if self._model is None:
            self._model = build_model(self.folder, self._weights() if self._weights else None)
        return self._model

    @property
    def mtp(self):
        """transformers' MtpModel over `model`, loaded from the stored MTP / NextN tensors (build_mtp)."""
        if self._mtp is None:
            self._mtp = build_mtp(self.model, self._weights() if self._weights else checkpoint_weights(self.folder))
        return self._mtp

    def cache_path(self, ids: Sequence[int]) -> Path:
        return cache_dir() / self.key / f"{ids_key(ids)}.npy"

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        ids = [int(i) for i in ids]
        p = self.cache_path(ids)
        if self.cache and p.is_file():
            try:
                arr = np.load(p)
                if arr.shape[0] == len(ids) and arr.dtype == np.float32:
                    return arr
            except (OSError, ValueError):
                pass
        arr = forward_logits(self.model, ids)
        self.computed += 1
        if self.cache:
            self._store(p, arr)
        return arr

    def mtp_logits(self, ids: Sequence[int]) -> np.ndarray:
        """The MTP / NextN layer's float32 logits [n - 1, vocab], teacher-forced over `ids`: row i
        predicts ids[i + 2] from the main model's final-norm hidden state of ids[i] and the embedding
        of ids[i + 1] (mtp_hidden: which hidden state, which positions), through the layer's own
        final norm and the main model's lm_head (MtpModel._project_to_logits). Cached beside the
        logits."""
        import torch

        ids = [int(i) for i in ids]
        p = self.cache_path(ids).with_suffix(".mtp.npy")
        if self.cache and p.is_file():
            try:
                arr = np.load(p)
                if arr.shape[0] == len(ids) - 1 and arr.dtype == np.float32:
                    return arr
            except (OSError, ValueError):
                pass
        with torch.inference_mode():
            h = mtp_hidden(self.model, self.mtp, torch.tensor([ids], dtype=torch.long))
            arr = self.mtp._project_to_logits(h)[0].to(torch.float32).numpy().copy()
        self.computed += 1
        if self.cache:
            self._store(p, arr)
        return arr

    def _store(self, p: Path, arr: np.ndarray) -> None:
        """Write a cache file atomically (a new key's folder made first)."""
        if not p.parent.is_dir():
            self._new_entry(p.parent)
        fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, p)

    def _new_entry(self, d: Path) -> None:
        """Make this key's folder, naming its source; drop the entries of the same source made
        under other keys (older code, other weights): the cache holds one answer per source."""
        source = {"folder": str(self.folder.resolve()), "weights": self._weights_key}
        for other in d.parent.glob("*/source.json") if d.parent.is_dir() else ():
            try:
                same = json.loads(other.read_text()) == source
            except (OSError, ValueError):
                continue
            if same and other.parent != d:
                for f in other.parent.iterdir():
                    f.unlink(missing_ok=True)
                other.parent.rmdir()
        d.mkdir(parents=True, exist_ok=True)
        (d / "source.json").write_text(json.dumps(source))

    def _margins(self, ids: Sequence[int], suffix: str, measure) -> np.ndarray | None:
        """Per-position margins by `measure(model, ids, worst)` (which lowers `worst` in place and
        returns False for a model with nothing to measure: then None), cached beside the logits."""
        ids = [int(i) for i in ids]
        p = self.cache_path(ids).with_suffix(suffix)
        if self.cache and p.is_file():       # all +inf: a model with nothing to measure
            try:
                arr = np.load(p)
                if arr.shape == (len(ids),):
                    return None if np.isinf(arr).all() else arr
            except (OSError, ValueError):
                pass
        worst = np.full(len(ids), np.inf)
        found = measure(self.model, ids, worst)
        if self.cache:
            self._store(p, worst)
        return worst if found else None

    def router_margins(self, ids: Sequence[int]) -> np.ndarray | None:
        """Per position, the smallest relative top-k margin of any MoE router of the model on this
        sequence: (s_k - s_(k+1)) / max|s| over the router's choice scores s (its logits; for a
        router with a correction bias, sigmoid(logits) + bias, the scores GLM chooses by), k its
        top_k; with a group limit (n_group > 1: GLM-5), also the margin of the topk_group-th group
        score over the next, and k counted within the chosen groups. None for a model without
        routers. A margin near float32 noise is a tie: an executor that rounds differently may pick
        the other expert there, a discrete change that says nothing about its correctness
        (tools/gates.py excludes such positions, counted). Cached beside the logits."""
        return self._margins(ids, ".margin.npy", _router_margins)

    def indexer_margins(self, ids: Sequence[int]) -> np.ndarray | None:
        """Per position, the smallest relative margin at the cut of any sparse-attention indexer
        (qwen4_exp QSA blocks, glm5_next DSA pools): (s_k - s_(k+1)) / max|s| over the scores of the
        candidates the position may select, k the number it keeps; +inf where it keeps them all.
        The scores are the module's own (its top-k input, recorded). None for a model without
        indexers. A tie there flips which keys a position attends to (docs/flagships.md Surprise
        6), like a router tie. Cached beside the logits."""
        return self._margins(ids, ".imargin.npy", _indexer_margins)

    def tie_margins(self, ids: Sequence[int]) -> np.ndarray | None:
        """The smaller of router_margins and indexer_margins per position (None where both are)."""
        got = [m for m in (self.router_margins(ids), self.indexer_margins(ids)) if m is not None]
        return np.minimum.reduce(got) if got else None

    def greedy(self, ids: Sequence[int], n: int, eos: Iterable[int] = ()) -> list[int]:
        """Greedy continuation (no cache of any kind: recomputes the prefix each step)."""
        ids, out, stop = list(ids), [], set(eos)
        for _ in range(n):
            t = int(np.argmax(forward_logits(self.model, ids)[-1]))
            out.append(t)
            ids.append(t)
            if t in stop:
                break
        return out


def logits(folder, ids: Sequence[int], cache: bool = True) -> np.ndarray:
    return Oracle(folder, cache=cache).logits(ids)


def mtp_logits(folder, ids: Sequence[int], cache: bool = True) -> np.ndarray:
    """Oracle(folder).mtp_logits(ids): the MTP / NextN layer's logits [len(ids) - 1, vocab]."""
    return Oracle(folder, cache=cache).mtp_logits(ids)


def artifact_oracle(folder, artifact) -> Oracle:
    """The oracle forward of `folder`'s architecture on the values a tp 1 artifact holds."""
    from bloomery.core.artifact.reader import SUMS

    sums = (Path(artifact) / SUMS).read_bytes()
    key = "artifact:" + hashlib.sha256(sums).hexdigest()
    return Oracle(folder, weights=lambda: artifact_weights(artifact), weights_key=key)


# --------------------------------------------------------------------------- command line


def chat_ids(folder, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bloomery.tools.oracle", description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--ids", help="JSON list of token ids")
    ap.add_argument("--out", help="write the float32 logits [n, vocab] here (.npy)")
    ap.add_argument("--mtp", action="store_true", help="the MTP / NextN layer's logits [n - 1, vocab] instead")
    ap.add_argument("--prompt", help="chat-templated prompt (with --generate)")
    ap.add_argument("--generate", type=int, default=0, help="greedy tokens to generate after --prompt")
    ap.add_argument("--no-cache", action="store_true")
    a = ap.parse_args(argv)
    o = Oracle(a.folder, cache=not a.no_cache)
    if a.prompt:
        from transformers import AutoTokenizer

        ids = chat_ids(a.folder, a.prompt)
        cfg = json.loads((Path(a.folder) / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        gen = o.greedy(ids, a.generate or 16, eos=eos if isinstance(eos, list) else [eos])
        print(AutoTokenizer.from_pretrained(a.folder).decode(gen))
        return 0
    if not (a.ids and a.out):
        ap.error("give --ids and --out, or --prompt")
    ids = json.loads(Path(a.ids).read_text())
    np.save(a.out, o.mtp_logits(ids) if a.mtp else o.logits(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
