"""Generation: prompt -> prefill -> decode steps until EOS, max_tokens or a full context, with
the text streamed through a callback and timings kept."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .engine import Engine
from .sampling import sample
from .text import Text


@dataclass
class Generation:
    text: str
    prompt_ids: list[int]
    token_ids: list[int]                  # generated, EOS excluded
    stop: str                             # "eos", "length" (max_tokens) or "ctx" (the context is full)
    prompt_s: float                       # prefill, up to the first generated token
    decode_s: float                       # every decode step after it
    decode_steps: int
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tps(self) -> float:
        return len(self.prompt_ids) / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d.update(prompt_tokens=len(self.prompt_ids), generated_tokens=len(self.token_ids),
                 prompt_tok_s=round(self.prompt_tps, 3), decode_tok_s=round(self.decode_tps, 3), **self.extra)
        return d


def generate(artifact, prompt: str | None = None, *, ids: list[int] | None = None, raw: bool = False,
             max_tokens: int | None = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, ctx: int | None = None, device: str = "cpu", threads: int | None = 1,
             ignore_eos: bool = False, on_text: Callable[[str], None] | None = None) -> Generation:
    """Greedy by default (temperature 0: the plan's argmax); `prompt` goes through the chat
    template unless raw, or pass token `ids`. `artifact`: a path, an Artifact or an Engine.
    max_tokens None: until EOS or the context is full. ignore_eos: the EOS ids are masked out of
    every pick (llama.cpp's --ignore-eos), so generation never stops at one."""
    eng = artifact if isinstance(artifact, Engine) else Engine(artifact, device=device, ctx=ctx, threads=threads)
    eng.reset(0)
    text = Text(eng.art, eng.eos_ids, eng.bos_id)
    prompt_ids = list(ids) if ids is not None else text.encode(prompt or "", raw=raw)
    eos = set(eng.eos_ids)
    masked = [e for e in eng.eos_ids if 0 <= e < eng.vocab_size] if ignore_eos else []
    rng = np.random.default_rng(seed)
    stream = text.stream()
    out: list[int] = []

    def pick(logits_row, greedy_id):
        if masked:
            logits_row = logits_row.copy()
            logits_row[masked] = -np.inf
            greedy_id = np.argmax(logits_row)
        return int(greedy_id) if temperature <= 0 else sample(logits_row, rng, temperature, top_k, top_p)

    t0 = time.perf_counter()
    row = eng.prefill(prompt_ids, last_only=True)
    nxt = pick(row, np.argmax(row))
    t1 = time.perf_counter()
    steps, stop = 0, "length"
    while True:
        if nxt in eos and not ignore_eos:
            stop = "eos"
            break
        out.append(nxt)
        piece = stream.push(nxt)
        if on_text and piece:
            on_text(piece)
        if max_tokens is not None and len(out) >= max_tokens:
            break
        if eng.lengths[0] >= eng.ctx:
            stop = "ctx"
            break
        logits_, greedy = eng.decode([nxt], logits=temperature > 0 or bool(masked))   # greedy: only the id
        steps += 1
        nxt = pick(None if logits_ is None else logits_[0], greedy[0])
    t2 = time.perf_counter()
    rest = stream.flush()
    if on_text and rest:
        on_text(rest)
    return Generation(text=text.decode(out), prompt_ids=prompt_ids, token_ids=out, stop=stop,
                      prompt_s=t1 - t0, decode_s=t2 - t1, decode_steps=steps, device=eng.device)
