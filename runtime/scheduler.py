"""Many requests on one Engine: slots, continuous batching, a bounded queue and prompt reuse
(what `bloomery serve` runs behind its HTTP layer; this file knows no HTTP).

One thread owns the Engine and loops:

  1. frees the slots of cancelled requests (a client that went away);
  2. admits waiting requests into free slots, oldest first: each takes the free slot that already
     holds the longest prefix of its prompt (prompt reuse, below), else the least recently used;
  3. prefills the admitted prompts (the oldest first) in ubatch chunks, up to `batch` prompt tokens
     (llama-server's -b: the generating slots wait at most that many prompt tokens between two
     decode steps); a prompt's last chunk gives its first token, and its slot joins the next step,
     so the prompts of a burst of requests are fed before the decode steps they then all share;
  4. runs one step of the decode program: one row per generating slot, the other rows inactive
     (position -1), so the weights are read once for every request in the step; each slot's next
     token is the plan's argmax (temperature 0) or drawn from its request's own seeded generator.
     With a draft (draft="ngram": serve's --draft) and a single greedy request generating, nothing
     being prefilled, the step is a verify pass of that slot instead (runtime/generate.py's rule:
     the drafted tokens equal to the greedy choice are kept, then the greedy token after them),
     which gives the same tokens as decode steps would; the draft belongs to the request.

A slot's state is never another request's: a request either starts a new sequence in its slot
(positions from 0, the recurrent state of an unused slot; KV rows are written before they are
read, so the old ones are never seen) or keeps exactly the tokens its prompt shares with what the
slot holds. Prompt reuse (llama-server's cache_prompt): the KV rows of the
shared prefix stay as they are (attention reads rows 0..pos, each written before it is read); a
model with recurrent state (conv windows, delta-rule states) resumes from a snapshot the slot
took at the end of a prompt or of a reply (the last SNAPSHOTS kept), the longest that fits in
the shared prefix, or recomputes from the start when none does. At least one prompt token is
always computed, since its logits give the first token.

A request ends with finish "stop" (an EOS id, one of its stop_ids, or one of its stop strings,
which is cut from the text), "length" (max_tokens, or the context is full) or "cancelled"; its
events reach on_event(kind, payload) from the scheduler's thread: ("text", str) as text becomes
final (held back while it may be the start of a stop string or of a UTF-8 sequence), then
("done", request), or ("error", message).
"""

from __future__ import annotations

import collections
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .draft import NgramDraft, accepted
from .engine import Engine
from .errors import PromptTooLong, RuntimeRefusal
from .sampling import sample
from .text import Text

SNAPSHOTS = 2            # recurrent-state snapshots kept per slot (end of the last prompt, of the last reply)
FINISH = ("stop", "length", "cancelled", "error")
METRICS = ("requests", *(f"requests_{f}" for f in FINISH), "request_s", "prompt_tokens", "prompt_tokens_reused",
           "prompt_s", "tokens_predicted", "completion_tokens", "decode_steps", "decode_rows", "decode_s",
           "draft_steps", "draft_tokens", "draft_accepted")


class QueueFull(RuntimeRefusal):
    """Every slot is busy and the waiting queue holds max_queue requests."""

    def __init__(self, msg: str, retry_after: int):
        super().__init__(msg)
        self.retry_after = retry_after


class EmptyPrompt(RuntimeRefusal):
    """A request with no prompt token."""


@dataclass
class Params:
    max_tokens: int | None = None          # None: until a stop or the context is full
    temperature: float = 0.0               # 0: greedy (the plan's argmax)
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()             # stop strings (cut from the text)
    stop_ids: tuple[int, ...] = ()         # stop token ids (besides the model's EOS ids)
    cache_prompt: bool = True              # reuse what a slot holds of the prompt
    ignore_eos: bool = False               # the model's EOS ids do not stop (a load generator's requests)


