"""Lowering: one rank's model (its spec family, metadata and tensor table) into the static
execution plan of core/plan.py, one op list for a decode step and one for a prompt chunk.

The decoder stack is generic over what the rank's tensor table holds: q/k norms when
`attn_q_norm` exists (Qwen3), q/k/v biases when `attn_q_bias` exists (Qwen2, GLM-4.5, Llama's
attention_bias, whose o_proj bias `attn_output_bias` is added once, after the all-reduce) and partial
rotary when rope.dimension_count < head_dim (GLM-4.5), rope scaling where the metadata has
rope.scaling.type (llama3, yarn: core/rope.py), routed experts where `ffn_gate_inp` exists, else a dense SwiGLU
MLP; the output head is `output`, or the tied `token_embd`. With tp > 1 the row-parallel
outputs (attn_output, ffn_down, the experts' down) are all-reduced and the vocab-parallel
logits all-gathered. A family with a genuinely new block (gated delta net, recurrent state)
adds its lowering here and its op to core/plan.OPS: Qwen3-Next (_Qwen3Next) does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from bloomery.core import ngram
from bloomery.core import plan as P
from bloomery.core import rope, specs
from bloomery.core.errors import MissingTensor, UnsupportedConfig

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "qwen3_next", "qwen4_exp", "glm5_next")


def lower_rank(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
    """The plan of one rank. `tensors`: base name -> object with .shape, .format, .optional."""
    family = str(metadata["bloomery.spec"])
    if family not in FAMILIES:
        raise UnsupportedConfig(f"no lowering for model family {family!r} (lowered: {', '.join(FAMILIES)})")
    cls = {"glm4_moe": _Glm4Moe, "qwen3_next": _Qwen3Next, "qwen4_exp": _Qwen4Exp,
           "glm5_next": _Glm5Next}.get(family, _Decoder)
    return cls(metadata, tensors).build()


def plan_metadata(rank_plans) -> None:
    """Adds each rank's plan (JSON) to its metadata: the hook prepare calls."""
    for rp in rank_plans:
        rp.metadata[P.KEY] = P.dumps(lower_rank(rp.metadata, {t.name: t for t in rp.tensors}))


