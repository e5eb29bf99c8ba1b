"""Synthetic ModelOpt checkpoints of real model shapes: random bytes in the exact layout an
export has (valid scales, no NaN), streamed to disk shard by shard, for the RSS test and the
benchmarks (the GPU machine generates its own: it takes no large files).

    python -m bloomery.tools.synthetic llama3-8b /tmp/l8 [--format nvfp4] [--layers N] [--shard-gb 2]
    python -m bloomery.tools.synthetic qwen3-next-80b-a3b /tmp/q3n --layers 4 [--size]

Linears are stored in --format (nvfp4, fp8, mxfp8 or bf16); embeddings, norms, routers and the
output head stay BF16, as ModelOpt leaves them. The hybrid shapes mirror what a real ModelOpt
export of transformers 5.24's model holds (the tiny exports tools/tiny.py makes show it):
qwen3-next-80b-a3b keeps its gated delta nets' in_proj_ba, conv1d, A_log, dt_bias and gated norm
in BF16 beside the quantized in_proj_qkvz / out_proj, and the sigmoid shared_expert_gate BF16;
glm-4.5-air keeps its router (mlp.gate) and e_score_correction_bias in F32 and its q/k/v biases
in BF16. Neither carries its multi-token-prediction layer (transformers drops mtp.* /
model.layers.46.*, so a ModelOpt export made through it holds none).

--layers N keeps the layer pattern valid: qwen3-next-80b-a3b needs N a multiple of 4 (its
3 linear_attention : 1 full_attention pattern, full_attention_interval 4, ends each group of 4);
glm-4.5-air needs N >= 2 (its first layer is the dense one, first_k_dense_replace 1).
--experts N (a smaller variant, not the real shape) keeps N routed experts: the NumPy executor
holds every weight in float32, so a CPU check of the 512-expert shape needs it.
--size prints the bytes the checkpoint would take and writes nothing."""

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
    # Qwen/Qwen3-Next-80B-A3B-Instruct (= transformers 5.24's Qwen3NextConfig defaults, but for
    # intermediate_size and max_position_embeddings: the release's 5120 and 262144; no layer is dense)
    "qwen3-next-80b-a3b": dict(arch="Qwen3NextForCausalLM", model_type="qwen3_next", hidden=2048, inter=5120,
                               layers=48, heads=16, kv=2, head_dim=256, vocab=151936, tied=False, experts=512,
                               top_k=10, moe_inter=512, shared_inter=512, lin_k_heads=16, lin_v_heads=32,
                               lin_k_dim=128, lin_v_dim=128, conv_kernel=4, full_interval=4, mlp_only=[],
                               rotary=0.25, theta=10_000_000.0, eps=1e-6, max_pos=262144),
    # zai-org/GLM-4.5-Air (transformers 5.24's Glm4MoeConfig defaults are its sizes; head_dim,
    # attention_bias, rope_theta are the release's)
    "glm-4.5-air": dict(arch="Glm4MoeForCausalLM", model_type="glm4_moe", hidden=4096, inter=10944, layers=46,
                        heads=96, kv=8, head_dim=128, vocab=151552, tied=False, experts=128, top_k=8,
                        moe_inter=1408, n_shared=1, first_dense=1, n_group=1, topk_group=1, routed_scale=1.0,
                        attention_bias=True, qk_norm=False, rotary=0.5, theta=1_000_000.0, eps=1e-5,
                        max_pos=131072),
}
ALGO = {"nvfp4": "NVFP4", "fp8": "FP8", "mxfp8": "MXFP8", "bf16": None}


