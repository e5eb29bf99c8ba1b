"""Tiny random-init models (seeded, deterministic) of each family, from transformers configs,
plus a tiny byte-level BPE tokenizer (vocab 512) built in code; no downloads."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
SEED = 1234
BOS, EOS = "<|im_start|>", "<|im_end|>"
SPECIALS = ["<|endoftext|>", BOS, EOS]  # ids 0, 1, 2 (as SmolLM2)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QUANT_FORMATS = ("nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv")
# further ModelOpt formats, exported for tiny-llama only
LLAMA_EXTRA_FORMATS = ("fp8_channel", "fp8_pb_wo", "nvfp4_w4a16", "mxfp4", "w4a8_nvfp4_fp8",
                       "mixed_nvfp4_fp8", "nvfp4_awq")
# the flagship families (docs/flagships.md): their own formats, and weights HF initialises to a
# constant randomised (randomise_init)
FLAGSHIPS = ("qwen4_exp", "glm5_next")
FLAGSHIP_FORMATS = ("nvfp4", "fp8", "mxfp8", "mixed_nvfp4_mxfp8")
# the dense families of published ModelOpt checkpoints beside Llama: rope scaling, Qwen3's q/k norms,
# Qwen2's q/k/v biases; a small set of formats keeps them cheap
DENSE = ("llama3-rope", "qwen3", "qwen2")
DENSE_FORMATS = ("nvfp4", "fp8")

_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
# the gates of the flagships run prompts of 1,024+ positions
_FLAGSHIP_COMMON = dict(vocab_size=VOCAB, hidden_size=128, max_position_embeddings=2048,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def quant_formats(family: str) -> tuple:
    """The quantized formats a tiny family is exported in (beside bf16)."""
    if family in FLAGSHIPS:
        return FLAGSHIP_FORMATS
    if family in DENSE:
        return DENSE_FORMATS
    return QUANT_FORMATS + (LLAMA_EXTRA_FORMATS if family == "llama" else ())


def family_config(family: str):
    """The transformers config of a tiny family (architectures set)."""
    import transformers as tf

    if family == "llama3-rope":
        # Llama 3.1's rope scaling with original_max_position_embeddings 64, so that it changes the
        # logits within the gates' 64-token slice (14 of the 16 frequencies scaled); attention_bias on:
        # the q/k/v/o biases of the Llama-class configs that set it. config.json in Llama 3.1's own
        # form (hub_rope_form)
        cfg = tf.LlamaConfig(**_COMMON, intermediate_size=256, num_hidden_layers=2, head_dim=32,
                             attention_bias=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        arch = "LlamaForCausalLM"
    elif family == "qwen3":
        # YaRN as Qwen3's long-context configs set it, factor 4 over 256 original positions
        # (max_position_embeddings 1024 = 4 x 256): 15 of 16 frequencies interpolated, attention factor 1.139
        cfg = tf.Qwen3Config(**_COMMON, intermediate_size=256, num_hidden_layers=2, head_dim=32,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 256})
        arch = "Qwen3ForCausalLM"
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**_COMMON, intermediate_size=256, num_hidden_layers=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        arch = "Qwen2ForCausalLM"
    elif family == "llama":
        # wider than the MoE ones so that FP8 128x128 blocks come out as real 2-D grids
        cfg = tf.LlamaConfig(**{**_COMMON, "hidden_size": 256}, intermediate_size=384,
                             num_hidden_layers=2, head_dim=32,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        arch = "LlamaForCausalLM"
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**_COMMON, intermediate_size=256, num_hidden_layers=2, head_dim=32,
                                moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        arch = "Qwen3MoeForCausalLM"
    elif family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(
            **_COMMON, intermediate_size=256, num_hidden_layers=4, head_dim=64,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            moe_intermediate_size=128, shared_expert_intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[1],            # a dense layer beside the sparse ones
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25})
        arch = "Qwen3NextForCausalLM"
    elif family == "glm4_moe":
        cfg = tf.Glm4MoeConfig(
            **_COMMON, intermediate_size=256, num_hidden_layers=3, first_k_dense_replace=1,
            moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "partial_rotary_factor": 0.5})
        arch = "Glm4MoeForCausalLM"
    elif family == "qwen4_exp":
        # docs/flagships.md "Test models": PLE on linear layers 1 and 3 (one-indexed), one linear layer
        # without PLE, one QSA-indexed layer that keeps 16 of up to 1,024 keys (4 of 256 blocks) plus
        # the tail: the relative gap at the cut grows as fewer blocks are kept (keeping 16 blocks, 0.6%
        # of the positions of 1,024-token prompts have one below 5e-5: more than the gates exclude)
        cfg = tf.Qwen4ExpTextConfig(
            **_FLAGSHIP_COMMON, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            head_dim=32,
            layer_types=["linear_attention"] * 3 + ["indexed_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            moe_intermediate_size=64, shared_expert_intermediate_size=64,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            hc_count=4, hc_lowrank=32,
            ple_layer_ids=[1, 3], ple_embed_dim=64, ngram_size=3, heads_per_ngram=4,
            ngram_vocab_size_base=4096, split_ngram_parts=4,
            indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=32,   # >= 8 heads: no ties
            indexer_compress_ratio=4, indexer_budget=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25})
        arch = "Qwen4ExpForCausalLM"
    elif family == "glm5_next":
        # KDA x3, MLA + DSA ("full"), KDA x3, MLA + DSA; layer 0 dense; the indexer keeps 16 of up
        # to 1,024 keys (4 of 256 pools) plus the tail. 16 indexer heads: with 8, some positions
        # weigh every head negatively and then prefer the pools whose relu terms are all 0, exact
        # ties; swiglu_limit clamps some gate/up values
        kda, mla = "linear_attention", "indexed_attention"
        text = tf.Glm5NextTextConfig(
            **_FLAGSHIP_COMMON, num_hidden_layers=8, layer_types=[kda] * 3 + [mla] + [kda] * 3 + [mla],
            mlp_layer_types=["dense"] + ["sparse"] * 7, intermediate_size=256, moe_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
            qk_nope_head_dim=32, v_head_dim=32, qk_rope_head_dim=0,
            index_n_heads=16, index_head_dim=32, index_kpool=4, index_topk=16,
            linear_num_heads=4, linear_head_dim=32, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
            hc_mult=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            swiglu_limit=0.5)
        vision = tf.Glm5NextVisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                         out_hidden_size=128, projection_intermediate_size=64)
        cfg = tf.Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        arch = "Glm5NextForConditionalGeneration"
    else:
        raise KeyError(family)
    cfg.architectures = [arch]  # required by ModelOpt's export
    return cfg


def model_class(cfg):
    """The transformers class of a config's architecture (glm5_next is no AutoModelForCausalLM)."""
    import transformers as tf

    return getattr(tf, cfg.architectures[0])


