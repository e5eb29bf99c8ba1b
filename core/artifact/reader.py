"""Open a bloomery artifact: a folder of GGUF splits, one per rank
(`rank{r}-{i:05d}-of-{n:05d}.gguf`), DIGESTS.json and SHA256SUMS (core/artifact/integrity.py).
Used by the runtime and by `bloomery inspect` / `verify`; imports nothing from the compiler.

    a = Artifact.open(path, verify=True)     # verify: every byte against SHA256SUMS and DIGESTS.json
    a = Artifact.open(path, check=True)      # check: each tensor against DIGESTS.json as it is first read
    a.tp, a.ranks, a.shards[rank]            # file paths, in order
    a.tensors(rank)                          # {base name: ArtifactTensor}
    a.metadata(rank)                         # first shard's keys (bloomery.tensors parsed away)
    a.parts(base, rank)                      # the format's parts (mmapped where possible)
    a.decode(base, rank)                     # float32, [out, in] / [expert, out, in]

Always, at open: DIGESTS.json against SHA256SUMS, each shard's size against DIGESTS.json, and
each shard's header (metadata and tensor infos) against its word sum before it is parsed. With
`check` (`bloomery run --verify`): each GGUF tensor's word sum the first time it is read (off by
default: it costs 4-9% of the CPU load time, docs/artifact.md "Integrity"); an artifact prepared
before DIGESTS.json existed is then checked file by file against SHA256SUMS as each shard opens.

A damaged artifact is refused by name: ArtifactMissingShard (a shard, a rank or SHA256SUMS
missing, or a file SHA256SUMS does not list), ShardSizeMismatch (a shard truncated or grown),
ArtifactChecksumMismatch (a header or tensor that does not match its digest), ArtifactMalformed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from .. import formats
from ..errors import (ArtifactChecksumMismatch, ArtifactError, ArtifactMalformed, ArtifactMissingShard,
                      ShardSizeMismatch)
from . import integrity, layout
from .integrity import DIGESTS

SUMS = "SHA256SUMS"
SHARD_RE = re.compile(r"rank(\d+)-(\d{5})-of-(\d{5})\.gguf")


@dataclass(frozen=True)
class ArtifactTensor:
    name: str                     # base name
    format: str
    role: str
    shape: tuple[int, ...]        # logical shape of this rank's piece
    optional: tuple[str, ...]
    sources: tuple[str, ...]
    cut: str
    layout: str                   # "ggml" or "stored"
    shard: str                    # file name
    parts: dict                   # part -> GGUF tensor name
    nbytes: int                   # bytes of its GGUF tensors


def read_sums(path: Path) -> dict[str, str]:
    """SHA256SUMS -> {file name: hex}."""
    res = {}
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise ArtifactMalformed(f"{path}: byte {e.start} is not ASCII; SHA256SUMS holds '<sha256>  <file>' lines: "
                                f"re-copy or re-prepare the artifact") from None
    for i, line in enumerate(text.splitlines()):
        m = re.fullmatch(r"([0-9a-f]{64})  (\S+)", line)
        if not m:
            raise ArtifactMalformed(f"{path}: line {i + 1} is not '<sha256>  <file>': {line[:80]!r}")
        res[m.group(2)] = m.group(1)
    return res


_HEADER = integrity.HEADER


class _Reader(GGUFReader):
    """gguf-py's reader with every read bounds-checked (a read past the end raises instead of giving
    a short array) and an array's length checked against the bytes left before gguf-py loops over
    its elements, so a damaged header is refused at once, never after a loop over the whole file."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if int(offset) < 0 or end > self.data.size:
            raise ValueError(f"a read of bytes {int(offset)}..{end} runs past the end of the file "
                             f"({self.data.size} bytes)")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            itype = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            alen = int(self._get(orig_offs + 4, np.uint64)[0])
            least = np.dtype(self.gguf_scalar_to_np[itype]).itemsize if itype in self.gguf_scalar_to_np else 8
            if alen * least > self.data.size - orig_offs - 12:
                raise ValueError(f"an array of {alen} {itype.name} at byte {orig_offs} runs past the end of the file "
                                 f"({self.data.size} bytes)")
        return super()._get_field_parts(orig_offs, raw_type)


def _contents(field, p: Path):
    """A metadata value; a string that is not UTF-8 is refused by name."""
    try:
        return field.contents()
    except UnicodeDecodeError as e:
        raise ArtifactMalformed(f"{p}: metadata key {field.name!r} holds a string that is not UTF-8 (byte {e.start}: "
                                f"{e.reason}); the shard is damaged: re-copy or re-prepare the artifact") from None