class _Decoder:
    MODED = ("attention", "gated_delta", "kda", "mla_attention")   # ops whose `mode` attr is the program's
    norm_attrs: dict = {}                    # extra attrs of the family's output norm (Qwen3-Next: offset)
    final_norm: str | None = None            # the buffer of the output norm's result (forward sets it)

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
        scaling, self.attn_factor = rope.from_metadata(md, arch)                  # llama3 / yarn
        if scaling is not None:
            self.rope_extra["scaling"] = scaling
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
        self.forward(tokens)
        body = self.ops
        programs = {}
        for prog in ("decode", "prefill", "verify"):                         # the mtp program: mtp()
            programs[prog] = {"rows": P.ALL_PROGRAMS[prog], "ops": self.moded(body, prog)}
        programs["verify"]["ops"] = [self.with_history(o) for o in programs["verify"]["ops"]]
        mtp = self.mtp(self.final_norm)
        if mtp is not None:
            programs["mtp"] = mtp
        plan = {"version": P.VERSION, "family": self.family, "tp": self.tp, "rank": self.rank,
                "model": {"vocab_size": self.vocab, "context_length": self.context},
                "buffers": self.buffers, "programs": programs}
        P.validate(plan, f"lowered plan of rank {self.rank}")
        return plan

    def pre(self, bid) -> str:
        """A layer's tensor prefix: blk.{bid}., or the MTP layer's (a name: Qwen3-Next's mtp.blk.0.)."""
        return f"blk.{bid}." if isinstance(bid, int) else f"{bid}."

    # -- the MTP / NextN layer (the mtp program: speculative decoding's draft) -----------------------
    mtp_names: dict | None = None            # the family's: layer (its bid), eh_proj, enorm, hnorm, norm

    def mtp(self, hidden: str) -> dict | None:
        """The mtp program where the rank holds an MTP layer (transformers 5.24's MtpLayer / MtpModel,
        the drafter of generate(..., use_mtp=True)): a row at position p takes the embedding of
        token x_{p+1} (`tokens`) and the main model's final-norm output at p (input `hidden`),
        eh_proj([enorm(e) | hnorm(h)]), one decoder layer at position p (rope and its own KV cache:
        the main row's position, as the oracle, tools/oracle.py mtp_logits, computes), the post
        norm (its output `mtp_hidden`, what a chained step feeds back), the main model's head and
        argmax: the draft of x_{p+2}. `hidden` names the main programs' buffer that
        holds the final-norm output when they end."""
        names = self.mtp_names
        if not names or names["eh_proj"] not in self.t:
            return None
        main, self.ops = self.ops, []
        D = self.hidden
        hid = self.buf("hidden", ["rows", D], kind="input")
        e = self.rows("mtp_embd", D)
        self.op("embed", ids="tokens", weight="token_embd", out=e)
        en, hn = self.rows("mtp_en", D), self.rows("mtp_hn", D)
        self.op("rmsnorm", x=e, weight=names["enorm"], out=en, eps=self.eps, group=D, **self.norm_attrs)
        self.op("rmsnorm", x=hid, weight=names["hnorm"], out=hn, eps=self.eps, group=D, **self.norm_attrs)
        eh = self.rows("mtp_eh", 2 * D)
        self.op("concat", a=en, b=hn, out=eh)
        h = self.linear(eh, names["eh_proj"], "mtp_h")
        self.layer(names["layer"], h)
        xn = self.buf("mtp_hidden", ["rows", D], kind="output")
        self.op("rmsnorm", x=h, weight=names["norm"], out=xn, eps=self.eps, group=D, **self.norm_attrs)
        self.head(xn)
        ops, self.ops = self.ops, main
        return {"rows": P.ALL_PROGRAMS["mtp"], "hidden": hidden, "ops": self.moded(ops, "mtp")}

    def moded(self, ops: list, prog: str) -> list:
        """The ops with the program's name as the `mode` attr of those that take one (a kernel hint)."""
        return [{**o, "mode": prog} if o["op"] in self.MODED else o for o in ops]

    def with_history(self, op: dict) -> dict:
        """A recurrent state op of the verify program also writes the slot's state after each row."""
        if "history" not in P.OPS[op["op"]].opt_writes:
            return op
        name = op[P.OPS[op["op"]].state[0]]                  # the op's one state buffer
        st = self.buffers[name]
        return {**op, "history": self.buf(f"{name}.history", ["rows", *st["shape"][1:]], st["dtype"])}

    def forward(self, tokens: str) -> None:
        """Embedding, the layers on the residual h, the output norm and the head."""
        h = self.rows("h", self.hidden)
        self.op("embed", ids=tokens, weight="token_embd", out=h)
        for bid in range(self.layers):
            self.layer(bid, h)
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight="output_norm", out=xn, eps=self.eps, group=self.hidden, **self.norm_attrs)
        self.final_norm = xn
        self.head(xn)

    def streams(self, tokens: str, n: int) -> str:
        """The flagships' residual: n streams side by side [rows, n*D], each the embedding."""
        e = self.rows("embd", self.hidden)
        self.op("embed", ids=tokens, weight="token_embd", out=e)
        X = self.rows("streams", n * self.hidden)
        self.op("hc_expand", x=e, out=X, n=n)
        return X

    def layer(self, bid: int, h: str) -> None:
        self.attention(bid, h)
        self.ffn(bid, h)

    def attention(self, bid: int, h: str) -> None:
        b, hd = self.pre(bid), self.head_dim
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

    def attend(self, bid: int, q: str, k: str, v: str, **select) -> str:
        """Rope on q and k, then causal attention over the layer's KV cache (state kv.{bid}.k/v),
        over the cache positions a `select` buffer lists where one is given. Returns the attention
        output buffer."""
        hd = self.head_dim
        for x, n in ((q, self.heads), (k, self.kv_heads)):
            self.op("rope", x=x, pos="positions", out=x, heads=n, head_dim=hd, theta=self.theta, **self.rope_extra)
        cache = ["slots", "ctx", self.kv_heads, hd]
        ck = self.buf(f"kv.{bid}.k", cache, kind="state")
        cv = self.buf(f"kv.{bid}.v", cache, kind="state")
        att = self.rows("attn", self.heads * hd)
        # ModelOpt's FP8 KV-cache scales, where the checkpoint has them (read by --cache-type fp8 only)
        b = self.pre(bid)
        scales = {k: f"{b}attn_{k}" for k in ("k_scale", "v_scale") if f"{b}attn_{k}" in self.t}
        # YaRN's attention factor m multiplies HF's cos and sin of q and of k: m^2 on the scores (core/rope.py)
        self.op("attention", q=q, k=k, v=v, pos="positions", slot="slot_ids", cache_k=ck, cache_v=cv, out=att,
                heads=self.heads, kv_heads=self.kv_heads, head_dim=hd, scale=self.attn_factor ** 2 / math.sqrt(hd),
                **select, **scales)
        return att

    def project_out(self, x: str, weight: str, h: str) -> None:
        """The block's output projection (row-cut) into the residual h, plus its bias where it has one."""
        bias = weight + "_bias"
        self.residual(self.linear(x, weight, "o"), h, bias if bias in self.t else None)

    def residual(self, x: str, h: str, bias: str | None = None) -> None:
        """h += x (+ bias), x a row-parallel partial sum (all-reduced first at tp > 1; the replicated
        bias is added once, after it)."""
        self.reduce(x)
        if bias is not None:
            self.op("bias_add", x=x, bias=bias, out=x)
        self.op("add", a=h, b=x, out=h)

    def ffn(self, bid: int, h: str) -> None:
        b = self.pre(bid)
        xn = self.rows("xn", self.hidden)
        self.op("rmsnorm", x=h, weight=b + "ffn_norm", out=xn, eps=self.eps, group=self.hidden)
        if b + "ffn_gate_inp" in self.t:
            f = self.routed(xn, b, "moe_router", norm=self.norm_topk)
        else:
            f = self.mlp(xn, b)
        self.residual(f, h)

    def mlp(self, xn: str, b: str, suffix: str = "", **attrs) -> str:
        """SwiGLU MLP down(silu(gate x) * up x) of tensors ffn_{gate,up,down}{suffix}: the dense
        FFN (suffix ''), or a shared expert ('_shexp'); `attrs` of the swiglu op (limit). Returns
        its output buffer."""
        buf = "ffn" if not suffix else suffix.strip("_")
        g = self.linear(xn, f"{b}ffn_gate{suffix}", f"{buf}_gate")
        u = self.linear(xn, f"{b}ffn_up{suffix}", f"{buf}_up")
        self.op("swiglu", gate=g, up=u, out=g, **attrs)
        return self.linear(g, f"{b}ffn_down{suffix}", f"{buf}_out")

    def routed(self, xn: str, b: str, router: str, experts_attrs: dict | None = None, **attrs) -> str:
        """The routed experts: the router op `router` (weight ffn_gate_inp, its attrs) choosing
        top_k of them, then moe_experts (with `experts_attrs`). Returns the output buffer ffn_out."""
        experts = int(self.t[b + "ffn_gate_inp"].shape[0])
        ids = self.buf("moe_ids", ["rows", self.top_k], "i32")
        wts = self.rows("moe_weights", self.top_k)
        self.op(router, x=xn, weight=b + "ffn_gate_inp", ids=ids, weights=wts, top_k=self.top_k, **attrs)
        f = self.rows("ffn_out", self.hidden)
        self.op("moe_experts", x=xn, ids=ids, weights=wts, gate=b + "ffn_gate_exps", up=b + "ffn_up_exps",
                down=b + "ffn_down_exps", out=f, experts=experts, top_k=self.top_k, **(experts_attrs or {}))
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
        kind = "output" if self.tp == 1 else "scratch"
        self.op("logits", x=xn, weight=weight, out=self.buf(out, ["rows", local], kind=kind), vocab=local, **extra)
        if self.tp > 1:
            sizes = self._vocab_sizes(tied)
            self.op("all_gather", x=out, out=self.buf("logits", ["rows", self.vocab], kind="output"), sizes=sizes)
        nt = self.buf("next_token", ["rows"], "i32", "output")
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
    first NextN layer (blk.{L}, L = block_count - nextn_predict_layers, with blk.{L}.nextn.*) is the
    mtp program; further ones are in the artifact, read by no op."""

    def __init__(self, md: Mapping[str, Any], tensors: Mapping[str, Any]):
        super().__init__(md, tensors)
        g = lambda k: md[f"{md['general.architecture']}.{k}"]
        self.layers -= int(g("nextn_predict_layers"))
        b = f"blk.{self.layers}.nextn."
        self.mtp_names = {"layer": self.layers, "eh_proj": b + "eh_proj", "enorm": b + "enorm", "hnorm": b + "hnorm",
                          "norm": b + "shared_head_norm"}
        self.n_group, self.topk_group = int(g("expert_group_count")), int(g("expert_group_used_count"))
        self.scale = float(g("expert_weights_scale"))

    def ffn(self, bid: int, h: str) -> None:
        b = self.pre(bid)
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
    out_proj, o_proj and the FFN's down projections are row-cut and all-reduced. The mtp.* layer
    is the mtp program (_Decoder.mtp)."""

    norm_attrs = {"offset": 1.0}
    # the MTP layer (vLLM's qwen3_next_mtp; transformers' MtpModel over the "Mellum" names: mtp.fc,
    # mtp.pre_fc_norm_embedding / _hidden, mtp.norm), its norms 1 + weight as the model's
    mtp_names = {"layer": "mtp.blk.0", "eh_proj": "mtp.nextn.eh_proj", "enorm": "mtp.nextn.enorm",
                 "hnorm": "mtp.nextn.hnorm", "norm": "mtp.nextn.shared_head_norm"}

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
        if self.pre(bid) + "ssm_in" in self.t:
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

    def gated_qkv(self, b: str, x: str) -> tuple[str, str, str, str]:
        """The gated attention's inputs (Qwen3-Next, qwen4_exp): q_proj's per-head [q | gate] split,
        k and v, q and k normed per head. Returns (q, gate, k, v)."""
        hd = self.head_dim
        qg = self.linear(x, b + "attn_q", "q_gate")
        q, gate = self.rows("q", self.heads * hd), self.rows("attn_gate", self.heads * hd)
        self.op("split_groups", x=qg, out=q, rest=gate, groups=self.heads, widths=[hd, hd], split=1)
        k = self.linear(x, b + "attn_k", "k")
        v = self.linear(x, b + "attn_v", "v")
        self.norm(q, b + "attn_q_norm", q, hd)
        self.norm(k, b + "attn_k_norm", k, hd)
        return q, gate, k, v

    def gated_attention(self, bid: int, h: str) -> None:
        """Qwen3NextAttention: q_proj gives each head's [q | gate]; q/k norms per head, partial rope,
        attention, output * sigmoid(gate), o_proj."""
        b = self.pre(bid)
        xn = self.rows("xn", self.hidden)
        self.norm(h, b + "attn_norm", xn, self.hidden)
        q, gate, k, v = self.gated_qkv(b, xn)
        att = self.attend(bid, q, k, v)
        self.op("sigmoid_mul", x=att, gate=gate, out=att)
        self.project_out(att, b + "attn_output", h)

    def moe_ffn(self, bid: int, h: str) -> None:
        """Qwen3NextSparseMoeBlock: experts(x) + sigmoid(shared_expert_gate x) * shared_expert(x),
        one all-reduce for both partial sums (the gate is replicated); or Qwen3NextMLP."""
        b = self.pre(bid)
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


