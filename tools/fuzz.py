"""A seeded fuzzer over every reader bloomery has: a checkpoint folder's safetensors shards
(bytes, header length, the header's dtypes, shapes and offsets), its JSON files (config.json,
hf_quant_config.json, the index, the tokenizer and generation configs), and an artifact's GGUF
shards (header, metadata, tensor infos, data), SHA256SUMS and DIGESTS.json, mutated from the
real files of the test models, each case run through the command line as a user runs it.

    python -m bloomery.tools.fuzz --minutes 10 --seed 1          # the long run (docs/fuzz.md)
    python -m bloomery.tools.fuzz --cases 40 --seed 0            # a short seeded subset (tests/test_fuzz.py)
    python -m bloomery.tools.fuzz --seed 1 --case 137 --keep /tmp/c   # one case again, its folder kept

Each case copies a seed (tiny-llama/* of `make models`, smollm2-135m/nvfp4 where built, or an
artifact prepared from one of them) into a temporary folder, applies one mutation and runs the
stages: a checkpoint folder `bloomery inspect`, `prepare` and (when prepare succeeded) `logits` and
`run`; an artifact `inspect`, `verify`, `logits`, `logits --verify` and `run`. A stage passes when it exits 0,
or non-zero with a named refusal (`error: <a BloomeryError>: ...`), with no traceback, within
--timeout seconds; a failed prepare leaves nothing where its output would be. An artifact whose
bytes changed behind SHA256SUMS' back (not `sealed`) must also be refused by `verify`, and by
`logits --verify` where the change lies in a header or a tensor: it is never run silently. A
sealed case rewrites SHA256SUMS to match and drops DIGESTS.json (an artifact of an older
bloomery), so that the GGUF parser itself meets the damage.

Stages run in children forked from this process, which has imported the command line already:
stdout and stderr go to files, the address space is capped (--memory), and a child past the
timeout is killed and counted as a hang. Case i of seed s draws everything from
numpy.random.default_rng([s, i]), so `--seed s --case i` reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CKPT_SEEDS = ["tiny-llama/nvfp4", "tiny-llama/fp8", "tiny-llama/bf16", "tiny-llama/mxfp8", "tiny-llama/nvfp4_awq",
              "tiny-llama/fp8_channel", "tiny-llama/fp8_pb_wo", "tiny-llama/mxfp4", "tiny-llama/mixed_nvfp4_fp8",
              "tiny-llama/nvfp4_fp8kv", "tiny-llama/nvfp4_w4a16", "tiny-llama/w4a8_nvfp4_fp8",
              "smollm2-135m/nvfp4"]
ART_SEEDS = ["tiny-llama/nvfp4", "tiny-llama/fp8", "tiny-llama/bf16", "tiny-llama/mxfp8", "smollm2-135m/nvfp4"]
LARGE = {"smollm2-135m/nvfp4"}          # drawn 1 case in 10
IDS = [1, 2, 3, 4, 5]
JSON_FILES = ["config.json", "hf_quant_config.json", "model.safetensors.index.json", "generation_config.json",
              "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"]
RUN = ["-p", "hi", "-n", "2"]
DTYPES = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "I64", "I32", "I16", "I8", "U64", "U32",
          "U16", "U8", "BOOL", "F4", "F6_E2M3", "C64", "X", "", 5, None]
VALUES = [None, True, False, 0, 1, -1, 2, 3, 7, 1000003, 2**31, 2**63, -2**63, 1e308, 0.5, -0.0, float("nan"),
          float("inf"), "x", "", "NVFP4", "nvfp4", "FP8", "MIXED_PRECISION", "*", [], [1], ["x"], ["*"], {}, {"a": 1}]


# -- files ---------------------------------------------------------------------------------------------

def _replace(path: Path, data: bytes) -> None:
    """Writes a new file (never into the seed's bytes: case folders hold hard links of them)."""
    if path.exists():
        path.unlink()
    path.write_bytes(data)


def _clone(src: Path, dst: Path) -> None:
    """A case's copy of a seed folder: hard links where the filesystem allows, else copies."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith("."):
            try:
                os.link(p, dst / p.name)
            except OSError:
                shutil.copyfile(p, dst / p.name)


def _any(rng, seq):
    """One element of a sequence, drawn from rng."""
    return seq[int(rng.integers(0, len(seq)))]


def _flip(data: bytearray, lo: int, hi: int, rng) -> int:
    """Flips one bit of data[lo:hi]; returns the byte's offset."""
    i = int(rng.integers(lo, hi))
    data[i] ^= 1 << int(rng.integers(0, 8))
    return i


# -- safetensors -----------------------------------------------------------------------------------------

def _st_split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _st_join(header, data: bytes) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def reshard(folder: Path) -> None:
    """model.safetensors -> two shards and model.safetensors.index.json (so that the index is fuzzed too)."""
    src = folder / "model.safetensors"
    header, data = _st_split(src.read_bytes())
    meta = header.pop("__metadata__", None)
    names = sorted(header)
    weight_map, files = {}, {}
    for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        h, chunks, pos = {}, [], 0
        for n in part:
            b, e = header[n]["data_offsets"]
            h[n] = {**header[n], "data_offsets": [pos, pos + e - b]}
            chunks.append(data[b:e])
            pos += e - b
            weight_map[n] = fname
        if meta is not None:
            h["__metadata__"] = meta
        files[fname] = _st_join(h, b"".join(chunks))
    src.unlink()
    for fname, raw in files.items():
        (folder / fname).write_bytes(raw)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": len(data)}, "weight_map": weight_map}, indent=2))


def mutate_st_bytes(path: Path, rng) -> str:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    kind = rng.choice(["flip_header", "flip_data", "truncate", "header_len", "append"])
    if kind == "flip_header":
        i = _flip(raw, 8, 8 + n, rng)
        _replace(path, bytes(raw))
        return f"{path.name}: bit flip in the header at byte {i}"
    if kind == "flip_data" and len(raw) > 8 + n:
        i = _flip(raw, 8 + n, len(raw), rng)
        _replace(path, bytes(raw))
        return f"{path.name}: bit flip in the data at byte {i}"
    if kind == "truncate" or kind == "flip_data":
        k = int(rng.choice([int(rng.integers(0, 9)), int(rng.integers(8, 8 + n)), int(rng.integers(8 + n, len(raw)))]))
        _replace(path, bytes(raw[:k]))
        return f"{path.name}: truncated to {k} bytes (of {len(raw)})"
    if kind == "header_len":
        v = int(rng.choice([0, 1, n - 1, n + 1, n - 8, n + 8, len(raw) - 8, len(raw) - 7, 2**63, 2**64 - 1,
                            int(rng.integers(0, 2**40))]))
        raw[:8] = struct.pack("<Q", v % 2**64)
        _replace(path, bytes(raw))
        return f"{path.name}: header length {n} -> {v % 2**64}"
    extra = bytes(rng.integers(0, 256, int(rng.integers(1, 100)), dtype=np.uint8))
    _replace(path, bytes(raw) + extra)
    return f"{path.name}: {len(extra)} bytes appended"


def mutate_st_entry(path: Path, rng) -> str:
    """One tensor entry of the header (dtype, shape, data_offsets, keys) or the entries themselves."""
    header, data = _st_split(path.read_bytes())
    names = sorted(n for n in header if n != "__metadata__")
    name = _any(rng, names)
    e = header[name]
    kind = rng.choice(["dtype", "shape", "offsets", "key", "entry", "metadata"])
    if kind == "dtype":
        e["dtype"] = _any(rng, DTYPES)
        what = f"dtype -> {e['dtype']!r}"
    elif kind == "shape":
        s = list(e["shape"])
        op = rng.choice(["append", "drop", "double", "inc", "neg", "zero", "huge", "str", "float", "none", "nest"])
        i = int(rng.integers(0, len(s))) if s else 0
        if op == "append":
            s.append(int(rng.choice([1, 2])))
        elif op == "drop" and s:
            s.pop(i)
        elif op in ("double", "inc", "neg", "zero", "huge") and s:
            s[i] = {"double": s[i] * 2, "inc": s[i] + 1, "neg": -s[i] - 1, "zero": 0, "huge": 2**62}[op]
        elif op == "str" and s:
            s[i] = str(s[i])
        elif op == "float" and s:
            s[i] = s[i] + 0.5
        elif op == "nest":
            s = [s]
        e["shape"] = None if op == "none" else s
        what = f"shape -> {e['shape']!r}"
    elif kind == "offsets":
        b, en = e["data_offsets"]
        op = rng.choice(["shift", "swap", "empty", "neg", "beyond", "three", "str", "other"])
        d = int(rng.choice([1, 2, 8, 64, 4096]))
        other = header[_any(rng, names)]["data_offsets"]
        e["data_offsets"] = {"shift": [b + d, en + d], "swap": [en, b], "empty": [b, b], "neg": [-d, en - b - d],
                             "beyond": [len(data), len(data) + en - b], "three": [b, en, en], "str": [str(b), en],
                             "other": list(other)}[op]
        what = f"data_offsets [{b}, {en}] -> {e['data_offsets']!r}"
    elif kind == "key":
        k = rng.choice(["dtype", "shape", "data_offsets"])
        del e[k]
        what = f"key {k!r} deleted"
    elif kind == "entry":
        op = rng.choice(["delete", "rename", "bogus", "scalar"])
        if op == "delete":
            del header[name]
        elif op == "rename":
            header[name + ".x" if rng.random() < 0.5 else name.replace("weight", "bias")] = header.pop(name)
        elif op == "bogus":
            header["model.bogus"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        else:
            header[name] = _any(rng, VALUES)
        what = f"entry {op}"
    else:
        header["__metadata__"] = _any(rng, VALUES) if rng.random() < 0.5 else {"format": 1}
        what = f"__metadata__ -> {header['__metadata__']!r}"
    _replace(path, _st_join(header, data))
    return f"{path.name}: tensor {name!r}: {what}"


# -- JSON -------------------------------------------------------------------------------------------------

def _paths(obj, at=()):
    yield at
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*at, i))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def mutate_json_value(obj, rng) -> tuple[object, str]:
    """One node of a JSON document replaced, deleted, added to or nudged."""
    paths = list(_paths(obj))
    path = _any(rng, paths)
    v = _get(obj, path)
    new = _any(rng, VALUES)
    op = rng.choice(["replace", "delete", "add", "nudge"])
    if not path:
        return new, f"the document -> {new!r}"
    parent = _get(obj, path[:-1])
    if op == "delete":
        del parent[path[-1]]
        return obj, f"{list(path)} deleted"
    if op == "add" and isinstance(v, (dict, list)):
        if isinstance(v, dict):
            v["x_" + str(int(rng.integers(0, 100)))] = new
        else:
            v.append(new)
        return obj, f"{list(path)} += {new!r}"
    if op == "nudge" and isinstance(v, (int, float)) and not isinstance(v, bool):
        new = rng.choice([v + 1, v - 1, v * 2, -v, v // 2 if isinstance(v, int) else v / 2])
        new = new.item() if hasattr(new, "item") else new
    parent[path[-1]] = new
    return obj, f"{list(path)}: {v!r} -> {new!r}"


def mutate_json_file(path: Path, rng) -> str:
    raw = path.read_bytes()
    kind = rng.choice(["value", "value", "value", "flip", "truncate", "not_object", "bad_utf8", "empty"])
    if kind == "value":
        try:
            obj = json.loads(raw)
        except ValueError:
            kind = "flip"
        else:
            obj, what = mutate_json_value(obj, rng)
            _replace(path, json.dumps(obj, indent=1).encode())
            return f"{path.name}: {what}"
    if kind == "flip":
        b = bytearray(raw)
        i = _flip(b, 0, len(b), rng)
        _replace(path, bytes(b))
        return f"{path.name}: bit flip at byte {i}"
    if kind == "truncate":
        k = int(rng.integers(0, len(raw)))
        _replace(path, raw[:k])
        return f"{path.name}: truncated to {k} bytes"
    if kind == "not_object":
        v = rng.choice(["[]", '"x"', "1", "null", "[{}]"])
        _replace(path, v.encode())
        return f"{path.name}: -> {v}"
    if kind == "bad_utf8":
        i = int(rng.integers(0, len(raw)))
        _replace(path, raw[:i] + b"\xff\xfe" + raw[i:])
        return f"{path.name}: invalid UTF-8 at byte {i}"
    _replace(path, b"")
    return f"{path.name}: emptied"


# -- GGUF -----------------------------------------------------------------------------------------------

@dataclass
class Region:
    """Bytes of a GGUF file the parser reads as one value: a field part (a count, a length, a
    string, a type) or a tensor's data."""
    name: str
    start: int
    stop: int
    dtype: str | None        # "u32" / "u64" / "i32" ... for numbers, None for bytes
    covered: bool = True     # inside the header or a tensor (load checks it)


def gguf_regions(path: Path) -> tuple[list[Region], int]:
    """(every region of a GGUF file, its data offset), from gguf-py's reader of the pristine file."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    regions = []
    for f in [*r.fields.values(), *(t.field for t in r.tensors)]:
        pos = f.offset
        for i, part in enumerate(f.parts):
            n = int(part.nbytes)
            kind = None if part.dtype == np.uint8 else f"{part.dtype.kind}{part.dtype.itemsize}"
            regions.append(Region(f"{f.name}[{i}]", pos, pos + n, kind))
            pos += n
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in r.tensors)
    for a, b, n in spans:
        regions.append(Region(f"data of {n}", a, b, None))
    end = os.path.getsize(path)
    gaps = [(b, c) for (_, b, _), (c, _, _) in zip(spans, spans[1:] + [(end, end, "")]) if c > b]
    regions += [Region("padding", a, b, None, covered=False) for a, b in gaps]
    return regions, int(r.data_offset)


def mutate_gguf(path: Path, regions: list[Region], rng) -> tuple[str, bool, bool]:
    """One region's bytes changed, or the file truncated / grown. Returns (what, covered: a header or
    tensor byte changed, changed: any byte)."""
    raw = bytearray(path.read_bytes())
    kind = rng.choice(["region", "region", "region", "data", "truncate", "append"])
    if kind == "truncate":
        k = int(rng.integers(0, len(raw)))
        _replace(path, bytes(raw[:k]))
        return f"{path.name}: truncated to {k} bytes (of {len(raw)})", True, True
    if kind == "append":
        _replace(path, bytes(raw) + bytes(int(rng.integers(1, 64))))
        return f"{path.name}: bytes appended", True, True
    pool = [g for g in regions if (g.name.startswith(("data of", "padding")) == (kind == "data")) and g.stop > g.start]
    g = _any(rng, pool)
    if g.dtype and g.dtype[0] in "ui":
        dt = np.dtype(f"<{g.dtype}")
        v = int(np.frombuffer(bytes(raw[g.start:g.stop]), dt)[0])
        hi = 2 ** (8 * dt.itemsize)
        new = int(rng.choice([0, 1, v - 1, v + 1, v * 2, v + 8, hi - 1, hi // 2, int(rng.integers(0, 2**31))])) % hi
        raw[g.start:g.stop] = new.to_bytes(dt.itemsize, "little")
        what = f"{g.name} {v} -> {new}"
    else:
        op = rng.choice(["flip", "flip", "invalid_utf8", "zero"])
        i = int(rng.integers(g.start, g.stop))
        if op == "flip":
            raw[i] ^= 1 << int(rng.integers(0, 8))
        elif op == "invalid_utf8":
            raw[i] = 0xFF
        else:
            raw[i] = 0
        what = f"{g.name}: byte {i} {op}"
    changed = raw != path.read_bytes()
    _replace(path, bytes(raw))
    return f"{path.name}: {what}", g.covered and changed, changed


def rewrite_gguf_json(path: Path, key: str, edit) -> str | None:
    """A JSON metadata string (bloomery.tensors, bloomery.plan, the tokenizer) replaced by edit(obj) ->
    (obj, what), compact and padded with spaces to its stored length, so that the header's layout
    holds; tries edit up to 20 times for a result that fits. Returns `what`, None when none fit."""
    from gguf import GGUFReader
    f = GGUFReader(path).fields[key]
    part = f.parts[-1]
    start = f.offset + sum(int(p.nbytes) for p in f.parts[:-1])
    text = bytes(part).decode("utf-8")
    for _ in range(20):
        obj, what = edit(json.loads(text))
        new = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        if len(new) <= len(part):
            raw = bytearray(path.read_bytes())
            raw[start:start + len(part)] = new + b" " * (len(part) - len(new))
            _replace(path, bytes(raw))
            return what
    return None


def mutate_gguf_json(path: Path, key: str, rng) -> tuple[str, bool]:
    what = rewrite_gguf_json(path, key, lambda obj: mutate_json_value(obj, rng))
    return (f"{path.name}: {key}: {what}", True) if what else (f"{path.name}: {key}: no mutation fits", False)


def seal(folder: Path) -> None:
    """SHA256SUMS rewritten to match every file, DIGESTS.json dropped (an older bloomery's artifact)."""
    from bloomery.core.artifact.integrity import DIGESTS, sha256_file
    from bloomery.core.artifact.reader import SUMS
    (folder / DIGESTS).unlink(missing_ok=True)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != SUMS)
    _replace(folder / SUMS, "".join(f"{sha256_file(folder / n)}  {n}\n" for n in names).encode())


# -- running a stage ----------------------------------------------------------------------------------------

def _named_errors() -> set[str]:
    import bloomery.cli  # noqa: F401  (the command line's refusals, every module's)
    import bloomery.compiler.prepare  # noqa: F401
    import bloomery.runtime  # noqa: F401
    import bloomery.serve  # noqa: F401
    from bloomery.core.errors import BloomeryError
    out, todo = set(), [BloomeryError]
    while todo:
        c = todo.pop()
        out.add(c.__name__)
        todo += c.__subclasses__()
    return out


def run_stage(args: list[str], workdir: Path, timeout: float, memory: int) -> tuple[str, str]:
    """One command in a forked child; (outcome, stderr). Outcome: "ok", "refused:<Name>", or a
    failure: "traceback:<Type>", "unnamed:<first line>", "hang", "signal:<n>"."""
    from bloomery.cli import main
    out, err = workdir / ".stdout", workdir / ".stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                            # the child: the command line, as a user runs it
        code = 1
        try:
            for fd, p in ((1, out), (2, err)):
                os.dup2(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.stdout = open(1, "w", closefd=False)           # whatever the parent had made of them
            sys.stderr = open(2, "w", closefd=False)
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            main.main(args=args, prog_name="bloomery", standalone_mode=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang", err.read_text(errors="replace") if err.exists() else ""
        time.sleep(0.002)
    text = err.read_text(errors="replace") if err.exists() else ""
    if os.WIFSIGNALED(status):
        return f"signal:{os.WTERMSIG(status)}", text
    code = os.WEXITSTATUS(status)
    if "Traceback (most recent call last)" in text:
        last = [ln for ln in text.strip().splitlines() if ln and not ln.startswith(" ")][-1]
        return f"traceback:{last.split(':')[0]}", text
    if code == 0:
        return "ok", text
    m = re.search(r"^error: (\w+): ", text, re.M)
    if m and m.group(1) in NAMED:
        return f"refused:{m.group(1)}", text
    first = (text.strip().splitlines() or ["(no message)"])[-1]
    return f"unnamed:{first[:120]}", text


NAMED: set[str] = set()
FAILED = ("traceback:", "unnamed:", "hang", "signal:", "left-behind", "silent")


@dataclass
class Case:
    index: int
    seed_model: str
    target: str                      # "checkpoint" or "artifact"
    mutation: str = ""
    sealed: bool = False
    covered: bool = False            # an artifact's header or tensor bytes changed behind SHA256SUMS
    stages: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


class Fuzzer:
    def __init__(self, seed: int, work: Path, timeout: float = 60.0, memory: int = 6 << 30,
                 models: list[str] | None = None):
        from bloomery.tools import models as M
        global NAMED
        NAMED = _named_errors()
        self.seed, self.work, self.timeout, self.memory = seed, work, timeout, memory
        built = [m for m in (models or sorted(set(CKPT_SEEDS) | set(ART_SEEDS))) if M.is_built(m)]
        if not built:
            raise SystemExit(f"no seed model is built in {M.models_dir()} (run: make models)")
        self.dirs = {m: M.model_dir(m) for m in built}
        self.ckpt = [m for m in CKPT_SEEDS if m in self.dirs]
        self.art = [m for m in ART_SEEDS if m in self.dirs]
        self._arts: dict[str, tuple[Path, dict]] = {}

    def _pick(self, rng, names: list[str]) -> str:
        small = [n for n in names if n not in LARGE]
        big = [n for n in names if n in LARGE]
        pool = big if big and (not small or rng.random() < 0.1) else small
        return _any(rng, pool)

    def base_artifact(self, name: str) -> tuple[Path, dict]:
        """An artifact prepared from a seed (once), and its shards' regions."""
        if name not in self._arts:
            from bloomery.compiler.prepare import prepare
            out = self.work / "bases" / name.replace("/", "-")
            prepare(self.dirs[name], out, progress=False)
            self._arts[name] = (out, {p.name: gguf_regions(p) for p in sorted(out.glob("*.gguf"))})
        return self._arts[name]

    def case(self, i: int, keep: Path | None = None) -> Case:
        rng = np.random.default_rng([self.seed, i])
        target = "artifact" if (self.art and rng.random() < 0.4) or not self.ckpt else "checkpoint"
        c = Case(i, self._pick(rng, self.art if target == "artifact" else self.ckpt), target)
        if keep is not None and keep.exists() and any(keep.iterdir()):
            raise SystemExit(f"--keep {keep}: give a new or empty folder")
        folder = (keep or self.work / f"case-{i}") / ("art" if target == "artifact" else "ckpt")
        t0 = time.monotonic()
        try:
            if target == "checkpoint":
                self._checkpoint_case(c, folder, rng)
            else:
                self._artifact_case(c, folder, rng)
        finally:
            c.seconds = time.monotonic() - t0
            if keep is None:
                shutil.rmtree(folder.parent, ignore_errors=True)
        return c

    def _stage(self, c: Case, name: str, args: list[str], workdir: Path) -> str:
        outcome, text = run_stage([str(a) for a in args], workdir, self.timeout, self.memory)
        c.stages[name] = outcome
        if outcome.startswith(FAILED):
            c.failures.append(f"{name}: {outcome}: {text.strip()[-600:]}")
        return outcome

    def _checkpoint_case(self, c: Case, folder: Path, rng) -> None:
        _clone(self.dirs[c.seed_model], folder)
        if rng.random() < 0.3:
            reshard(folder)
        kind = rng.choice(["st_bytes", "st_entry", "st_entry", "json", "json", "json", "delete", "none"],
                          p=[0.2, 0.15, 0.15, 0.13, 0.13, 0.13, 0.06, 0.05])
        shards = sorted(folder.glob("*.safetensors"))
        if kind == "st_bytes":
            c.mutation = mutate_st_bytes(_any(rng, shards), rng)
        elif kind == "st_entry":
            c.mutation = mutate_st_entry(_any(rng, shards), rng)
        elif kind == "json":
            files = [folder / f for f in JSON_FILES if (folder / f).exists()]
            c.mutation = mutate_json_file(_any(rng, files), rng)
        elif kind == "delete":
            files = sorted(p for p in folder.iterdir() if p.is_file())
            victim = _any(rng, files)
            victim.unlink()
            c.mutation = f"{victim.name} deleted"
        else:
            c.mutation = "none (control)"
        work = folder.parent
        out = work / "out"
        self._stage(c, "inspect", ["inspect", folder], work)
        got = self._stage(c, "prepare", ["prepare", folder, out, "--no-progress"], work)
        left = [p.name for p in work.iterdir() if p.is_dir() and p.name not in ("ckpt", "out")
                and ".bloomery-" in p.name]
        if got != "ok" and (out.exists() or left):
            c.stages["prepare"] = "left-behind"
            c.failures.append(f"prepare: left-behind: {[*(['out'] if out.exists() else []), *left]}")
        if got == "ok":
            (work / "ids.json").write_text(json.dumps(IDS))
            got = self._stage(c, "logits", ["logits", out, "--ids", work / "ids.json", "--out", work / "x.npy"], work)
            if got.startswith("refused:") and got != "refused:PromptTooLong":
                c.failures.append(f"logits: {got}: prepare wrote an artifact that logits refuses")
            self._stage(c, "run", ["run", out, *RUN], work)
        if c.mutation.startswith("none") and not all(v == "ok" for v in c.stages.values()):
            c.failures.append(f"control: an unmutated seed does not pass: {c.stages}")

    def _artifact_case(self, c: Case, folder: Path, rng) -> None:
        base, regions = self.base_artifact(c.seed_model)
        _clone(base, folder)
        shards = sorted(regions)
        kind = rng.choice(["gguf", "gguf", "gguf", "gguf_json", "sums", "digests", "delete"],
                          p=[0.25, 0.2, 0.15, 0.15, 0.1, 0.1, 0.05])
        verify_must_fail = True
        if kind == "gguf":
            shard = _any(rng, shards)
            c.mutation, c.covered, verify_must_fail = mutate_gguf(folder / shard, regions[shard][0], rng)
        elif kind == "gguf_json":
            key = rng.choice(["bloomery.tensors", "bloomery.plan", "tokenizer.huggingface.json"])
            c.mutation, c.covered = mutate_gguf_json(folder / shards[0], key, rng)
        elif kind == "sums":
            c.mutation = mutate_sums(folder / "SHA256SUMS", rng)
            verify_must_fail = False            # a change of line breaks or order may mean the same sums
        elif kind == "digests":
            c.mutation = mutate_json_file(folder / "DIGESTS.json", rng)
        else:
            victim = _any(rng, sorted(folder.iterdir()))
            victim.unlink()
            c.mutation = f"{victim.name} deleted"
        if kind in ("gguf", "gguf_json") and rng.random() < 0.4:
            seal(folder)
            c.sealed, c.covered, verify_must_fail = True, False, False
            c.mutation += " (sealed)"
        work = folder.parent
        (work / "ids.json").write_text(json.dumps(IDS))
        self._stage(c, "inspect", ["inspect", folder], work)
        v = self._stage(c, "verify", ["verify", folder, "--no-progress"], work)
        for name, extra in (("logits", []), ("logits --verify", ["--verify"])):
            got = self._stage(c, name, ["logits", folder, "--ids", work / "ids.json", "--out", work / "x.npy", *extra],
                              work)
            if name == "logits --verify" and c.covered and got == "ok":
                c.stages[name] = "silent"
                c.failures.append(f"{name}: silent: the changed bytes of {c.mutation} were run")
        self._stage(c, "run", ["run", folder, *RUN], work)
        if verify_must_fail and v == "ok" and not c.mutation.endswith("no mutation fits"):
            c.stages["verify"] = "silent"
            c.failures.append(f"verify: silent: {c.mutation} passed verification")


def mutate_sums(path: Path, rng) -> str:
    """SHA256SUMS: a bit flip, a truncation, a line dropped or doubled."""
    lines = path.read_text().splitlines(keepends=True)
    kind = rng.choice(["flip", "truncate", "drop", "double"])
    raw = bytearray("".join(lines).encode())
    if kind == "flip":
        i = _flip(raw, 0, len(raw), rng)
        _replace(path, bytes(raw))
        return f"{path.name}: bit flip at byte {i}"
    if kind == "truncate":
        k = int(rng.integers(0, len(raw)))
        _replace(path, bytes(raw[:k]))
        return f"{path.name}: truncated to {k} bytes"
    i = int(rng.integers(0, len(lines)))
    lines = lines[:i] + lines[i + 1:] if kind == "drop" else lines[:i] + [lines[i]] + lines[i:]
    _replace(path, "".join(lines).encode())
    return f"{path.name}: line {i + 1} {'dropped' if kind == 'drop' else 'doubled'}"


# -- the run ---------------------------------------------------------------------------------------------------

def summary(cases: list[Case], seconds: float) -> dict:
    outcomes = {s: Counter() for s in sorted({s for c in cases for s in c.stages})}
    for c in cases:
        for s, o in c.stages.items():
            outcomes[s][o] += 1
    return {"cases": len(cases), "passed": sum(c.passed for c in cases), "failed": sum(not c.passed for c in cases),
            "seconds": round(seconds, 1), "by_target": dict(Counter(c.target for c in cases)),
            "by_seed_model": dict(Counter(c.seed_model for c in cases)),
            "sealed": sum(c.sealed for c in cases), "covered": sum(c.covered for c in cases),
            "outcomes": {s: dict(v.most_common()) for s, v in outcomes.items()},
            "failures": [{"case": c.index, "seed_model": c.seed_model, "mutation": c.mutation, "failures": c.failures}
                         for c in cases if not c.passed]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bloomery.tools.fuzz", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=None, help="Cases to run (default: until --minutes).")
    ap.add_argument("--minutes", type=float, default=None, help="Run until this much time has passed.")
    ap.add_argument("--case", type=int, default=None, help="Run this one case (with --keep: its folder stays).")
    ap.add_argument("--keep", type=Path, default=None, help="With --case: the folder to leave the case in.")
    ap.add_argument("--timeout", type=float, default=60.0, help="Seconds a stage may take before it is a hang.")
    ap.add_argument("--memory", type=float, default=6.0, help="GiB of address space a stage may take.")
    ap.add_argument("--models", default=None, help="Comma-separated seed models (default: every one built).")
    ap.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    ap.add_argument("--log", type=Path, default=None, help="Write every case as a JSON line here.")
    a = ap.parse_args(argv)
    if a.cases is None and a.minutes is None and a.case is None:
        a.cases = 40
    work = Path(tempfile.mkdtemp(prefix="bloomery-fuzz-"))
    try:
        fz = Fuzzer(a.seed, work, a.timeout, int(a.memory * 2**30), a.models.split(",") if a.models else None)
        t0 = time.monotonic()
        cases: list[Case] = []
        log = open(a.log, "w") if a.log else None
        indices = [a.case] if a.case is not None else range(10**9)
        for i in indices:
            if a.case is None and ((a.cases is not None and i >= a.cases)
                                   or (a.minutes is not None and time.monotonic() - t0 > a.minutes * 60)):
                break
            c = fz.case(i, a.keep if a.case is not None else None)
            cases.append(c)
            if log:
                log.write(json.dumps(c.__dict__, default=str) + "\n")
                log.flush()
            if not c.passed or a.case is not None:
                print(f"case {i} ({c.seed_model}, {c.target}): {c.mutation}: "
                      f"{'pass' if c.passed else 'FAIL'} {c.stages}", file=sys.stderr)
                for f in c.failures:
                    print(f"    {f}", file=sys.stderr)
        s = summary(cases, time.monotonic() - t0)
        if a.json:
            print(json.dumps(s, indent=1))
        else:
            print(f"{s['cases']} cases in {s['seconds']} s: {s['passed']} passed, {s['failed']} failed "
                  f"({s['by_target']}, {s['sealed']} sealed)")
            for st, counts in s["outcomes"].items():
                print(f"  {st}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return 1 if s["failed"] else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
