"""Lowering: one rank's model (its spec family, metadata and tensor table) into the static
execution plan of core/plan.py, one op list for a decode step and one for a prompt chunk.

The decoder stack is generic over what the rank's tensor table holds: q/k norms when
`attn_q_norm` exists (Qwen3), q/k/v biases when `attn_q_bias` exists and partial rotary when
rope.dimension_count < head_dim (GLM-4.5), routed experts where `ffn_gate_inp` exists, else a dense SwiGLU
MLP; the output head is `output`, or the tied `token_embd`. With tp > 1 the row-parallel
outputs (attn_output, ffn_down, the experts' down) are all-reduced and the vocab-parallel
logits all-gathered. A family with a genuinely new block (gated delta net, recurrent state)
adds its lowering here and its op to core/plan.OPS: Qwen3-Next (_Qwen3Next) does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from bloomery.core import plan as P
from bloomery.core import specs
from bloomery.core.errors import UnsupportedConfig

FAMILIES = ("llama", "qwen3_moe", "glm4_moe", "qwen3_next")


def lower_rank(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
    """The plan of one rank. `tensors`: base name -> object with .shape, .format, .optional."""
    family = str(metadata["bloomery.spec"])
    if family not in FAMILIES:
        raise UnsupportedConfig(f"no lowering for model family {family!r} (lowered: {', '.join(FAMILIES)})")
    cls = {"glm4_moe": _Glm4Moe, "qwen3_next": _Qwen3Next}.get(family, _Decoder)
    return cls(metadata, tensors).build()


def plan_metadata(rank_plans) -> None:
    """Adds each rank's plan (JSON) to its metadata: the hook prepare calls."""
    for rp in rank_plans:
        rp.metadata[P.KEY] = P.dumps(lower_rank(rp.metadata, {t.name: t for t in rp.tensors}))


class _Decoder:
    MODED = ("attention", "gated_delta")     # ops whose `mode` attr is the program's (decode / prefill)
    norm_attrs: dict = {}                    # extra attrs of the family's output norm (Qwen3-Next: offset)

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
        rot = int(md.get(f"{arch}.rope.dimension_count", self.head_dim))
        self.rope_extra = {"rotary_dim": rot} if rot < self.head_dim else {}      # partial rotary (GLM-4.5)
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
            self.layer(bid, h)
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight="output_norm", out=xn, eps=self.eps, group=self.hidden, **self.norm_attrs)
        self.head(xn)
        body = self.ops
        programs = {}
        for prog, rows in P.PROGRAMS.items():
            mode = {"mode": prog}
            programs[prog] = {"rows": rows, "ops": [{**o, **mode} if o["op"] in self.MODED else o for o in body]}
        plan = {"version": P.VERSION, "family": self.family, "tp": self.tp, "rank": self.rank,
                "model": {"vocab_size": self.vocab, "context_length": self.context},
                "buffers": self.buffers, "programs": programs}
        P.validate(plan, f"lowered plan of rank {self.rank}")
        return plan

    def layer(self, bid: int, h: str) -> None:
        self.attention(bid, h)
        self.ffn(bid, h)

    def attention(self, bid: int, h: str) -> None:
        b, hd = f"blk.{bid}.", self.head_dim
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight=b + "attn_norm", out=xn, eps=self.eps, group=self.hidden)
        q = self.linear(xn, b + "attn_q", "q")
        k = self.linear(xn, b + "attn_k", "k")
        v = self.linear(xn, b + "attn_v", "v")
        for x, n in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")):
            if f"{b}{n}_bias" in self.t:                  # attention_bias (GLM-4.5)
                self.op("bias_add", x=x, bias=f"{b}{n}_bias", out=x)
        if b + "attn_q_norm" in self.t:
            self.op("rmsnorm", x=q, weight=b + "attn_q_norm", out=q, eps=self.eps, group=hd)
            self.op("rmsnorm", x=k, weight=b + "attn_k_norm", out=k, eps=self.eps, group=hd)
        att = self.attend(bid, q, k, v)
        self.project_out(att, b + "attn_output", h)

    def attend(self, bid: int, q: str, k: str, v: str) -> str:
        """Rope on q and k, then causal attention over the layer's KV cache (state kv.{bid}.k/v).
        Returns the attention output buffer."""
        hd = self.head_dim
        for x, n in ((q, self.heads), (k, self.kv_heads)):
            self.op("rope", x=x, pos="positions", out=x, heads=n, head_dim=hd, theta=self.theta, **self.rope_extra)
        cache = ["slots", "ctx", self.kv_heads, hd]
        ck = self.buf(f"kv.{bid}.k", cache, kind="state")
        cv = self.buf(f"kv.{bid}.v", cache, kind="state")
        att = self.rows("attn", self.heads * hd)
        self.op("attention", q=q, k=k, v=v, pos="positions", slot="slot_ids", cache_k=ck, cache_v=cv, out=att,
                heads=self.heads, kv_heads=self.kv_heads, head_dim=hd, scale=1.0 / math.sqrt(hd))
        return att

    def project_out(self, x: str, weight: str, h: str) -> None:
        """The block's output projection (row-cut) into the residual h."""
        self.residual(self.linear(x, weight, "o"), h)

    def residual(self, x: str, h: str) -> None:
        """h += x, x a row-parallel partial sum (all-reduced first at tp > 1)."""
        self.reduce(x)
        self.op("add", a=h, b=x, out=h)

    def ffn(self, bid: int, h: str) -> None:
        b = f"blk.{bid}."
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight=b + "ffn_norm", out=xn, eps=self.eps, group=self.hidden)
        if b + "ffn_gate_inp" in self.t:
            f = self.routed(xn, b, "moe_router", norm=self.norm_topk)
        else:
            f = self.mlp(xn, b)
        self.residual(f, h)

    def mlp(self, xn: str, b: str, suffix: str = "") -> str:
        """SwiGLU MLP down(silu(gate x) * up x) of tensors ffn_{gate,up,down}{suffix}: the dense
        FFN (suffix ''), or a shared expert ('_shexp'). Returns its output buffer."""
        buf = "ffn" if not suffix else suffix.strip("_")
        g = self.linear(xn, f"{b}ffn_gate{suffix}", f"{buf}_gate")
        u = self.linear(xn, f"{b}ffn_up{suffix}", f"{buf}_up")
        self.op("swiglu", gate=g, up=u, out=g)
        return self.linear(g, f"{b}ffn_down{suffix}", f"{buf}_out")

    def routed(self, xn: str, b: str, router: str, **attrs) -> str:
        """The routed experts: the router op `router` (weight ffn_gate_inp, its attrs) choosing
        top_k of them, then moe_experts. Returns the output buffer ffn_out."""
        experts = int(self.t[b + "ffn_gate_inp"].shape[0])
        ids = self.buf("moe_ids", ["rows", self.top_k], "i32")
        wts = self.rows("moe_weights", self.top_k)
        self.op(router, x=xn, weight=b + "ffn_gate_inp", ids=ids, weights=wts, top_k=self.top_k, **attrs)
        f = self.rows("ffn_out", self.hidden)
        self.op("moe_experts", x=xn, ids=ids, weights=wts, gate=b + "ffn_gate_exps", up=b + "ffn_up_exps",
                down=b + "ffn_down_exps", out=f, experts=experts, top_k=self.top_k)
        return f

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