class _Qwen4Exp(_Qwen3Next):
    """qwen4_exp (specs/qwen4_exp.yaml; transformers 5.24's modeling_qwen4_exp.py, docs/flagships.md).
    The residual is `hc` streams side by side, X [rows, n*D], each starting as the embedding. A
    layer: the per-layer n-gram embedding (PLE layers) added to X; then twice (before the
    attention, before the experts) a gated hyper-connection: Xn = hc_norm(X) per stream, the
    block input m = mean_i sigmoid(up(silu(down(Xn) / n)))_i * Xn_i, the block's output y
    injected into each stream with weight 2 * sigmoid(inject(Xn) / n). The blocks: the gated
    delta net (separate q|k|v, z, b, a projections; output gate silu or sigmoid), or gated
    attention over the keys the QSA indexer selects; the experts plus the sigmoid-gated shared
    expert. The final mixer's m feeds the head (no final norm). The PLE's n-gram ids and table
    rows are host ops: computed from the token ids before the device step."""

    mtp_names = None                         # no MTP layer is lowered for the flagships

    def __init__(self, md: Mapping[str, Any], tensors: Mapping[str, Any]):
        super().__init__(md, tensors)
        arch = str(md["general.architecture"])
        g = lambda k: md[f"{arch}.{k}"]      # noqa: E731
        self.n = int(g("hc.count"))
        self.gate_act = str(g("ssm.gate_act"))
        self.idx_heads, self.idx_dim = int(g("indexer.head_count")), int(g("indexer.key_length"))
        self.budget, self.ratio = int(g("indexer.budget")), int(g("indexer.compress_ratio"))
        self.ngram_size, self.heads_per_ngram = int(g("ple.ngram_size")), int(g("ple.heads_per_ngram"))
        self.ple_args = (int(g("ple.vocab_base")), int(g("ple.seed")))
        self.ple_divisor, self.eos = int(g("ple.vocab_divisor")), int(g("ple.eos_token_id"))
        self.ple_kernel = int(g("ple.conv_kernel"))
        self.ple_index = 0

    def forward(self, tokens: str) -> None:
        n = self.n
        X = self.streams(tokens, n)
        for bid in range(self.layers):
            b = f"blk.{bid}."
            if b + "ple_table" in self.t:
                self.ple(bid, X)
            m, inj = self.hyper(b + "hc_attn", X)
            y = self.delta_net(bid, m) if b + "ssm_qkv" in self.t else self.indexed_attention(bid, m)
            self.op("hc_inject", x=X, y=y, w=inj, out=X, n=n)
            m, inj = self.hyper(b + "hc_ffn", X)
            y = self.experts(b, m)
            self.op("hc_inject", x=X, y=y, w=inj, out=X, n=n)
        m, _ = self.hyper("hc_out", X, inject=False)
        self.head(m)

    def hyper(self, p: str, X: str, inject: bool = True) -> tuple[str, str | None]:
        """Qwen4ExpTextGatedResidual of tensors {p}_norm/_down/_up/_inject: (m [rows, D], the
        injection weights [rows, n] or None)."""
        D, n = self.hidden, self.n
        xn = self.rows("hc_xn", n * D)
        self.norm(X, p + "_norm", xn, D)
        d = self.linear(xn, p + "_down", "hc_low")
        self.op("act_scale", x=d, out=d, act="silu", scale=1.0 / n)
        w = self.linear(d, p + "_up", "hc_mix")
        m = self.rows("hc_m", D)
        self.op("hc_gate_mix", xn=xn, w=w, out=m, n=n)
        if not inject:
            return m, None
        inj = self.linear(xn, p + "_inject", "hc_inj")
        self.op("act_scale", x=inj, out=inj, act="sigmoid", scale=1.0 / n, mul=2.0)
        return m, inj

    def ple(self, bid: int, X: str) -> None:
        """Qwen4ExpTextPLELayer: X += gv + silu(dilated conv(norm_conv(gv))), gv_i = sigmoid(g_i) v
        with g_i the signed square root of norm_key(key(e))_i . norm_query(X)_i / sqrt(D) and
        v = value(e), e the layer's n-gram embedding (ngram_hash and host_embed on the host)."""
        b, D, n = f"blk.{bid}.", self.hidden, self.n
        G = (self.ngram_size - 1) * self.heads_per_ngram
        tab = ngram.tables(self.vocab, self.ngram_size, self.heads_per_ngram, *self.ple_args, self.ple_index,
                           self.ple_divisor)
        self.ple_index += 1
        ctx = self.buf(f"ngram.{bid}", ["slots", self.ngram_size - 1], "i32", "state")
        ids = self.buf(f"ple_ids.{bid}", ["rows", G], "i32")
        self.op("ngram_hash", tokens="tokens", pos="positions", slot="slot_ids", ctx=ctx, ids=ids,
                ngram_size=self.ngram_size, heads_per_ngram=self.heads_per_ngram, eos=self.eos,
                multipliers=list(tab.multipliers), sizes=list(tab.sizes), offsets=list(tab.offsets))
        width = int(self.t[b + "ple_table"].shape[-1])
        e = self.rows(f"ple_e.{bid}", G * width)
        self.op("host_embed", ids=ids, out=e, table=b + "ple_table", heads=G)
        kn = self.linear(e, b + "ple_key", "ple_k")
        self.norm(kn, b + "ple_norm_key", kn, D)
        v = self.linear(e, b + "ple_value", "ple_v")
        qn = self.rows("ple_q", n * D)
        self.norm(X, b + "ple_norm_query", qn, D)
        gv = self.rows("ple_gv", n * D)
        self.op("ple_gate", kn=kn, qn=qn, v=v, out=gv, n=n)
        gn = self.rows("ple_gn", n * D)
        self.norm(gv, b + "ple_norm_conv", gn, D)
        conv = self.buf(f"ple_conv.{bid}", ["slots", (self.ple_kernel - 1) * self.ngram_size, n * D], kind="state")
        self.op("causal_conv1d", x=gn, pos="positions", slot="slot_ids", state=conv, out=gn,
                weight=b + "ple_conv1d", kernel=self.ple_kernel, dilation=self.ngram_size)
        self.op("add", a=gv, b=gn, out=gv)
        self.op("add", a=X, b=gv, out=X)

    def delta_net(self, bid: int, m: str) -> str:
        """Qwen4ExpTextGatedDeltaNet on the block input m: in_proj_qkv already gives the conv's
        channels [all q | all k | all v]. Returns out_proj's output [rows, D]."""
        b = f"blk.{bid}."
        Hk, Hv, dk, dv, K = self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.conv_kernel
        qkv = self.linear(m, b + "ssm_qkv", "ssm_qkv")
        z = self.linear(m, b + "ssm_gate", "ssm_z")
        beta = self.linear(m, b + "ssm_beta", "ssm_b")
        alpha = self.linear(m, b + "ssm_alpha", "ssm_a")
        conv = self.buf(f"conv.{bid}", ["slots", K - 1, Hk * 2 * dk + Hv * dv], kind="state")
        self.op("causal_conv1d", x=qkv, pos="positions", slot="slot_ids", state=conv, out=qkv,
                weight=b + "ssm_conv1d", kernel=K)
        ssm = self.buf(f"ssm.{bid}", ["slots", Hv, dk, dv], kind="state")
        o = self.rows("ssm_o", Hv * dv)
        self.op("gated_delta", qkv=qkv, a=alpha, b=beta, pos="positions", slot="slot_ids", state=ssm, out=o,
                A_log=b + "ssm_a", dt_bias=b + "ssm_dt", k_heads=Hk, v_heads=Hv, k_dim=dk, v_dim=dv)
        self.op("rmsnorm_gated", x=o, gate=z, out=o, weight=b + "ssm_norm", eps=self.eps, group=dv,
                act=self.gate_act)
        return self.linear(o, b + "ssm_out", "y")

    def indexed_attention(self, bid: int, m: str) -> str:
        """Qwen4ExpTextAttention: gated attention (q_proj's per-head [q | gate], q/k norms,
        partial rope) over the cache positions the QSA indexer selects (Qwen4ExpTextQSAIndexer:
        index_qk_proj's [Hi query heads | one raw key], the queries normed and roped). Returns
        o_proj's output."""
        b, hd = f"blk.{bid}.", self.head_dim
        Hi, Di = self.idx_heads, self.idx_dim
        q, gate, k, v = self.gated_qkv(b, m)
        qk = self.linear(m, b + "idx_qk", "idx_qk")
        iq, ik = self.rows("idx_q", Hi * Di), self.rows("idx_k", Di)
        self.op("split_groups", x=qk, out=iq, rest=ik, groups=1, widths=[Hi * Di, Di], split=1)
        self.norm(iq, b + "idx_q_norm", iq, Di)
        rot = self.rope_extra.get("rotary_dim", hd)
        self.op("rope", x=iq, pos="positions", out=iq, heads=Hi, head_dim=Di, theta=self.theta, rotary_dim=rot)
        cache = self.buf(f"qsa.{bid}", ["slots", "ctx", Di], kind="state")
        sel = self.buf(f"sel.{bid}", ["rows", self.budget + self.ratio - 1], "i32")
        self.op("qsa_index", q=iq, k=ik, pos="positions", slot="slot_ids", cache=cache, sel=sel,
                k_norm=b + "idx_k_norm", heads=Hi, head_dim=Di, ratio=self.ratio, budget=self.budget,
                theta=self.theta, rotary_dim=rot, eps=self.eps, offset=1.0)
        att = self.attend(bid, q, k, v, select=sel)
        self.op("sigmoid_mul", x=att, gate=gate, out=att)
        return self.linear(att, b + "attn_output", "y")

    def experts(self, b: str, m: str) -> str:
        """Qwen4ExpTextSparseMoeBlock: experts(m) + sigmoid(shared_expert_gate m) * shared_expert(m)."""
        f = self.routed(m, b, "moe_router", norm=self.norm_topk)
        s = self.mlp(m, b, "_shexp")
        sg = self.linear(m, b + "ffn_gate_inp_shexp", "shexp_weight")
        self.op("sigmoid_mul", x=s, gate=sg, out=s)
        self.op("add", a=f, b=s, out=f)
        return f