class Artifact:
    def __init__(self, path: Path, shards: dict[int, list[Path]], sums: dict[str, str],
                 digests: dict[str, dict] | None = None, check: bool = False):
        self.path = path
        self.shards = shards
        self.sums = sums
        self.digests = digests            # DIGESTS.json's shards; None: an artifact from before it
        self.check = check
        self._checked: set = set()        # (shard, GGUF tensor) whose word sum matched
        self._readers: dict[Path, Any] = {}
        self._tables: dict[int, dict[str, ArtifactTensor]] = {}
        self._meta: dict[int, dict[str, Any]] = {}
        first = self._reader(shards[min(shards)][0])
        self.tp = int(self._field(first, "bloomery.tp", shards[min(shards)][0]))
        missing = [r for r in range(self.tp) if r not in shards]
        extra = [r for r in shards if r >= self.tp]
        if missing or extra:
            raise ArtifactMissingShard(f"{path}: tp={self.tp} but the folder holds ranks {sorted(shards)}"
                                       f"{f'; missing rank {missing[0]}' if missing else ''}")
        self.ranks = list(range(self.tp))

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path, verify: bool = False, check: bool = False) -> "Artifact":
        path = Path(path)
        if not path.is_dir():
            raise ArtifactMissingShard(f"{path}: no artifact folder here")
        if not (path / SUMS).is_file():
            raise ArtifactMissingShard(f"{path}: {SUMS} is missing (not a published artifact, or damaged)")
        sums = read_sums(path / SUMS)
        files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != SUMS)
        for n in sums:
            if not (path / n).is_file():
                raise ArtifactMissingShard(f"{path}: {n} is listed in {SUMS} but missing")
        for n in files:
            if n not in sums:
                raise ArtifactMissingShard(f"{path}: {n} is not listed in {SUMS}")
        shards: dict[int, dict[int, Path]] = {}
        counts: dict[int, int] = {}
        for n in sums:
            if n == DIGESTS:
                continue
            m = SHARD_RE.fullmatch(n)
            if not m:
                raise ArtifactMalformed(f"{path}: {SUMS} lists {n}, not a shard name rank<r>-<i>-of-<n>.gguf")
            r, i, k = (int(g) for g in m.groups())
            if counts.setdefault(r, k) != k:
                raise ArtifactMalformed(f"{path}: rank {r} has shards of {counts[r]} and of {k}")
            shards.setdefault(r, {})[i] = path / n
        if not shards:
            raise ArtifactMissingShard(f"{path}: no shards")
        for r, d in shards.items():
            for i in range(1, counts[r] + 1):
                if i not in d:
                    raise ArtifactMissingShard(f"{path}: rank {r} shard {i} of {counts[r]} is missing "
                                               f"(rank{r}-{i:05d}-of-{counts[r]:05d}.gguf)")
        digests = _read_digests(path, sums) if DIGESTS in sums else None
        a = cls(path, {r: [d[i] for i in sorted(d)] for r, d in sorted(shards.items())}, sums, digests, check)
        if verify:
            a.verify()
        return a

    def verify(self, progress=None) -> None:
        """Every byte: each file against SHA256SUMS, each shard's header and GGUF tensors against
        DIGESTS.json (one sequential read per file). ArtifactChecksumMismatch lists every damaged
        file and tensor. `progress`: update(nbytes)."""
        problems = []
        for n, h in sorted(self.sums.items()):
            p = self.path / n
            e = (self.digests or {}).get(n)
            ranges = []
            if e is not None:
                try:
                    r = self._reader(p)
                    ranges = [(0, r.data_offset, _HEADER), *((t.data_offset, t.data_offset + t.n_bytes, t.name)
                                                             for t in r.tensors)]
                except ArtifactError as ex:    # its header is damaged: the file's SHA-256 says the rest
                    problems.append(str(ex))
            got, regions = integrity.hash_file(p, ranges, progress=progress)
            if got != h:
                problems.append(f"{n}: SHA-256 {got} does not match {SUMS} ({h})")
            if not ranges:
                continue
            want = {_HEADER: e["header"], **e["tensors"]}
            for name, d in regions.items():
                w = want.get(name)
                if w is None:
                    problems.append(f"{n}: GGUF tensor {name!r} has no entry in {DIGESTS}")
                elif d != {"sha256": w["sha256"], "sum": w["sum"]}:
                    what = "the header (metadata and tensor infos)" if name == _HEADER else f"tensor {name!r}"
                    problems.append(f"{n}: {what} does not match its SHA-256 in {DIGESTS}")
            problems += [f"{n}: tensor {name!r} of {DIGESTS} is not in the file" for name in e["tensors"]
                         if name not in regions]
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ArtifactChecksumMismatch(f"{self.path}: {len(problems)} problem(s): " + "; ".join(problems[:8]) + more
                                           + ". Re-copy the artifact, or re-prepare it")

    def _reader(self, p: Path):
        if p not in self._readers:
            e = (self.digests or {}).get(p.name)
            if e is not None or self.check:
                self._check_header(p, e)
            try:
                r = _Reader(p)
            except Exception as ex:        # a truncated or garbled file
                raise ArtifactMalformed(f"{p}: not a readable GGUF file ({type(ex).__name__}: {ex})") from None
            if e is not None and r.data_offset != e["header"]["bytes"]:
                raise ArtifactMalformed(f"{p}: its tensor data starts at byte {r.data_offset}; {DIGESTS} records "
                                        f"{e['header']['bytes']}: re-copy or re-prepare the artifact")
            self._readers[p] = r
        return self._readers[p]

    def _check_header(self, p: Path, e: dict | None) -> None:
        """Before a shard is parsed: its header against its word sum (or, in an artifact without
        DIGESTS.json, the whole file against SHA256SUMS)."""
        if e is None:
            got = integrity.sha256_file(p)
            if got != self.sums[p.name]:
                raise ArtifactChecksumMismatch(f"{p}: SHA-256 {got} does not match {SUMS} ({self.sums[p.name]}): "
                                               f"the shard is damaged; re-copy or re-prepare the artifact")
            return
        with open(p, "rb") as f:
            head = f.read(e["header"]["bytes"])
        if integrity.word_sum(head) != e["header"]["sum"]:
            raise ArtifactChecksumMismatch(f"{p}: its header (metadata and tensor infos, bytes 0..{len(head)}) does "
                                           f"not match {DIGESTS}: the shard is damaged; `bloomery verify "
                                           f"{self.path}` checks every file; re-copy or re-prepare the artifact")

    @staticmethod
    def _field(r, key, p):
        if key not in r.fields:
            raise ArtifactMalformed(f"{p}: metadata key {key!r} is missing")
        return _contents(r.fields[key], p)

    def close(self) -> None:
        self._readers.clear()

    # -- contents ----------------------------------------------------------------------------
    def metadata(self, rank: int = 0) -> dict[str, Any]:
        """The first shard's metadata of a rank, bloomery.tensors left out (see tensors())."""
        if rank not in self._meta:
            p = self._shards(rank)[0]
            r = self._reader(p)
            self._meta[rank] = {k: _contents(f, p) for k, f in r.fields.items()
                                if not k.startswith("GGUF.") and k != "bloomery.tensors"}
        return self._meta[rank]

    def _shards(self, rank: int) -> list[Path]:
        if rank not in self.shards:
            raise KeyError(f"{self.path}: no rank {rank} (tp={self.tp})")
        return self.shards[rank]

    def tensors(self, rank: int = 0) -> dict[str, ArtifactTensor]:
        if rank not in self._tables:
            ps = self._shards(rank)
            try:
                table = json.loads(self._field(self._reader(ps[0]), "bloomery.tensors", ps[0]))
            except json.JSONDecodeError as e:
                raise ArtifactMalformed(f"{ps[0]}: bloomery.tensors is not JSON ({e})") from None
            if not isinstance(table, dict):
                raise ArtifactMalformed(f"{ps[0]}: bloomery.tensors is not a JSON object; re-prepare the artifact")
            present = {}
            for p in ps:
                for t in self._reader(p).tensors:
                    present[t.name] = (p.name, int(t.n_bytes))
            res = {}
            for base, e in table.items():
                _check_entry(base, e, ps[0])
                names = sorted(set(e["parts"].values()))
                for n in names:
                    if n not in present or present[n][0] != e["shard"]:
                        raise ArtifactMalformed(f"{self.path}: rank {rank}: tensor {n!r} of {base!r} is not "
                                                f"in {e['shard']}")
                res[base] = ArtifactTensor(base, e["format"], e["role"], tuple(e["shape"]), tuple(e["optional"]),
                                           tuple(e["sources"]), e["cut"], e["layout"], e["shard"], dict(e["parts"]),
                                           sum(present[n][1] for n in names))
            self._tables[rank] = res
        return self._tables[rank]

    def nbytes(self, rank: int = 0) -> int:
        return sum(p.stat().st_size for p in self._shards(rank))

    @property
    def tokenizer_json(self) -> str | None:
        return self.metadata(0).get("tokenizer.huggingface.json")

    @property
    def chat_template(self) -> str | None:
        return self.metadata(0).get("tokenizer.chat_template")

    def _info(self, base: str, rank: int) -> ArtifactTensor:
        t = self.tensors(rank)
        if base not in t:
            raise KeyError(f"{self.path}: rank {rank} has no tensor {base!r}")
        return t[base]

    def gguf_arrays(self, base: str, rank: int = 0) -> dict[str, np.ndarray]:
        """The GGUF tensors of `base` by suffix (mmapped, read-only); with `check`, each one's word
        sum is checked against DIGESTS.json the first time it is read."""
        info = self._info(base, rank)
        r = self._reader(self.path / info.shard)
        data = {t.name: t.data for t in r.tensors}
        spec = layout.gguf_parts(info.format, info.shape, info.optional, base)
        res = {}
        for s, shp, qt in spec:
            n = layout.gguf_name(base, s)
            a = data.get(n)
            if a is None:
                raise ArtifactMalformed(f"{info.shard}: GGUF tensor {n!r} of {base!r} is missing")
            want = layout.byte_shape(shp, qt) if qt != layout.GQ.BF16 else (*shp[:-1], shp[-1] * 2)
            if tuple(a.shape) != tuple(want):
                raise ArtifactMalformed(f"{info.shard}: GGUF tensor {n!r} has shape {list(a.shape)}; the "
                                        f"{info.format} layout of {list(info.shape)} needs {list(want)}")
            res[s] = a
        if self.check and self.digests is not None:
            self._check_tensors(info.shard, base, {layout.gguf_name(base, s): a for s, a in res.items()})
        return res

    def _check_tensors(self, shard: str, base: str, arrays: dict) -> None:
        want = self.digests[shard]["tensors"]
        for n, a in arrays.items():
            if (shard, n) in self._checked:
                continue
            if n not in want:
                raise ArtifactMalformed(f"{self.path / shard}: GGUF tensor {n!r} (of {base!r}) has no entry in "
                                        f"{DIGESTS}; re-prepare the artifact")
            if integrity.word_sum(a) != want[n]["sum"]:
                raise ArtifactChecksumMismatch(f"{self.path / shard}: tensor {n!r} (of {base!r}) does not match its "
                                               f"digest in {DIGESTS}: the shard is damaged (a flipped byte, a bad "
                                               f"copy); `bloomery verify {self.path}` checks every file; re-copy or "
                                               f"re-prepare the artifact")
            self._checked.add((shard, n))

    def parts(self, base: str, rank: int = 0) -> dict[str, np.ndarray]:
        info = self._info(base, rank)
        return layout.from_gguf(info.format, self.gguf_arrays(base, rank), f"{self.path}: rank {rank}: {base}")

    def decode(self, base: str, rank: int = 0) -> np.ndarray:
        """float32 values in the checkpoint's orientation: [out, in], experts [E, out, in]."""
        info = self._info(base, rank)
        return formats.get(info.format).decode(self.parts(base, rank), f"{self.path}: rank {rank}: {base}")


