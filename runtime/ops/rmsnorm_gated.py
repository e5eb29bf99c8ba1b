"""rmsnorm_gated: the gated RMSNorm after the gated delta rule (HF's Qwen3NextRMSNormGated and
Qwen4ExpTextRMSNormGated, norm before gate): over each group of `group` values (one v head),

    out = x / sqrt(mean(x^2) + eps) * weight * act(gate)

x, gate, out f32 [rows, n*group] (out may be x); weight [group], shared by every head, used as
stored (`weight`, initialised to ones: not the `1 + weight` of Qwen3NextRMSNorm); attrs eps, group;
optional act ("silu", the default: Qwen3-Next; or "sigmoid": qwen4_exp's `output_gate_type`).
The normalization is rmsnorm's, the activations act_scale's."""

from .act_scale import ACT
from .rmsnorm import normalize


def run(op, buf, w):
    x, gate = buf[op["x"]], buf[op["gate"]]
    g = op["group"]
    y = normalize(x, g, op["eps"]) * w[op["weight"]]
    act = ACT[op.get("act", "silu")]
    buf[op["out"]][...] = (y * act(gate.reshape(gate.shape[0], -1, g))).reshape(x.shape)
