"""bloomery's runtime: reads an artifact (never the compiler, never torch) and runs its plan.

    from bloomery import runtime
    x = runtime.logits("art/", ids)                        # teacher-forced [n, vocab] float32
    g = runtime.generate("art/", "What is 2+2?")           # a Generation: text, token_ids, timings
    eng = runtime.Engine("art/", ctx=2048)                 # load once, then prefill/decode/logits/generate
"""

from .engine import Engine, logits
from .errors import DeviceUnavailable, NoPlan, PlanMismatch, PromptTooLong, TokenOutOfVocab
from .generate import Generation, generate

__all__ = ["Engine", "Generation", "generate", "logits", "DeviceUnavailable", "NoPlan", "PlanMismatch",
           "PromptTooLong", "TokenOutOfVocab"]
