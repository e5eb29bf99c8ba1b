"""A checkpoint's quantization config, from whichever file carries it, and which stored
format each module is in (the one place that maps a quant_algo to a format).

The forms ModelOpt has written (modelopt/torch/export: quant_utils.get_quant_config and
convert_hf_config.convert_hf_quant_config_format):

- hf_quant_config.json, 0.x releases: {"producer": ..., "quantization": {"quant_algo",
  "kv_cache_quant_algo", "group_size", "exclude_modules" | "quantized_layers"}};
- the flat form: {"quant_method": "modelopt", "quant_algo", "kv_cache_scheme" (a dict such as
  {"num_bits": 8, "type": "float"}, or a name), "ignore", "config_groups", "quantized_layers"}:
  config.json's quantization_config, and hf_quant_config.json of later releases;
- quant_algo in either case ("fp8_pb_wo" is written lower-case); exclude_modules / ignore as
  fnmatch patterns ("lm_head", "model.layers.*.mlp.gate", "*router*", a prefix "name*"), a
  pattern also covering the modules below the one it names; MIXED_PRECISION's quantized_layers
  naming a module or a parent of modules ("model.layers.N.mlp.experts" for the experts below).
"""

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
    "W4A8_NVFP4_FP8": "nvfp4_g32",    # NVFP4 weights with an E4M3 scale per 32, FP8 activations
    "W4A8_MXFP4_FP8": "mxfp4",        # MXFP4 weights, FP8 activations (input_scale)
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


def _field(q: dict, keys: tuple[str, ...], kind: type, where: str):
    """The first of `keys` that q holds (None if none), refused by name unless of `kind`."""
    key = next((k for k in keys if q.get(k) is not None), None)
    if key is None:
        return None
    v = q[key]
    if not isinstance(v, kind) or isinstance(v, bool) or (kind is list and not all(isinstance(p, str) for p in v)):
        want = {list: "a list of module-name patterns", dict: "an object of module -> config", int: "an integer"}[kind]
        raise UnreadableJSON(f"{where}: {key!r} is {json.dumps(v)[:80]}; expected {want}. Fix or re-export the "
                             "file.")
    return v


def _modelopt(q: dict, where: str) -> QuantConfig:
    """Either ModelOpt form: the "quantization" object of hf_quant_config.json or the flat one."""
    algo = _algo(q.get("quant_algo"), where)
    layers = {}
    for module, cfg in (_field(q, ("quantized_layers",), dict, where) or {}).items():
        a = cfg.get("quant_algo") if isinstance(cfg, dict) else cfg
        layers[module] = _algo(a, f"{where} quantized_layers[{module!r}]")
    if algo == "MIXED_PRECISION" and not layers:
        raise UnknownQuantAlgo(f"{where}: quant_algo MIXED_PRECISION without quantized_layers.")
    return QuantConfig(
        source=where,
        quant_algo=algo,
        kv_cache_quant_algo=_kv_algo(next((q[k] for k in ("kv_cache_quant_algo", "kv_cache_scheme")
                                            if q.get(k) is not None), None), where),
        group_size=_field(q, ("group_size",), int, where),
        exclude=list(_field(q, ("exclude_modules", "ignore"), list, where) or []),
        quantized_layers=layers,
    )


def _is_flat(obj: dict) -> bool:
    """ModelOpt's flat form: the fields at the top, beside quant_method "modelopt" (or its producer)."""
    producer = obj.get("producer")
    return ("quant_algo" in obj or str(obj.get("quant_method", "")).lower() == "modelopt"
            or (isinstance(producer, dict) and producer.get("name") == "modelopt"))


def load(folder: Path, config: dict) -> QuantConfig:
    """The quantization config of a checkpoint folder: hf_quant_config.json first (either form),
    then config.json's quantization_config (quant_method "modelopt", or "fp8" with weight_block_size)."""
    hf = folder / "hf_quant_config.json"
    if hf.exists():
        obj = read_json(hf)
        q = obj.get("quantization", obj if _is_flat(obj) else None)
        if not isinstance(q, dict):
            raise UnreadableJSON(f"{hf}: neither a \"quantization\" object (ModelOpt 0.x) nor a flat ModelOpt config "
                                 "(quant_method \"modelopt\" with quant_algo at the top). Fix or re-export the file.")
        return _modelopt(q, str(hf))
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
        elif block in ([128, 128], [32, 32]):
            algo = f"FP8_BLOCK{block[0]}"
        else:
            raise UnknownQuantAlgo(f"{where}: fp8 weight_block_size {block} (bloomery reads [128, 128] "
                                   "and [32, 32]).")
        return QuantConfig(source=where, quant_algo=algo,
                           exclude=list(_field(qc, ("modules_to_not_convert", "ignored_layers"), list, where) or []))
    raise UnknownQuantAlgo(f"{where}: quant_method {qc.get('quant_method')!r} is not one bloomery reads "
                           "(known: modelopt, fp8).")
