"""One safetensors shard: its header, read and validated without touching tensor data,
and its tensors as lazy read-only mmaps. Each view maps only its own tensor and is unmapped
when the last array over it dies, so pages read while streaming leave the resident set."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bloomery.core import dtypes
from bloomery.core.errors import (
    BadHeader,
    HeaderTooLong,
    OverlappingTensors,
    TensorOutOfBounds,
    TruncatedShard,
    UnsupportedDtype,
)

# A header larger than this is refused before it is read (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class StoredTensor:
    """One tensor entry of a shard: where its bytes are and what they are."""

    name: str
    dtype: str               # safetensors dtype name
    shape: tuple[int, ...]
    shard: "Shard"
    begin: int               # absolute byte offset in the file
    nbytes: int

    def array(self) -> np.ndarray:
        """A read-only NumPy view of the tensor's bytes (mmapped: nothing is read until touched)."""
        return self.shard.view(self)

    def __repr__(self) -> str:
        return f"StoredTensor({self.name!r}, {self.dtype}, {list(self.shape)}, {self.shard.path.name})"


class Shard:
    """A safetensors file. Construction reads and checks the header only."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = None                  # opened on the first view; each view maps its own tensor
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise TruncatedShard(f"{self.path}: {size} bytes, too short to hold a safetensors header "
                                     "(8-byte length first). Re-download or re-export the shard.")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise HeaderTooLong(f"{self.path}: header length {hlen} bytes runs beyond the file "
                                    f"({size} bytes). The file is truncated or not safetensors.")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise BadHeader(f"{self.path}: the safetensors header is not valid JSON ({e}).") from None
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.data_start = 8 + hlen
        self.size = size
        self.tensors: dict[str, StoredTensor] = {}
        spans = []
        for name, entry in header.items():
            t = self._entry(name, entry)
            self.tensors[name] = t
            spans.append((t.begin, t.begin + t.nbytes, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise OverlappingTensors(f"{self.path}: tensors {n0!r} (bytes {b0}..{e0}) and {n1!r} "
                                         f"(bytes {b1}..{e1}) overlap. The shard is corrupt; re-export it.")
        end = max((e for _, e, _ in spans), default=self.data_start)
        if end > size:
            last = max(spans, key=lambda s: s[1])[2]
            raise TruncatedShard(f"{self.path}: the header places tensor {last!r} up to byte {end}, but the "
                                 f"file has {size} bytes. The shard is truncated; re-download or re-export it.")

    def _entry(self, name: str, entry) -> StoredTensor:
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise BadHeader(f"{self.path}: header entry of tensor {name!r} lacks dtype, shape or "
                            f"data_offsets: {entry!r}.") from None
        if dtype not in dtypes.SAFETENSORS_DTYPES:
            raise UnsupportedDtype(f"{self.path}: tensor {name!r} has dtype {dtype}, which bloomery cannot "
                                   f"read (known: {', '.join(dtypes.SAFETENSORS_DTYPES)}).")
        want = math.prod(shape) * dtypes.to_numpy(dtype).itemsize
        if b < 0 or e < b or e - b != want or any(d < 0 for d in shape):
            raise TensorOutOfBounds(f"{self.path}: tensor {name!r} ({dtype} {list(shape)}) claims bytes "
                                    f"{b}..{e} of the data section, but its shape and dtype need {want} bytes.")
        return StoredTensor(name, dtype, shape, self, self.data_start + b, e - b)

    def view(self, t: StoredTensor) -> np.ndarray:
        dt = dtypes.to_numpy(t.dtype)
        if t.nbytes == 0:
            return np.zeros(t.shape, dt)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        start = t.begin - t.begin % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self._fd, t.begin + t.nbytes - start, offset=start, access=mmap.ACCESS_READ)
        return np.frombuffer(m, dt, math.prod(t.shape), t.begin - start).reshape(t.shape)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __repr__(self) -> str:
        return f"Shard({self.path.name!r}, {len(self.tensors)} tensors)"
