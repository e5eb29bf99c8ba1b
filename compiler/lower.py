"""Lowering: one rank's model (its spec family, metadata and tensor table) into the static
execution plan of core/plan.py, one op list for a decode step and one for a prompt chunk.

The decoder stack is generic over what the rank's tensor table holds: q/k norms when
`attn_q_norm` exists (Qwen3), routed experts where `ffn_gate_inp` exists, else a dense SwiGLU
MLP; the output head is `output`, or the tied `token_embd`. With tp > 1 the row-parallel
outputs (attn_output, ffn_down, the experts' down) are all-reduced and the vocab-parallel
logits all-gathered. A family with a genuinely new block (gated delta net, recurrent state)
adds its lowering here and its op to core/plan.OPS.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from bloomery.core import plan as P
from bloomery.core import specs
from bloomery.core.errors import UnsupportedConfig

FAMILIES = ("llama", "qwen3_moe")


def lower_rank(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
    """The plan of one rank. `tensors`: base name -> object with .shape, .format, .optional."""
    family = str(metadata["bloomery.spec"])
    if family not in FAMILIES:
        raise UnsupportedConfig(f"no lowering for model family {family!r} (lowered: {', '.join(FAMILIES)})")
    return _Decoder(metadata, tensors).build()


def plan_metadata(rank_plans) -> None:
    """Adds each rank's plan (JSON) to its metadata: the hook prepare calls."""
    for rp in rank_plans:
        rp.metadata[P.KEY] = P.dumps(lower_rank(rp.metadata, {t.name: t for t in rp.tensors}))


