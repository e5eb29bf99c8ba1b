"""rmsnorm_gated: Qwen3-Next's gated RMSNorm after the gated delta rule (HF's
Qwen3NextRMSNormGated, norm before gate): over each group of `group` values (one v head),

    out = x / sqrt(mean(x^2) + eps) * weight * silu(gate)

x, gate, out f32 [rows, n*group] (out may be x); weight [group], shared by every head, used as
stored (`weight`, initialised to ones: not the `1 + weight` of Qwen3NextRMSNorm); attrs eps, group.
The normalization is rmsnorm's."""

from .rmsnorm import normalize
from .swiglu import silu


def run(op, buf, w):
    x, gate = buf[op["x"]], buf[op["gate"]]
    g = op["group"]
    y = normalize(x, g, op["eps"]) * w[op["weight"]]
    buf[op["out"]][...] = (y * silu(gate.reshape(gate.shape[0], -1, g))).reshape(x.shape)
