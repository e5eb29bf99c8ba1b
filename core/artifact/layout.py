"""How each stored format lies in a GGUF file: a pure function of (format, logical shape,
optional parts), known before any data is read, so a GGUF header can be written first.

One artifact tensor (base name `blk.0.attn_q`) becomes one or more GGUF tensors:
the main one `{base}.weight` and side tensors `{base}.{part}` (scale, scale_2,
input_scale, pre_quant_scale). A GGML type is used where one exists and is lossless
(BF16, F16, F32, Q8_0, NVFP4 when the row length is a multiple of 64, MXFP4); formats
without one keep their stored bytes (E4M3 and E8M0 bytes as GGML I8, F32 scales as F32)
and the artifact names the format in its metadata (`bloomery.tensors`).

Canonical GGUF shapes (NumPy order, elements; `lead` = the stacked dims, e.g. [E]; `one`
= lead, or [1] when there is none):

    weight           the logical shape (GGML types) or the stored byte shape (I8)
    scale            nvfp4 (stored) [*lead, out, in/16] I8; mxfp8 [*lead, out, in/32] I8;
                     fp8_tensor one F32; fp8_channel [*lead, out] F32;
                     fp8_block128 [*lead, ceil(out/128), ceil(in/128)] F32;
                     fp8_block32 [*lead, ceil(out/32), ceil(in/32)] I8
    scale_2          one F32 (a scale shared by a stack is repeated per matrix)
    input_scale      one F32 (likewise)
    pre_quant_scale  [*lead, in] F32 (BF16/F16 widened exactly; repeated per matrix if shared)

Arrays (to_gguf's output, from_gguf's input): GGML block types (Q8_0, NVFP4, MXFP4) and
BF16 as uint8 in their byte shape (`byte_shape`), as GGUFReader returns them (to_gguf
gives BF16 as bfloat16 elements; from_gguf takes either); I8 as int8; F16/F32 as such.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GQ

from .. import formats
from ..errors import ArtifactMalformed
from ..formats import mxfp4 as mxfp4_mod
from ..formats import nvfp4 as nvfp4_mod
from ..formats.common import cdiv

LAYOUT_VERSION = 1
SIDE_PARTS = ("scale", "scale_2", "input_scale", "pre_quant_scale")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

# GGML element type -> the NumPy dtype of to_gguf's arrays (uint8: block bytes)
_NP = {GQ.F32: np.dtype(np.float32), GQ.F16: np.dtype(np.float16), GQ.BF16: BF16,
       GQ.I8: np.dtype(np.int8), GQ.Q8_0: np.dtype(np.uint8), GQ.NVFP4: np.dtype(np.uint8),
       GQ.MXFP4: np.dtype(np.uint8)}
_DENSE = {"bf16": GQ.BF16, "f16": GQ.F16, "f32": GQ.F32}
_OPTIONAL = {"nvfp4": ("input_scale", "pre_quant_scale")}   # every other quantized format: input_scale


def _where(w):
    return f"{w}: " if w else ""


def gguf_name(base: str, suffix: str) -> str:
    return f"{base}.{suffix}"


def nbytes(shape: Sequence[int], qtype: GQ) -> int:
    """Bytes of a GGUF tensor of element shape `shape` (NumPy order) and type `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n * (shape[-1] // block) * size if shape else size


def byte_shape(shape: Sequence[int], qtype: GQ) -> tuple[int, ...]:
    """The shape of to_gguf's array for a GGUF tensor: elements, or bytes for block types/BF16."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in (GQ.Q8_0, GQ.NVFP4, GQ.MXFP4):
        return (*shape[:-1], shape[-1] // block * size)
    return tuple(shape)


def layout_name(fmt_name: str, shape: Sequence[int]) -> str:
    """'ggml' when the main tensor is a GGML type of the format, else 'stored' (raw bytes)."""
    if fmt_name == "nvfp4":
        return "ggml" if shape[-1] % nvfp4_mod.GGML_BLOCK == 0 else "stored"
    return "ggml" if fmt_name in ("mxfp4", "q8_0", *_DENSE) else "stored"


def _check_request(fmt_name, shape, optional, where=""):
    held = formats.get(fmt_name).held_as
    if held is not None:
        raise ArtifactMalformed(f"{_where(where)}{fmt_name} has no artifact layout of its own: the artifact holds "
                                f"it as {held} (planning converts it)")
    allowed = () if fmt_name in _DENSE or fmt_name == "q8_0" else _OPTIONAL.get(fmt_name, ("input_scale",))
    for o in optional:
        if o not in allowed:
            raise ArtifactMalformed(f"{_where(where)}{fmt_name}: optional part {o!r} is not one of "
                                    f"this format's ({', '.join(allowed) or 'none'})")
    if len(shape) < (1 if fmt_name in _DENSE else 2) or any(int(d) <= 0 for d in shape):
        raise ArtifactMalformed(f"{_where(where)}{fmt_name}: logical shape {list(shape)} is not "
                                f"[..., out, in] with positive sizes")


def gguf_parts(fmt_name: str, shape: Sequence[int], optional: Sequence[str] = (),
               where: str = "") -> list[tuple[str, tuple[int, ...], GQ]]:
    """The GGUF tensors of one artifact tensor, in file order: (suffix, element shape, type)."""
    shape = tuple(int(d) for d in shape)
    _check_request(fmt_name, shape, optional, where)
    if fmt_name in _DENSE:
        return [("weight", shape, _DENSE[fmt_name])]
    if fmt_name == "q8_0":
        return [("weight", shape, GQ.Q8_0)]
    lead, out, inn = shape[:-2], shape[-2], shape[-1]
    one = lead or (1,)
    if fmt_name == "nvfp4":
        if layout_name(fmt_name, shape) == "ggml":
            res = [("weight", shape, GQ.NVFP4)]
        else:
            res = [("weight", (*lead, out, inn // 2), GQ.I8), ("scale", (*lead, out, inn // 16), GQ.I8)]
        res.append(("scale_2", one, GQ.F32))
    elif fmt_name == "mxfp4":
        res = [("weight", shape, GQ.MXFP4)]
    else:
        res = [("weight", shape, GQ.I8)]
        res.append({"mxfp8": ("scale", (*lead, out, inn // 32), GQ.I8),
                    "fp8_tensor": ("scale", one, GQ.F32),
                    "fp8_channel": ("scale", (*lead, out), GQ.F32),
                    "fp8_block128": ("scale", (*lead, cdiv(out, 128), cdiv(inn, 128)), GQ.F32),
                    "fp8_block32": ("scale", (*lead, cdiv(out, 32), cdiv(inn, 32)), GQ.I8)}[fmt_name])
    if "input_scale" in optional:
        res.append(("input_scale", one, GQ.F32))
    if "pre_quant_scale" in optional:
        res.append(("pre_quant_scale", (*lead, inn), GQ.F32))
    return res


# -- parts -> GGUF arrays ------------------------------------------------------------------


def _bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _per_lead(a, lead, dtype=np.float32) -> np.ndarray:
    """A scalar-per-matrix part (() / (1,) / lead) as one = lead or [1]."""
    a = np.asarray(a, dtype=dtype)
    one = lead or (1,)
    if a.size == 1:
        return np.full(one, a.reshape(()), dtype=dtype)
    return np.ascontiguousarray(a.reshape(one))


def to_gguf(fmt_name: str, parts: Mapping[str, np.ndarray], only: Sequence[str] | None = None,
            where: str = "", checked: bool = False) -> dict[str, np.ndarray]:
    """The arrays to hand GGUF, keyed by suffix, in the canonical shapes of gguf_parts
    (byte_shape for block types). `only`: compute just these suffixes. `checked`: the parts
    passed the format's check already (the writer checks each tensor's parts once)."""
    fmt = formats.get(fmt_name)
    if not checked:
        fmt.check(parts, where)
    shape = fmt.shape(parts)
    optional = tuple(k for k in ("input_scale", "pre_quant_scale") if k in parts)
    spec = gguf_parts(fmt_name, shape, optional, where)
    lead = tuple(shape[:-2])
    out = {}
    for suffix, gshape, qt in spec:
        if only is not None and suffix not in only:
            continue
        p = parts.get(suffix)
        if suffix == "weight":
            if qt == GQ.NVFP4:
                a = nvfp4_mod.ggml_blocks(p, parts["scale"])
            elif qt == GQ.MXFP4:
                a = mxfp4_mod.to_ggml(parts, where)[0]
            elif qt == GQ.I8:
                a = _bytes(p).view(np.int8)
            else:                                    # dense and Q8_0: as stored
                a = np.asarray(p)
        elif suffix in ("scale_2", "input_scale") or (suffix == "scale" and fmt_name == "fp8_tensor"):
            a = _per_lead(p, lead)
        elif suffix == "pre_quant_scale":
            a = np.asarray(p, dtype=np.float32)
            a = np.ascontiguousarray(np.broadcast_to(a.reshape(*(lead if a.ndim > 1 else ()), -1), gshape))
        elif suffix == "scale":
            a = np.asarray(p)
            a = (_bytes(a).view(np.int8) if qt == GQ.I8 else a.astype(np.float32, copy=False)).reshape(gshape)
        a = np.ascontiguousarray(a)
        want = byte_shape(gshape, qt)
        if a.shape != want or a.dtype != _NP[qt]:
            raise ArtifactMalformed(f"{_where(where)}{fmt_name}: GGUF part {suffix!r} came out "
                                    f"{a.dtype}{list(a.shape)}; expected {_NP[qt]}{list(want)}")
        out[suffix] = a
    return out


def iter_gguf(fmt_name: str, parts: Mapping[str, np.ndarray], chunk_bytes: int = 32 << 20,
              where: str = "", checked: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """to_gguf's arrays as (suffix, chunk) in file order, the main tensor in row chunks of
    about `chunk_bytes` (so a repack never holds more than a chunk's transients);
    concatenating a suffix's chunks gives to_gguf's bytes. `checked` as in to_gguf."""
    fmt = formats.get(fmt_name)
    if not checked:
        fmt.check(parts, where)
    shape = fmt.shape(parts)
    optional = tuple(k for k in ("input_scale", "pre_quant_scale") if k in parts)
    spec = gguf_parts(fmt_name, shape, optional, where)
    wq = spec[0][2]
    w = np.asarray(parts["weight"])
    if w.ndim < 2:
        rows, n = w.reshape(1, -1), 1
    else:
        n = int(np.prod(w.shape[:-1]))
        rows = w.reshape(n, w.shape[-1])
    row_bytes = max(1, rows.shape[1] * rows.dtype.itemsize)
    step = max(1, chunk_bytes // row_bytes)
    if wq == GQ.NVFP4:
        s = np.asarray(parts["scale"]).reshape(n, -1)
        for r in range(0, n, step):
            yield "weight", nvfp4_mod.ggml_blocks(rows[r:r + step], s[r:r + step]).reshape(-1)
    elif wq == GQ.MXFP4:
        s = np.asarray(parts["scale"]).reshape(n, -1)
        for r in range(0, n, step):
            sub = {"weight": rows[r:r + step], "scale": s[r:r + step]}
            yield "weight", mxfp4_mod.to_ggml(sub, where)[0].reshape(-1)
    else:
        for r in range(0, rows.shape[0], step):
            c = np.ascontiguousarray(rows[r:r + step])
            yield "weight", (c.view(np.int8) if wq == GQ.I8 else c).reshape(-1)
    side = [s for s, _, _ in spec[1:]]
    if side:
        arrs = to_gguf(fmt_name, parts, only=side, where=where, checked=True)
        for s in side:
            yield s, arrs[s].reshape(-1)


# -- GGUF arrays -> parts --------------------------------------------------------------------


def from_gguf(fmt_name: str, arrays: Mapping[str, np.ndarray], where: str = "") -> dict[str, np.ndarray]:
    """Parts of `fmt_name` from its GGUF arrays (to_gguf's, or GGUFReader's `tensor.data`):
    decode(from_gguf(to_gguf(p))) == decode(p) bit for bit. Scales come back in their
    canonical shapes (per matrix), E8M0 scales as U8, pre_quant_scale as F32."""
    fmt = formats.get(fmt_name)
    a = {k: np.asarray(v) for k, v in arrays.items()}
    missing = [k for k in ("weight",) if k not in a]
    if missing:
        raise ArtifactMalformed(f"{_where(where)}{fmt_name}: GGUF tensor '.weight' is missing")
    opt = {k: np.ascontiguousarray(a[k], dtype=np.float32) for k in ("input_scale", "pre_quant_scale") if k in a}
    w = a["weight"]
    if fmt_name in _DENSE:
        if fmt_name == "bf16" and w.dtype == np.uint8:
            w = np.ascontiguousarray(w).view(BF16)
        parts = {"weight": w}
    elif fmt_name == "q8_0":
        parts = {"weight": w.view(np.uint8) if w.dtype != np.uint8 else w}
    elif fmt_name == "nvfp4" and "scale" not in a:
        return nvfp4_mod.from_ggml(w.view(np.uint8), a["scale_2"], opt.get("input_scale"),
                                   opt.get("pre_quant_scale"), where)
    elif fmt_name == "mxfp4":
        parts = mxfp4_mod.from_ggml(w.view(np.uint8), where)
    else:
        if "scale" not in a:
            raise ArtifactMalformed(f"{_where(where)}{fmt_name}: GGUF tensor '.scale' is missing")
        s = a["scale"]
        if fmt_name == "nvfp4":
            parts = {"weight": w.view(np.uint8), "scale": s.view(E4M3), "scale_2": a["scale_2"]}
        elif fmt_name in ("mxfp8", "fp8_block32"):
            parts = {"weight": w.view(E4M3), "scale": s.view(np.uint8)}
        else:
            parts = {"weight": w.view(E4M3), "scale": s}
    parts.update(opt)
    fmt.check(parts, where)
    return parts


# -- sub-tensors (spot checks) ----------------------------------------------------------------


def take_lead(parts: Mapping[str, np.ndarray], lead: Sequence[int], index: int) -> dict:
    """Matrix `index` (flat over the stacked dims) of stacked parts, keeping one lead dim of
    size 1: parts that hold one value per matrix are sliced, shared ones kept. Works on stored
    and canonical parts alike (and on GGUF arrays keyed by suffix)."""
    lead = tuple(lead)
    if not lead:
        return dict(parts)
    idx = np.unravel_index(index, lead)
    res = {}
    for k, v in parts.items():
        v = np.asarray(v)
        per = v.shape[:len(lead)] == lead and (k != "pre_quant_scale" or v.ndim == len(lead) + 1)
        if per:
            v = v[idx][None]
        res[k] = v
    return res


def rows_of_gguf(fmt_name: str, shape: Sequence[int], arrays: Mapping[str, np.ndarray],
                 r0: int, r1: int) -> dict:
    """Rows [r0, r1) of a single matrix's GGUF arrays (shape [out, in] or [1, out, in], as
    take_lead leaves them). r0, r1 on the format's row cut unit (or r1 == out)."""
    out = shape[-2]
    res = {}
    for k, v in arrays.items():
        v = np.asarray(v)
        if k == "weight" and fmt_name in _DENSE and len(shape) == 1:
            res[k] = v
        elif k == "weight" or (k == "scale" and fmt_name in ("nvfp4", "mxfp8", "fp8_channel")):
            idx = [slice(None)] * v.ndim
            idx[v.ndim - (1 if (k == "scale" and fmt_name == "fp8_channel") else 2)] = slice(r0, r1)
            res[k] = v[tuple(idx)]
        elif k == "scale" and fmt_name in ("fp8_block128", "fp8_block32"):
            b = 128 if fmt_name == "fp8_block128" else 32
            res[k] = v[..., r0 // b:cdiv(min(r1, out), b), :]
        else:
            res[k] = v
    return res
