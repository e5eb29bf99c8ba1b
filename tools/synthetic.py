"""Synthetic ModelOpt checkpoints of real model shapes: random bytes in the exact layout an
export has (valid scales, no NaN), streamed to disk shard by shard, for the RSS test and the
benchmarks (the GPU machine generates its own: it takes no large files).

    python -m bloomery.tools.synthetic llama3-8b /tmp/l8 [--format nvfp4] [--layers N] [--shard-gb 2]

Linears are stored in --format (nvfp4, fp8, mxfp8 or bf16); embeddings, norms, routers and the
output head stay BF16, as ModelOpt leaves them."""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2-135m": dict(arch="LlamaForCausalLM", model_type="llama", hidden=576, inter=1536, layers=30, heads=9,
                         kv=3, head_dim=64, vocab=49152, tied=True),
    "llama3-8b": dict(arch="LlamaForCausalLM", model_type="llama", hidden=4096, inter=14336, layers=32, heads=32,
                      kv=8, head_dim=128, vocab=128256, tied=False),
    "qwen3-30b-a3b": dict(arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", hidden=2048, inter=6144, layers=48,
                          heads=32, kv=4, head_dim=128, vocab=151936, tied=False, experts=128, top_k=8,
                          moe_inter=768),
}
ALGO = {"nvfp4": "NVFP4", "fp8": "FP8", "mxfp8": "MXFP8", "bf16": None}


def config(shape: dict) -> dict:
    s = shape
    cfg = {"architectures": [s["arch"]], "model_type": s["model_type"], "hidden_size": s["hidden"],
           "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv"], "head_dim": s["head_dim"], "vocab_size": s["vocab"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": s["tied"], "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if "experts" in s:
        cfg.update(num_experts=s["experts"], num_experts_per_tok=s["top_k"], moe_intermediate_size=s["moe_inter"],
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def tensors(shape: dict, fmt: str):
    """(name, dtype, shape) of every stored tensor, in order; linears expanded into their parts."""
    s, h, hd = shape, shape["hidden"], shape["head_dim"]
    out = [("model.embed_tokens.weight", "BF16", (s["vocab"], h))]

    def linear(name, o, i):
        if fmt == "bf16":
            return [(f"{name}.weight", "BF16", (o, i))]
        if fmt == "nvfp4":
            return [(f"{name}.weight", "U8", (o, i // 2)), (f"{name}.weight_scale", "F8_E4M3", (o, i // 16)),
                    (f"{name}.weight_scale_2", "F32", ()), (f"{name}.input_scale", "F32", ())]
        if fmt == "fp8":
            return [(f"{name}.weight", "F8_E4M3", (o, i)), (f"{name}.weight_scale", "F32", ()),
                    (f"{name}.input_scale", "F32", ())]
        return [(f"{name}.weight", "F8_E4M3", (o, i)), (f"{name}.weight_scale", "U8", (o, i // 32))]

    for b in range(s["layers"]):
        p = f"model.layers.{b}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (h,)), (f"{p}.post_attention_layernorm.weight", "BF16", (h,))]
        out += linear(f"{p}.self_attn.q_proj", s["heads"] * hd, h)
        out += linear(f"{p}.self_attn.k_proj", s["kv"] * hd, h)
        out += linear(f"{p}.self_attn.v_proj", s["kv"] * hd, h)
        out += linear(f"{p}.self_attn.o_proj", h, s["heads"] * hd)
        if "experts" in s:
            out += [(f"{p}.self_attn.q_norm.weight", "BF16", (hd,)), (f"{p}.self_attn.k_norm.weight", "BF16", (hd,)),
                    (f"{p}.mlp.gate.weight", "BF16", (s["experts"], h))]
            for e in range(s["experts"]):
                q = f"{p}.mlp.experts.{e}"
                out += linear(f"{q}.gate_proj", s["moe_inter"], h) + linear(f"{q}.up_proj", s["moe_inter"], h)
                out += linear(f"{q}.down_proj", h, s["moe_inter"])
        else:
            out += linear(f"{p}.mlp.gate_proj", s["inter"], h) + linear(f"{p}.mlp.up_proj", s["inter"], h)
            out += linear(f"{p}.mlp.down_proj", h, s["inter"])
    out.append(("model.norm.weight", "BF16", (h,)))
    if not s["tied"]:
        out.append(("lm_head.weight", "BF16", (s["vocab"], h)))
    return out


ITEMSIZE = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4}


CHUNK = 1 << 24   # elements generated at a time (memory stays bounded whatever the tensor size)


def fill(rng: np.random.Generator, name: str, dtype: str, shape: tuple):
    """The tensor's bytes, in chunks."""
    n = int(np.prod(shape))
    for i in range(0, max(n, 1), CHUNK):
        yield _chunk(rng, name, dtype, min(CHUNK, n - i))


def _chunk(rng: np.random.Generator, name: str, dtype: str, n: int) -> bytes:
    if dtype == "BF16":   # small normal-ish values: random mantissa and sign, exponent near 2^-6
        bits = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & 0x807F) | (0x79 << 7)   # exponent 121: 2^-6
        return bits.astype(np.uint16).tobytes()
    if dtype == "F32":    # a global / input / per-tensor scale
        return np.full(n, 1e-3 if "input" in name else 2e-4, np.float32).tobytes()
    if dtype == "F8_E4M3" and name.endswith("weight_scale"):   # NVFP4 block scales: positive, finite
        return rng.integers(0x20, 0x70, n, dtype=np.uint8).tobytes()
    if dtype == "F8_E4M3":   # FP8 weights: any finite code (0x7F / 0xFF are NaN)
        b = rng.integers(0, 256, n, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] &= 0xFE
        return b.tobytes()
    if name.endswith("weight_scale"):   # E8M0 exponents near 2^-8
        return rng.integers(115, 125, n, dtype=np.uint8).tobytes()
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()   # packed E2M1: every code is valid


def write(name: str, out: Path, fmt: str = "nvfp4", layers: int | None = None, shard_gb: float = 2.0,
          seed: int = 0) -> Path:
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if ALGO[fmt]:
        excl = ["lm_head", "model.embed_tokens"] + (["model.layers.*.mlp.gate"] if "experts" in shape else [])
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "synthetic"},
             "quantization": {"quant_algo": ALGO[fmt], "kv_cache_quant_algo": None, "exclude_modules": excl,
                              **({"group_size": 16} if fmt == "nvfp4" else {})}}, indent=1))
    items = tensors(shape, fmt)
    limit = int(shard_gb * 2**30)
    groups, cur, size = [], [], 0
    for t in items:
        nb = int(np.prod(t[2])) * ITEMSIZE[t[1]]
        if cur and size + nb > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nb
    groups.append(cur)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for n, dt, shp in group:
            nb = int(np.prod(shp)) * ITEMSIZE[dt]
            header[n] = {"dtype": dt, "shape": list(shp), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[n] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for n, dt, shp in group:
                for chunk in fill(rng, n, dt, shp):
                    f.write(chunk)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", default="nvfp4", choices=sorted(ALGO))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    write(a.shape, a.out, a.format, a.layers, a.shard_gb)
    size = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    print(f"{a.out}: {a.shape} {a.format}, {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
