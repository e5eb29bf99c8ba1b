"""A loaded artifact ready to run: its plans (one per rank), weights, executor and KV-cache slots.

    eng = Engine("art/", ctx=2048)            # device: "cpu" | "cuda" | "auto" (cuda when CuPy and a GPU are present)
    eng = Engine("art/", check=True)          # each tensor checked against DIGESTS.json as it loads (--verify)
    logits = eng.prefill(ids)                  # [n, vocab] float32, appended to slot 0's sequence
    logits, next_ids = eng.decode([tok])       # one row per slot
    eng.reset()
    snap = eng.snapshot(s); eng.rewind(s, n, snap)   # a slot back to its first n tokens (prompt reuse)
    logits, nxt = eng.verify([tok, *drafts]); eng.accept(n)  # speculative decoding (runtime/draft.py)

The runtime's only way into the artifact is the artifact reader; the plan says everything
model-specific, so this file knows no model family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from bloomery.core import plan as P
from bloomery.core.artifact import Artifact

from . import blas
from . import device as devices
from . import kv_cache
from .errors import DeviceUnavailable, NoPlan, NoVerifyProgram, PlanMismatch, PromptTooLong, TokenOutOfVocab
from .numpy_executor import NumpyExecutor
from .weights import CpuWeights

DEFAULT_CTX = 4096
DEFAULT_UBATCH = 64
DEFAULT_DRAFT_MAX = 4          # drafted tokens a verify step takes at most (--draft-max)


def read_plans(art: Artifact) -> list[dict]:
    plans = []
    for r in art.ranks:
        text = art.metadata(r).get(P.KEY)
        if text is None:
            raise NoPlan(f"{art.path}: rank {r} holds no execution plan ({P.KEY}); it was prepared by an older "
                         f"bloomery: re-prepare it (bloomery prepare <checkpoint> {art.path})")
        plans.append(P.loads(text, f"{art.path}: rank {r}: {P.KEY}"))
    return plans


class Engine:
    def __init__(self, artifact, *, device: str = "cpu", ctx: int | None = None, slots: int = 1,
                 ubatch: int = DEFAULT_UBATCH, threads: int | None = 1, check: bool = False,
                 draft_max: int = DEFAULT_DRAFT_MAX, cache_type_k: str = "f32", cache_type_v: str = "f32"):
        self.art = artifact if isinstance(artifact, Artifact) else Artifact.open(Path(artifact), check=check)
        self.device = devices.resolve(device)
        if self.device == "cuda" and self.art.tp > 1:       # one process per rank, rank r on GPU r
            n = devices.gpu_count()
            if getattr(self.art, "in_memory", False):
                raise DeviceUnavailable(f"{self.art.path}: tp={self.art.tp} on CUDA runs one process per rank, "
                                        f"each opening the artifact from disk: prepare it first (bloomery "
                                        f"prepare --tp {self.art.tp}), or use --tp 1")
            if n < self.art.tp:
                if device == "auto":
                    self.device = "cpu"
                else:
                    raise DeviceUnavailable(f"{self.art.path}: tp={self.art.tp}: the CUDA executor runs one rank "
                                            f"per GPU and {n} GPU(s) are present; use --device cpu or prepare "
                                            f"with --tp 1")
        if threads is not None:
            blas.set_threads(threads)          # runtime/blas.py: why one thread by default
        self.plans = read_plans(self.art)
        model = self.plans[0]["model"]
        self.vocab_size = int(model["vocab_size"])
        self.context_length = int(model["context_length"])
        self.ctx = int(ctx or min(self.context_length, DEFAULT_CTX))
        if self.ctx < 1 or slots < 1 or ubatch < 1:
            raise ValueError(f"ctx {self.ctx}, slots {slots} and ubatch {ubatch} must be positive")
        self.slots, self.ubatch = slots, ubatch
        symbols = {"slots": slots, "ubatch": ubatch, "ctx": self.ctx}
        self.cache_types = (cache_type_k, cache_type_v)
        for kind in self.cache_types:
            if kind not in kv_cache.TYPES:
                raise kv_cache.CacheTypeRefused(f"cache type {kind!r}: choose one of {', '.join(kv_cache.TYPES)}")
        if self.device == "cuda" and self.cache_types != ("f32", "f32"):
            gpu = ("f32", "bf16", "f16") if self.art.tp == 1 else ("f32",)
            bad = [k for k in self.cache_types if k not in gpu]
            if bad:
                raise kv_cache.CacheTypeRefused(
                    f"--cache-type-k {cache_type_k} --cache-type-v {cache_type_v}: the CUDA kernels hold the KV cache as "
                    f"{', '.join(gpu)}{' at tp 1' if self.art.tp == 1 else ' at tp > 1'} in this version; choose "
                    f"{' or '.join(gpu)} on the GPU, or --device cpu")
        # the verify program (speculative decoding), for plans that hold it: the NumPy executor, and the
        # CUDA executor at tp 1 (a graph per drafted-token count)
        self.draft_max = int(draft_max) if "verify" in self.plans[0]["programs"] and (
            self.device == "cpu" or self.art.tp == 1) else 0
        self._verified: tuple = (None, 0)          # (slot, rows) of the verify pass accept() may keep
        self._draft_asked = int(draft_max)
        if self.draft_max:
            symbols["verify"] = self.draft_max + 1
        if self.device == "cuda":
            self.weights = None
            self._check_formats()
            if self.art.tp > 1:
                from .cuda.tp import TpCudaExecutor       # the ranks' processes (runtime/cuda/tp.py)
                from .numpy_executor import _check_lockstep
                _check_lockstep(self.plans)
                if self.art.check:                        # the ranks' processes open it unchecked: check here
                    for r, p in zip(self.art.ranks, self.plans):
                        for n in P.weights_of(p):
                            self.art.gguf_arrays(n, r)
                self.exec = TpCudaExecutor(self.art.path, self.art.tp, symbols)
            else:
                from .cuda.executor import CudaExecutor   # imports CuPy
                self.exec = CudaExecutor(self.plans, self.art, symbols, cache_types=self.cache_types)
        else:
            shared: dict = {}
            self.weights = [CpuWeights(self.art, r, P.weights_of(p), shared) for r, p in zip(self.art.ranks, self.plans)]
            self._check_formats()
            try:
                self.exec = NumpyExecutor(self.plans, self.weights, symbols, self.cache_types)
            except kv_cache.CacheTypeRefused as e:
                raise kv_cache.CacheTypeRefused(f"{self.art.path}: {e}") from None
        self.lengths = np.zeros(slots, np.int64)
        # state kept per slot that is not indexed by position (conv windows, delta-rule states): a
        # slot's first n tokens are restored from a snapshot; KV rows past n are simply rewritten
        self.recurrent = [n for n, b in self.plans[0]["buffers"].items()
                          if b["kind"] == "state" and "ctx" not in b["shape"]]
        self._blank = self.snapshot(0)         # the recurrent state of a slot before any token
        md = self.art.metadata(0)
        self.eos_ids = [int(e) for e in md.get("bloomery.eos_token_ids", [])]
        self.bos_id = md.get("tokenizer.ggml.bos_token_id")

    def _check_formats(self) -> None:
        """Each linear's declared format matches the artifact (a stale plan is refused by name)."""
        for r, p in enumerate(self.plans):
            table = self.art.tensors(r)
            for op in p["programs"]["decode"]["ops"]:
                if op["op"] == "linear" and op["weight"] not in table:
                    raise PlanMismatch(f"{self.art.path}: rank {r}'s plan reads tensor {op['weight']!r}, which the "
                                       f"artifact does not hold; re-prepare the artifact")
                if op["op"] == "linear" and (table[op["weight"]].format != op["format"]
                                             or ("pre_quant_scale" in table[op["weight"]].optional)
                                             != op["pre_quant_scale"]):
                    raise PlanMismatch(f"{self.art.path}: rank {r}: the plan reads {op['weight']!r} as "
                                       f"{op['format']}, the artifact holds {table[op['weight']].format}; "
                                       f"re-prepare the artifact")

    # -- state --------------------------------------------------------------------------------------
    def reset(self, slot: int | None = None) -> None:
        self.exec.reset(slot)
        if slot is None:
            self.lengths[:] = 0
        else:
            self.lengths[slot] = 0

    def snapshot(self, slot: int):
        """A copy of the slot's recurrent state at its present length, for rewind ({} when the model
        keeps none; None when the executor cannot copy it: TP ranks on CUDA, which then recompute)."""
        if not self.recurrent:
            return {}
        copy = getattr(self.exec, "copy_state", None)
        return None if copy is None else copy(slot, self.recurrent)

    def rewind(self, slot: int, length: int, snap=None) -> None:
        """Keeps the slot's first `length` tokens (0: none, a new sequence): their KV rows stay and
        the rows past `length` are left as they are, never seen (attention reads rows 0..pos, each
        written before it is read); the recurrent state comes from `snap`, a snapshot taken when
        the slot held exactly those tokens (at 0: the state of a slot before any token)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {int(self.lengths[slot])} tokens; cannot keep {length}")
        if length == 0:
            snap = self._blank
        if self.recurrent:
            if snap is None and length == 0:          # an executor that cannot copy state: clear it all
                self.exec.reset(slot)
            elif not snap:
                raise ValueError(f"slot {slot}: the model keeps recurrent state; rewinding needs a snapshot")
            else:
                self.exec.set_state(slot, snap)
        self.lengths[slot] = length

    def memory(self) -> dict[str, int]:
        """Bytes held: the weights as the executor keeps them (float32 on the CPU, stored bytes on a
        GPU) and the per-slot state (KV cache and recurrent states) of every rank."""
        weights = (sum(w.nbytes() for w in self.weights) if self.weights is not None
                   else int(self.exec.weight_nbytes()))
        if hasattr(self.exec, "state_nbytes"):
            return {"weights": weights, "state": self.exec.state_nbytes()}
        bind = {"slots": self.slots, "ubatch": self.ubatch, "ctx": self.ctx}
        state = sum(int(np.prod(P.shape(b, bind))) * 4 for p in self.plans for b in p["buffers"].values()
                    if b["kind"] == "state")
        return {"weights": weights, "state": state}

    def check_ids(self, ids: Sequence[int], what: str = "token ids") -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = np.nonzero((a < 0) | (a >= self.vocab_size))[0]
        if bad.size:
            i = int(bad[0])
            raise TokenOutOfVocab(f"{what}: id {int(a[i])} at index {i} is outside the vocabulary "
                                  f"[0, {self.vocab_size}) of {self.art.path}")
        return a

    # -- running ------------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], slot: int = 0, last_only: bool = False, on_chunk=None) -> np.ndarray:
        """Appends ids to a slot's sequence in chunks of ubatch rows; the logits of every id
        ([n, vocab]), or of the last only ([vocab]). on_chunk(start, n): called after each chunk
        (the MTP draft reads the chunk's hidden rows then)."""
        a = self.check_ids(ids)
        start = int(self.lengths[slot])
        if start + a.size > self.ctx:
            raise PromptTooLong(f"{a.size} tokens after {start} do not fit the context of {self.ctx} "
                                f"(--ctx-size); the model's own context length is {self.context_length}")
        u = self.ubatch
        out = []
        for c in range(0, a.size, u):
            chunk = a[c:c + u]
            n = chunk.size
            tokens = np.zeros(u, np.int32)
            tokens[:n] = chunk
            pos = np.full(u, -1, np.int32)
            pos[:n] = np.arange(start + c, start + c + n)
            keep = not last_only or c + u >= a.size
            lo = n - 1 if last_only else 0                      # the rows of logits wanted back
            res = self._run("prefill", {"tokens": tokens, "positions": pos, "slot_ids": np.full(u, slot, np.int32)},
                            ("logits",) if keep else (), rows=(lo, n))
            if keep:
                out.append(res["logits"].copy())
            if on_chunk is not None:
                on_chunk(start + c, n)
        self.lengths[slot] = start + a.size
        if last_only:
            return out[-1][-1]
        return np.concatenate(out) if out else np.zeros((0, self.vocab_size), np.float32)

    def verify(self, tokens: Sequence[int], slot: int = 0, logits: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """One verify pass (speculative decoding): tokens (the slot's next token, then drafted ones)
        at the slot's next positions, each row computed as a one-row decode step would compute it.
        Returns the logits [n, vocab] and greedy next ids [n] of the rows; the slot's length is not
        advanced: accept(k) keeps the first k rows (KV rows past them are never read; the recurrent
        states go back to the k-th row's). logits=False: only the ids (on the GPU the logits stay there)."""
        if not self.draft_max:
            raise NoVerifyProgram(self._no_verify_why())
        a = self.check_ids(tokens)
        n, L = a.size, int(self.lengths[slot])
        if not 1 <= n <= self.draft_max + 1:
            raise ValueError(f"a verify pass takes 1 to {self.draft_max + 1} tokens (--draft-max {self.draft_max}), "
                             f"got {n}")
        if L + n > self.ctx:
            raise PromptTooLong(f"slot {slot}: {n} verified tokens after {L} do not fit the context of {self.ctx} "
                                f"(--ctx-size)")
        R = self.draft_max + 1
        tok = np.zeros(R, np.int32)
        tok[:n] = a
        pos = np.full(R, -1, np.int32)
        pos[:n] = np.arange(L, L + n)
        res = self._run("verify", {"tokens": tok, "positions": pos, "slot_ids": np.full(R, slot, np.int32)},
                        ("logits", "next_token") if logits else ("next_token",), rows=(0, n))
        self._verified = (slot, n)
        return (res["logits"].copy() if logits else None), res["next_token"].astype(np.int64)

    def accept(self, keep: int, slot: int = 0) -> None:
        """After verify(): the slot keeps the first `keep` verified tokens (1..n)."""
        vslot, n = self._verified
        if vslot != slot or not 1 <= keep <= n:
            raise ValueError(f"accept({keep}) of slot {slot} after a verify pass of {n} rows of slot {vslot}")
        self.exec.keep(slot, keep - 1)             # the states after the last kept row (the executor's histories)
        self.lengths[slot] += keep
        self._verified = (None, 0)

    def hidden(self, prog: str, n: int) -> np.ndarray:
        """The first n rows of the main model's final-norm output in the last run of `prog` (what the
        MTP layer drafts from), copied to the host."""
        name = self.plans[0]["programs"]["mtp"]["hidden"]
        if self.device == "cuda":
            return self.exec.buffers[prog][name][:n].get()
        return self.exec.buffers[prog][0][name][:n].copy()

    def mtp(self, tokens: Sequence[int], positions: Sequence[int], hidden: np.ndarray, slot: int = 0):
        """One run of the plan's mtp program (the MTP / NextN layer) over up to ubatch rows of a slot:
        row i embeds tokens[i] at positions[i] with the main model's hidden[i] (of position
        positions[i] - 1). Returns its logits [n, vocab], greedy drafts [n] and post-norm hidden [n, D]."""
        n, u = len(tokens), self.ubatch
        if not 1 <= n <= u:
            raise ValueError(f"an mtp run takes 1 to {u} rows (--ubatch), got {n}")
        tok = np.zeros(u, np.int32)
        tok[:n] = self.check_ids(tokens)
        pos = np.full(u, -1, np.int32)
        pos[:n] = positions
        hid = np.zeros((u, hidden.shape[-1]), np.float32)
        hid[:n] = hidden
        res = self._run("mtp", {"tokens": tok, "positions": pos, "slot_ids": np.full(u, slot, np.int32),
                                "hidden": hid}, ("logits", "next_token", "mtp_hidden"), rows=(0, n))
        return res["logits"].copy(), res["next_token"].astype(np.int64), res["mtp_hidden"].copy()

    def _no_verify_why(self) -> str:
        if "verify" not in self.plans[0]["programs"]:
            return (f"{self.art.path}: its plan holds no verify program (prepared by an older bloomery); "
                    f"re-prepare it for speculative decoding (--draft)")
        if not self._draft_asked:
            return f"{self.art.path}: this engine was opened without a verify program (draft_max 0)"
        return (f"{self.art.path}: tp={self.art.tp}: the verify step runs on the NumPy executor and on one GPU in "
                f"this version (--device cpu, or prepare with --tp 1); these GPU ranks decode without a draft "
                f"(--draft off)")

    def _run(self, prog: str, inputs: dict, want: tuple, rows: tuple | None = None):
        """The executor's run; the CUDA executors copy back only the outputs in `want`, and with
        rows=(lo, hi) only those rows of them (the NumPy executor's are sliced here)."""
        if self.device == "cuda":
            return self.exec.run(prog, inputs, want, rows=rows)
        res = self.exec.run(prog, inputs)
        return res if rows is None else {k: v[rows[0]:rows[1]] for k, v in res.items()}

    def decode(self, tokens: Sequence[int], active: Sequence[bool] | None = None, logits: bool = True):
        """One step: tokens[s] appended to slot s (for every active slot). Returns the logits
        [slots, vocab] (None when logits=False: on the GPU they then stay there) and the greedy
        next ids [slots] (copies)."""
        a = self.check_ids(tokens)
        if a.size != self.slots:
            raise ValueError(f"decode takes one token per slot ({self.slots}), got {a.size}")
        act = np.ones(self.slots, bool) if active is None else np.asarray(active, bool)
        full = act & (self.lengths >= self.ctx)
        if full.any():
            raise PromptTooLong(f"slot {int(np.nonzero(full)[0][0])} is full: the context holds {self.ctx} "
                                f"tokens (--ctx-size)")
        pos = np.where(act, self.lengths, -1).astype(np.int32)
        res = self._run("decode", {"tokens": a.astype(np.int32), "positions": pos,
                                   "slot_ids": np.arange(self.slots, dtype=np.int32)},
                        ("logits", "next_token") if logits else ("next_token",))
        self.lengths[act] += 1
        return (res["logits"].copy() if logits else None), res["next_token"].astype(np.int64)


def logits(artifact, ids: Sequence[int], device: str = "cpu", ubatch: int = DEFAULT_UBATCH,
           ctx: int | None = None, threads: int | None = 1, check: bool = False,
           cache_types: tuple = ("f32", "f32")) -> np.ndarray:
    """Teacher-forced logits [n, vocab] float32 of a token-id list (row i predicts ids[i+1]).
    `artifact`: a path, an Artifact, or a loaded Engine (reused: its slot 0 is reset)."""
    ids = list(ids)
    if isinstance(artifact, Engine):
        eng = artifact
        eng.reset(0)
    else:
        eng = Engine(artifact, device=device, ctx=ctx or max(len(ids), 1), ubatch=ubatch, threads=threads,
                     check=check, cache_type_k=cache_types[0], cache_type_v=cache_types[1])
    return eng.prefill(ids)
