"""Synthetic ModelOpt checkpoints of real model shapes: random bytes in the exact layout an
export has (valid scales, no NaN), streamed to disk shard by shard, for the RSS test and the
benchmarks (the GPU machine generates its own: it takes no large files).

    python -m bloomery.tools.synthetic llama3-8b /tmp/l8 [--format nvfp4] [--layers N] [--shard-gb 2]
    python -m bloomery.tools.synthetic qwen3-next-80b-a3b /tmp/q3n --layers 4 [--size]
    python -m bloomery.tools.synthetic qwen4-exp /tmp/q4 --layers 4 --experts 4 --ple-rows 65536
    python -m bloomery.tools.synthetic glm5-next /tmp/g5 --layers 4 --experts 4

Linears are stored in --format (nvfp4, fp8, mxfp8 or bf16); embeddings, norms, routers and the
output head stay BF16, as ModelOpt leaves them. The hybrid shapes mirror what a real ModelOpt
export of transformers 5.24's model holds (the tiny exports tools/tiny.py makes show it):
qwen3-next-80b-a3b keeps its gated delta nets' in_proj_ba, conv1d, A_log, dt_bias and gated norm
in BF16 beside the quantized in_proj_qkvz / out_proj, and the sigmoid shared_expert_gate BF16;
glm-4.5-air keeps its router (mlp.gate) and e_score_correction_bias in F32 and its q/k/v biases
in BF16. Neither carries its multi-token-prediction layer (transformers drops mtp.* /
model.layers.46.*, so a ModelOpt export made through it holds none).

The flagships (docs/flagships.md) are transformers 5.24's default configs, stored under the
names save_pretrained writes:
qwen4-exp (Qwen4ExpForCausalLM, model.layers.*): the hyper-connection mixers, the delta nets'
in_proj_qkv / in_proj_z / out_proj, the attention, the QSA indexer's index_qk_proj, the experts
and the PLE key / value projections quantized; in_proj_a / in_proj_b, conv1d, A_log, dt_bias, the
norms, the routers and shared_expert_gate, the PLE conv and its n-gram table BF16 (the table as
split_ngram_parts torch.chunk shards ple.ple_embedding.ngram_embedding.shard_{i}.weight), the
three I64 hash buffers per PLE layer holding exactly core/ngram.py's values. Defaults the
config leaves unset are chosen: the QSA indexer (indexer_* are None and transformers builds no
attention without them: 16 heads x 128, one key head, ratio 4, budget 2048), rotary factor
0.25 (the default 1.0 rotates 256 values, more than an index head holds, which transformers
refuses; 0.25 is what the default mrope_section [11, 11, 10] spans) and one PLE layer,
ple_layer_ids [2] (empty by default; one table is what transformers' "~95 GiB" comment sizes,
and an early linear layer is where Engram-style memories sit).
glm5-next (Glm5NextForConditionalGeneration, model.language_model.*, config.json with a
text_config; no vision tensors): MLA, the DSA indexer's wq_b / wk / weights_proj, KDA's
projections (f_a / f_b / g_a / g_b / b_proj too) and the FFNs quantized; hc_{attn,ffn}_fn and
index_kpool_compress_gate / _ape BF16 (bare Parameters ModelOpt does not wrap), the router,
its correction bias, q/k/v_conv1d, A_log, dt_bias and hc base / scale F32 (transformers'
_keep_in_fp32_modules_strict).
Both carry a tokenizer (tools/tiny.py's byte-level BPE, ids < 512) and chat template so that
`bloomery run` takes a text prompt.

--layers N keeps the layer pattern valid: qwen3-next-80b-a3b and qwen4-exp need N a multiple of 4
(their 3 linear_attention : 1 full / indexed attention pattern ends each group of 4; qwen4-exp's
PLE layer 2 stays); glm-4.5-air needs N >= 2 (its first layer is the dense one,
first_k_dense_replace 1); glm5-next N >= 4 (its three dense layers, KDA, then MLA every 4th).
--experts N (a smaller variant, not the real shape) keeps N routed experts: the NumPy executor
holds every weight in float32, so a CPU check of the 512-expert shape needs it.
--ple-rows N (qwen4-exp) writes tables of about N rows: the config's ngram_vocab_size_base is
lowered to N / (n-gram heads), so the primes, the I64 buffers and the table agree (prepare checks
the table's rows and the buffers against the config). Without it the tables have their real row
count, 320,001,536 rows x 128 BF16 = 81.9 GB per PLE layer: let the disk decide.
--size prints the bytes the checkpoint would take (and its n-gram tables') and writes nothing."""

