"""What an artifact's bytes must be, and the checks: SHA256SUMS (each file's SHA-256, in
sha256sum's format) and DIGESTS.json (each shard's size, and the SHA-256 and word sum of its
header and of each of its GGUF tensors). `bloomery prepare` writes both; `bloomery verify`
checks every byte against them; loading checks each shard's size, and its header's word sum
before the shard is parsed; with `--verify` (Artifact.open(check=True)) each tensor's word sum
the first time it is read.

    DIGESTS.json: {"version": 1, "shards": {"rank0-00001-of-00001.gguf": {
        "bytes": file size, "header": {"bytes": data offset, "sha256": hex, "sum": hex},
        "tensors": {GGUF tensor name: {"sha256": hex, "sum": hex}, ...}}, ...}}

The word sum (`WordSum`) is two 64-bit sums of the little-endian 8-byte words of a region (the
last word zero-padded): of every word, and of each 4 KiB block's sum times the block's index
(1, 2, ...). It runs at the memory's speed with NumPy (about 25 GB/s here in memory, SHA-256
1.8 GB/s; 4-16 GB/s on pages first touched through the mmap, which is 4-9% of the CPU load time
measured: docs/artifact.md, "Integrity"). It is not cryptographic: it catches damage (a flipped
byte or bit, a zeroed page, a misplaced block), not a forgery; the SHA-256 of `bloomery verify`
is the strong check.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArtifactMalformed

DIGESTS = "DIGESTS.json"
DIGESTS_VERSION = 1
HEADER = "\0header"            # hash_file's name of a shard's header range (no GGUF tensor's name)
BLOCK = 4096
_MASK = (1 << 64) - 1


def _bytes(data) -> np.ndarray:
    a = np.asarray(data) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class WordSum:
    """The word sum of a byte stream, fed in pieces of any size (the same as one update of all)."""

    def __init__(self):
        self.s1 = self.s2 = self.blocks = 0
        self._carry = np.zeros(0, np.uint8)

    def update(self, data) -> "WordSum":
        b = _bytes(data)
        if self._carry.size:
            take = BLOCK - self._carry.size
            self._carry = np.concatenate([self._carry, b[:take]])
            b = b[take:]
            if self._carry.size < BLOCK:
                return self
            self._blocks(self._carry)
            self._carry = np.zeros(0, np.uint8)
        k = b.size - b.size % BLOCK
        if k:
            self._blocks(b[:k])
        if k < b.size:
            self._carry = b[k:].copy()
        return self

    def _blocks(self, b: np.ndarray) -> None:
        s = b.view("<u8").reshape(-1, BLOCK // 8).sum(axis=1, dtype=np.uint64)
        j = np.arange(self.blocks + 1, self.blocks + 1 + s.size, dtype=np.uint64)
        self.s1 = (self.s1 + int(s.sum(dtype=np.uint64))) & _MASK
        self.s2 = (self.s2 + int((s * j).sum(dtype=np.uint64))) & _MASK
        self.blocks += s.size

    def hexdigest(self) -> str:
        s1, s2, blocks = self.s1, self.s2, self.blocks
        if self._carry.size:
            tail = np.zeros(-(-self._carry.size // 8) * 8, np.uint8)
            tail[:self._carry.size] = self._carry
            t = int(tail.view("<u8").sum(dtype=np.uint64))
            s1, s2 = (s1 + t) & _MASK, (s2 + t * (blocks + 1)) & _MASK
        return f"{s1:016x}{s2:016x}"


def word_sum(data) -> str:
    return WordSum().update(data).hexdigest()


def hash_file(path: Path, ranges: list[tuple[int, int, str]], block: int = 16 << 20,
              progress=None, kinds: tuple[str, ...] = ("sha256", "sum")) -> tuple[str, dict[str, dict[str, str]]]:
    """One sequential read: the file's SHA-256, and each [start, stop) range's {"sha256", "sum"}
    (those of `kinds`). The pages read are dropped from the page cache behind the read.
    `progress`: update(nbytes)."""
    fh = hashlib.sha256()
    make = {"sha256": hashlib.sha256, "sum": WordSum}
    hs = {name: tuple(make[k]() for k in kinds) for _, _, name in ranges}
    rs = sorted(ranges)
    buf = bytearray(block)
    mv = memoryview(buf)
    pos, j = 0, 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            chunk = mv[:n]
            fh.update(chunk)
            end = pos + n
            while j < len(rs) and rs[j][1] <= pos:
                j += 1
            k = j
            while k < len(rs) and rs[k][0] < end:
                a, b, name = rs[k]
                lo, hi = max(a, pos), min(b, end)
                if hi > lo:
                    for h in hs[name]:
                        h.update(chunk[lo - pos:hi - pos])
                k += 1
            pos = end
            if progress is not None:
                progress.update(n)
            try:
                os.posix_fadvise(f.fileno(), 0, pos, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                pass
    return fh.hexdigest(), {name: {k: h.hexdigest() for k, h in zip(kinds, h2)} for name, h2 in hs.items()}


def sha256_file(path: Path) -> str:
    return hash_file(path, [])[0]


def dumps(shards: dict[str, dict]) -> str:
    return json.dumps({"version": DIGESTS_VERSION, "shards": shards}, sort_keys=True, indent=0) + "\n"


def _is_hex(v, n: int) -> bool:
    return isinstance(v, str) and len(v) == n and all(c in "0123456789abcdef" for c in v)


def _region_ok(r) -> bool:
    return isinstance(r, dict) and _is_hex(r.get("sha256"), 64) and _is_hex(r.get("sum"), 32)


def loads(text: str, where: str) -> dict[str, dict[str, Any]]:
    """DIGESTS.json's shards, checked for shape (ArtifactMalformed naming the entry otherwise)."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ArtifactMalformed(f"{where}: not JSON ({e}); re-prepare the artifact") from None
    if not isinstance(obj, dict) or obj.get("version") != DIGESTS_VERSION or not isinstance(obj.get("shards"), dict):
        raise ArtifactMalformed(f"{where}: expected {{\"version\": {DIGESTS_VERSION}, \"shards\": {{...}}}}; "
                                f"re-prepare the artifact")
    for name, e in obj["shards"].items():
        ok = (isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("header"), dict)
              and isinstance(e["header"].get("bytes"), int) and _region_ok(e["header"])
              and isinstance(e.get("tensors"), dict) and all(_region_ok(t) for t in e["tensors"].values()))
        if not ok:
            raise ArtifactMalformed(f"{where}: the entry of {name!r} is not {{bytes, header: {{bytes, sha256, sum}}, "
                                    f"tensors: {{name: {{sha256, sum}}}}}}; re-prepare the artifact")
    return obj["shards"]