# Drawn anew in every flagship model: (name pattern, mean, std). The routers get logits well apart
# (with initializer_range's 0.02, GLM's sigmoid scores are within 5e-5 relative at the top-k cut
# at ~0.7% of the positions of 1,024-token prompts); the DSA gate is ones at init, a real
# projection here (gate scores ~ +-0.6).
_REDRAW = (
    (r"mlp\.gate\.weight$", 0.0, 0.3),
    (r"index_kpool_compress_gate$", 0.0, 0.05),
)
# The other float tensors transformers initialises to a constant c (RMSNorm 0 / 1, LayerNorm, PLE
# conv, mHC base / scale, KDA A_log, DSA ape, the correction bias, dt_bias): c + std * N(0, 1),
# std of the first pattern that matches.
_CONSTANT_STD = (
    (r"ple\.conv1d\.weight$", 0.3),
    (r"_hc\.base$|index_kpool_compress_ape$|A_log$", 0.5),
    (r"e_score_correction_bias$", 0.02),
    (r"", 0.2),
)


def randomise_init(model, seed: int) -> list[str]:
    """Redraw the _REDRAW tensors and every constant float tensor of `model` (parameters and
    persistent buffers; _CONSTANT_STD), in name order from `seed`, so that every path of the
    forward is exercised. Returns the names changed."""
    import re

    import torch

    g = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict())
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n in persistent)
    done = []
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        redraw = next(((m, s) for pat, m, s in _REDRAW if re.search(pat, name)), None)
        if redraw is None:
            if t.numel() < 2 or not bool((t == t.flatten()[0]).all()):
                continue
            redraw = (t.flatten()[0].item(), next(s for pat, s in _CONSTANT_STD if re.search(pat, name)))
        mean, std = redraw
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        with torch.no_grad():
            t.copy_(mean + std * noise)
        done.append(name)
    return done


