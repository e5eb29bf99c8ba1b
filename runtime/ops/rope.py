"""rope: rotary embedding in HF's rotate_half convention on HF-layout heads (the halves of each
head rotate together; bloomery does not permute q/k). inv_freq and angles in float32 as HF
computes them: inv_freq = 1 / theta^(arange(0, d, 2) / d) for the default rope, scaled as the
op's optional `scaling` attr says (Llama 3.x's llama3, YaRN: core/rope.py, the one owner, which
the CUDA executor reads too), angle = pos * inv_freq. YaRN's attention factor is not applied
here: the lowering folds it into the attention op's scale. Partial rotary (`rotary_dim` <
head_dim: Qwen3-Next, GLM-4.5's partial_rotary_factor): only the first rotary_dim values of each
head rotate (d = rotary_dim above), the rest pass through."""

import numpy as np

from bloomery.core.rope import inv_freq


def cos_sin(pos: np.ndarray, theta: float, dim: int, scaling=None):
    ang = np.maximum(pos, 0).astype(np.float32)[:, None] * inv_freq(theta, dim, scaling)[None, :]
    return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]


def run(op, buf, w):
    x = buf[op["x"]]
    hd = op["head_dim"]
    d = int(op.get("rotary_dim") or hd)
    half = d // 2
    xr = x.reshape(x.shape[0], op["heads"], hd)
    cos, sin = cos_sin(buf[op["pos"]], op["theta"], d, op.get("scaling"))
    x1, x2 = xr[..., :half], xr[..., half:d]
    y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xr[..., d:]], axis=-1)
    buf[op["out"]][...] = y.reshape(x.shape)