@dataclass
class Request:
    prompt_ids: list[int]
    params: Params
    on_event: Callable[[str, object], None] = lambda kind, payload: None
    ids: list[int] = field(default_factory=list)        # generated tokens (a stop token left out)
    text: str = ""                                      # the text given out
    finish: str | None = None                           # "stop", "length", "cancelled"
    reused: int = 0                                     # prompt tokens the slot already held
    slot: int | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None                        # first token chosen
    t_done: float | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        """Frees the request's slot (or queue place) at the scheduler's next step."""
        self.cancelled = True


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.req: Request | None = None
        self.tokens: list[int] = []       # what the engine holds for this slot, in order
        self.snaps: list[tuple[int, object]] = []     # (length, recurrent-state snapshot), oldest first
        self.todo: list[int] = []         # prompt ids still to prefill
        self.next: int | None = None      # chosen, fed at the next decode step
        self.used = 0.0                   # when a request last left it
        self.rng = None
        self.stream = None
        self.acc = ""                     # the reply's text so far (given out: acc[:len(req.text)])
        self.draft: NgramDraft | None = None      # the request's n-gram draft (over s.tokens)


class Scheduler:
    def __init__(self, engine: Engine, text: Text, *, max_queue: int = 64, draft: str = "off",
                 batch: int | None = None):
        if draft not in ("off", "ngram"):
            raise ValueError(f"the scheduler drafts with 'ngram' or 'off', not {draft!r}")
        self.eng, self.text = engine, text
        self.batch = batch or engine.ubatch           # prompt tokens fed between two decode steps (at least a chunk)
        self.drafting = draft == "ngram" and engine.draft_max > 0
        self.max_queue = max_queue
        self.slots = [_Slot(i) for i in range(engine.slots)]
        self.eos = set(engine.eos_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.admitted: list[_Slot] = []               # slots whose prompt is being prefilled, oldest first
        self.cond = threading.Condition()
        self.stopping = False
        self.metrics = dict.fromkeys(METRICS, 0)     # every key made here: stats() copies it from another thread
        self.thread = threading.Thread(target=self._loop, name="bloomery-scheduler", daemon=True)
        self.thread.start()

    # -- from other threads ----------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queues a request (PromptTooLong, EmptyPrompt, TokenOutOfVocab, QueueFull refuse it)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise EmptyPrompt("the prompt holds no token")
        if n > self.eng.ctx:
            raise PromptTooLong(f"the prompt holds {n} tokens and the context {self.eng.ctx} per slot "
                                f"(--ctx-size)")
        self.eng.check_ids(req.prompt_ids, "prompt")
        with self.cond:
            free = sum(s.req is None for s in self.slots)
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.waiting) - free} requests wait "
                                f"(--max-queue {self.max_queue})", self.retry_after())
            req.t_submit = time.perf_counter()
            self.waiting.append(req)
            self.cond.notify()
        return req

    def retry_after(self) -> int:
        """Seconds after which a refused client might find room: the queue ahead at the mean request time."""
        done = self.metrics["requests"]
        mean = self.metrics["request_s"] / done if done else 1.0
        ahead = max(1, len(self.waiting) - sum(s.req is None for s in self.slots))
        return int(min(60, max(1, math.ceil(mean * ahead / len(self.slots)))))

    def stats(self) -> dict:
        with self.cond:
            return {**self.metrics, "slots_total": len(self.slots),
                    "slots_busy": sum(s.req is not None for s in self.slots), "queue_length": len(self.waiting)}

    def slot_states(self) -> list[dict]:
        """Each slot as llama-server's GET /slots gives it (the fields it shares with it): whether a
        request holds it, the tokens it holds (the KV rows a next prompt may reuse), what its request
        has decoded and has left of its prompt."""
        with self.cond:
            out = []
            for s in self.slots:
                r = s.req
                out.append({"id": s.index, "n_ctx": self.eng.ctx, "is_processing": r is not None,
                            "n_cached": len(s.tokens), "n_prompt_left": len(s.todo) if r is not None else 0,
                            "next_token": {"n_decoded": len(r.ids) if r is not None else 0}})
            return out

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)

    # -- the loop ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                with self.cond:
                    while not self.stopping and not self.waiting and all(s.req is None for s in self.slots):
                        self.cond.wait()
                    if self.stopping:
                        return
                    self._drop_cancelled()
                    self._admit()
                fed = 0                             # whole chunks, at most batch tokens (one at least)
                while self.admitted and (fed == 0 or fed + self._next_chunk() <= self.batch):
                    fed += self._prefill_chunk()
                self._decode_step()
            except Exception as e:              # a failed step fails its requests, never the server
                traceback.print_exc()
                for s in self.slots:
                    if s.req is not None:
                        self._fail(s, f"{type(e).__name__}: {e}")

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                self._finish(s, "cancelled")
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            r.finish, r.t_done = "cancelled", time.perf_counter()
            self.metrics["requests_cancelled"] += 1

    def _admit(self) -> None:
        while self.waiting:
            free = [s for s in self.slots if s.req is None]
            if not free:
                return
            req = self.waiting.popleft()
            best = max(free, key=lambda s: (self._reusable(s, req)[0], -s.used))
            self._start(best, req)

    def _reusable(self, s: _Slot, req: Request) -> tuple[int, object]:
        """(tokens of req's prompt the slot can keep, the snapshot to resume from)."""
        if not req.params.cache_prompt:
            return 0, None
        common = min(lcp(s.tokens, req.prompt_ids), len(req.prompt_ids) - 1)   # one token is always computed
        if not self.eng.recurrent:
            return common, None
        return max(((k, snap) for k, snap in s.snaps if k <= common), key=lambda x: x[0], default=(0, None))

    def _start(self, s: _Slot, req: Request) -> None:
        s.req = req
        keep, snap = self._reusable(s, req)
        self.eng.rewind(s.index, keep, snap)     # 0: a new sequence (the recurrent state of an unused slot)
        s.tokens = s.tokens[:keep]
        s.snaps = [(k, x) for k, x in s.snaps if k <= keep]
        s.todo = list(req.prompt_ids[keep:])
        s.next = None
        s.rng = np.random.default_rng(req.params.seed)
        s.stream, s.acc = self.text.stream(), ""
        s.draft = NgramDraft() if self.drafting and req.params.temperature <= 0 else None
        req.slot, req.reused = s.index, keep
        self.metrics["prompt_tokens_reused"] += keep
        self.admitted.append(s)

    def _snapshot(self, s: _Slot) -> None:
        if self.eng.recurrent:
            snap = self.eng.snapshot(s.index)
            if snap is not None:
                s.snaps = [x for x in s.snaps if x[0] != len(s.tokens)][-(SNAPSHOTS - 1):] + [(len(s.tokens), snap)]

    def _pick(self, s: _Slot, row, greedy: int) -> int:
        p = s.req.params
        return int(greedy) if p.temperature <= 0 else sample(row, s.rng, p.temperature, p.top_k, p.top_p)

    def _next_chunk(self) -> int:
        return min(self.eng.ubatch, len(self.admitted[0].todo))

    def _prefill_chunk(self) -> int:
        """One ubatch chunk of the oldest admitted prompt; the prompt tokens it fed."""
        s = self.admitted[0]
        chunk = s.todo[:self.eng.ubatch]
        t0 = time.perf_counter()
        row = self.eng.prefill(chunk, slot=s.index, last_only=True)
        s.tokens += chunk
        s.todo = s.todo[len(chunk):]
        self.metrics["prompt_tokens"] += len(chunk)
        self.metrics["prompt_s"] += time.perf_counter() - t0
        if s.todo:
            return len(chunk)
        self.admitted.pop(0)
        self._snapshot(s)
        s.req.t_first = time.perf_counter()
        self._take(s, self._pick(s, row, int(np.argmax(row))))
        return len(chunk)

    def _decode_step(self) -> None:
        act = [s for s in self.slots if s.req is not None and s.next is not None]
        if not act:
            return
        if len(act) == 1 and act[0].draft is not None and not self.admitted and self._verify_step(act[0]):
            return
        tokens = np.zeros(len(self.slots), np.int64)
        active = np.zeros(len(self.slots), bool)
        for s in act:
            tokens[s.index], active[s.index] = s.next, True
        sampled = any(s.req.params.temperature > 0 for s in act)
        t0 = time.perf_counter()
        logits, greedy = self.eng.decode(tokens, active, logits=sampled)
        self.metrics["decode_steps"] += 1
        self.metrics["decode_rows"] += len(act)
        self.metrics["decode_s"] += time.perf_counter() - t0
        for s in act:
            s.tokens.append(s.next)
            s.next = None
            self._take(s, self._pick(s, None if logits is None else logits[s.index], greedy[s.index]))

    def _verify_step(self, s: _Slot) -> bool:
        """The lone generating slot's next token and its drafts through one verify pass (False: no
        draft, a plain decode step instead). Every kept token is taken as a decode step would take
        it, so a stop, a length or a full context ends the request at the same token."""
        d = s.draft
        d.follow(s.tokens + [s.next])                 # what the slot holds, then the next token
        room = self.eng.ctx - len(s.tokens) - 1
        mt = s.req.params.max_tokens
        left = self.eng.draft_max if mt is None else mt - len(s.req.ids) - 1
        drafts = d.propose(min(self.eng.draft_max, room, left))
        if not drafts:
            return False
        t0 = time.perf_counter()
        _, greedy = self.eng.verify([s.next, *drafts], slot=s.index, logits=False)
        a = accepted(drafts, greedy)
        self.eng.accept(a + 1, slot=s.index)
        m = self.metrics
        m["decode_steps"] += 1
        m["decode_rows"] += a + 1
        m["decode_s"] += time.perf_counter() - t0
        m["draft_steps"] += 1
        m["draft_tokens"] += len(drafts)
        m["draft_accepted"] += a
        fed = [s.next, *drafts[:a]]
        for i in range(a + 1):
            s.tokens.append(fed[i])
            s.next = None
            self._take(s, int(greedy[i]))
            if s.next is None:                      # the request ended at this token
                rest = fed[i + 1:]                  # fed all the same: the slot holds them
                if rest:
                    at = len(s.tokens)
                    s.tokens += rest
                    if s.snaps and s.snaps[-1][0] == at:      # its end-of-reply snapshot: the state after them
                        s.snaps[-1] = (len(s.tokens), s.snaps[-1][1])
                break
        return True

    # -- a chosen token --------------------------------------------------------------------------------
    def _take(self, s: _Slot, t: int) -> None:
        req = s.req
        self.metrics["tokens_predicted"] += 1
        if (t in self.eos and not req.params.ignore_eos) or t in req.params.stop_ids:
            return self._finish(s, "stop")
        req.ids.append(t)
        s.acc += s.stream.push(t)
        if self._give_text(s, final=False):
            return self._finish(s, "stop", flush=False)
        if (req.params.max_tokens is not None and len(req.ids) >= req.params.max_tokens) \
                or len(s.tokens) >= self.eng.ctx:
            return self._finish(s, "length")
        s.next = t

    def _give_text(self, s: _Slot, final: bool) -> bool:
        """Gives out the reply's text that is final; True when a stop string ended it (cut there)."""
        req, acc, stops = s.req, s.acc, s.req.params.stop
        sent = len(req.text)
        hits = [i for i in (acc.find(x, sent) for x in stops) if i >= 0]
        if hits:
            end = min(hits)
        elif final:
            end = len(acc)
        else:                                     # hold back a tail that may begin a stop string
            end = len(acc) - max((k for x in stops for k in range(min(len(x) - 1, len(acc) - sent), 0, -1)
                                  if acc.endswith(x[:k])), default=0)
        if end > sent:
            piece = acc[sent:end]
            req.text += piece
            req.on_event("text", piece)
        return bool(hits)

    def _finish(self, s: _Slot, reason: str, flush: bool = True) -> None:
        req = s.req
        if reason != "cancelled" and flush:
            s.acc += s.stream.flush()
            if self._give_text(s, final=True):
                reason = "stop"
        req.finish, req.t_done = reason, time.perf_counter()
        self._snapshot(s)
        self._release(s)
        m = self.metrics
        m["requests"] += 1
        m[f"requests_{reason}"] += 1
        m["request_s"] += req.t_done - req.t_submit
        m["completion_tokens"] += len(req.ids)
        if reason != "cancelled":
            req.on_event("done", req)

    def _release(self, s: _Slot) -> None:
        s.req, s.next, s.todo, s.used = None, None, [], time.perf_counter()
        if s in self.admitted:
            self.admitted.remove(s)

    def _fail(self, s: _Slot, message: str) -> None:
        req = s.req
        req.finish, req.t_done = "error", time.perf_counter()
        self._release(s)
        s.tokens, s.snaps = [], []
        self.metrics["requests_error"] += 1
        req.on_event("error", message)
        try:
            self.eng.reset(s.index)
        except Exception:
            traceback.print_exc()


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