def _corpus() -> list[str]:
    from .smollm2 import CALIB_PROMPTS

    text = [
        "The quick brown fox jumps over the lazy dog.",
        "Paris is the capital of France. Berlin is the capital of Germany.",
        "Rome is the capital of Italy and Madrid is the capital of Spain.",
        "def add(a, b):\n    return a + b\n",
        "for i in range(10):\n    print(i * i)\n",
        "One, two, three, four, five, six, seven, eight, nine, ten.",
        "0123456789 + - * / = ( ) [ ] { } < > ' \" ! ? , . ; :",
        "Quantization maps weights to fewer bits: FP8, NVFP4, MXFP8 and MXFP4.",
        "A small model answers questions about the world, writes poems and code.",
        "The weather today is sunny with a light breeze from the west.",
    ]
    return (text + CALIB_PROMPTS) * 4


def build_tokenizer():
    """Byte-level BPE of exactly VOCAB tokens, trained on a fixed in-code corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB}")
    return tok


def save_tokenizer(out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, unk_token=SPECIALS[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    tc_p = out / "tokenizer_config.json"
    tc = json.loads(tc_p.read_text())
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    tc_p.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def add_legacy_keys(folder: Path) -> None:
    """transformers 5 writes rope settings only under "rope_parameters" and Qwen3-MoE's expert
    count as "num_local_experts"; add the top-level keys that hub configs (and older
    loaders) use: rope_theta, partial_rotary_factor, num_experts."""
    cfg_p = folder / "config.json"
    cfg = json.loads(cfg_p.read_text())
    rope = cfg.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in cfg and key in rope:
            cfg[key] = rope[key]
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:
        cfg.setdefault("num_experts", cfg["num_local_experts"])
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def hub_rope_form(folder: Path) -> None:
    """Rope settings as Llama 3.1's published config.json writes them (transformers before 5): a
    `rope_scaling` object beside a top-level rope_theta, no rope_parameters."""
    cfg_p = folder / "config.json"
    cfg = json.loads(cfg_p.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def to_bf16(model) -> None:
    """Float tensors to BF16 except those transformers keeps in float32 when it loads the model
    in BF16 (`_keep_in_fp32_modules_strict`: GLM-5's router, conv, decay and mHC base / scale)."""
    import re

    import torch

    keep = getattr(model, "_keep_in_fp32_modules_strict", None)
    keep = re.compile("|".join(sorted(keep))) if keep else None
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not (keep and keep.search(name)):
            t.data = t.data.to(torch.bfloat16)


def build_bf16(family: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = family_config(family)
    torch.manual_seed(SEED)
    if family in FLAGSHIPS:
        model = model_class(cfg)._from_config(cfg).eval()
        randomise_init(model, SEED + 2)
        to_bf16(model)
    else:
        model = AutoModelForCausalLM.from_config(cfg).eval()
        if family in DENSE:          # biases (HF initialises them to 0) and norm weights drawn too
            randomise_init(model, SEED + 2)
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)
    save_tokenizer(out)
    add_legacy_keys(out)
    if family == "llama3-rope":
        hub_rope_form(out)


def calib_batches(n: int = 4, batch: int = 2, seq: int = 32):
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(3, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def build_quant(fmt: str, out: Path, bf16_dir: Path) -> dict:
    import torch
    from transformers import AutoConfig

    from .modelopt_export import finish_folder, quantize_and_export

    cls = model_class(AutoConfig.from_pretrained(str(bf16_dir)))
    model = cls.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).eval()
    qcfg = quantize_and_export(model, fmt, calib_batches(), out)
    finish_folder(out, bf16_dir)
    if "rope_scaling" in json.loads((bf16_dir / "config.json").read_text()):    # the bf16 folder's rope form
        hub_rope_form(out)
    return qcfg
