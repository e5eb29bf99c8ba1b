"""A checkpoint folder compiled into an artifact held in memory (core/artifact/memory.py): the
tensor planning and lowering of `bloomery prepare`, the metadata and tensor table its writer
would put in each rank's first shard, and no file written. Each tensor's bytes are produced
from the (mmapped) checkpoint when the runtime asks for them, once.

    art = compile_folder("./SmolLM2-135M-Instruct-NVFP4", tp=1)
    Engine(art)          # the same plan, tensors and greedy tokens as the prepared artifact
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from gguf import GGUFValueType as VT

from bloomery.compiler import lower, planning, publish, writer
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.prepare import source_metadata, tokenizer_files
from bloomery.core.artifact.memory import MemoryArtifact


def _as_read(v) -> Any:
    """A GGUFValue as GGUFReader gives it back: floats are stored in f32."""
    if v.type == VT.FLOAT32:
        return float(np.float32(v.value))
    if v.type == VT.ARRAY and v.sub_type == VT.FLOAT32:
        return [float(np.float32(x)) for x in v.value]
    return v.value


def compile_folder(folder, *, tp: int = 1, keep_bf16: bool = False,
                   env: Mapping[str, str] = os.environ) -> MemoryArtifact:
    folder = Path(folder)
    ckpt = Checkpoint.open(folder)
    ranks = planning.plan(ckpt, tp=tp, env=env, keep_bf16=keep_bf16)
    lower.plan_metadata(ranks)
    publish.check_plans(ranks)
    tok_json, template = tokenizer_files(folder)
    extra = source_metadata(ckpt)
    tables, produce, metadata = {}, {}, {}
    for rp in sorted(ranks, key=lambda p: p.rank):
        shards = writer.plan_shards(rp)
        table = writer.tensor_table(shards)
        for sh in shards:
            for g in sh.gguf:
                table[g.base]["nbytes"] = table[g.base].get("nbytes", 0) + g.nbytes
        arch, kv = writer.shard_metadata(rp, 0, shards, extra, tok_json, template)
        tables[rp.rank] = table
        produce[rp.rank] = {t.name: t.produce for t in rp.tensors}
        metadata[rp.rank] = {"general.architecture": arch,      # as the reader gives it: the table left out
                             **{k: _as_read(v) for k, v in kv.items() if k != writer.KEY_TENSORS}}
    return MemoryArtifact(folder, tables, produce, metadata)