def shape_of(name: str, layers: int | None = None, experts: int | None = None) -> dict:
    """The shape's parameters, with `layers` layers (refused where that breaks the layer pattern) and
    `experts` routed experts (a smaller variant for a CPU check, whose NumPy executor holds every
    weight in float32; top_k stays, up to `experts`)."""
    s = dict(SHAPES[name])
    if experts is not None:
        if "experts" not in s or experts < 1:
            raise ValueError(f"{name}: --experts {experts}: {'at least 1' if 'experts' in s else 'no routed experts'}")
        s["experts"], s["top_k"] = experts, min(s["top_k"], experts)
    if layers is None:
        return s
    if layers < 1:
        raise ValueError(f"{name}: --layers {layers}: at least 1")
    if s["model_type"] == "qwen3_next" and layers % s["full_interval"]:
        raise ValueError(f"{name}: --layers {layers} breaks the pattern of {s['full_interval'] - 1} linear_attention "
                         f"layers then 1 full_attention layer: give a multiple of {s['full_interval']}")
    if s["model_type"] == "glm4_moe" and layers <= s["first_dense"]:
        raise ValueError(f"{name}: --layers {layers} leaves no MoE layer after the {s['first_dense']} dense "
                         f"one(s) (first_k_dense_replace): give at least {s['first_dense'] + 1}")
    s["layers"] = layers
    return s


def layer_types(shape: dict) -> list[str]:
    """Qwen3-Next: each layer's token mixer (transformers' default pattern for full_attention_interval)."""
    return ["full_attention" if (i + 1) % shape["full_interval"] == 0 else "linear_attention"
            for i in range(shape["layers"])]


def sparse(shape: dict, b: int) -> bool:
    if "experts" not in shape:
        return False
    if shape["model_type"] == "glm4_moe":
        return b >= shape["first_dense"]
    return b not in shape.get("mlp_only", [])


def config(shape: dict) -> dict:
    s = shape
    if s["model_type"] == "qwen3_next":
        return _config_qwen3_next(s)
    if s["model_type"] == "glm4_moe":
        return _config_glm4_moe(s)
    cfg = {"architectures": [s["arch"]], "model_type": s["model_type"], "hidden_size": s["hidden"],
           "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv"], "head_dim": s["head_dim"], "vocab_size": s["vocab"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": s["tied"], "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if "experts" in s:
        cfg.update(num_experts=s["experts"], num_experts_per_tok=s["top_k"], moe_intermediate_size=s["moe_inter"],
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def _common(s: dict) -> dict:
    return {"architectures": [s["arch"]], "model_type": s["model_type"], "hidden_size": s["hidden"],
            "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv"], "head_dim": s["head_dim"], "vocab_size": s["vocab"],
            "max_position_embeddings": s["max_pos"], "rms_norm_eps": s["eps"], "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": s["theta"], "partial_rotary_factor": s["rotary"]},
            "tie_word_embeddings": s["tied"], "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 2, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
            "transformers_version": "5.24.0"}


def _config_qwen3_next(s: dict) -> dict:
    return {**_common(s), "attention_bias": False, "layer_types": layer_types(s),
            "linear_conv_kernel_dim": s["conv_kernel"], "linear_key_head_dim": s["lin_k_dim"],
            "linear_value_head_dim": s["lin_v_dim"], "linear_num_key_heads": s["lin_k_heads"],
            "linear_num_value_heads": s["lin_v_heads"], "decoder_sparse_step": 1, "mlp_only_layers": s["mlp_only"],
            "num_experts": s["experts"], "num_experts_per_tok": s["top_k"], "moe_intermediate_size": s["moe_inter"],
            "shared_expert_intermediate_size": s["shared_inter"], "norm_topk_prob": True,
            "output_router_logits": False, "router_aux_loss_coef": 0.001}


def _config_glm4_moe(s: dict) -> dict:
    return {**_common(s), "attention_bias": s["attention_bias"], "use_qk_norm": s["qk_norm"],
            "first_k_dense_replace": s["first_dense"], "n_routed_experts": s["experts"],
            "num_experts_per_tok": s["top_k"], "moe_intermediate_size": s["moe_inter"],
            "n_shared_experts": s["n_shared"], "n_group": s["n_group"], "topk_group": s["topk_group"],
            "routed_scaling_factor": s["routed_scale"], "norm_topk_prob": True, "num_nextn_predict_layers": 0,
            "output_router_logits": False}


