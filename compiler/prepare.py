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
from bloomery.core.artifact import kernels as K
from bloomery.core.errors import UnreadableJSON


def _text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableJSON(f"{p}: byte {e.start} is not UTF-8 ({e.reason}). Fix or re-download the file; "
                             f"nothing was written.") from None


def tokenizer_files(folder: Path) -> tuple[str | None, str | None]:
    """tokenizer.json's text and the chat template (chat_template.jinja, else tokenizer_config.json's).
    They travel as text: the runtime loads them (and refuses by name what does not load)."""
    tok = folder / "tokenizer.json"
    tok_json = _text(tok) if tok.is_file() else None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return tok_json, _text(jinja)
    cfg = folder / "tokenizer_config.json"
    template = read_json(cfg).get("chat_template") if cfg.is_file() else None
    if isinstance(template, list):   # named templates: keep the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise UnreadableJSON(f"{cfg}: chat_template is {type(template).__name__}; expected a Jinja template string "
                             f"(or a list of named ones). Nothing was written.")
    return tok_json, template


def source_metadata(ckpt: Checkpoint) -> dict:
    """What the artifact records of its source checkpoint (no paths: the bytes must not depend on where it lay)."""
    q = ckpt.quant
    md = {"bloomery.source.quant_algo": q.quant_algo or "none",
          "bloomery.source.kv_cache_quant_algo": q.kv_cache_quant_algo or "none"}
    eos, where = ckpt.config.get("eos_token_id"), ckpt.folder / "config.json"
    gen = ckpt.folder / "generation_config.json"
    if gen.is_file() and "eos_token_id" in (g := read_json(gen)):
        eos, where = g["eos_token_id"], gen
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < 2**31 for e in ids):
            raise UnreadableJSON(f"{where}: eos_token_id is {eos!r}; expected a token id or a list of them.")
        md["bloomery.eos_token_ids"] = ids
    bos = ckpt.config.get("bos_token_id")
    if isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < 2**31:
        md["tokenizer.ggml.bos_token_id"] = bos
    return md


def prepare(folder, out, *, tp: int = 1, keep_bf16: bool = False, env: Mapping[str, str] = os.environ,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool | None = None,
            target: str | None = None) -> publish.Published:
    """target: a GPU target (core/artifact/kernels.TARGETS, e.g. sm_90a) whose kernels are compiled
    ahead of time with the CUTLASS DSL (compiler/cutedsl) into the artifact; None: none (the
    runtime's NVRTC kernels)."""
    folder = Path(folder)
    if target is not None and target not in K.TARGETS:
        raise K.BadKernelRecord(f"--target {target!r}: known targets {', '.join(K.TARGETS)}")
    ckpt = Checkpoint.open(folder)
    ranks = planning.plan(ckpt, tp=tp, env=env, keep_bf16=keep_bf16)
    lower.plan_metadata(ranks)           # the execution plan, per rank (compiler/lower.py)
    tok_json, template = tokenizer_files(folder)
    md = source_metadata(ckpt)
    if target is not None:               # before anything is written: a failed compile leaves OUT as it was
        from bloomery.compiler import cutedsl
        md[K.KEY] = cutedsl.compile_record(target)
    return publish.publish(out, ranks, md, tokenizer_json=tok_json, chat_template=template,
                           max_shard_bytes=max_shard_bytes, progress=progress)
