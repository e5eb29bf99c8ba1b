"""ModelOpt quantize + export on the CPU (see /work/shared/notes/modelopt-cpu.md).

Imports torch and modelopt; only the builders import this module.

`FORMATS` names the recipes: each is a list of ModelOpt preset config names
whose ``quant_cfg`` lists are joined (later entries win), or a callable that
builds a config.  `quantize_and_export` runs ``mtq.quantize`` with a
calibration loop and writes ``export_hf_checkpoint(..., dtype=bfloat16)``.

`install_cpu_block_quant` replaces ModelOpt's CUDA-only dynamic block
fake-quantizer (NVFP4 / MXFP8 / MXFP4) with plain torch so that calibration
algorithms that run the quantized forward (AWQ) work on the CPU.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0


# --------------------------------------------------------------------------- shim


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to even, |y| > 6 saturating;
    the same as NVFP4QTensor._cast_fp4's table (bounds .25 .75 1.25 1.75 2.5 3.5 5)."""
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = torch.round(a / step).mul_(step).clamp_(max=E2M1_MAX)  # round: half to even
    return q.copysign_(y)


def nvfp4_fake_quant(x: torch.Tensor, block_size: int, amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize: global scale amax/(6*448), E4M3 block scales, E2M1 values."""
    shape, dtype = x.shape, x.dtype
    xf = x.float().reshape(-1, block_size)
    gs = amax.float().reshape(()) / (E2M1_MAX * E4M3_MAX)
    s = xf.abs().amax(-1, keepdim=True) / (E2M1_MAX * gs)
    s = torch.where(s == 0, torch.ones_like(s), s)
    s = s.clamp(min=2**-9, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    sc = s * gs
    return (_round_e2m1(xf / sc) * sc).reshape(shape).to(dtype)


def _e8m0_exp(block_amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    d = block_amax / elem_max
    e = torch.where(d > 0, torch.log2(d), torch.full_like(d, -127.0))
    return torch.ceil(e).clamp(-127, 127)


def mxfp8_fake_quant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    shape, dtype = x.shape, x.dtype
    xf = x.float().reshape(-1, block_size)
    sc = torch.exp2(_e8m0_exp(xf.abs().amax(-1, keepdim=True), E4M3_MAX))
    return ((xf / sc).to(torch.float8_e4m3fn).float() * sc).reshape(shape).to(dtype)


def mxfp4_fake_quant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    shape, dtype = x.shape, x.dtype
    xf = x.float().reshape(-1, block_size)
    sc = torch.exp2(_e8m0_exp(xf.abs().amax(-1, keepdim=True), E2M1_MAX))
    return (_round_e2m1(xf / sc) * sc).reshape(shape).to(dtype)


def _cpu_dynamic_block_quantize(original):
    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        if inputs.is_cuda:
            return original(inputs, block_size, amax, num_bits, exponent_bits,
                            scale_num_bits, scale_exponent_bits)
        elem = (exponent_bits, num_bits - exponent_bits - 1) if exponent_bits else num_bits
        scale = (scale_exponent_bits, scale_num_bits - scale_exponent_bits - 1)
        if inputs.shape[-1] % block_size:
            raise ValueError(f"last dim {inputs.shape[-1]} not a multiple of block {block_size}")
        if elem == (2, 1) and scale == (4, 3):
            if amax is None:
                amax = inputs.detach().abs().amax()
            return nvfp4_fake_quant(inputs, block_size, amax.amax())
        if elem == (4, 3) and scale == (8, 0):
            return mxfp8_fake_quant(inputs, block_size)
        if elem == (2, 1) and scale == (8, 0):
            return mxfp4_fake_quant(inputs, block_size)
        return original(inputs, block_size, amax, num_bits, exponent_bits,
                        scale_num_bits, scale_exponent_bits)

    op._bloomery_shim = True
    return op


def install_cpu_block_quant() -> None:
    """Route ModelOpt's dynamic block fake-quant through plain torch on CPU tensors."""
    from modelopt.torch.quantization import tensor_quant

    if not getattr(tensor_quant.dynamic_block_quantize_op, "_bloomery_shim", False):
        tensor_quant.dynamic_block_quantize_op = _cpu_dynamic_block_quantize(
            tensor_quant.dynamic_block_quantize_op)


# --------------------------------------------------------------------------- recipes


def _preset(name: str) -> dict:
    import modelopt.torch.quantization as mtq

    return copy.deepcopy(getattr(mtq, name))


def join_configs(*names: str) -> dict:
    """Join presets: concatenate their quant_cfg lists; algorithm from the first."""
    cfgs = [_preset(n) for n in names]
    out = {k: v for k, v in cfgs[0].items() if k != "quant_cfg"}
    out["quant_cfg"] = [e for c in cfgs for e in c["quant_cfg"]]
    return out


def _mixed_nvfp4_fp8() -> dict:
    """NVFP4 attention projections, FP8 MLP projections -> quant_algo MIXED_PRECISION."""
    cfg = _preset("NVFP4_DEFAULT_CFG")
    fp8 = _preset("FP8_DEFAULT_CFG")
    fp8_w = next(e["cfg"] for e in fp8["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer")
    fp8_i = next(e["cfg"] for e in fp8["quant_cfg"] if e.get("quantizer_name") == "*input_quantizer")
    extra = [
        {"quantizer_name": "*mlp*weight_quantizer", "cfg": fp8_w},
        {"quantizer_name": "*mlp*input_quantizer", "cfg": fp8_i},
    ]
    # after "*" off / "*weight_quantizer" / "*input_quantizer", before the exclusions
    # (lm_head, routers, ...) so those still win
    assert [e.get("quantizer_name") for e in cfg["quant_cfg"][:3]] == [
        "*", "*weight_quantizer", "*input_quantizer"]
    cfg["quant_cfg"] = cfg["quant_cfg"][:3] + extra + cfg["quant_cfg"][3:]
    return cfg


def _mixed_nvfp4_mxfp8() -> dict:
    """The flagships in the style NVIDIA ships them: NVFP4 routed experts; MXFP8 attention (softmax,
    linear, MLA), indexers, shared experts and the other projections (PLE, dense MLP); BF16
    hyper-connections, routers and convs -> quant_algo MIXED_PRECISION."""
    cfg = _preset("MXFP8_DEFAULT_CFG")
    nvfp4 = _preset("NVFP4_DEFAULT_CFG")
    fp4_w = next(e["cfg"] for e in nvfp4["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer")
    fp4_i = next(e["cfg"] for e in nvfp4["quant_cfg"] if e.get("quantizer_name") == "*input_quantizer")
    extra = [
        # fused experts hold per-expert `<proj>_weight_quantizers.<e>` and one `<proj>_input_quantizer`
        {"quantizer_name": "*mlp.experts.*weight_quantizer*", "cfg": fp4_w},
        {"quantizer_name": "*mlp.experts.*input_quantizer*", "cfg": fp4_i},
        {"quantizer_name": "*hyper_connection*", "enable": False},    # qwen4 HC (glm's are Parameters)
        # the depthwise convs (glm KDA self_attn.conv1d, qwen4 ple.conv1d): ModelOpt stores them
        # unquantized but would list them as MXFP8 in quantized_layers
        {"quantizer_name": "*conv1d*", "enable": False},
    ]
    assert [e.get("quantizer_name") for e in cfg["quant_cfg"][:3]] == [
        "*", "*weight_quantizer", "*input_quantizer"]
    cfg["quant_cfg"] = cfg["quant_cfg"][:3] + extra + cfg["quant_cfg"][3:]    # routers stay excluded
    return cfg


# name -> (preset names to join | callable returning a config, needs the CPU shim)
FORMATS: dict[str, tuple] = {
    "nvfp4": (("NVFP4_DEFAULT_CFG",), False),
    "fp8": (("FP8_DEFAULT_CFG",), False),
    "mxfp8": (("MXFP8_DEFAULT_CFG",), False),
    "nvfp4_fp8kv": (("NVFP4_DEFAULT_CFG", "FP8_KV_CFG"), False),
    "nvfp4_awq": (("NVFP4_AWQ_LITE_CFG",), True),
    "fp8_channel": (("FP8_PER_CHANNEL_PER_TOKEN_CFG",), False),
    "fp8_pb_wo": (("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",), False),
    "nvfp4_w4a16": (("W4A16_NVFP4_CFG",), False),
    "mxfp4": (("MXFP4_DEFAULT_CFG",), False),
    "w4a8_nvfp4_fp8": (("W4A8_NVFP4_FP8_CFG",), False),
    "mixed_nvfp4_fp8": (_mixed_nvfp4_fp8, False),
    "mixed_nvfp4_mxfp8": (_mixed_nvfp4_mxfp8, False),
}


def format_config(fmt: str) -> dict:
    spec, _ = FORMATS[fmt]
    return spec() if callable(spec) else join_configs(*spec)


# --------------------------------------------------------------------------- export


def quantize_and_export(model, fmt: str, calib_batches: Iterable[torch.Tensor], out_dir: Path) -> dict:
    """Quantize `model` in place with recipe `fmt`, calibrating on `calib_batches` (token ids
    [B, T]); export a Hugging Face folder into `out_dir`. Returns the hf_quant_config."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    _, needs_shim = FORMATS[fmt]
    if needs_shim:
        install_cpu_block_quant()
    cfg = format_config(fmt)
    batches = list(calib_batches)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids)

    model = mtq.quantize(model, cfg, forward_loop)
    out_dir = Path(out_dir)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=out_dir)
    repair_ple_table(out_dir, model.config)
    return json.loads((out_dir / "hf_quant_config.json").read_text())


PLE_MISNAMED = ".ple_embedding.shard_.weight"


def repair_ple_table(out_dir: Path, config) -> list[str]:
    """ModelOpt 0.47's reverse of transformers' load conversion writes qwen4_exp's PLE table
    ([Rpad, P/G], BF16: not quantized) as one tensor `<layer>.ple.ple_embedding.shard_.weight`, a
    name transformers cannot load. Write it as transformers' save_pretrained does (the bf16
    folder): its own Chunk op, the reverse of Concatenate(num_shards_attribute="split_ngram_parts"),
    into `<layer>.ple.ple_embedding.ngram_embedding.shard_{i}.weight`. Values unchanged. Returns
    the names repaired (none for other models)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.core_model_loading import Chunk

    repaired = []
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if not any(k.endswith(PLE_MISNAMED) for k in sf.keys()):
                continue
            meta = sf.metadata()
            tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        if (Path(out_dir) / "model.safetensors.index.json").exists():
            raise RuntimeError(f"{f}: repairing the PLE table of a sharded export is not implemented")
        for k in [k for k in tensors if k.endswith(PLE_MISNAMED)]:
            prefix = k[: -len(PLE_MISNAMED)] + ".ple_embedding."
            shards = Chunk(dim=0, num_shards_attribute="split_ngram_parts").convert(
                {k: tensors.pop(k)}, [k], ["ngram_embedding.shard_*.weight"], config=config)
            tensors.update({prefix + name: t for name, t in shards.items()})
            repaired.append(k)
        save_file(tensors, str(f), metadata=meta)
    return repaired


def finish_folder(out_dir: Path, tokenizer_dir: Path | None) -> None:
    """Copy the tokenizer files in (ModelOpt writes none); files 0644 (ModelOpt writes 0600)."""
    out_dir = Path(out_dir)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "generation_config.json"):
            src = Path(tokenizer_dir) / name
            if src.exists() and not (out_dir / name).exists():
                shutil.copyfile(src, out_dir / name)
    for p in out_dir.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    os.chmod(out_dir, 0o755)