def excluded(shape: dict) -> list[str]:
    """hf_quant_config.json's exclude_modules, as ModelOpt 0.47 writes them for the family (the tiny
    exports): the head, the embedding, and per layer the modules it leaves unquantized."""
    s, out = shape, ["lm_head", "model.embed_tokens"]
    if s["model_type"] == "qwen3_next":
        for b, t in enumerate(layer_types(s)):
            p = f"model.layers.{b}"
            if t == "linear_attention":
                out += [f"{p}.linear_attn.conv1d", f"{p}.linear_attn.in_proj_ba"]
            if sparse(s, b):
                out += [f"{p}.mlp.gate", f"{p}.mlp.shared_expert_gate"]
        return out
    if s["model_type"] == "glm4_moe":
        return out + [f"model.layers.{b}.mlp.gate" for b in range(s["layers"]) if sparse(s, b)]
    return out + (["model.layers.*.mlp.gate"] if "experts" in s else [])


def _linear(fmt: str, name: str, o: int, i: int) -> list:
    if fmt == "bf16":
        return [(f"{name}.weight", "BF16", (o, i))]
    if fmt == "nvfp4":
        return [(f"{name}.weight", "U8", (o, i // 2)), (f"{name}.weight_scale", "F8_E4M3", (o, i // 16)),
                (f"{name}.weight_scale_2", "F32", ()), (f"{name}.input_scale", "F32", ())]
    if fmt == "fp8":
        return [(f"{name}.weight", "F8_E4M3", (o, i)), (f"{name}.weight_scale", "F32", ()),
                (f"{name}.input_scale", "F32", ())]
    return [(f"{name}.weight", "F8_E4M3", (o, i)), (f"{name}.weight_scale", "U8", (o, i // 32))]


def _mlp(fmt: str, p: str, inter: int, h: int) -> list:
    return (_linear(fmt, f"{p}.gate_proj", inter, h) + _linear(fmt, f"{p}.up_proj", inter, h)
            + _linear(fmt, f"{p}.down_proj", h, inter))


def tensors(shape: dict, fmt: str):
    """(name, dtype, shape) of every stored tensor, in order; linears expanded into their parts."""
    if shape["model_type"] == "qwen3_next":
        return _tensors_qwen3_next(shape, fmt)
    if shape["model_type"] == "glm4_moe":
        return _tensors_glm4_moe(shape, fmt)
    s, h, hd = shape, shape["hidden"], shape["head_dim"]
    out = [("model.embed_tokens.weight", "BF16", (s["vocab"], h))]

    def linear(name, o, i):
        return _linear(fmt, name, o, i)

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


def _tensors_qwen3_next(s: dict, fmt: str) -> list:
    """transformers 5.24's Qwen3NextForCausalLM state dict in its saved (per-expert) names."""
    h, hd = s["hidden"], s["head_dim"]
    kdim, vdim = s["lin_k_heads"] * s["lin_k_dim"], s["lin_v_heads"] * s["lin_v_dim"]
    conv = 2 * kdim + vdim
    out = [("model.embed_tokens.weight", "BF16", (s["vocab"], h))]
    for b, kind in enumerate(layer_types(s)):
        p = f"model.layers.{b}"
        out.append((f"{p}.input_layernorm.weight", "BF16", (h,)))
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            out += _linear(fmt, f"{a}.in_proj_qkvz", 2 * kdim + 2 * vdim, h)
            out += [(f"{a}.in_proj_ba.weight", "BF16", (2 * s["lin_v_heads"], h)),
                    (f"{a}.conv1d.weight", "BF16", (conv, 1, s["conv_kernel"])),
                    (f"{a}.A_log", "BF16", (s["lin_v_heads"],)), (f"{a}.dt_bias", "BF16", (s["lin_v_heads"],)),
                    (f"{a}.norm.weight", "BF16", (s["lin_v_dim"],))]
            out += _linear(fmt, f"{a}.out_proj", h, vdim)
        else:
            a = f"{p}.self_attn"
            out += _linear(fmt, f"{a}.q_proj", 2 * s["heads"] * hd, h)          # each head's [q | gate]
            out += _linear(fmt, f"{a}.k_proj", s["kv"] * hd, h) + _linear(fmt, f"{a}.v_proj", s["kv"] * hd, h)
            out += _linear(fmt, f"{a}.o_proj", h, s["heads"] * hd)
            out += [(f"{a}.q_norm.weight", "BF16", (hd,)), (f"{a}.k_norm.weight", "BF16", (hd,))]
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        if sparse(s, b):
            out.append((f"{p}.mlp.gate.weight", "BF16", (s["experts"], h)))
            for e in range(s["experts"]):
                out += _mlp(fmt, f"{p}.mlp.experts.{e}", s["moe_inter"], h)
            out += _mlp(fmt, f"{p}.mlp.shared_expert", s["shared_inter"], h)
            out.append((f"{p}.mlp.shared_expert_gate.weight", "BF16", (1, h)))
        else:
            out += _mlp(fmt, f"{p}.mlp", s["inter"], h)
    out.append(("model.norm.weight", "BF16", (h,)))
    if not s["tied"]:
        out.append(("lm_head.weight", "BF16", (s["vocab"], h)))
    return out


def _tensors_glm4_moe(s: dict, fmt: str) -> list:
    """transformers 5.24's Glm4MoeForCausalLM state dict in its saved (per-expert) names; the router
    and its correction bias F32 (_keep_in_fp32_modules_strict), as ModelOpt exports keep them."""
    h, hd, bias = s["hidden"], s["head_dim"], s["attention_bias"]
    out = [("model.embed_tokens.weight", "BF16", (s["vocab"], h))]
    for b in range(s["layers"]):
        p, a = f"model.layers.{b}", f"model.layers.{b}.self_attn"
        out.append((f"{p}.input_layernorm.weight", "BF16", (h,)))
        for n, rows in (("q_proj", s["heads"] * hd), ("k_proj", s["kv"] * hd), ("v_proj", s["kv"] * hd)):
            out += _linear(fmt, f"{a}.{n}", rows, h)
            if bias:
                out.append((f"{a}.{n}.bias", "BF16", (rows,)))
        out += _linear(fmt, f"{a}.o_proj", h, s["heads"] * hd)                # o_proj: never a bias
        if s["qk_norm"]:
            out += [(f"{a}.q_norm.weight", "BF16", (hd,)), (f"{a}.k_norm.weight", "BF16", (hd,))]
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        if sparse(s, b):
            out += [(f"{p}.mlp.gate.weight", "F32", (s["experts"], h)),
                    (f"{p}.mlp.gate.e_score_correction_bias", "F32", (s["experts"],))]
            for e in range(s["experts"]):
                out += _mlp(fmt, f"{p}.mlp.experts.{e}", s["moe_inter"], h)
            out += _mlp(fmt, f"{p}.mlp.shared_experts", s["moe_inter"] * s["n_shared"], h)
        else:
            out += _mlp(fmt, f"{p}.mlp", s["inter"], h)
    out.append(("model.norm.weight", "BF16", (h,)))
    if not s["tied"]:
        out.append(("lm_head.weight", "BF16", (s["vocab"], h)))
    return out


ITEMSIZE = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4}


def nbytes(items) -> int:
    """Bytes of the tensors' data (the shards add a JSON header each)."""
    return sum(int(np.prod(shp)) * ITEMSIZE[dt] for _, dt, shp in items)


CHUNK = 1 << 24   # elements generated at a time (memory stays bounded whatever the tensor size)

SCALES = ("weight_scale", "weight_scale_2", "input_scale")   # F32 quantization scalars / FP8 weight scales


def value_kind(shape: dict, name: str) -> str | None:
    """How a tensor's values are drawn where the default (random bytes of the stored format, scales
    valid) would not keep a forward numerically sane; None: the default."""
    mt = shape["model_type"]
    if mt == "qwen3_next":
        if name.endswith(".A_log"):
            return "a_log"                    # log(A), A ~ U(1, 16): decay exp(-A softplus(a + dt_bias)) in (0, 1)
        if name.endswith(".dt_bias"):
            return "dt_bias"
        if name.endswith("linear_attn.norm.weight"):
            return "one"                      # Qwen3NextRMSNormGated multiplies by its weight (init ones)
        return None                           # the other norms multiply by 1 + weight: small values sit near 1
    if mt == "glm4_moe":
        if name.endswith("norm.weight"):
            return "one"                      # Glm4MoeRMSNorm: weight as is (init ones)
        if name.endswith("mlp.gate.weight"):
            return "f32_small"
        if name.endswith("e_score_correction_bias"):
            return "f32_bias"
    return None


def _bf16(v: np.ndarray) -> bytes:
    return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()   # truncated to bf16


def _special(rng: np.random.Generator, kind: str, dtype: str, n: int) -> bytes:
    if kind == "a_log":
        v = np.log(rng.uniform(1.0, 16.0, n))
    elif kind == "dt_bias":
        v = rng.uniform(-0.5, 0.5, n)
    elif kind == "one":
        v = rng.uniform(0.9, 1.1, n)
    elif kind == "f32_small":
        v = rng.normal(0.0, 0.02, n)
    elif kind == "f32_bias":
        v = rng.uniform(-0.01, 0.01, n)
    else:
        raise ValueError(f"value kind {kind!r}")
    if dtype == "BF16":
        return _bf16(v)
    if dtype == "F32":
        return v.astype(np.float32).tobytes()
    raise ValueError(f"value kind {kind!r} for a {dtype} tensor")


def fill(rng: np.random.Generator, name: str, dtype: str, shape: tuple, kind: str | None = None):
    """The tensor's bytes, in chunks."""
    n = int(np.prod(shape))
    for i in range(0, max(n, 1), CHUNK):
        m = min(CHUNK, n - i)
        yield _special(rng, kind, dtype, m) if kind else _chunk(rng, name, dtype, m)


def _chunk(rng: np.random.Generator, name: str, dtype: str, n: int) -> bytes:
    if dtype == "BF16":   # small normal-ish values: random mantissa and sign, exponent near 2^-6
        bits = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & 0x807F) | (0x79 << 7)   # exponent 121: 2^-6
        return bits.astype(np.uint16).tobytes()
    if dtype == "F32" and not name.endswith(SCALES):   # an F32 tensor that is no scale: small values
        return rng.normal(0.0, 0.02, n).astype(np.float32).tobytes()
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


def write_config(shape: dict, out: Path, fmt: str = "nvfp4") -> None:
    """config.json and (for a quantized format) hf_quant_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(shape), indent=1))
    if ALGO[fmt]:
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "synthetic"},
             "quantization": {"quant_algo": ALGO[fmt], "kv_cache_quant_algo": None, "exclude_modules": excluded(shape),
                              **({"group_size": 16} if fmt == "nvfp4" else {})}}, indent=1))


def write(name: str, out: Path, fmt: str = "nvfp4", layers: int | None = None, shard_gb: float = 2.0,
          seed: int = 0, experts: int | None = None) -> Path:
    shape = shape_of(name, layers, experts)
    write_config(shape, out, fmt)
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
                for chunk in fill(rng, n, dt, shp, value_kind(shape, n)):
                    f.write(chunk)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--format", default="nvfp4", choices=sorted(ALGO))
    ap.add_argument("--layers", type=int, default=None,
                    help="fewer layers than the real model (qwen3-next-80b-a3b: a multiple of 4; glm-4.5-air: >= 2)")
    ap.add_argument("--experts", type=int, default=None,
                    help="fewer routed experts: a smaller variant for CPU checks (not the real shape)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--size", action="store_true", help="print the checkpoint's size and write nothing")
    a = ap.parse_args(argv)
    try:
        shape = shape_of(a.shape, a.layers, a.experts)
    except ValueError as e:
        ap.error(str(e))
    if a.size or a.out is None:
        if not a.size:
            ap.error("the output folder is required (or --size)")
        print(f"{a.shape} {a.format}, {shape['layers']} layers: {nbytes(tensors(shape, a.format)) / 1e9:.2f} GB")
        return 0
    t0 = time.perf_counter()
    write(a.shape, a.out, a.format, a.layers, a.shard_gb, experts=a.experts)
    size = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    print(f"{a.out}: {a.shape} {a.format}, {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
