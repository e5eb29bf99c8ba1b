"""split_groups: a row laid out as `groups` consecutive groups of fields (widths[0], widths[1],
...) re-laid out field by field. `out` takes fields 0 .. split-1, `rest` the others, each as
[field f of group 0, field f of group 1, ...] for each field in order:

    x    [rows, groups * sum(widths)]    viewed as [rows, groups, (w0 | w1 | ...)]
    out  [rows, groups * sum(widths[:split])] = concat_f<split concat_g x[:, g, f]
    rest [rows, groups * sum(widths[split:])] = concat_f>=split concat_g x[:, g, f]

Qwen3-Next: in_proj_qkvz's output per key head group [q | k | v | z] becomes qkv = [all q |
all k | all v] (the conv's channel order) and z; in_proj_ba's [b | a] becomes b and a; the gated
attention's q_proj output per head [q | gate] becomes q and gate."""

import numpy as np


def fields(x: np.ndarray, groups: int, widths) -> list[np.ndarray]:
    """Each field as [rows, groups * width] (group-major inside)."""
    xr = x.reshape(x.shape[0], groups, sum(widths))
    out, at = [], 0
    for wd in widths:
        out.append(xr[:, :, at:at + wd].reshape(x.shape[0], groups * wd))
        at += wd
    return out


def run(op, buf, w):
    f = fields(buf[op["x"]], op["groups"], op["widths"])
    s = op["split"]
    buf[op["out"]][...] = np.concatenate(f[:s], axis=-1)
    buf[op["rest"]][...] = np.concatenate(f[s:], axis=-1)
