"""A checkpoint's quantization config, from whichever file carries it, and which stored
format each module is in (the one place that maps a quant_algo to a format)."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

from bloomery.core.errors import UnknownQuantAlgo, UnreadableJSON

# quant_algo (as ModelOpt writes it, upper-cased) -> stored format name.
ALGO_FORMATS: dict[str, str] = {
    "NVFP4": "nvfp4",
    "NVFP4_AWQ": "nvfp4",
    "W4A16_NVFP4": "nvfp4",
    "MXFP8": "mxfp8",
    "MXFP4": "mxfp4",
    "FP8": "fp8_tensor",
    "FP8_PER_CHANNEL_PER_TOKEN": "fp8_channel",
    "FP8_PC_PT": "fp8_channel",
    "FP8_PB_WO": "fp8_block128",
    "FP8_BLOCK128": "fp8_block128",   # quant_method "fp8", weight_block_size [128, 128]
    "FP8_BLOCK32": "fp8_block32",     # quant_method "fp8", weight_block_size [32, 32] (E8M0 scales)
}
KV_ALGOS = {"FP8"}


def read_json(path: Path) -> dict:
    """A JSON object from a file of the folder, or UnreadableJSON naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UnreadableJSON(f"{path}: cannot be read as JSON ({e}). Fix or re-export the file.") from None
    if not isinstance(obj, dict):
        raise UnreadableJSON(f"{path}: expected a JSON object, found {type(obj).__name__}.")
    return obj


@dataclass
class QuantConfig:
    source: str = "none"                      # the file (and key) it came from
    quant_algo: str | None = None             # upper-cased; None: nothing quantized
    kv_cache_quant_algo: str | None = None
    group_size: int | None = None
    exclude: list[str] = field(default_factory=list)                 # prefix-wildcard module patterns
    quantized_layers: dict[str, str] = field(default_factory=dict)   # MIXED_PRECISION: module -> algo

    def algo_for(self, module: str) -> str | None:
        """The quant_algo a module's weight is stored in, per the config (None: not quantized)."""
        if self.quant_algo == "MIXED_PRECISION":
            return self.quantized_layers.get(self.layer_entry(module))
        if self.quant_algo is None or self.excluded_by(module):
            return None
        return self.quant_algo

    def layer_entry(self, module: str) -> str | None:
        """The quantized_layers entry covering a module: its own, else the nearest parent's
        (ModelOpt writes one entry `model.layers.N.mlp.experts` for the per-expert weights
        below it)."""
        parts = module.split(".")
        for i in range(len(parts), 0, -1):
            name = ".".join(parts[:i])
            if name in self.quantized_layers:
                return name
        return None

    def excluded_by(self, module: str) -> str | None:
        """The exclude pattern that matches a module, if any."""
        for pat in self.exclude:
            if fnmatch.fnmatchcase(module, pat) or module.startswith(pat + "."):
                return pat
        return None

    def format_for(self, module: str) -> str | None:
        algo = self.algo_for(module)
        return None if algo is None else ALGO_FORMATS[algo]


def _algo(value, where: str) -> str | None:
    if value is None:
        return None
    algo = str(value).upper()
    if algo != "MIXED_PRECISION" and algo not in ALGO_FORMATS:
        raise UnknownQuantAlgo(f"{where}: quant_algo {value!r} is not one bloomery reads. Known: "
                               f"{', '.join(sorted(ALGO_FORMATS))}, MIXED_PRECISION.")
    return algo


def _kv_algo(value, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # config.json form: {"dynamic": false, "num_bits": 8, "type": "float"}
        value = "FP8" if (value.get("num_bits"), value.get("type")) == (8, "float") else repr(value)
    algo = str(value).upper()
    if algo not in KV_ALGOS:
        raise UnknownQuantAlgo(f"{where}: kv_cache_quant_algo {value!r} is not one bloomery reads "
                               f"(known: {', '.join(sorted(KV_ALGOS))}).")
    return algo


def _modelopt(q: dict, where: str) -> QuantConfig:
    algo = _algo(q.get("quant_algo"), where)
    layers = {}
    for module, cfg in (q.get("quantized_layers") or {}).items():
        a = cfg.get("quant_algo") if isinstance(cfg, dict) else cfg
        layers[module] = _algo(a, f"{where} quantized_layers[{module!r}]")
    if algo == "MIXED_PRECISION" and not layers:
        raise UnknownQuantAlgo(f"{where}: quant_algo MIXED_PRECISION without quantized_layers.")
    return QuantConfig(
        source=where,
        quant_algo=algo,
        kv_cache_quant_algo=_kv_algo(q.get("kv_cache_quant_algo", q.get("kv_cache_scheme")), where),
        group_size=q.get("group_size"),
        exclude=list(q.get("exclude_modules") or q.get("ignore") or []),
        quantized_layers=layers,
    )


def load(folder: Path, config: dict) -> QuantConfig:
    """The quantization config of a checkpoint folder: hf_quant_config.json first, then
    config.json's quantization_config (quant_method "modelopt", or "fp8" with weight_block_size)."""
    hf = folder / "hf_quant_config.json"
    if hf.exists():
        obj = read_json(hf)
        if not isinstance(obj.get("quantization"), dict):
            raise UnreadableJSON(f"{hf}: no \"quantization\" object.")
        return _modelopt(obj["quantization"], str(hf))
    qc = config.get("quantization_config")
    if qc is None:
        return QuantConfig()
    where = f"{folder / 'config.json'} quantization_config"
    if not isinstance(qc, dict):
        raise UnreadableJSON(f"{where}: expected an object.")
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt(qc, where)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            algo = "FP8"
        elif list(block) in ([128, 128], [32, 32]):
            algo = f"FP8_BLOCK{block[0]}"
        else:
            raise UnknownQuantAlgo(f"{where}: fp8 weight_block_size {block} (bloomery reads [128, 128] "
                                   "and [32, 32]).")
        return QuantConfig(source=where, quant_algo=algo,
                           exclude=list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []))
    raise UnknownQuantAlgo(f"{where}: quant_method {qc.get('quant_method')!r} is not one bloomery reads "
                           "(known: modelopt, fp8).")
