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

from .errors import NoDraft

DRAFTS = ("auto", "off", "ngram", "mtp")


def has_mtp(art) -> bool:
    """Whether the artifact carries an MTP / NextN layer (Qwen3-Next's mtp.*, GLM-4.5's blk.L.nextn.*)."""
    return any(n.startswith("mtp.") or ".nextn." in n for n in art.tensors(art.ranks[0]))


def choose(eng, draft: str, temperature: float) -> tuple[str, str]:
    """The draft a run uses and why: --draft auto picks the one measured faster for this engine."""
    if draft == "mtp":
        if not has_mtp(eng.art):
            raise NoDraft(f"{eng.art.path} holds no MTP / NextN layer (no mtp.* or blk.N.nextn.* tensors): "
                          f"--draft mtp needs a checkpoint that ships one (Qwen3-Next, GLM-4.5); use --draft ngram")
        raise NoDraft(f"{eng.art.path}: its MTP layer travels in the artifact, but this version does not run it "
                      f"yet; use --draft ngram")
    if draft != "auto":
        return draft, "as asked"
    if temperature > 0:
        return "off", "a draft verifies greedy choices; sampling (--temperature > 0) decodes without one"
    if not eng.draft_max:
        return "off", eng._no_verify_why()
    return "off", ("the CPU executor verifies a draft row by row, bit for bit as decoding, so a draft "
                   "costs a decode step per drafted token and is never faster here (--draft ngram uses one)")


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
