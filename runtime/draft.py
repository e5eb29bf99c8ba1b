"""Drafts for speculative decoding: who proposes the next few tokens that one verify pass checks.

    d = NgramDraft(max_n=4, min_n=2)
    d.extend(prompt_ids); d.extend([tok])       # the slot's sequence, as it grows
    drafts = d.propose(k)                       # up to k tokens ([] when nothing matches)

A draft only proposes: the verify pass (Engine.verify, the plan's verify program) computes each
row as plain decoding would, and generation keeps the drafted tokens that equal the greedy
choice, so the output never depends on the draft (runtime/generate.py). A draft's state belongs
to one sequence: a new request starts a new draft.

`ngram` is prompt-lookup drafting (the idea of llama.cpp's lookup and vLLM's ngram method):
the longest recent n-gram of the sequence (n = max_n down to min_n) that occurred earlier in it
proposes the tokens that followed its latest earlier occurrence. It needs no weights and works
for every model; it pays off where text repeats its own context (code, quoting, lists).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .errors import NoDraft

def accepted(drafts, picks) -> int:
    """How many drafted tokens a verify pass keeps: those equal, in order, to the greedy pick of the
    row before each (picks[i]: the choice after row i); picks[kept] is then the next token."""
    a = 0
    while a < len(drafts) and int(picks[a]) == drafts[a]:
        a += 1
    return a


def has_mtp(art) -> bool:
    """Whether the artifact carries an MTP / NextN layer (Qwen3-Next's mtp.*, GLM-4.5's blk.L.nextn.*)."""
    return any(n.startswith("mtp.") or ".nextn." in n for n in art.tensors(art.ranks[0]))


def choose(eng, draft: str, temperature: float) -> tuple[str, str]:
    """The draft a run uses and why: --draft auto picks the one measured faster for this engine."""
    if draft == "mtp":
        if not has_mtp(eng.art):
            raise NoDraft(f"{eng.art.path} holds no MTP / NextN layer (no mtp.* or blk.N.nextn.* tensors): "
                          f"--draft mtp needs a checkpoint that ships one (Qwen3-Next, GLM-4.5); use --draft ngram")
        if "mtp" not in eng.plans[0]["programs"]:
            raise NoDraft(f"{eng.art.path}: its plan holds no mtp program (prepared by an older bloomery, or a "
                          f"family whose MTP layer is not lowered yet); re-prepare it, or use --draft ngram")
    if draft != "auto":
        return draft, "as asked"
    if temperature > 0:
        return "off", "a draft verifies greedy choices; sampling (--temperature > 0) decodes without one"
    if not eng.draft_max:
        return "off", eng._no_verify_why()
    if eng.device == "cuda":
        return "ngram", ("measured faster on the H200: 1.88x on code, 1.98x on prose with SmolLM2, docs/PERF.md; "
                         "the text is the same as with --draft off")
    return "ngram", ("measured faster on the CPU: 1.16x on code, 1.35x on prose with SmolLM2, docs/PERF.md; "
                     "the text is the same as with --draft off")


class NgramDraft:
    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n ({min_n}) <= max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.seq: list[int] = []
        self.last: list[dict] = [dict() for _ in range(max_n + 1)]   # n -> {n-gram: end index of its latest}
        self.done = 0           # n-grams ending before this index are registered

    def extend(self, ids: Iterable[int]) -> None:
        self.seq.extend(int(i) for i in ids)

    def follow(self, seq) -> None:
        """The sequence is now `seq`, which extends the one held (a server slot's tokens)."""
        self.seq = [int(i) for i in seq]
        self.done = min(self.done, len(self.seq))

    def _register(self) -> None:
        """Registers the n-grams that end before the sequence's end (the suffix itself is looked up)."""
        s = self.seq
        for e in range(max(self.done, 1), len(s)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.last[n][tuple(s[e - n:e])] = e
        self.done = max(self.done, len(s))

    def propose(self, k: int) -> list[int]:
        if k <= 0 or len(self.seq) < self.min_n + 1:
            return []
        self._register()
        s = self.seq
        for n in range(min(self.max_n, len(s) - 1), self.min_n - 1, -1):
            e = self.last[n].get(tuple(s[len(s) - n:]))
            if e is not None:
                return s[e:e + k]
        return []


class MtpDraft:
    """The checkpoint's own MTP / NextN layer (the plan's mtp program) as the draft. After each pass
    of the main model it runs the layer over the rows kept (each row's next token, at the row's
    position, with the row's final-norm hidden state: this also fills the layer's KV cache), then
    chains the layer on its own draft and post-norm output for the further tokens (vLLM's way of
    running one MTP layer k times). Its state (the layer's KV cache rows) belongs to the slot and
    is rewritten from the kept rows on, so nothing stale from a rejected draft is read."""

    def __init__(self, eng, slot: int = 0):
        if "mtp" not in eng.plans[0]["programs"]:
            raise NoDraft(f"{eng.art.path}: its plan holds no mtp program (no MTP / NextN layer lowered); "
                          f"use --draft ngram")
        self.eng, self.slot, self.drafts = eng, slot, []

    def extend(self, ids) -> None:           # the MTP layer reads the engine's passes (observe), not the ids
        pass

    def observe(self, start: int, nexts, hidden, k: int) -> None:
        """The main model ran rows at positions start.. with final-norm outputs `hidden`; `nexts` are
        the tokens that follow those rows (the prompt's next ones, then the greedy choices kept)."""
        eng, u = self.eng, self.eng.ubatch
        n = len(nexts)                                       # an MTP row takes its main row's position
        self.drafts = []
        for c in range(0, n, u):
            m = min(u, n - c)
            _, nt, mh = eng.mtp(list(nexts[c:c + m]), np.arange(start + c, start + c + m), hidden[c:c + m], self.slot)
        d, h, p = [int(nt[-1])], mh[-1:], start + n - 1      # p: the position of the last MTP row
        while len(d) < k and p + len(d) < eng.ctx:
            _, nt, h = eng.mtp([d[-1]], [p + len(d)], h, self.slot)
            d.append(int(nt[0]))
        self.drafts = d

    def propose(self, k: int) -> list[int]:
        d, self.drafts = self.drafts[:k], []
        return d
