"""act_scale: out = mul * act(x * scale), elementwise in float32 (qwen4_exp's hyper-connection
gates, Qwen4ExpTextGatedResidual: `silu(input_mix_weight_down(Xn) / n)` is act "silu", scale 1/n;
`2 * sigmoid(block_inject_weight(Xn) / n)` is act "sigmoid", scale 1/n, mul 2).

Keys: x, out f32 of one shape (out may be x). Attrs act ("silu" | "sigmoid"), scale; optional mul
(default 1). silu(x) = x / (1 + exp(-x)), sigmoid(x) = 1 / (1 + exp(-x)), as torch. `ACT` maps
the names to the functions (rmsnorm_gated's `act` reads it too)."""

import numpy as np

from .sigmoid_mul import sigmoid
from .swiglu import silu

ACT = {"silu": silu, "sigmoid": sigmoid}


def run(op, buf, w):
    y = ACT[op["act"]](buf[op["x"]] * np.float32(op["scale"]))
    mul = op.get("mul", 1)
    buf[op["out"]][...] = y if mul == 1 else y * np.float32(mul)
