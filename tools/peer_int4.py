"""The 4-bit weight-only peer of tools/bench_decode.py (issue 13 item 7): gpt-fast's int4 recipe in
torch, so that bloomery's NVFP4 decode is compared with a peer that reads as many weight bytes.

    from bloomery.tools import peer_int4
    n = peer_int4.quantize_model(model, groupsize=128)   # every decoder nn.Linear -> its int4 form, in place

Quantization (gpt-fast's `group_quantize_tensor`): per group of `groupsize` input values of a row,
scale = (max - min) / 15 and zero = min + 8 scale (both rounded to bfloat16), q = round((w - (zero -
8 scale)) / scale) clamped to [0, 15]; the weight the kernel multiplies is (q - 8) scale + zero.
The kernels are the ones torch ships: `aten._convert_weight_to_int4pack` / `_weight_int4pack_mm`
on CUDA (tinygemm: bfloat16 activations, 4.25 bits a weight with the bfloat16 scale and zero of a
group of 128), their `_for_cpu` twins elsewhere (what the tests run). The output head and the
embedding stay bfloat16, as bloomery's benchmark artifacts keep them.
"""

from __future__ import annotations


def group_quantize(w, groupsize: int = 128):
    """w float [out, in] -> (q int32 [out, in] in 0..15, scales_and_zeros bfloat16 [in / groupsize, out, 2])."""
    import torch
    out, inn = w.shape
    if inn % groupsize:
        raise ValueError(f"int4 peer: a row of {inn} values is not a whole number of groups of {groupsize}")
    g = w.float().reshape(-1, groupsize)
    mx, mn = g.amax(1, keepdim=True), g.amin(1, keepdim=True)
    scales = ((mx - mn).clamp(min=1e-6) / 15).to(torch.bfloat16)
    zeros = (mn + scales.float() * 8).to(torch.bfloat16)
    low = zeros.float() - scales.float() * 8
    q = g.sub(low).div(scales.float()).round().clamp(0, 15).to(torch.int32).reshape(out, inn)
    sz = torch.cat([scales.reshape(out, -1, 1), zeros.reshape(out, -1, 1)], 2).transpose(0, 1).contiguous()
    return q, sz


def dequantize(q, sz, groupsize: int = 128):
    """The float32 weight [out, in] the int4 kernels multiply by."""
    out, inn = q.shape
    s = sz[:, :, 0].transpose(0, 1).float().reshape(-1, 1)
    z = sz[:, :, 1].transpose(0, 1).float().reshape(-1, 1)
    return ((q.float().reshape(-1, groupsize) - 8) * s + z).reshape(out, inn)


def make(linear, groupsize: int = 128, inner_k_tiles: int = 8):
    """An nn.Module computing `linear` (no bias) with its weight quantized to int4 groups."""
    import torch

    class _Int4Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            w = linear.weight.detach()
            self.out_features, self.in_features = w.shape
            self.groupsize = groupsize
            q, sz = group_quantize(w, groupsize)
            if w.is_cuda:
                packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
                wp = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
            else:
                wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
            self.register_buffer("weight_int4", wp)
            self.register_buffer("scales_and_zeros", sz.to(w.device))

        def forward(self, x):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
            mm = torch.ops.aten._weight_int4pack_mm if x2.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
            y = mm(x2, self.weight_int4, self.groupsize, self.scales_and_zeros)
            return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    if linear.bias is not None:
        raise ValueError("int4 peer: a linear with a bias (the benchmark shapes have none)")
    return _Int4Linear()


def quantize_model(model, groupsize: int = 128, inner_k_tiles: int = 8, skip=("lm_head",)) -> int:
    """Every nn.Linear of the model whose name has no part in `skip` (and whose input width is a whole
    number of groups) replaced by its int4 form, in place; returns how many were replaced."""
    import torch
    todo = [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(s in name.split(".") for s in skip)
            and m.in_features % groupsize == 0 and m.bias is None]
    for name, m in todo:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, make(m, groupsize, inner_k_tiles))
    return len(todo)


def nbytes(model) -> int:
    """Bytes of the model's parameters and buffers (the int4 weights, their scales, the bf16 rest)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
