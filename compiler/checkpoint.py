"""A Hugging Face checkpoint folder as ModelOpt exports it: config, quantization config,
shards (headers only), and each weight grouped with its scales into one quantized tensor
whose format comes from the config and is checked against what is stored."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bloomery.compiler import quant_config
from bloomery.compiler.shard import Shard, StoredTensor
from bloomery.core import formats
from bloomery.core.errors import (
    CheckpointError,
    DuplicateTensor,
    IndexOutsideFolder,
    MissingScale,
    MissingShard,
    NegativeScale,
    NonFiniteScale,
    NoWeights,
    ScaleShapeMismatch,
    TensorNotInShard,
    UnexpectedScale,
    UnreadableJSON,
)

# Stored name suffix -> canonical part name (core/formats/base.py).
SCALE_PARTS = {
    "weight_scale": "scale",
    "weight_scale_inv": "scale",
    "weight_scale_2": "scale_2",
    "input_scale": "input_scale",
    "pre_quant_scale": "pre_quant_scale",
}
KV_SCALES = ("k_scale", "v_scale")
PLAIN_FORMATS = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
QUANTIZED_STORAGE = {"U8", "F8_E4M3", "F8_E5M2", "I8"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class QuantTensor:
    """A weight with its scales: one value tensor of one stored format."""

    name: str                                   # HF name of the weight tensor
    format: formats.Format
    sources: dict[str, StoredTensor]            # canonical part -> stored tensor

    @property
    def parts(self) -> dict[str, np.ndarray]:
        return {k: t.array() for k, t in self.sources.items()}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.format.shape(self.parts))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.sources.values())

    @property
    def scales(self) -> list[str]:
        return [t.name for k, t in self.sources.items() if k != "weight"]

    def where(self) -> str:
        return f"{self.sources['weight'].shard.path}: tensor {self.name!r}"

    def decode(self) -> np.ndarray:
        return self.format.decode(self.parts)


@dataclass
class Checkpoint:
    folder: Path
    config: dict
    quant: quant_config.QuantConfig
    shards: dict[str, Shard]
    tensors: dict[str, QuantTensor]
    kv_scales: dict[str, StoredTensor] = field(default_factory=dict)
    integers: dict[str, StoredTensor] = field(default_factory=dict)   # I64 / I32 / ... tensors (not weights)
    unread: dict[str, StoredTensor] = field(default_factory=dict)     # a dtype no format reads (F64, ...)

    @classmethod
    def open(cls, folder) -> "Checkpoint":
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: not a folder. Give the checkpoint folder (with config.json and "
                                  "*.safetensors).")
        cfg_path = folder / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{folder}: no config.json; this is not a Hugging Face checkpoint folder.")
        config = quant_config.read_json(cfg_path)
        quant = quant_config.load(folder, config)
        shards, stored = _open_shards(folder)
        tensors, kv, ints, unread = _group(stored, quant)
        if quant.kv_cache_quant_algo and not kv:
            raise MissingScale(f"{quant.source}: kv_cache_quant_algo {quant.kv_cache_quant_algo} but no "
                               "k_scale/v_scale tensor is stored.")
        return cls(folder, config, quant, shards, tensors, kv, ints, unread)

    def totals(self) -> dict[str, dict[str, int]]:
        """Per format: tensor count, elements and bytes (scales folded into their weight)."""
        out: dict[str, dict[str, int]] = {}
        for t in self.tensors.values():
            row = out.setdefault(t.format.name, {"tensors": 0, "elements": 0, "bytes": 0})
            row["tensors"] += 1
            row["elements"] += int(np.prod(t.shape))
            row["bytes"] += t.nbytes
        return out


def _open_shards(folder: Path) -> tuple[dict[str, Shard], dict[str, StoredTensor]]:
    root = folder.resolve()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        obj = quant_config.read_json(index)
        weight_map = obj.get("weight_map")
        if not isinstance(weight_map, dict):
            raise UnreadableJSON(f"{index}: no \"weight_map\" object.")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise UnreadableJSON(f"{index}: weight_map[{bad[0]!r}] is {bad[1]!r}; expected a shard file name.")
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
            hint = (f" It holds only pickle files ({', '.join(pickles)}); bloomery never unpickles. Convert "
                    "them to safetensors first." if pickles else "")
            raise NoWeights(f"{folder}: no *.safetensors weights.{hint}")
    shards: dict[str, Shard] = {}
    for fname in files:
        path = (folder / str(fname))
        if os.path.isabs(str(fname)) or root not in path.resolve().parents:
            raise IndexOutsideFolder(f"{index}: shard {fname!r} lies outside the checkpoint folder; refusing "
                                     "to read it.")
        if not path.is_file():
            raise MissingShard(f"{index}: names shard {fname!r}, which is not in {folder}.")
        shards[fname] = Shard(path)
    stored: dict[str, StoredTensor] = {}
    if weight_map is not None:
        for name, fname in weight_map.items():
            t = shards[fname].tensors.get(name)
            if t is None:
                raise TensorNotInShard(f"{index}: tensor {name!r} is listed in shard {fname!r}, which does not "
                                       "hold it. The index and shards are from different exports.")
            stored[name] = t
    else:
        for shard in shards.values():
            for name, t in shard.tensors.items():
                if name in stored:
                    raise DuplicateTensor(f"{folder}: tensor {name!r} is in both {stored[name].shard.path.name} "
                                          f"and {shard.path.name}.")
                stored[name] = t
    return shards, stored


def _check_kv_scale(t: StoredTensor) -> None:
    if t.dtype not in ("F32", "BF16", "F16") or int(np.prod(t.shape)) != 1:
        raise ScaleShapeMismatch(f"{t.shard.path}: KV cache scale {t.name!r} is {t.dtype} {list(t.shape)}; "
                                 "expected one F32 value.")
    v = float(np.asarray(t.array(), dtype=np.float32).reshape(-1)[0])
    if not np.isfinite(v):
        raise NonFiniteScale(f"{t.shard.path}: KV cache scale {t.name!r} is {v}.")
    if v < 0:
        raise NegativeScale(f"{t.shard.path}: KV cache scale {t.name!r} is {v} (must be >= 0).")


def _group(stored: dict[str, StoredTensor], quant):
    """(QuantTensors by weight name, KV-cache scales, integer tensors, unread tensors): the integer
    tensors (qwen4_exp's n-gram hash buffers) are not weights, nor are the tensors of a dtype no
    format reads (F64, ...); the spec says what each one is."""
    weights: dict[str, StoredTensor] = {}
    scales: dict[str, dict[str, StoredTensor]] = {}
    kv: dict[str, StoredTensor] = {}
    plain: list[StoredTensor] = []
    for name, t in stored.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight":
            weights[module] = t
        elif suffix in SCALE_PARTS:
            scales.setdefault(module, {})[suffix] = t
        elif suffix in KV_SCALES:
            _check_kv_scale(t)
            kv[name] = t
        else:
            plain.append(t)
    if kv and not quant.kv_cache_quant_algo:
        t = next(iter(kv.values()))
        raise UnexpectedScale(f"{t.shard.path}: KV cache scale {t.name!r} is stored, but the quantization config "
                              f"({quant.source}) sets no kv_cache_quant_algo.")
    for module, found in scales.items():
        if module not in weights:
            t = next(iter(found.values()))
            raise UnexpectedScale(f"{t.shard.path}: scale {t.name!r} belongs to no weight ({module}.weight is "
                                  "not stored).")

    out: dict[str, QuantTensor] = {}
    unread: dict[str, StoredTensor] = {}
    for module, w in weights.items():
        found = scales.get(module, {})
        fmt_name = quant.format_for(module)
        where = f"{w.shard.path}: tensor {w.name!r}"
        if fmt_name is None or (not found and w.dtype in PLAIN_FORMATS and quant.layer_entry(module) is None):
            # Not quantized by the config (or a non-Linear weight such as a norm or an embedding).
            if found:
                why = (f"excluded by pattern {quant.excluded_by(module)!r}" if quant.excluded_by(module)
                       else "not quantized by the config")
                raise UnexpectedScale(f"{where}: has {', '.join(sorted(found))} but is {why} "
                                      f"({quant.source}).")
            if w.dtype not in PLAIN_FORMATS:
                if w.dtype in QUANTIZED_STORAGE:
                    raise MissingScale(f"{where}: stored as {w.dtype} but the quantization config "
                                       f"({quant.source}) does not quantize it, and no scale is stored.")
                unread[w.name] = w
                continue
            out[w.name] = QuantTensor(w.name, formats.get(PLAIN_FORMATS[w.dtype]), {"weight": w})
            continue
        if not found:
            raise MissingScale(f"{where}: the config ({quant.source}) stores it as {quant.algo_for(module)} "
                               f"({fmt_name}), but no weight_scale is stored beside it.")
        if "weight_scale_inv" in found and fmt_name != "fp8_block128":
            raise UnexpectedScale(f"{where}: weight_scale_inv is a DeepSeek-style FP8 block scale, but the "
                                  f"format is {fmt_name}.")
        if "weight_scale_inv" in found and "weight_scale" in found:
            raise UnexpectedScale(f"{where}: both weight_scale and weight_scale_inv are stored.")
        fmt = formats.get(fmt_name)
        sources = {"weight": w, **{SCALE_PARTS[s]: t for s, t in found.items()}}
        qt = QuantTensor(w.name, fmt, sources)
        fmt.check(qt.parts, where)
        out[w.name] = qt
    ints: dict[str, StoredTensor] = {}
    for t in plain:
        if t.dtype in INTEGER_DTYPES:
            ints[t.name] = t
        elif t.dtype not in PLAIN_FORMATS:
            unread[t.name] = t
        else:
            out[t.name] = QuantTensor(t.name, formats.get(PLAIN_FORMATS[t.dtype]), {"weight": t})
    return out, kv, ints, unread