class _Glm5Next(_Decoder):
    """glm5_next (specs/glm5_next.yaml; transformers 5.24's modeling_glm5_next.py, docs/flagships.md).
    The residual is `hc` streams side by side, X [rows, n*D]. Before each block a manifold
    hyper-connection: z = fn(X) (mhc_weights divides by X's RMS), giving the collapse weights
    pre, the expansion weights post and the doubly-stochastic mix comb; the block input
    m = sum_i pre_i X_i goes through the layer's RMSNorm; after it X_j <- post_j y + sum_i
    comb[i, j] X_i. Blocks: KDA (q, k, v each through its short conv, the per-channel forget gate
    f_b(f_a(x)), beta, the Kimi delta rule, the sigmoid-gated output norm) or MLA over the
    positions the DSA indexer of a "full" layer selects (a "shared" layer reuses the selection
    of the full layer just before it); then a dense clamped SwiGLU or the routed experts under
    the grouped sigmoid router plus the shared experts. The head reads norm(mean_i X_i). At tp > 1
    a rank holds whole MLA and KDA heads; the indexer is replicated (every rank selects the same
    positions); o_proj and the FFN's down projections are all-reduced before the injection."""

    def __init__(self, md: Mapping[str, Any], tensors: Mapping[str, Any]):
        super().__init__(md, tensors)
        arch = str(md["general.architecture"])
        g = lambda k: md[f"{arch}.{k}"]      # noqa: E731
        self.n = int(g("hc.count"))
        self.hc_eps, self.iters = float(g("hc.eps")), int(g("hc.sinkhorn_iters"))
        self.v_dim = int(g("attention.value_length"))
        self.q_rank, self.kv_rank = int(g("attention.q_lora_rank")), int(g("attention.kv_lora_rank"))
        self.idx_heads, self.idx_dim = int(g("indexer.head_count")), int(g("indexer.key_length"))
        self.topk, self.kpool, self.tail = int(g("indexer.top_k")), int(g("indexer.kpool")), bool(g("indexer.tail"))
        self.conv_kernel = int(g("ssm.conv_kernel"))
        self.lin_heads, self.lin_dim = int(md["bloomery.tp.ssm_head_count"]), int(g("ssm.head_dim"))
        self.lower_bound = float(g("ssm.lower_bound")) if bool(g("ssm.bounded")) else None
        self.limit = float(g("swiglu_limit"))
        self.n_group, self.topk_group = int(g("expert_group_count")), int(g("expert_group_used_count"))
        self.scale = float(g("expert_weights_scale"))
        self.sel: str | None = None          # the selection of the last full indexed layer

    def forward(self, tokens: str) -> None:
        D, n = self.hidden, self.n
        X = self.streams(tokens, n)
        for bid in range(self.layers):
            b = f"blk.{bid}."
            m, post, comb = self.hyper(b + "hc_attn", X)
            self.op("rmsnorm", x=m, weight=b + "attn_norm", out=m, eps=self.eps, group=D)
            y = self.kda(bid, m) if b + "kda_f_a" in self.t else self.mla(bid, m)
            self.inject(X, y, post, comb)
            m, post, comb = self.hyper(b + "hc_ffn", X)
            self.op("rmsnorm", x=m, weight=b + "post_attention_norm", out=m, eps=self.eps, group=D)
            self.inject(X, self.ffn_out(b, m), post, comb)
        xm = self.rows("xn", D)
        self.op("hc_mean", x=X, out=xm, n=n)
        self.op("rmsnorm", x=xm, weight="output_norm", out=xm, eps=self.eps, group=D)
        self.head(xm)

    def hyper(self, p: str, X: str) -> tuple[str, str, str]:
        """Glm5NextTextHyperConnection of tensors {p}_fn/_base/_scale: (m, post, comb)."""
        n = self.n
        z = self.linear(X, p + "_fn", "hc_z")
        pre, post, comb = self.rows("hc_pre", n), self.rows("hc_post", n), self.rows("hc_comb", n * n)
        self.op("mhc_weights", z=z, x=X, pre=pre, post=post, comb=comb, base=p + "_base", scale=p + "_scale",
                n=n, iters=self.iters, hc_eps=self.hc_eps, eps=self.eps)
        m = self.rows("hc_m", self.hidden)
        self.op("hc_collapse", x=X, w=pre, out=m, n=n)
        return m, post, comb

    def inject(self, X: str, y: str, post: str, comb: str) -> None:
        self.reduce(y)
        self.op("mhc_inject", x=X, y=y, post=post, comb=comb, out=X, n=self.n)

    def kda(self, bid: int, m: str) -> str:
        """Glm5NextTextLinearAttention on the normed block input m; returns o_proj's partial output."""
        b, H, d, K = f"blk.{bid}.", self.lin_heads, self.lin_dim, self.conv_kernel
        fused = b + "ssm_conv1d" in self.t          # one stored [q | k | v] conv weight, read in three ranges
        if not fused and b + "ssm_conv_q" not in self.t:
            raise MissingTensor(f"glm5_next layer {bid} (KDA) has neither self_attn.conv1d.weight nor "
                                f"self_attn.{{q,k,v}}_conv1d.weight")
        qkv = []
        for i, x in enumerate(("q", "k", "v")):
            y = self.linear(m, f"{b}attn_{x}", f"kda_{x}")
            conv = self.buf(f"conv_{x}.{bid}", ["slots", K - 1, H * d], kind="state")
            w = {"weight": b + "ssm_conv1d", "channels": [i * H * d, (i + 1) * H * d]} if fused else \
                {"weight": f"{b}ssm_conv_{x}"}
            self.op("causal_conv1d", x=y, pos="positions", slot="slot_ids", state=conv, out=y, kernel=K, **w)
            qkv.append(y)
        f = self.linear(self.linear(m, b + "kda_f_a", "kda_fa"), b + "kda_f_b", "kda_f")
        beta = self.linear(m, b + "ssm_beta", "kda_b")
        ssm = self.buf(f"ssm.{bid}", ["slots", H, d, d], kind="state")
        o = self.rows("kda_o", H * d)
        self.op("kda", q=qkv[0], k=qkv[1], v=qkv[2], g=f, b=beta, pos="positions", slot="slot_ids", state=ssm,
                out=o, A_log=b + "ssm_a", dt_bias=b + "ssm_dt", heads=H, head_dim=d, lower_bound=self.lower_bound)
        gate = self.linear(self.linear(m, b + "kda_g_a", "kda_ga"), b + "kda_g_b", "kda_gate")
        self.op("rmsnorm_gated", x=o, gate=gate, out=o, weight=b + "ssm_norm", eps=self.eps, group=d, act="sigmoid")
        return self.linear(o, b + "attn_output", "y")

    def mla(self, bid: int, m: str) -> str:
        """Glm5NextTextAttention: q from the q_a latent, the kv latent c cached, attention over the
        DSA selection (this layer's indexer, or the previous full layer's). Returns o_proj's partial
        output."""
        b = f"blk.{bid}."
        qa = self.linear(m, b + "attn_q_a", "mla_qa")
        self.op("rmsnorm", x=qa, weight=b + "attn_q_a_norm", out=qa, eps=self.eps, group=self.q_rank)
        q = self.linear(qa, b + "attn_q_b", "mla_q")
        c = self.linear(m, b + "attn_kv_a_mqa", "mla_c")
        self.op("rmsnorm", x=c, weight=b + "attn_kv_a_norm", out=c, eps=self.eps, group=self.kv_rank)
        if b + "idx_k" in self.t:
            self.sel = self.index(bid, m, qa)
        elif self.sel is None or f"blk.{bid - 1}.idx_k" not in self.t:
            raise UnsupportedConfig(f"glm5_next layer {bid} is a shared DSA layer (indexer_types), but layer "
                                    f"{bid - 1} is not a full indexed layer whose selection it could reuse "
                                    f"(transformers refuses this arrangement too)")
        cache = self.buf(f"mla.{bid}", ["slots", "ctx", self.kv_rank], kind="state")
        o = self.rows("mla_o", self.heads * self.v_dim)
        self.op("mla_attention", q=q, c=c, pos="positions", slot="slot_ids", sel=self.sel, cache=cache, out=o,
                kv_b=b + "attn_kv_b", heads=self.heads, nope_dim=self.head_dim, v_dim=self.v_dim,
                scale=1.0 / math.sqrt(self.head_dim))
        return self.linear(o, b + "attn_output", "y")

    def index(self, bid: int, m: str, qa: str) -> str:
        """Glm5NextTextIndexer: the selected positions sel.{bid} [rows, topk + kpool - 1]."""
        b, Di = f"blk.{bid}.", self.idx_dim
        iq = self.linear(qa, b + "idx_q_b", "idx_q")
        ik = self.linear(m, b + "idx_k", "idx_k")
        self.op("layernorm", x=ik, weight=b + "idx_k_norm", bias=b + "idx_k_norm_b", out=ik, eps=1e-6, group=Di)
        gs = self.linear(m, b + "idx_gate", "idx_gs")
        hw = self.linear(m, b + "idx_weights", "idx_w")
        cache = self.buf(f"dsa.{bid}", ["slots", "ctx", 2 * Di], kind="state")
        sel = self.buf(f"sel.{bid}", ["rows", self.topk + self.kpool - 1], "i32")
        self.op("dsa_index", q=iq, k=ik, gs=gs, hw=hw, pos="positions", slot="slot_ids", cache=cache, sel=sel,
                ape=b + "idx_ape", heads=self.idx_heads, head_dim=Di, topk=self.topk, kpool=self.kpool,
                tail=self.tail)
        return sel

    def ffn_out(self, b: str, m: str) -> str:
        """Glm5NextTextMLP (clamped SwiGLU) or Glm5NextTextMoE: routed experts (clamped) plus the
        shared experts, one partial sum."""
        lim = {"limit": self.limit} if self.limit > 0 else {}
        if b + "ffn_gate_inp" not in self.t:
            return self.mlp(m, b, **lim)
        f = self.routed(m, b, "moe_router_grouped", bias=b + "exp_probs_b", n_group=self.n_group,
                        topk_group=self.topk_group, norm=self.norm_topk, scale=self.scale, experts_attrs=lim)
        s = self.mlp(m, b, "_shexp", **lim)
        self.op("add", a=f, b=s, out=f)
        return f
