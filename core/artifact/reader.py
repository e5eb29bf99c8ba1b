"""Open a bloomery artifact: a folder of GGUF splits, one per rank
(`rank{r}-{i:05d}-of-{n:05d}.gguf`), and SHA256SUMS. Used by the runtime and by
`bloomery inspect`; imports nothing from the compiler.

    a = Artifact.open(path, verify=True)     # verify: every file against SHA256SUMS
    a.tp, a.ranks, a.shards[rank]            # file paths, in order
    a.tensors(rank)                          # {base name: ArtifactTensor}
    a.metadata(rank)                         # first shard's keys (bloomery.tensors parsed away)
    a.parts(base, rank)                      # the format's parts (mmapped where possible)
    a.decode(base, rank)                     # float32, [out, in] / [expert, out, in]

A damaged artifact is refused by name: ArtifactMissingShard (a shard, a rank or SHA256SUMS
missing, or a file SHA256SUMS does not list), ArtifactChecksumMismatch, ArtifactMalformed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import formats
from ..errors import ArtifactChecksumMismatch, ArtifactMalformed, ArtifactMissingShard
from . import layout

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
    for i, line in enumerate(path.read_text(encoding="ascii").splitlines()):
        m = re.fullmatch(r"([0-9a-f]{64})  (\S+)", line)
        if not m:
            raise ArtifactMalformed(f"{path}: line {i + 1} is not '<sha256>  <file>': {line[:80]!r}")
        res[m.group(2)] = m.group(1)
    return res


def sha256_file(path: Path, block: int = 16 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(block)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()


class Artifact:
    def __init__(self, path: Path, shards: dict[int, list[Path]], sums: dict[str, str]):
        self.path = path
        self.shards = shards
        self.sums = sums
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
    def open(cls, path, verify: bool = False) -> "Artifact":
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
        a = cls(path, {r: [d[i] for i in sorted(d)] for r, d in sorted(shards.items())}, sums)
        if verify:
            a.verify()
        return a

    def verify(self) -> None:
        """Every file against SHA256SUMS (ArtifactChecksumMismatch naming the file)."""
        for n, h in sorted(self.sums.items()):
            got = sha256_file(self.path / n)
            if got != h:
                raise ArtifactChecksumMismatch(f"{self.path / n}: SHA-256 {got} does not match {SUMS} ({h})")

    def _reader(self, p: Path):
        if p not in self._readers:
            from gguf import GGUFReader
            try:
                self._readers[p] = GGUFReader(p)
            except Exception as e:         # a truncated or garbled file
                raise ArtifactMalformed(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        return self._readers[p]

    @staticmethod
    def _field(r, key, p):
        if key not in r.fields:
            raise ArtifactMalformed(f"{p}: metadata key {key!r} is missing")
        return r.fields[key].contents()

    def close(self) -> None:
        self._readers.clear()

    # -- contents ----------------------------------------------------------------------------
    def metadata(self, rank: int = 0) -> dict[str, Any]:
        """The first shard's metadata of a rank, bloomery.tensors left out (see tensors())."""
        if rank not in self._meta:
            p = self._shards(rank)[0]
            r = self._reader(p)
            self._meta[rank] = {k: f.contents() for k, f in r.fields.items()
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
            present = {}
            for p in ps:
                for t in self._reader(p).tensors:
                    present[t.name] = (p.name, int(t.n_bytes))
            res = {}
            for base, e in table.items():
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
        """The GGUF tensors of `base` by suffix (mmapped, read-only)."""
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
        return res

    def parts(self, base: str, rank: int = 0) -> dict[str, np.ndarray]:
        info = self._info(base, rank)
        return layout.from_gguf(info.format, self.gguf_arrays(base, rank), f"{self.path}: rank {rank}: {base}")

    def decode(self, base: str, rank: int = 0) -> np.ndarray:
        """float32 values in the checkpoint's orientation: [out, in], experts [E, out, in]."""
        info = self._info(base, rank)
        return formats.get(info.format).decode(self.parts(base, rank), f"{self.path}: rank {rank}: {base}")
