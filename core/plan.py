"""The execution plan's schema, shared by the compiler (compiler/lower.py writes it) and the
runtime (runtime/ executes it); docs/plan.md describes it in prose.

A plan is one JSON object per rank, stored under metadata key `bloomery.plan`:

    {"version": 1, "family": "llama", "tp": 2, "rank": 0,
     "model": {"vocab_size": ..., "context_length": ...},
     "buffers": {name: {"shape": [int | symbol, ...], "dtype": "f32" | "i32",
                        "kind": "input" | "output" | "state" | "scratch"}},
     "programs": {"decode": {"rows": "slots", "ops": [op, ...]},
                  "prefill": {"rows": "ubatch", "ops": [op, ...]},
                  "verify": {"rows": "verify", "ops": [op, ...]},       # optional (speculative decoding)
                  "mtp": {"rows": "ubatch", "hidden": buffer, "ops": [op, ...]}}}   # optional (MTP draft)

An op is a flat object: {"op": name, <buffer keys>: buffer, <weight keys>: tensor, <attrs>}.
OPS below names, per op, which keys are buffers read, buffers written, buffers read and
written in place (state), weights (artifact tensor names) and attributes. Symbols in shapes:
slots, ubatch, ctx, verify (bound at load) and rows (the running program's row count).

The verify program (speculative decoding, docs/plan.md "Verify"): the decode op list over the
rows of one slot at consecutive positions (a token and the drafts after it), each row computed
as a one-row decode step computes it; the recurrent state ops also write `history`, the slot's
state after each row, so that the state after the last accepted row can be kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import BloomeryError

KEY = "bloomery.plan"
VERSION = 1
SYMBOLS = ("slots", "ubatch", "ctx", "verify", "rows")
DTYPES = ("f32", "i32")
KINDS = ("input", "output", "state", "scratch")
PROGRAMS = {"decode": "slots", "prefill": "ubatch"}           # every plan holds these
# verify: plans of this version hold it, older may not; mtp: where the model has an MTP / NextN layer
OPTIONAL_PROGRAMS = {"verify": "verify", "mtp": "ubatch"}
ALL_PROGRAMS = {**PROGRAMS, **OPTIONAL_PROGRAMS}


class PlanInvalid(BloomeryError):
    """A plan breaks its schema (unknown op, undeclared buffer, missing key)."""


@dataclass(frozen=True)
class OpSig:
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    state: tuple[str, ...] = ()          # read and written in place, kept across steps
    weights: tuple[str, ...] = ()        # artifact tensor names
    attrs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()       # attrs that may be absent
    collective: bool = False
    opt_reads: tuple[str, ...] = ()      # buffers read when the key is present (attention's `select`)
    host: bool = False                   # runs on the host before the device step (the PLE gather)
    opt_writes: tuple[str, ...] = ()     # buffers written when the key is present (a state's `history`)
    opt_weights: tuple[str, ...] = ()    # artifact tensors read when the key is present (attention's k/v scales)

    @property
    def needed(self) -> tuple[str, ...]:
        """The keys every such op holds."""
        return (*self.reads, *self.writes, *self.state, *self.weights, *self.attrs)

    @property
    def may(self) -> tuple[str, ...]:
        """The keys such an op may leave out."""
        return (*self.optional, *self.opt_reads, *self.opt_writes, *self.opt_weights)

    @property
    def named(self) -> tuple[str, ...]:
        """The keys whose values name a buffer or an artifact tensor."""
        return (*self.reads, *self.writes, *self.state, *self.weights, *self.opt_reads, *self.opt_writes,
                *self.opt_weights)


OPS: dict[str, OpSig] = {
    "embed": OpSig(reads=("ids",), writes=("out",), weights=("weight",)),
    "rmsnorm": OpSig(reads=("x",), writes=("out",), weights=("weight",), attrs=("eps", "group"),
                     optional=("offset",)),
    "linear": OpSig(reads=("x",), writes=("out",), weights=("weight",), attrs=("format", "pre_quant_scale")),
    "rope": OpSig(reads=("x", "pos"), writes=("out",), attrs=("heads", "head_dim", "theta"),
                  optional=("rotary_dim", "scaling")),      # scaling: core/rope.py (llama3, yarn)
    "attention": OpSig(reads=("q", "k", "v", "pos", "slot"), writes=("out",), state=("cache_k", "cache_v"),
                       attrs=("heads", "kv_heads", "head_dim", "scale", "mode"), opt_reads=("select",),
                       opt_weights=("k_scale", "v_scale")),    # ModelOpt's FP8 KV-cache scales (--cache-type fp8)
    "swiglu": OpSig(reads=("gate", "up"), writes=("out",), optional=("limit",)),
    "add": OpSig(reads=("a", "b"), writes=("out",)),
    "concat": OpSig(reads=("a", "b"), writes=("out",)),             # [a | b] along the last axis (the MTP's eh input)
    "moe_router": OpSig(reads=("x",), writes=("ids", "weights"), weights=("weight",), attrs=("top_k", "norm")),
    # GLM-4.5's sigmoid router: correction bias for the choice, group-limited top-k, scaled weights
    "moe_router_grouped": OpSig(reads=("x",), writes=("ids", "weights"), weights=("weight", "bias"),
                                attrs=("top_k", "n_group", "topk_group", "norm", "scale")),
    "moe_experts": OpSig(reads=("x", "ids", "weights"), writes=("out",), weights=("gate", "up", "down"),
                         attrs=("experts", "top_k"), optional=("limit",)),
    "logits": OpSig(reads=("x",), writes=("out",), weights=("weight",), attrs=("vocab",), optional=("rows",)),
    "argmax": OpSig(reads=("x",), writes=("out",)),
    "all_reduce": OpSig(reads=("x",), writes=("out",), collective=True),
    "all_gather": OpSig(reads=("x",), writes=("out",), attrs=("sizes",), collective=True),
    # the gated delta net (Qwen3-Next's linear attention); states are per slot, like the KV cache
    "causal_conv1d": OpSig(reads=("x", "pos", "slot"), writes=("out",), state=("state",), weights=("weight",),
                           attrs=("kernel",), optional=("dilation", "channels"), opt_writes=("history",)),
    "gated_delta": OpSig(reads=("qkv", "a", "b", "pos", "slot"), writes=("out",), state=("state",),
                         weights=("A_log", "dt_bias"), attrs=("k_heads", "v_heads", "k_dim", "v_dim", "mode"),
                         optional=("chunk",), opt_writes=("history",)),
    "rmsnorm_gated": OpSig(reads=("x", "gate"), writes=("out",), weights=("weight",), attrs=("eps", "group"),
                           optional=("act",)),
    # layout and gating helpers of the hybrid families
    "split_groups": OpSig(reads=("x",), writes=("out", "rest"), attrs=("groups", "widths", "split")),
    "sigmoid_mul": OpSig(reads=("x", "gate"), writes=("out",)),
    "bias_add": OpSig(reads=("x",), writes=("out",), weights=("bias",)),
    # --- qwen4_exp (hyper-connections, PLE, QSA indexer): docs/flagships.md
    "hc_expand": OpSig(reads=("x",), writes=("out",), attrs=("n",)),
    "hc_gate_mix": OpSig(reads=("xn", "w"), writes=("out",), attrs=("n",)),
    "act_scale": OpSig(reads=("x",), writes=("out",), attrs=("act", "scale"), optional=("mul",)),
    "hc_inject": OpSig(reads=("x", "y", "w"), writes=("out",), attrs=("n",)),
    "ngram_hash": OpSig(reads=("tokens", "pos", "slot"), writes=("ids",), state=("ctx",),
                        attrs=("ngram_size", "heads_per_ngram", "eos", "multipliers", "sizes", "offsets"), host=True,
                        opt_writes=("history",)),
    "host_embed": OpSig(reads=("ids",), writes=("out",), weights=("table",), attrs=("heads",), host=True),
    "ple_gate": OpSig(reads=("kn", "qn", "v"), writes=("out",), attrs=("n",)),
    "qsa_index": OpSig(reads=("q", "k", "pos", "slot"), writes=("sel",), state=("cache",), weights=("k_norm",),
                       attrs=("heads", "head_dim", "ratio", "budget", "theta", "rotary_dim", "eps", "offset")),
    # --- glm5_next (mHC, KDA, MLA, DSA indexer): docs/flagships.md
    "mhc_weights": OpSig(reads=("z", "x"), writes=("pre", "post", "comb"), weights=("base", "scale"),
                         attrs=("n", "iters", "hc_eps", "eps")),
    "hc_collapse": OpSig(reads=("x", "w"), writes=("out",), attrs=("n",)),
    "hc_mean": OpSig(reads=("x",), writes=("out",), attrs=("n",)),
    "mhc_inject": OpSig(reads=("x", "y", "post", "comb"), writes=("out",), attrs=("n",)),
    "kda": OpSig(reads=("q", "k", "v", "g", "b", "pos", "slot"), writes=("out",), state=("state",),
                 weights=("A_log", "dt_bias"), attrs=("heads", "head_dim", "lower_bound", "mode"),
                 optional=("chunk",), opt_writes=("history",)),
    "layernorm": OpSig(reads=("x",), writes=("out",), weights=("weight", "bias"), attrs=("eps", "group")),
    "dsa_index": OpSig(reads=("q", "k", "gs", "hw", "pos", "slot"), writes=("sel",), state=("cache",),
                       weights=("ape",), attrs=("heads", "head_dim", "topk", "kpool", "tail")),
    "mla_attention": OpSig(reads=("q", "c", "pos", "slot"), writes=("out",), state=("cache",), weights=("kv_b",),
                           attrs=("heads", "nope_dim", "v_dim", "scale", "mode"), opt_reads=("sel",)),
}


def dumps(plan: dict) -> str:
    """The stored form: sorted keys, compact, so the same plan gives the same bytes."""
    return json.dumps(plan, sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads(text: str, where: str = "plan") -> dict:
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanInvalid(f"{where}: not JSON ({e})") from None
    validate(plan, where)
    return plan


def buffers_of(op: dict) -> list[str]:
    sig = OPS[op["op"]]
    return [op[k] for k in (*sig.reads, *sig.opt_reads, *sig.state, *sig.writes, *sig.opt_writes) if k in op]


def programs_of(plan: dict) -> dict[str, str]:
    """The programs a plan holds (name -> its rows symbol): decode and prefill, verify and mtp where present."""
    return {p: r for p, r in ALL_PROGRAMS.items() if p in plan["programs"]}


def buffers_used(plan: dict, prog: str) -> set[str]:
    """The buffers a program's ops name (an executor allocates a program's scratch for these only)."""
    return {b for op in plan["programs"][prog]["ops"] for b in buffers_of(op)}


def validate(plan: dict, where: str = "plan") -> None:
    """Refuse a plan that breaks the schema, naming the op and the key."""
    if not isinstance(plan, dict):
        raise PlanInvalid(f"{where}: not a JSON object; re-prepare the artifact")
    if plan.get("version") != VERSION:
        raise PlanInvalid(f"{where}: plan version {plan.get('version')!r}, this bloomery reads {VERSION}; "
                          f"re-prepare the artifact")
    model = plan.get("model")
    if not isinstance(model, dict) or not all(_count(model.get(k)) for k in ("vocab_size", "context_length")):
        raise PlanInvalid(f"{where}: \"model\" is not an object with positive integers vocab_size and context_length")
    bufs = plan.get("buffers", {})
    if not isinstance(bufs, dict):
        raise PlanInvalid(f"{where}: \"buffers\" is not an object")
    for name, b in bufs.items():
        if not isinstance(b, dict) or b.get("dtype") not in DTYPES or b.get("kind") not in KINDS:
            b = b if isinstance(b, dict) else {}
            raise PlanInvalid(f"{where}: buffer {name!r} has dtype {b.get('dtype')!r} / kind {b.get('kind')!r}")
        if not isinstance(b.get("shape"), list):
            raise PlanInvalid(f"{where}: buffer {name!r} has no shape list")
        for d in b["shape"]:
            if not (_count(d, 0) or (isinstance(d, str) and d in SYMBOLS)):
                raise PlanInvalid(f"{where}: buffer {name!r} has shape entry {d!r} (an int >= 0 or one of {SYMBOLS})")
    progs = plan.get("programs")
    for prog in ALL_PROGRAMS:
        body = progs.get(prog) if isinstance(progs, dict) else None
        if prog in OPTIONAL_PROGRAMS and body is None:
            continue
        if prog == "mtp" and (not isinstance(body, dict) or body.get("hidden") not in bufs):
            raise PlanInvalid(f"{where}: program 'mtp' names no declared \"hidden\" buffer (the main programs' "
                              f"final-norm output it drafts from); re-prepare the artifact")
        if not isinstance(body, dict) or not isinstance(body.get("ops"), list):
            raise PlanInvalid(f"{where}: program {prog!r} is missing (or has no list of ops)")
        for i, op in enumerate(body["ops"]):
            if not isinstance(op, dict) or not isinstance(op.get("op"), str):
                raise PlanInvalid(f"{where}: {prog} op {i} is not an object with an \"op\" name")
            at = f"{where}: {prog} op {i} ({op.get('op')})"
            sig = OPS.get(op.get("op"))
            if sig is None:
                raise PlanInvalid(f"{at}: unknown op; this runtime knows {', '.join(OPS)}")
            missing = [k for k in sig.needed if k not in op]
            extra = [k for k in op if k != "op" and k not in sig.needed and k not in sig.may]
            if missing or extra:
                raise PlanInvalid(f"{at}: missing keys {missing}, unknown keys {extra}")
            names = [op[k] for k in sig.named if k in op]
            if not all(isinstance(n, str) for n in names):
                raise PlanInvalid(f"{at}: a buffer or weight name is not a string: {names}")
            for b in buffers_of(op):
                if b not in bufs:
                    raise PlanInvalid(f"{at}: buffer {b!r} is not declared")


def _count(v, least: int = 1) -> bool:
    """An int (not a bool) of at least `least`."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def shape(buf: dict, symbols: dict[str, int]) -> tuple[int, ...]:
    """A buffer's shape with its symbols bound."""
    return tuple(d if isinstance(d, int) else int(symbols[d]) for d in buf["shape"])


def weights_of(plan: dict) -> list[str]:
    """Every artifact tensor the plan reads, in first-use order."""
    seen: dict[str, None] = {}
    for prog in programs_of(plan):
        for op in plan["programs"][prog]["ops"]:
            for k in (*OPS[op["op"]].weights, *OPS[op["op"]].opt_weights):
                if k in op:
                    seen.setdefault(op[k], None)
    return list(seen)