from __future__ import annotations

import argparse
import json
import math
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
    # transformers 5.24's Qwen4ExpTextConfig defaults, with the QSA indexer, the rotary factor and the PLE layer
    # that the defaults leave unset chosen (the docstring says why); theta is the default 10,000
    "qwen4-exp": dict(arch="Qwen4ExpForCausalLM", model_type="qwen4_exp_text", hidden=2048, layers=40, heads=16,
                      kv=2, head_dim=256, vocab=248320, tied=False, experts=512, top_k=10, moe_inter=512,
                      shared_inter=512, lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, conv_kernel=4,
                      full_interval=4, hc=4, hc_rank=320, ple_layers=[2], ple_dim=2048, ple_kernel=4, ngram_size=3,
                      ngram_heads=8, ngram_base=20_000_000, ngram_divisor=128, ngram_seed=1234, ngram_parts=512,
                      idx_heads=16, idx_kv=1, idx_dim=128, idx_ratio=4, idx_budget=2048, rotary=0.25,
                      theta=10_000.0, eps=1e-6, max_pos=32768),
    # transformers 5.24's Glm5NextTextConfig defaults: MLA every 4th layer (3, 7, ...), KDA elsewhere, layers 0-2
    # dense, every indexer "full"
    "glm5-next": dict(arch="Glm5NextForConditionalGeneration", model_type="glm5_next", hidden=4096, inter=12288,
                      layers=45, heads=64, vocab=154880, tied=False, experts=288, top_k=8, moe_inter=2048,
                      n_shared=1, first_dense=3, n_group=1, topk_group=1, routed_scale=2.5, swiglu_limit=10.0,
                      q_rank=1536, kv_rank=512, nope=256, v_dim=256, idx_heads=32, idx_dim=128, idx_topk=2048,
                      kpool=16, lin_heads=64, lin_dim=128, conv_kernel=4, lower_bound=-5.0, mla_interval=4, hc=4,
                      hc_iters=20, hc_eps=1e-6, eps=1e-5, max_pos=1048576),
}
ALGO = {"nvfp4": "NVFP4", "fp8": "FP8", "mxfp8": "MXFP8", "bf16": None}


def shape_of(name: str, layers: int | None = None, experts: int | None = None, ple_rows: int | None = None) -> dict:
    """The shape's parameters, with `layers` layers (refused where that breaks the layer pattern),
    `experts` routed experts (a smaller variant for a CPU check, whose NumPy executor holds every
    weight in float32; top_k stays, up to `experts`) and n-gram tables of about `ple_rows` rows
    (qwen4-exp: ngram_vocab_size_base lowered to match)."""
    s = dict(SHAPES[name])
    if experts is not None:
        if "experts" not in s or experts < 1:
            raise ValueError(f"{name}: --experts {experts}: {'at least 1' if 'experts' in s else 'no routed experts'}")
        s["experts"], s["top_k"] = experts, min(s["top_k"], experts)
    if ple_rows is not None:
        if "ngram_base" not in s or ple_rows < 1:
            raise ValueError(f"{name}: --ple-rows {ple_rows}: {'at least 1' if 'ngram_base' in s else 'no n-gram tables'}")
        s["ngram_base"] = min(s["ngram_base"], _ple_base(s, ple_rows))
    if layers is None:
        return s
    if layers < 1:
        raise ValueError(f"{name}: --layers {layers}: at least 1")
    mt = s["model_type"]
    if mt in ("qwen3_next", "qwen4_exp_text") and layers % s["full_interval"]:
        raise ValueError(f"{name}: --layers {layers} breaks the pattern of {s['full_interval'] - 1} linear_attention "
                         f"layers then 1 attention layer: give a multiple of {s['full_interval']}")
    if mt == "glm4_moe" and layers <= s["first_dense"]:
        raise ValueError(f"{name}: --layers {layers} leaves no MoE layer after the {s['first_dense']} dense "
                         f"one(s) (first_k_dense_replace): give at least {s['first_dense'] + 1}")
    if mt == "glm5_next" and layers < s["mla_interval"]:
        raise ValueError(f"{name}: --layers {layers} leaves no MLA layer (every {s['mla_interval']}th, after the "
                         f"{s['first_dense']} dense KDA layers of mlp_layer_types): give at least {s['mla_interval']}")
    if mt == "qwen4_exp_text":
        s["ple_layers"] = [i for i in s["ple_layers"] if i <= layers]
        if not s["ple_layers"]:
            raise ValueError(f"{name}: --layers {layers} drops every PLE layer ({SHAPES[name]['ple_layers']})")
    s["layers"] = layers
    return s