class _Decoder:
    def __init__(self, md: Mapping[str, Any], tensors: Mapping[str, Any]):
        self.md, self.t = md, tensors
        arch = str(md["general.architecture"])
        g = lambda k: md[f"{arch}.{k}"]
        self.layers = int(g("block_count"))
        self.hidden = int(g("embedding_length"))
        self.head_dim = int(g("attention.key_length"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.theta = float(g("rope.freq_base"))
        self.vocab = int(g("vocab_size"))
        self.context = int(g("context_length"))
        self.top_k = int(md.get(f"{arch}.expert_used_count", 0))
        self.norm_topk = bool(md.get(f"{arch}.expert_weights_norm", False))
        self.heads = int(md["bloomery.tp.head_count"])
        self.kv_heads = int(md["bloomery.tp.head_count_kv"])
        self.tp, self.rank = int(md["bloomery.tp.size"]), int(md["bloomery.tp.rank"])
        self.family = str(md["bloomery.spec"])
        self.buffers: dict[str, dict] = {}
        self.ops: list[dict] = []

    # -- buffers and ops -----------------------------------------------------------------------
    def buf(self, name: str, shape: list, dtype: str = "f32", kind: str = "scratch") -> str:
        """Declares a buffer (or reuses one of the same shape); a width that differs gets its own name."""
        want = {"shape": list(shape), "dtype": dtype, "kind": kind}
        b = self.buffers.get(name)
        if b is not None and b != want:
            return self.buf(f"{name}.{'x'.join(str(d) for d in shape[1:])}", shape, dtype, kind)
        self.buffers[name] = want
        return name

    def op(self, name: str, **kw) -> None:
        self.ops.append({"op": name, **kw})

    def rows(self, name: str, width: int, dtype: str = "f32") -> str:
        return self.buf(name, ["rows", width], dtype)

    def linear(self, x: str, weight: str, out: str) -> str:
        t = self.t[weight]
        out = self.rows(out, int(t.shape[-2]))
        self.op("linear", x=x, weight=weight, out=out, format=t.format,
                pre_quant_scale="pre_quant_scale" in t.optional)
        return out

    def reduce(self, x: str) -> None:
        if self.tp > 1:
            self.op("all_reduce", x=x, out=x)

    # -- the model ------------------------------------------------------------------------------
    def build(self) -> dict:
        tokens = self.buf("tokens", ["rows"], "i32", "input")
        self.buf("positions", ["rows"], "i32", "input")
        self.buf("slot_ids", ["rows"], "i32", "input")
        h = self.rows("h", self.hidden)
        self.op("embed", ids=tokens, weight="token_embd", out=h)
        for bid in range(self.layers):
            self.attention(bid, h)
            self.ffn(bid, h)
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight="output_norm", out=xn, eps=self.eps, group=self.hidden)
        self.head(xn)
        body = self.ops
        programs = {}
        for prog, rows in P.PROGRAMS.items():
            mode = {"mode": prog}
            programs[prog] = {"rows": rows, "ops": [{**o, **mode} if o["op"] == "attention" else o for o in body]}
        plan = {"version": P.VERSION, "family": self.family, "tp": self.tp, "rank": self.rank,
                "model": {"vocab_size": self.vocab, "context_length": self.context},
                "buffers": self.buffers, "programs": programs}
        P.validate(plan, f"lowered plan of rank {self.rank}")
        return plan

    def attention(self, bid: int, h: str) -> None:
        b, hd = f"blk.{bid}.", self.head_dim
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight=b + "attn_norm", out=xn, eps=self.eps, group=self.hidden)
        q = self.linear(xn, b + "attn_q", "q")
        k = self.linear(xn, b + "attn_k", "k")
        v = self.linear(xn, b + "attn_v", "v")
        if b + "attn_q_norm" in self.t:
            self.op("rmsnorm", x=q, weight=b + "attn_q_norm", out=q, eps=self.eps, group=hd)
            self.op("rmsnorm", x=k, weight=b + "attn_k_norm", out=k, eps=self.eps, group=hd)
        self.op("rope", x=q, pos="positions", out=q, heads=self.heads, head_dim=hd, theta=self.theta)
        self.op("rope", x=k, pos="positions", out=k, heads=self.kv_heads, head_dim=hd, theta=self.theta)
        cache = ["slots", "ctx", self.kv_heads, hd]
        ck = self.buf(f"kv.{bid}.k", cache, kind="state")
        cv = self.buf(f"kv.{bid}.v", cache, kind="state")
        att = self.rows("attn", self.heads * hd)
        self.op("attention", q=q, k=k, v=v, pos="positions", slot="slot_ids", cache_k=ck, cache_v=cv, out=att,
                heads=self.heads, kv_heads=self.kv_heads, head_dim=hd, scale=1.0 / math.sqrt(hd))
        o = self.linear(att, b + "attn_output", "o")
        self.reduce(o)
        self.op("add", a=h, b=o, out=h)

    def ffn(self, bid: int, h: str) -> None:
        b = f"blk.{bid}."
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight=b + "ffn_norm", out=xn, eps=self.eps, group=self.hidden)
        if b + "ffn_gate_inp" in self.t:
            experts = int(self.t[b + "ffn_gate_inp"].shape[0])
            ids = self.buf("moe_ids", ["rows", self.top_k], "i32")
            wts = self.rows("moe_weights", self.top_k)
            self.op("moe_router", x=xn, weight=b + "ffn_gate_inp", ids=ids, weights=wts, top_k=self.top_k,
                    norm=self.norm_topk)
            f = self.rows("ffn_out", self.hidden)
            self.op("moe_experts", x=xn, ids=ids, weights=wts, gate=b + "ffn_gate_exps", up=b + "ffn_up_exps",
                    down=b + "ffn_down_exps", out=f, experts=experts, top_k=self.top_k)
        else:
            g = self.linear(xn, b + "ffn_gate", "ffn_gate")
            u = self.linear(xn, b + "ffn_up", "ffn_up")
            self.op("swiglu", gate=g, up=u, out=g)
            f = self.linear(g, b + "ffn_down", "ffn_out")
        self.reduce(f)
        self.op("add", a=h, b=f, out=h)

    def head(self, xn: str) -> None:
        tied = "output" not in self.t
        weight = "token_embd" if tied else "output"
        out = "logits"
        if self.tp > 1:
            out = "logits.local"
        extra: dict = {}
        if tied and self.tp > 1:        # each rank takes its share of the (replicated) table's rows
            start = sum(specs.share(self.vocab, self.tp, r) for r in range(self.rank))
            extra["rows"] = [start, start + specs.share(self.vocab, self.tp, self.rank)]
            local = extra["rows"][1] - start
        else:
            local = int(self.t[weight].shape[0])
        self.op("logits", x=xn, weight=weight, out=self.rows(out, local), vocab=local, **extra)
        if self.tp > 1:
            sizes = self._vocab_sizes(tied)
            self.op("all_gather", x=out, out=self.rows("logits", self.vocab), sizes=sizes)
        nt = self.buf("next_token", ["rows"], "i32", "output")
        self.buffers["logits"]["kind"] = "output"
        self.op("argmax", x="logits", out=nt)

    def _vocab_sizes(self, tied: bool) -> list[int]:
        if tied:
            return [specs.share(self.vocab, self.tp, r) for r in range(self.tp)]
        return [self.vocab // self.tp] * self.tp      # the head's column cut: equal slices