_ENTRY = {"format": str, "role": str, "shape": list, "optional": list, "sources": list, "cut": str, "layout": str,
          "shard": str, "parts": dict}


def _check_entry(base: str, e, p: Path) -> None:
    """One bloomery.tensors entry has the writer's fields and types (ArtifactMalformed naming it)."""
    ok = (isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in _ENTRY.items())
          and e["format"] in formats.FORMATS
          and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in e["shape"])
          and all(isinstance(x, str) for x in (*e["optional"], *e["sources"], *e["parts"], *e["parts"].values())))
    if not ok:
        raise ArtifactMalformed(f"{p}: bloomery.tensors entry {base!r} is not {{{', '.join(_ENTRY)}}} with a known "
                                f"format and a shape of positive sizes; re-prepare the artifact")


def _read_digests(path: Path, sums: dict[str, str]) -> dict[str, dict]:
    """DIGESTS.json, checked against SHA256SUMS; every shard's size against it."""
    p = path / DIGESTS
    text = p.read_bytes()
    if hashlib.sha256(text).hexdigest() != sums[DIGESTS]:
        raise ArtifactChecksumMismatch(f"{p}: does not match its SHA-256 in {SUMS}; re-copy or re-prepare the artifact")
    digests = integrity.loads(text, str(p))
    shards = sorted(n for n in sums if n != DIGESTS)
    if any(n not in digests for n in shards):
        raise ArtifactMalformed(f"{p}: lists shards {sorted(digests)}; {SUMS} lists {shards}: re-prepare the "
                                f"artifact")
    for n in shards:
        size = (path / n).stat().st_size
        if size != digests[n]["bytes"]:
            raise ShardSizeMismatch(f"{path / n}: {size} bytes; {DIGESTS} records {digests[n]['bytes']} "
                                    f"({'truncated' if size < digests[n]['bytes'] else 'bytes added'}): re-copy or "
                                    f"re-prepare the artifact")
    return digests
