"""Generation: prompt -> prefill -> decode steps until EOS, max_tokens or a full context, with
the text streamed through a callback and timings kept.

With a draft (runtime/draft.py, greedy only) a step feeds the next token and up to draft_max
drafted ones through one verify pass; the drafted tokens that equal the greedy choice of the row
before them are kept, then the greedy token after the last kept one, exactly the tokens plain
decoding would have produced (each verify row is computed as a decode step computes it)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .draft import MtpDraft, NgramDraft, accepted
from .engine import Engine
from .errors import NoDraft
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
    decode_steps: int                     # tokens the decode (or verify) steps gave
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
             ignore_eos: bool = False, on_text: Callable[[str], None] | None = None,
             draft: str = "off", draft_max: int | None = None) -> Generation:
    """Greedy by default (temperature 0: the plan's argmax); `prompt` goes through the chat
    template unless raw, or pass token `ids`. `artifact`: a path, an Artifact or an Engine.
    max_tokens None: until EOS or the context is full. ignore_eos: the EOS ids are masked out of
    every pick (llama.cpp's --ignore-eos), so generation never stops at one. draft: "off",
    "ngram", "mtp" or a draft object (runtime/draft.py) for speculative decoding, greedy
    only; draft_max tokens a verify pass at most (default the engine's); the tokens are the same as
    with "off"."""
    eng = artifact if isinstance(artifact, Engine) else Engine(artifact, device=device, ctx=ctx, threads=threads)
    drafter = draft
    if isinstance(draft, str):
        if draft not in ("off", "ngram", "mtp"):
            raise NoDraft(f"draft {draft!r}: choose off, ngram or mtp")
        drafter = None if draft == "off" else NgramDraft() if draft == "ngram" else MtpDraft(eng)
    if drafter is not None and temperature > 0:
        raise NoDraft(f"--draft verifies greedy choices: it needs --temperature 0 (it was {temperature})")
    if drafter is not None and not eng.draft_max:
        raise NoDraft(eng._no_verify_why())
    k_max = eng.draft_max if draft_max is None else min(int(draft_max), eng.draft_max)
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

    if drafter is not None:
        drafter.extend(prompt_ids)
    stats = {"verify_steps": 0, "drafted": 0, "accepted": 0}
    queue: list[int] = []               # greedy tokens a verify pass has decided, not yet emitted
    watch = getattr(drafter, "observe", None)          # a draft that reads the passes' hidden rows (MTP)
    hid: list = []
    t0 = time.perf_counter()
    row = eng.prefill(prompt_ids, last_only=True,
                      on_chunk=(lambda c, n: hid.append(eng.hidden("prefill", n))) if watch else None)
    nxt = pick(row, np.argmax(row))
    if watch:
        watch(0, prompt_ids[1:] + [nxt], np.concatenate(hid), k_max)
    t1 = time.perf_counter()
    stop = "length"
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
        if eng.lengths[0] - len(queue) >= eng.ctx:     # the tokens plain decoding would have fed by now
            stop = "ctx"
            break
        if queue:                       # fed by the verify pass already: emit it as decoding would
            nxt = queue.pop(0)
            continue
        if drafter is not None:
            drafter.extend([nxt])
            room = eng.ctx - int(eng.lengths[0]) - 1
            left = k_max if max_tokens is None else max_tokens - len(out) - 1
            drafts = drafter.propose(min(k_max, room, left))
            if drafts:
                start = int(eng.lengths[0])
                logits_, greedy = eng.verify([nxt, *drafts], logits=bool(masked))   # greedy: only the ids
                picks = [pick(None if logits_ is None else logits_[i], greedy[i]) for i in range(len(drafts) + 1)]
                a = accepted(drafts, picks)
                eng.accept(a + 1)
                stats["verify_steps"] += 1
                stats["drafted"] += len(drafts)
                stats["accepted"] += a
                drafter.extend(drafts[:a])
                if watch:
                    watch(start, picks[:a + 1], eng.hidden("verify", a + 1), k_max)
                queue = picks[:a + 1]
                nxt = queue.pop(0)
                continue
        start = int(eng.lengths[0])
        logits_, greedy = eng.decode([nxt], logits=temperature > 0 or bool(masked))   # greedy: only the id
        nxt = pick(None if logits_ is None else logits_[0], greedy[0])
        if watch:
            watch(start, [nxt], eng.hidden("decode", 1), k_max)
    t2 = time.perf_counter()
    rest = stream.flush()
    if on_text and rest:
        on_text(rest)
    steps = len(out) - 1 + (stop == "eos")     # the tokens decoding gave after the prefill's (a pass may give several)
    extra = {}
    if drafter is not None:
        extra = {"draft": draft if isinstance(draft, str) else type(draft).__name__, **stats,
                 "acceptance_length": round((stats["accepted"] + stats["verify_steps"]) / stats["verify_steps"], 3)
                 if stats["verify_steps"] else 0.0}
    return Generation(text=text.decode(out), prompt_ids=prompt_ids, token_ids=out, stop=stop,
                      prompt_s=t1 - t0, decode_s=t2 - t1, decode_steps=steps, device=eng.device, extra=extra)
