"""Write small checkpoint folders in ModelOpt's layout (real safetensors files), and plant defects in them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

E4M3 = ml_dtypes.float8_e4m3fn


def e4m3(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(E4M3)


def nvfp4_parts(rng, out: int, inn: int, prefix: str) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.weight": rng.integers(0, 256, (out, inn // 2), dtype=np.uint8),
        f"{prefix}.weight_scale": e4m3(rng.uniform(0.01, 400, (out, inn // 16))),
        f"{prefix}.weight_scale_2": np.array(rng.uniform(1e-4, 1e-2), np.float32),
        f"{prefix}.input_scale": np.array(rng.uniform(1e-3, 1), np.float32),
    }


def fp8_parts(rng, out: int, inn: int, prefix: str) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.weight": e4m3(rng.normal(0, 50, (out, inn))),
        f"{prefix}.weight_scale": np.array(rng.uniform(1e-4, 1e-2), np.float32),
        f"{prefix}.input_scale": np.array(rng.uniform(1e-3, 1), np.float32),
    }


def mxfp8_parts(rng, out: int, inn: int, prefix: str) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.weight": e4m3(rng.normal(0, 50, (out, inn))),
        f"{prefix}.weight_scale": rng.integers(110, 130, (out, inn // 32), dtype=np.uint8),
    }


def bf16(rng, *shape) -> np.ndarray:
    return rng.normal(0, 0.02, shape).astype(ml_dtypes.bfloat16)


PARTS = {"NVFP4": nvfp4_parts, "FP8": fp8_parts, "MXFP8": mxfp8_parts}


def llama_tensors(rng, algo: str, hidden=64, inter=128, layers=1, vocab=96) -> dict[str, np.ndarray]:
    """A Llama-shaped state dict whose linears are stored in `algo` (router-free, like ModelOpt exports)."""
    t = {"model.embed_tokens.weight": bf16(rng, vocab, hidden), "model.norm.weight": bf16(rng, hidden),
         "lm_head.weight": bf16(rng, vocab, hidden)}
    make = PARTS[algo]
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = bf16(rng, hidden)
        t[f"{p}.post_attention_layernorm.weight"] = bf16(rng, hidden)
        for name, o, n in (("self_attn.q_proj", hidden, hidden), ("self_attn.k_proj", hidden // 2, hidden),
                           ("self_attn.v_proj", hidden // 2, hidden), ("self_attn.o_proj", hidden, hidden),
                           ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
                           ("mlp.down_proj", hidden, inter)):
            t.update(make(rng, o, n, f"{p}.{name}"))
    return t


def write_folder(folder: Path, tensors: dict[str, np.ndarray], quant: dict | None, *, shards: int = 1,
                 config: dict | None = None, quant_in_config: bool = False) -> Path:
    """A checkpoint folder: config.json, hf_quant_config.json (or config.json quantization_config),
    and `shards` safetensors files (with model.safetensors.index.json when more than one)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config or {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    if quant is not None and quant_in_config:
        cfg["quantization_config"] = quant
    elif quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "test"}, "quantization": quant}))
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def read_header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), n


def rewrite_header(path: Path, edit) -> None:
    """Plant a defect in a shard's header in place, keeping its length (and so every data offset)."""
    header, n = read_header(path)
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n, "the edited header must not grow"
    raw = bytearray(path.read_bytes())
    raw[8:8 + n] = new + b" " * (n - len(new))
    path.write_bytes(bytes(raw))


def overwrite_tensor(path: Path, name: str, values: np.ndarray) -> None:
    """Overwrite a stored tensor's bytes in place (same dtype and size)."""
    header, n = read_header(path)
    b, e = header[name]["data_offsets"]
    data = np.ascontiguousarray(values).tobytes()
    assert len(data) == e - b
    raw = bytearray(path.read_bytes())
    raw[8 + n + b:8 + n + e] = data
    path.write_bytes(bytes(raw))
