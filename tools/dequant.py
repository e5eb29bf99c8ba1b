"""The oracle's own dequantization of a ModelOpt checkpoint folder, independent of bloomery.

    from bloomery.tools import dequant
    w = dequant.folder_weights(folder)          # HF name -> float32 torch tensor, scales applied
    dequant.plan(folder)                        # HF name -> the rule it was decoded by (for tests)

Written from the formats' published definitions, in torch, and importing nothing from
bloomery's formats, compiler or runtime, so that a decoder or scale-layout defect there shows
up against it (tools/oracle.py builds its model from these values; docs/gates.md):

- NVFP4 (ModelOpt NVFP4QTensor; also W4A16_NVFP4, NVFP4_AWQ, W4A8_NVFP4_FP8): `weight` U8
  [.., out, in/2], two E2M1 codes a byte, the even element in the low nibble; E2M1 is the OCP
  MX v1.0 FP4 element (sign, 2 exponent bits with bias 1, 1 mantissa bit: magnitudes 0, 0.5, 1,
  1.5, 2, 3, 4, 6); `weight_scale` F8_E4M3 [.., out, in/B], one per B consecutive elements of a
  row (B = 16; 32 for W4A8_NVFP4_FP8, read off the shapes); `weight_scale_2` F32, the global
  scale (scalar, or one per stacked expert).
  value = e2m1 * e4m3(scale) * scale_2, the exact product rounded once to float32.
- MXFP8 / MXFP4 (OCP MX v1.0): E4M3 or E2M1 elements, `weight_scale` U8 E8M0 [.., out, in/32]:
  2^(e - 127), e = 255 is NaN. value = element * 2^(e-127), rounded once.
- FP8 (E4M3, OCP OFP8 with the FN encoding: no infinities, S.1111.111 is NaN) with an F32
  `weight_scale`: a scalar (per tensor), [out] or [out, 1] (per channel), or a 2-D block
  grid [ceil(out/b), ceil(in/b)] (ModelOpt fp8_pb_wo may store it 4-D [ob, 1, ib, 1]; DeepSeek's
  `weight_scale_inv` is a multiplier too, despite its name); b from config.json's
  `quantization_config.weight_block_size`, else 128. A U8 scale grid [ceil(out/32),
  ceil(in/32)] over an FP8 weight is an E8M0 scale per 32x32 block.
- NVFP4_AWQ's `pre_quant_scale` [in] multiplies the activation entering the linear; folded
  here: W_eff = W * pre_quant_scale[None, :] (one more rounding, float32).
- BF16 / F16 / F32 tensors as they are. input_scale and the FP8 KV-cache scales (k_scale,
  v_scale) are activation scales, not weights: read past.

The format is read off what is stored (dtypes and shapes), not off the quant config: a config
that names one format while the tensors hold another is exactly what bloomery's reader refuses,
and this module must not share that reading. Element values come from torch's own float8 type
(torch.float8_e4m3fn) and the E2M1 table below; products are taken in float64 (exact: at most
3 + 4 + 24 significant bits) and rounded once to float32, the correctly rounded value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

# OCP MX v1.0, FP4 E2M1: codes 0..7 positive, 8..15 the same magnitudes negated (code 8 is -0).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
AUX = ("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale", "pre_quant_scale")
KV_SCALES = ("k_scale", "v_scale")
DEFAULT_FP8_BLOCK = 128


class DequantError(RuntimeError):
    pass


def _f64_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(E2M1, dtype=torch.float64)[codes.long()]


def unpack_e2m1(w: torch.Tensor) -> torch.Tensor:
    """U8 [.., n] -> E2M1 values float64 [.., 2n]: element 2i from the low nibble of byte i."""
    lo, hi = w & 0x0F, w >> 4
    return _f64_e2m1(torch.stack([lo, hi], dim=-1).reshape(*w.shape[:-1], w.shape[-1] * 2))


def e8m0(s: torch.Tensor) -> torch.Tensor:
    """U8 E8M0 -> float64 2^(e-127); 255 is NaN."""
    e = s.to(torch.int32)
    v = torch.pow(torch.tensor(2.0, dtype=torch.float64), (e - 127).to(torch.float64))
    return torch.where(e == 255, torch.tensor(float("nan"), dtype=torch.float64), v)


def e4m3(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float8_e4m3fn:
        raise DequantError(f"expected float8_e4m3fn, got {t.dtype}")
    return t.to(torch.float64)


def expand(s: torch.Tensor, out: int, inn: int, bo: int, bi: int) -> torch.Tensor:
    """A scale grid [.., ceil(out/bo), ceil(in/bi)] -> [.., out, in], one value per block."""
    return s.repeat_interleave(bo, dim=-2)[..., :out, :].repeat_interleave(bi, dim=-1)[..., :inn]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round(v64: torch.Tensor) -> torch.Tensor:
    return v64.to(torch.float32)


def _lead_scalar(s: torch.Tensor, lead: tuple) -> torch.Tensor:
    """A global scale: a scalar, or one per leading (stacked expert) index -> broadcastable."""
    if s.numel() == 1:
        return s.reshape(())
    if tuple(s.shape) == lead or tuple(s.shape) == lead + (1,) or tuple(s.shape) == lead + (1, 1):
        return s.reshape(*lead, 1, 1)
    raise DequantError(f"global scale of shape {list(s.shape)} for a weight with leading dims {list(lead)}")


def decode(name: str, parts: dict[str, torch.Tensor], block: int = DEFAULT_FP8_BLOCK) -> tuple[torch.Tensor, str]:
    """One module's weight from its stored parts (keys: weight, and any of AUX) -> (float32 value, rule)."""
    w = parts["weight"]
    sc = parts.get("weight_scale", parts.get("weight_scale_inv"))
    s2 = parts.get("weight_scale_2")
    where = f"{name}: "
    if w.dtype == torch.uint8:                                  # packed E2M1
        if sc is None:
            raise DequantError(f"{where}U8 (packed FP4) weight without a weight_scale")
        v = unpack_e2m1(w)
        out, inn = v.shape[-2], v.shape[-1]
        if sc.shape[-2] != out or inn % sc.shape[-1]:
            raise DequantError(f"{where}FP4 weight {list(v.shape)} with a scale of shape {list(sc.shape)}")
        b = inn // sc.shape[-1]
        if sc.dtype == torch.float8_e4m3fn:                     # NVFP4
            if s2 is None:
                raise DequantError(f"{where}NVFP4 weight without weight_scale_2")
            g = _lead_scalar(s2.to(torch.float64), tuple(v.shape[:-2]))
            val = v * expand(e4m3(sc), out, inn, 1, b) * g
            rule = f"nvfp4/{b}"
        elif sc.dtype == torch.uint8:                           # MXFP4
            val = v * expand(e8m0(sc), out, inn, 1, b)
            rule = f"mxfp4/{b}"
        else:
            raise DequantError(f"{where}FP4 weight with a {sc.dtype} scale")
    elif w.dtype == torch.float8_e4m3fn:
        if sc is None:
            raise DequantError(f"{where}FP8 weight without a weight_scale")
        v = e4m3(w)
        out, inn = v.shape[-2], v.shape[-1]
        lead = tuple(v.shape[:-2])
        if sc.dtype == torch.uint8:                             # E8M0: MXFP8 rows, or 32x32 blocks
            if sc.shape[-2] == out and sc.shape[-1] == _cdiv(inn, 32):
                val, rule = v * expand(e8m0(sc), out, inn, 1, 32), "mxfp8/32"
            elif sc.shape[-2] == _cdiv(out, 32) and sc.shape[-1] == _cdiv(inn, 32):
                val, rule = v * expand(e8m0(sc), out, inn, 32, 32), "fp8_e8m0/32x32"
            else:
                raise DequantError(f"{where}FP8 weight {list(v.shape)} with an E8M0 scale {list(sc.shape)}")
        elif sc.dtype == torch.float32:
            s = sc.to(torch.float64)
            if s.ndim == len(lead) + 4 and s.shape[-1] == 1 and s.shape[-3] == 1:    # ModelOpt [ob, 1, ib, 1]
                s = s.reshape(*s.shape[:-4], s.shape[-4], s.shape[-2])
            if s.numel() == 1 or tuple(s.shape) == lead:
                val, rule = v * _lead_scalar(s, lead), "fp8/tensor"
            elif tuple(s.shape) in (lead + (out,), lead + (out, 1)):
                val, rule = v * s.reshape(*lead, out, 1), "fp8/channel"
            elif tuple(s.shape) == lead + (_cdiv(out, block), _cdiv(inn, block)):
                val, rule = v * expand(s, out, inn, block, block), f"fp8/block{block}"
            else:
                raise DequantError(f"{where}FP8 weight {list(v.shape)} with an F32 scale of shape "
                                   f"{list(sc.shape)} (block size {block})")
        else:
            raise DequantError(f"{where}FP8 weight with a {sc.dtype} scale")
    elif w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if sc is not None:
            raise DequantError(f"{where}a {w.dtype} weight with a weight_scale")
        return w.to(torch.float32), str(w.dtype).replace("torch.", "")
    else:
        raise DequantError(f"{where}weight of dtype {w.dtype}")
    out32 = _round(val)
    pqs = parts.get("pre_quant_scale")
    if pqs is not None:
        if pqs.shape[-1] != out32.shape[-1]:
            raise DequantError(f"{where}pre_quant_scale {list(pqs.shape)} for a weight {list(out32.shape)}")
        out32 = out32 * pqs.to(torch.float32).unsqueeze(-2)
        rule += "+pre_quant_scale"
    return out32, rule