def layer_types(shape: dict) -> list[str]:
    """The hybrids' token mixer per layer (transformers' default patterns): Qwen3-Next's
    full_attention / qwen4_exp's indexed_attention every full_interval-th layer, glm5_next's MLA
    (indexed_attention) every mla_interval-th, linear_attention elsewhere."""
    if shape.get("model_type") == "glm5_next":
        return ["indexed_attention" if i % shape["mla_interval"] == shape["mla_interval"] - 1 else "linear_attention"
                for i in range(shape["layers"])]
    att = "indexed_attention" if shape.get("model_type") == "qwen4_exp_text" else "full_attention"
    return [att if (i + 1) % shape["full_interval"] == 0 else "linear_attention" for i in range(shape["layers"])]


def sparse(shape: dict, b: int) -> bool:
    if "experts" not in shape:
        return False
    if shape["model_type"] in ("glm4_moe", "glm5_next"):
        return b >= shape["first_dense"]
    return b not in shape.get("mlp_only", [])


def ngram_heads(shape: dict) -> int:
    """qwen4_exp's n-gram heads per PLE layer, G = (ngram_size - 1) * heads_per_ngram."""
    return (shape["ngram_size"] - 1) * shape["ngram_heads"]


def _ple_base(shape: dict, rows: int) -> int:
    """The ngram_vocab_size_base whose first PLE layer's table has about `rows` rows (not more but for
    the padding): G primes from the base up, so base ~ rows / G less the primes' gaps."""
    from bloomery.core import ngram
    s, G = shape, ngram_heads(shape)
    base = max(2, rows // G)
    while base > 2:
        over = ngram.tables(s["vocab"], s["ngram_size"], s["ngram_heads"], base, s["ngram_seed"], 0,
                            s["ngram_divisor"]).rows - rows
        if over <= s["ngram_divisor"]:
            break
        base = max(2, base - max(1, over // G))
    return base


def ple_tables(shape: dict) -> dict:
    """{layer (0-based): core/ngram.py's Tables} of qwen4_exp's PLE layers (the k-th in sorted
    ple_layer_ids hashes with layer index k)."""
    from bloomery.core import ngram
    s = shape
    return {i - 1: ngram.tables(s["vocab"], s["ngram_size"], s["ngram_heads"], s["ngram_base"], s["ngram_seed"], k,
                                s["ngram_divisor"]) for k, i in enumerate(sorted(s["ple_layers"]))}


def config(shape: dict) -> dict:
    s = shape
    if s["model_type"] == "qwen3_next":
        return _config_qwen3_next(s)
    if s["model_type"] == "glm4_moe":
        return _config_glm4_moe(s)
    if s["model_type"] == "qwen4_exp_text":
        return _config_qwen4_exp(s)
    if s["model_type"] == "glm5_next":
        return _config_glm5_next(s)
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


def _config_qwen4_exp(s: dict) -> dict:
    """Qwen4ExpTextConfig's keys as save_pretrained writes them (no intermediate_size: every layer
    is MoE); eos_token_id 2 (PLE needs one) is the tokenizer's <|im_end|>."""
    return {"architectures": [s["arch"]], "model_type": s["model_type"], "vocab_size": s["vocab"],
            "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv"], "head_dim": s["head_dim"], "hidden_act": "silu",
            "max_position_embeddings": s["max_pos"], "initializer_range": 0.02, "rms_norm_eps": s["eps"],
            "use_cache": True, "tie_word_embeddings": s["tied"],
            "rope_parameters": {"rope_type": "default", "rope_theta": s["theta"], "partial_rotary_factor": s["rotary"]},
            "attention_bias": False, "attention_dropout": 0.0, "linear_conv_kernel_dim": s["conv_kernel"],
            "linear_key_head_dim": s["lin_k_dim"], "linear_value_head_dim": s["lin_v_dim"],
            "linear_num_key_heads": s["lin_k_heads"], "linear_num_value_heads": s["lin_v_heads"],
            "moe_intermediate_size": s["moe_inter"], "shared_expert_intermediate_size": s["shared_inter"],
            "num_experts_per_tok": s["top_k"], "num_experts": s["experts"], "norm_topk_prob": True,
            "output_router_logits": False, "router_aux_loss_coef": 0.001, "layer_types": layer_types(s),
            "hc_count": s["hc"], "hc_lowrank": s["hc_rank"], "ple_layer_ids": sorted(s["ple_layers"]),
            "ple_embed_dim": s["ple_dim"], "ple_conv_kernel_size": s["ple_kernel"], "ngram_size": s["ngram_size"],
            "heads_per_ngram": s["ngram_heads"], "ngram_vocab_size_base": s["ngram_base"],
            "make_ngram_vocab_size_divisible_by": s["ngram_divisor"], "seed": s["ngram_seed"],
            "split_ngram_parts": s["ngram_parts"], "number_of_conv_states": 3 if s["ple_layers"] else 1,
            "indexer_n_heads": s["idx_heads"], "indexer_kv_heads": s["idx_kv"], "indexer_head_dim": s["idx_dim"],
            "indexer_budget": s["idx_budget"], "indexer_compress_ratio": s["idx_ratio"], "output_gate_type": None,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "dtype": "bfloat16",
            "transformers_version": "5.24.0"}


def _config_glm5_next(s: dict) -> dict:
    """Glm5NextConfig with the text model's Glm5NextTextConfig as text_config (the vision tower's
    config left to its defaults: no vision tensors are written); bos / eos 1 / 2 (None by
    default) are the tokenizer's; the default pad id 154820 where the vocabulary holds it."""
    n = s["layers"]
    text = {"model_type": "glm5_next_text", "vocab_size": s["vocab"], "hidden_size": s["hidden"],
            "intermediate_size": s["inter"], "moe_intermediate_size": s["moe_inter"], "num_hidden_layers": n,
            "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"], "n_shared_experts": s["n_shared"],
            "n_routed_experts": s["experts"], "output_router_logits": False, "routed_scaling_factor": s["routed_scale"],
            "kv_lora_rank": s["kv_rank"], "q_lora_rank": s["q_rank"], "qk_rope_head_dim": 0, "v_head_dim": s["v_dim"],
            "qk_nope_head_dim": s["nope"], "qk_head_dim": s["nope"], "head_dim": 0, "n_group": s["n_group"],
            "topk_group": s["topk_group"], "num_experts_per_tok": s["top_k"], "norm_topk_prob": True,
            "hidden_act": "silu", "max_position_embeddings": s["max_pos"], "initializer_range": 0.02,
            "rms_norm_eps": s["eps"], "use_cache": True, "pad_token_id": 154820 if s["vocab"] > 154820 else None,
            "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": s["tied"],
            "mlp_layer_types": ["sparse" if sparse(s, b) else "dense" for b in range(n)],
            "attention_bias": False, "attention_dropout": 0.0, "index_topk": s["idx_topk"],
            "index_head_dim": s["idx_dim"], "index_n_heads": s["idx_heads"], "layer_types": layer_types(s),
            "indexer_types": ["full"] * n, "swiglu_limit": s["swiglu_limit"], "linear_head_dim": s["lin_dim"],
            "linear_num_heads": s["lin_heads"], "linear_conv_kernel_dim": s["conv_kernel"],
            "linear_lower_bound": s["lower_bound"], "hc_mult": s["hc"], "hc_eps": s["hc_eps"],
            "hc_sinkhorn_iters": s["hc_iters"], "router_aux_loss_coef": 0.001, "index_kpool": s["kpool"],
            "index_kpool_always_select_tail": True, "dtype": "bfloat16"}
    return {"architectures": [s["arch"]], "model_type": s["model_type"], "text_config": text,
            "tie_word_embeddings": s["tied"], "dtype": "bfloat16", "transformers_version": "5.24.0"}


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
    if s["model_type"] == "qwen4_exp_text":       # bare Parameters (A_log, dt_bias) and Conv1d (ple.conv1d): not listed
        ple = {i - 1 for i in s["ple_layers"]}
        for b, t in enumerate(layer_types(s)):
            p = f"model.layers.{b}"
            if t == "linear_attention":
                out += [f"{p}.linear_attn.conv1d", f"{p}.linear_attn.in_proj_a", f"{p}.linear_attn.in_proj_b"]
            out += [f"{p}.mlp.gate", f"{p}.mlp.shared_expert_gate"] + ([f"{p}.ple.ple_embedding*"] if b in ple else [])
        return out
    if s["model_type"] == "glm5_next":            # hc fn / base / scale, conv, kpool gate: Parameters, not listed
        p = "model.language_model"
        return (["lm_head", f"{p}.embed_tokens"] + [f"{p}.layers.{b}.mlp.gate" for b in range(s["layers"]) if sparse(s, b)]
                + ["model.visual*"])
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


def _gated_attention(fmt: str, a: str, s: dict, hd: int, h: int) -> list:
    """Qwen3-Next's and qwen4_exp's gated attention: q_proj gives each head's [q | gate]; q/k norms."""
    return (_linear(fmt, f"{a}.q_proj", 2 * s["heads"] * hd, h) + _linear(fmt, f"{a}.k_proj", s["kv"] * hd, h)
            + _linear(fmt, f"{a}.v_proj", s["kv"] * hd, h) + _linear(fmt, f"{a}.o_proj", h, s["heads"] * hd)
            + [(f"{a}.q_norm.weight", "BF16", (hd,)), (f"{a}.k_norm.weight", "BF16", (hd,))])


def _mlp(fmt: str, p: str, inter: int, h: int) -> list:
    return (_linear(fmt, f"{p}.gate_proj", inter, h) + _linear(fmt, f"{p}.up_proj", inter, h)
            + _linear(fmt, f"{p}.down_proj", h, inter))


def tensors(shape: dict, fmt: str):
    """(name, dtype, shape) of every stored tensor, in order; linears expanded into their parts."""
    if shape["model_type"] == "qwen3_next":
        return _tensors_qwen3_next(shape, fmt)
    if shape["model_type"] == "glm4_moe":
        return _tensors_glm4_moe(shape, fmt)
    if shape["model_type"] == "qwen4_exp_text":
        return _tensors_qwen4_exp(shape, fmt)
    if shape["model_type"] == "glm5_next":
        return _tensors_glm5_next(shape, fmt)
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
            out += _gated_attention(fmt, a, s, hd, h)
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


def _hyper(fmt: str, p: str, s: dict, inject: bool = True) -> list:
    """Qwen4ExpTextGatedResidual {p}: hc_norm BF16, the low-rank mixer and the injection quantized."""
    nd, r = s["hc"] * s["hidden"], s["hc_rank"]
    out = [(f"{p}.hc_norm.weight", "BF16", (nd,))]
    out += _linear(fmt, f"{p}.input_mix_weight_down", r, nd) + _linear(fmt, f"{p}.input_mix_weight_up", nd, r)
    return out + (_linear(fmt, f"{p}.block_inject_weight", s["hc"], nd) if inject else [])


def _tensors_qwen4_exp(s: dict, fmt: str) -> list:
    """transformers 5.24's Qwen4ExpForCausalLM state dict in its saved names (per-expert experts, the
    n-gram tables in torch.chunk shards, the hash buffers I64)."""
    from bloomery.core import ngram
    h, hd, nd, n = s["hidden"], s["head_dim"], s["hc"] * s["hidden"], s["hc"]
    kdim, vdim = s["lin_k_heads"] * s["lin_k_dim"], s["lin_v_heads"] * s["lin_v_dim"]
    G, tabs = ngram_heads(s), ple_tables(s)
    out = [("model.embed_tokens.weight", "BF16", (s["vocab"], h))]
    for b, kind in enumerate(layer_types(s)):
        p = f"model.layers.{b}"
        if b in tabs:
            e = f"{p}.ple.ple_embedding"
            out += [(f"{e}.layer_multipliers", "I64", (s["ngram_size"],)),
                    (f"{e}.ngram_heads_vocab_sizes", "I64", (G,)), (f"{e}.ngram_heads_offsets", "I64", (G,))]
            out += [(f"{e}.ngram_embedding.shard_{i}.weight", "BF16", (rows, s["ple_dim"] // G))
                    for i, rows in enumerate(ngram.chunks(tabs[b].rows, s["ngram_parts"]))]
            out += _linear(fmt, f"{p}.ple.key_proj", nd, s["ple_dim"]) + _linear(fmt, f"{p}.ple.value_proj", h, s["ple_dim"])
            out += [(f"{p}.ple.norm_{x}.weight", "BF16", (nd,)) for x in ("key", "query", "conv")]
            out.append((f"{p}.ple.conv1d.weight", "BF16", (nd, 1, s["ple_kernel"])))
        out += _hyper(fmt, f"{p}.attn_hyper_connection", s)
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            out += _linear(fmt, f"{a}.in_proj_qkv", 2 * kdim + vdim, h) + _linear(fmt, f"{a}.in_proj_z", vdim, h)
            out += [(f"{a}.in_proj_b.weight", "BF16", (s["lin_v_heads"], h)),
                    (f"{a}.in_proj_a.weight", "BF16", (s["lin_v_heads"], h)),
                    (f"{a}.conv1d.weight", "BF16", (2 * kdim + vdim, 1, s["conv_kernel"])),
                    (f"{a}.A_log", "BF16", (s["lin_v_heads"],)), (f"{a}.dt_bias", "BF16", (s["lin_v_heads"],)),
                    (f"{a}.norm.weight", "BF16", (s["lin_v_dim"],))]
            out += _linear(fmt, f"{a}.out_proj", h, vdim)
        else:
            a = f"{p}.self_attn"
            out += _gated_attention(fmt, a, s, hd, h)
            out += _linear(fmt, f"{a}.indexer.index_qk_proj", (s["idx_heads"] + s["idx_kv"]) * s["idx_dim"], h)
            out += [(f"{a}.indexer.q_layernorm.weight", "BF16", (s["idx_dim"],)),
                    (f"{a}.indexer.k_layernorm.weight", "BF16", (s["idx_dim"],))]
        out += _hyper(fmt, f"{p}.mlp_hyper_connection", s)
        out.append((f"{p}.mlp.gate.weight", "BF16", (s["experts"], h)))
        for e in range(s["experts"]):
            out += _mlp(fmt, f"{p}.mlp.experts.{e}", s["moe_inter"], h)
        out += _mlp(fmt, f"{p}.mlp.shared_expert", s["shared_inter"], h)
        out.append((f"{p}.mlp.shared_expert_gate.weight", "BF16", (1, h)))
    out += _hyper(fmt, "model.hyper_connection_mixer", s, inject=False)
    if not s["tied"]:
        out.append(("lm_head.weight", "BF16", (s["vocab"], h)))
    return out


def _tensors_glm5_next(s: dict, fmt: str) -> list:
    """transformers 5.24's Glm5NextForConditionalGeneration language model in its saved names
    (hc_{attn,ffn}_*, q/k/v_conv1d, f_a_proj ... without forget_gate., per-expert experts); F32 what
    _keep_in_fp32_modules_strict keeps (router, correction bias, conv, A_log, dt_bias, hc base / scale)."""
    h, P, n = s["hidden"], "model.language_model", s["hc"]
    H, d, K, Di = s["lin_heads"], s["lin_dim"], s["conv_kernel"], s["idx_dim"]
    out = [(f"{P}.embed_tokens.weight", "BF16", (s["vocab"], h))]
    for b, kind in enumerate(layer_types(s)):
        p, a = f"{P}.layers.{b}", f"{P}.layers.{b}.self_attn"
        for hc in ("attn", "ffn"):
            out += [(f"{p}.hc_{hc}_fn", "BF16", ((2 + n) * n, n * h)), (f"{p}.hc_{hc}_base", "F32", ((2 + n) * n,)),
                    (f"{p}.hc_{hc}_scale", "F32", (3,))]
        out.append((f"{p}.input_layernorm.weight", "BF16", (h,)))
        if kind == "linear_attention":
            for x in "qkv":
                out += _linear(fmt, f"{a}.{x}_proj", H * d, h)
            out += [(f"{a}.{x}_conv1d.weight", "F32", (H * d, 1, K)) for x in "qkv"]
            out += _linear(fmt, f"{a}.f_a_proj", d, h) + _linear(fmt, f"{a}.f_b_proj", H * d, d)
            out += [(f"{a}.dt_bias", "F32", (H * d,)), (f"{a}.A_log", "F32", (H,))]
            out += _linear(fmt, f"{a}.b_proj", H, h)
            out += _linear(fmt, f"{a}.g_a_proj", d, h) + _linear(fmt, f"{a}.g_b_proj", H * d, d)
            out.append((f"{a}.o_norm.weight", "BF16", (d,)))
            out += _linear(fmt, f"{a}.o_proj", h, H * d)
        else:
            out += _linear(fmt, f"{a}.q_a_proj", s["q_rank"], h) + [(f"{a}.q_a_layernorm.weight", "BF16", (s["q_rank"],))]
            out += _linear(fmt, f"{a}.q_b_proj", s["heads"] * s["nope"], s["q_rank"])
            out += _linear(fmt, f"{a}.kv_a_proj_with_mqa", s["kv_rank"], h)
            out += [(f"{a}.kv_a_layernorm.weight", "BF16", (s["kv_rank"],))]
            out += _linear(fmt, f"{a}.kv_b_proj", s["heads"] * (s["nope"] + s["v_dim"]), s["kv_rank"])
            out += _linear(fmt, f"{a}.o_proj", h, s["heads"] * s["v_dim"])
            i = f"{a}.indexer"                        # every layer's indexer is "full" (indexer_types)
            out += _linear(fmt, f"{i}.wq_b", s["idx_heads"] * Di, s["q_rank"]) + _linear(fmt, f"{i}.wk", Di, h)
            out += [(f"{i}.k_norm.weight", "BF16", (Di,)), (f"{i}.k_norm.bias", "BF16", (Di,))]
            out += _linear(fmt, f"{i}.weights_proj", s["idx_heads"], h)
            out += [(f"{i}.index_kpool_compress_gate", "BF16", (Di, h)),
                    (f"{i}.index_kpool_compress_ape", "BF16", (s["kpool"], Di))]
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        if sparse(s, b):
            out += [(f"{p}.mlp.gate.weight", "F32", (s["experts"], h)),
                    (f"{p}.mlp.gate.e_score_correction_bias", "F32", (s["experts"],))]
            for e in range(s["experts"]):
                out += _mlp(fmt, f"{p}.mlp.experts.{e}", s["moe_inter"], h)
            out += _mlp(fmt, f"{p}.mlp.shared_experts", s["moe_inter"] * s["n_shared"], h)
        else:
            out += _mlp(fmt, f"{p}.mlp", s["inter"], h)
    out.append((f"{P}.norm.weight", "BF16", (h,)))
    if not s["tied"]:
        out.append(("lm_head.weight", "BF16", (s["vocab"], h)))
    return out


ITEMSIZE = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4, "I64": 8}


def nbytes(items) -> int:
    """Bytes of the tensors' data (the shards add a JSON header each)."""
    return sum(math.prod(shp) * ITEMSIZE[dt] for _, dt, shp in items)


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
    if mt == "qwen4_exp_text":
        if name.endswith(".A_log"):
            return "a_log"
        if name.endswith(".dt_bias"):
            return "dt_bias"
        if name.endswith("linear_attn.norm.weight"):
            return "one"                      # Qwen4ExpTextRMSNormGated multiplies by its weight
        return None                           # Qwen4ExpTextRMSNorm multiplies by 1 + weight
    if mt == "glm5_next":
        if name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale")):
            return "one"                      # the RMSNorms / the k LayerNorm / mHC's scales multiply (init ones)
        if name.endswith(("mlp.gate.weight", "hc_attn_base", "hc_ffn_base")):
            return "f32_small"
        if name.endswith(("e_score_correction_bias", ".A_log")):
            return "f32_bias"                 # A = exp(A_log) ~ 1: the bounded decay lb * sigmoid(A (f + dt)) mid-range
        if name.endswith(".dt_bias"):
            return "dt_bias"
    return None


def constant(shape: dict, name: str) -> np.ndarray:
    """The values of an integer tensor: qwen4_exp's hash buffers of a PLE layer, exactly what
    core/ngram.py computes from the config (and prepare checks)."""
    t = ple_tables(shape)[int(name.split(".")[2])]
    field = name.rsplit(".", 1)[1]
    return np.asarray({"layer_multipliers": t.multipliers, "ngram_heads_vocab_sizes": t.sizes,
                       "ngram_heads_offsets": t.offsets}[field], np.int64)


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


def write_tokenizer(out: Path) -> None:
    """tools/tiny.py's byte-level BPE (512 ids, <|im_end|> = 2) and its chat template, with a
    generation_config.json naming bos / eos: enough for `bloomery run --prompt` on any shape."""
    from bloomery.tools import tiny
    (out / "tokenizer.json").write_text(tiny.build_tokenizer().to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tiny.BOS, "eos_token": tiny.EOS,
         "pad_token": tiny.EOS, "unk_token": tiny.SPECIALS[0], "chat_template": tiny.CHAT_TEMPLATE}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def write(name: str, out: Path, fmt: str = "nvfp4", layers: int | None = None, shard_gb: float = 2.0,
          seed: int = 0, experts: int | None = None, ple_rows: int | None = None) -> Path:
    return write_shape(shape_of(name, layers, experts, ple_rows), out, fmt, shard_gb, seed)


def write_shape(shape: dict, out: Path, fmt: str = "nvfp4", shard_gb: float = 2.0, seed: int = 0) -> Path:
    """The checkpoint of a shape (SHAPES' entries through shape_of, or a smaller variant of one)."""
    write_config(shape, out, fmt)
    write_tokenizer(out)
    items = tensors(shape, fmt)
    limit = int(shard_gb * 2**30)
    groups, cur, size = [], [], 0
    for t in items:
        nb = math.prod(t[2]) * ITEMSIZE[t[1]]
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
            nb = math.prod(shp) * ITEMSIZE[dt]
            header[n] = {"dtype": dt, "shape": list(shp), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[n] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for n, dt, shp in group:
                if dt == "I64":
                    f.write(constant(shape, n).astype("<i8").tobytes())
                    continue
                for chunk in fill(rng, n, dt, shp, value_kind(shape, n)):
                    f.write(chunk)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def size_report(name: str, shape: dict, fmt: str) -> str:
    """The checkpoint's bytes and, for qwen4-exp, its n-gram tables' (and a table's at the real
    row count)."""
    nb = nbytes(tensors(shape, fmt))
    out = f"{name} {fmt}, {shape['layers']} layers: {nb / 1e9:.2f} GB ({nb:,} bytes)"
    if "ngram_base" not in shape:
        return out
    tabs, d = ple_tables(shape), shape["ple_dim"] // ngram_heads(shape)
    real = next(iter(ple_tables({**shape, "ngram_base": SHAPES[name]["ngram_base"]}).values()))
    rows = ", ".join(f"{t.rows:,}" for t in tabs.values())
    return (f"{out}; n-gram tables of PLE layers {shape['ple_layers']}: {rows} rows x {d} BF16 "
            f"(ngram_vocab_size_base {shape['ngram_base']:,}) = {sum(t.rows for t in tabs.values()) * d * 2 / 1e9:.2f} "
            f"GB; a table at the real row count (base {SHAPES[name]['ngram_base']:,}): {real.rows:,} rows = "
            f"{real.rows * d * 2:,} bytes ({real.rows * d * 2 / 1e9:.2f} GB)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--format", default="nvfp4", choices=sorted(ALGO))
    ap.add_argument("--layers", type=int, default=None,
                    help="fewer layers than the real model (qwen3-next-80b-a3b, qwen4-exp: a multiple of 4; "
                         "glm-4.5-air: >= 2; glm5-next: >= 4)")
    ap.add_argument("--experts", type=int, default=None,
                    help="fewer routed experts: a smaller variant for CPU checks (not the real shape)")
    ap.add_argument("--ple-rows", type=int, default=None,
                    help="qwen4-exp: n-gram tables of about this many rows (ngram_vocab_size_base lowered to "
                         "match; default: the real 320,001,536 rows, 81.9 GB a PLE layer)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--size", action="store_true", help="print the checkpoint's size and write nothing")
    a = ap.parse_args(argv)
    try:
        shape = shape_of(a.shape, a.layers, a.experts, a.ple_rows)
    except ValueError as e:
        ap.error(str(e))
    if a.size or a.out is None:
        if not a.size:
            ap.error("the output folder is required (or --size)")
        print(size_report(a.shape, shape, a.format))
        return 0
    t0 = time.perf_counter()
    write_shape(shape, a.out, a.format, a.shard_gb)
    size = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    print(f"{a.out}: {a.shape} {a.format}, {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
