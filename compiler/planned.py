"""What tensor planning hands to the artifact writer: per rank, the artifact tensors with
everything the GGUF header needs known up front, and their bytes produced lazily."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass
class PlannedTensor:
    name: str                       # artifact base name, llama.cpp's where one exists: "token_embd", "blk.0.attn_q"
    role: str                       # the spec's role: "token_embd", "attn_q", "ffn_gate_exps", ...
    format: str                     # format in the artifact (the stored one, or q8_0 by the lever)
    shape: tuple[int, ...]          # logical shape of this rank's piece: [out, in], [expert, out, in], [n]
    optional: tuple[str, ...]       # optional parts present: "input_scale", "pre_quant_scale"
    sources: tuple[str, ...]        # the HF tensors it is made of (one per expert when stacked)
    cut: str                        # TP cut: "column", "row", "replicated" (experts: cut inside each expert)
    produce: Callable[[], dict[str, np.ndarray]]  # this rank's parts in `format` (core/formats/base.py)
    # a table stored in pieces along axis 0 (qwen4_exp's n-gram tables): each piece's parts, in order,
    # as stored (mmapped); the writer streams them one after another instead of joining them in memory
    pieces: Callable[[], list[dict[str, np.ndarray]]] | None = None


@dataclass
class RankPlan:
    rank: int
    tp: int
    tensors: list[PlannedTensor]
    metadata: dict[str, Any] = field(default_factory=dict)   # GGUF key -> value (architecture, hparams, ...)