# --------------------------------------------------------------------------- folders


def _shards(folder: Path) -> list[Path]:
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise DequantError(f"{folder}: no .safetensors files")
    return shards


def fp8_block(folder: Path) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    bs = (cfg.get("quantization_config") or {}).get("weight_block_size")
    if bs:
        if len(set(bs)) != 1:
            raise DequantError(f"{folder}: weight_block_size {bs}: only square blocks are read")
        return int(bs[0])
    return DEFAULT_FP8_BLOCK


def _stored(folder: Path) -> dict[str, tuple[Path, str]]:
    from safetensors import safe_open

    where: dict[str, tuple[Path, str]] = {}
    for p in _shards(folder):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                if k in where:
                    raise DequantError(f"{folder}: tensor {k!r} stored twice ({where[k][0].name}, {p.name})")
                where[k] = (p, k)
    return where


def groups(names) -> tuple[dict[str, dict[str, str]], list[str]]:
    """module prefix -> {part: stored name} for every `<prefix>.weight`; and the plain tensors."""
    names = set(names)
    mods: dict[str, dict[str, str]] = {}
    for n in names:
        if n.endswith(".weight"):
            pre = n[: -len(".weight")]
            mods[pre] = {"weight": n}
            for a in AUX:
                if f"{pre}.{a}" in names:
                    mods[pre][a] = f"{pre}.{a}"
    claimed = {v for m in mods.values() for v in m.values()}
    rest = []
    for n in sorted(names - claimed):
        leaf = n.rsplit(".", 1)[-1]
        if leaf in KV_SCALES or leaf == "input_scale":
            continue
        if leaf in AUX:
            raise DequantError(f"tensor {n!r} is a {leaf} with no {n.rsplit('.', 1)[0]}.weight beside it")
        rest.append(n)
    return mods, rest


def iter_weights(folder) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(HF weight name, float32 value, rule) for every tensor a model holds."""
    from safetensors import safe_open

    folder = Path(folder)
    where = _stored(folder)
    block = fp8_block(folder)
    mods, rest = groups(where)
    handles: dict[Path, object] = {}

    def get(n):
        p, k = where[n]
        if p not in handles:
            handles[p] = safe_open(str(p), framework="pt")
        return handles[p].get_tensor(k)

    for pre in sorted(mods):
        parts = {part: get(n) for part, n in mods[pre].items()}
        v, rule = decode(pre + ".weight", parts, block)
        yield pre + ".weight", v, rule
    for n in rest:
        t = get(n)
        if not t.is_floating_point():
            yield n, t, str(t.dtype).replace("torch.", "")
        else:
            yield n, t.to(torch.float32), str(t.dtype).replace("torch.", "")


def folder_weights(folder) -> dict[str, torch.Tensor]:
    return {n: v for n, v, _ in iter_weights(folder)}


def plan(folder) -> dict[str, str]:
    """HF name -> the rule (format/block) each weight was decoded by."""
    return {n: r for n, _, r in iter_weights(folder)}