class _Glm4Moe(_Decoder):
    """GLM-4.5 MoE (specs/glm4_moe.yaml): the generic attention (its q/k/v biases, q/k norms and
    partial rotary come from the tensor table and metadata); the pre-FFN norm is
    `post_attention_norm`; the first leading_dense_block_count layers are a dense SwiGLU, the
    others routed experts under moe_router_grouped plus the shared experts, whose output is added
    to the routed one before the residual (one all_reduce for both partial sums at tp > 1). The
    NextN layers (blk.{block_count - nextn_predict_layers}...) are in the artifact, not in the plan."""

    def __init__(self, md: Mapping[str, Any], tensors: Mapping[str, Any]):
        super().__init__(md, tensors)
        g = lambda k: md[f"{md['general.architecture']}.{k}"]
        self.layers -= int(g("nextn_predict_layers"))
        self.n_group, self.topk_group = int(g("expert_group_count")), int(g("expert_group_used_count"))
        self.scale = float(g("expert_weights_scale"))

    def ffn(self, bid: int, h: str) -> None:
        b = f"blk.{bid}."
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight=b + "post_attention_norm", out=xn, eps=self.eps, group=self.hidden)
        if b + "ffn_gate_inp" not in self.t:          # a leading dense layer
            f = self.mlp(xn, b)
        else:
            f = self.routed(xn, b, "moe_router_grouped", bias=b + "exp_probs_b", n_group=self.n_group,
                            topk_group=self.topk_group, norm=self.norm_topk, scale=self.scale)
            s = self.mlp(xn, b, "_shexp")
            self.op("add", a=f, b=s, out=f)
        self.residual(f, h)


