"""`bloomery prepare`: a checkpoint folder compiled into an artifact. Read (headers only),
plan (every refusal happens here, before anything is written), then stream, verify and
publish atomically (compiler/publish.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from bloomery.compiler import lower, planning, publish
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.quant_config import read_json
from bloomery.compiler.writer import DEFAULT_MAX_SHARD_BYTES


def tokenizer_files(folder: Path) -> tuple[str | None, str | None]:
    """tokenizer.json's text and the chat template (chat_template.jinja, else tokenizer_config.json's)."""
    tok = folder / "tokenizer.json"
    tok_json = tok.read_text(encoding="utf-8") if tok.is_file() else None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return tok_json, jinja.read_text(encoding="utf-8")
    cfg = folder / "tokenizer_config.json"
    template = read_json(cfg).get("chat_template") if cfg.is_file() else None
    if isinstance(template, list):   # named templates: keep the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return tok_json, template


def source_metadata(ckpt: Checkpoint) -> dict:
    """What the artifact records of its source checkpoint (no paths: the bytes must not depend on where it lay)."""
    q = ckpt.quant
    md = {"bloomery.source.quant_algo": q.quant_algo or "none",
          "bloomery.source.kv_cache_quant_algo": q.kv_cache_quant_algo or "none"}
    eos = ckpt.config.get("eos_token_id")
    gen = ckpt.folder / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen).get("eos_token_id", eos)
    if eos is not None:
        md["bloomery.eos_token_ids"] = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    bos = ckpt.config.get("bos_token_id")
    if isinstance(bos, int):
        md["tokenizer.ggml.bos_token_id"] = bos
    return md


def prepare(folder, out, *, tp: int = 1, keep_bf16: bool = False, env: Mapping[str, str] = os.environ,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool | None = None) -> publish.Published:
    folder = Path(folder)
    ckpt = Checkpoint.open(folder)
    ranks = planning.plan(ckpt, tp=tp, env=env, keep_bf16=keep_bf16)
    lower.plan_metadata(ranks)           # the execution plan, per rank (compiler/lower.py)
    tok_json, template = tokenizer_files(folder)
    return publish.publish(out, ranks, source_metadata(ckpt), tokenizer_json=tok_json, chat_template=template,
                           max_shard_bytes=max_shard_bytes, progress=progress)