class _Qwen3Next(_Decoder):
    """Qwen3-Next (specs/qwen3_next.yaml; transformers 5.24's modeling_qwen3_next.py): per layer a
    gated delta net (where `ssm_in` exists) or gated full attention, then routed experts plus the
    shared expert scaled by sigmoid(ffn_gate_inp_shexp x), or a dense MLP (mlp_only_layers). Its
    RMSNorms multiply by 1 + weight (offset 1.0), all but the gated norm after the delta rule. At
    tp > 1 a rank holds whole key-head groups of each delta net (their in_proj_qkvz and in_proj_ba
    rows, conv channels, A_log, dt_bias and states) and whole KV head groups of the attention;
    out_proj, o_proj and the FFN's down projections are row-cut and all-reduced. The mtp.*
    tensors are in the artifact, read by no op yet."""

    norm_attrs = {"offset": 1.0}

    def __init__(self, md: Mapping[str, Any], tensors: Mapping[str, Any]):
        super().__init__(md, tensors)
        g = lambda k: int(md[f"{md['general.architecture']}.{k}"])      # noqa: E731
        self.conv_kernel = g("ssm.conv_kernel")
        self.k_dim = g("ssm.state_size")
        self.vk = g("ssm.time_step_rank") // g("ssm.group_count")       # v heads per key head
        self.v_dim = g("ssm.inner_size") // g("ssm.time_step_rank")
        self.k_heads = int(md["bloomery.tp.ssm_group_count"])           # this rank's key heads
        self.v_heads = self.k_heads * self.vk

    def norm(self, x: str, weight: str, out: str, group: int) -> None:
        self.op("rmsnorm", x=x, weight=weight, out=out, eps=self.eps, group=group, **self.norm_attrs)

    def layer(self, bid: int, h: str) -> None:
        if f"blk.{bid}.ssm_in" in self.t:
            self.delta_net(bid, h)
        else:
            self.gated_attention(bid, h)
        self.moe_ffn(bid, h)

    def delta_net(self, bid: int, h: str) -> None:
        """Qwen3NextGatedDeltaNet: in_proj_qkvz's per-key-head groups [q | k | v | z] re-laid out as
        the conv's channels [all q | all k | all v] and z; in_proj_ba's [b | a] as b and a; the
        causal conv (state conv.{bid}), the delta rule (state ssm.{bid}), the gated norm (gate z),
        out_proj."""
        b = f"blk.{bid}."
        Hk, Hv, dk, dv, r, K = self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.vk, self.conv_kernel
        xn = self.rows("xn", self.hidden)
        self.norm(h, b + "attn_norm", xn, self.hidden)
        qkvz = self.linear(xn, b + "ssm_in", "ssm_qkvz")
        qkv, z = self.rows("ssm_qkv", Hk * (2 * dk + r * dv)), self.rows("ssm_z", Hv * dv)
        self.op("split_groups", x=qkvz, out=qkv, rest=z, groups=Hk, widths=[dk, dk, r * dv, r * dv], split=3)
        ba = self.linear(xn, b + "ssm_ba", "ssm_ba")
        beta, alpha = self.rows("ssm_b", Hv), self.rows("ssm_a", Hv)
        self.op("split_groups", x=ba, out=beta, rest=alpha, groups=Hk, widths=[r, r], split=1)
        conv = self.buf(f"conv.{bid}", ["slots", K - 1, Hk * (2 * dk + r * dv)], kind="state")
        self.op("causal_conv1d", x=qkv, pos="positions", slot="slot_ids", state=conv, out=qkv,
                weight=b + "ssm_conv1d", kernel=K)
        ssm = self.buf(f"ssm.{bid}", ["slots", Hv, dk, dv], kind="state")
        o = self.rows("ssm_o", Hv * dv)
        self.op("gated_delta", qkv=qkv, a=alpha, b=beta, pos="positions", slot="slot_ids", state=ssm, out=o,
                A_log=b + "ssm_a", dt_bias=b + "ssm_dt", k_heads=Hk, v_heads=Hv, k_dim=dk, v_dim=dv)
        self.op("rmsnorm_gated", x=o, gate=z, out=o, weight=b + "ssm_norm", eps=self.eps, group=dv)
        self.project_out(o, b + "ssm_out", h)

    def gated_attention(self, bid: int, h: str) -> None:
        """Qwen3NextAttention: q_proj gives each head's [q | gate]; q/k norms per head, partial rope,
        attention, output * sigmoid(gate), o_proj."""
        b, hd = f"blk.{bid}.", self.head_dim
        xn = self.rows("xn", self.hidden)
        self.norm(h, b + "attn_norm", xn, self.hidden)
        qg = self.linear(xn, b + "attn_q", "q_gate")
        q, gate = self.rows("q", self.heads * hd), self.rows("attn_gate", self.heads * hd)
        self.op("split_groups", x=qg, out=q, rest=gate, groups=self.heads, widths=[hd, hd], split=1)
        k = self.linear(xn, b + "attn_k", "k")
        v = self.linear(xn, b + "attn_v", "v")
        self.norm(q, b + "attn_q_norm", q, hd)
        self.norm(k, b + "attn_k_norm", k, hd)
        att = self.attend(bid, q, k, v)
        self.op("sigmoid_mul", x=att, gate=gate, out=att)
        self.project_out(att, b + "attn_output", h)

    def moe_ffn(self, bid: int, h: str) -> None:
        """Qwen3NextSparseMoeBlock: experts(x) + sigmoid(shared_expert_gate x) * shared_expert(x),
        one all-reduce for both partial sums (the gate is replicated); or Qwen3NextMLP."""
        b = f"blk.{bid}."
        xn = self.rows("xn", self.hidden)
        self.norm(h, b + "post_attention_norm", xn, self.hidden)
        if b + "ffn_gate_inp" in self.t:
            f = self.routed(xn, b, "moe_router", norm=self.norm_topk)
            s = self.mlp(xn, b, "_shexp")
            sg = self.linear(xn, b + "ffn_gate_inp_shexp", "shexp_weight")
            self.op("sigmoid_mul", x=s, gate=sg, out=s)
            self.op("add", a=f, b=s, out=f)
        else:
            f = self.mlp(xn, b)
        self.residual(f, h)
