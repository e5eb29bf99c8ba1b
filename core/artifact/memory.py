"""An artifact held in memory: what `bloomery prepare` would write, never written. The compiler
builds it from a checkpoint folder (compiler/in_memory.py) so that `bloomery serve` runs a
downloaded folder with no prepare step; the runtime takes it wherever it takes an Artifact.

It answers the reader's questions with the reader's answers: the same tensor table, the same
first-shard metadata (values as GGUF stores them: floats in f32), and each tensor's GGUF arrays
(layout.to_gguf of the planned parts, made when asked, typed as GGUFReader types them), so parts() and decode() are the reader's
own (from_gguf of those arrays) and give the values an artifact on disk gives, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from . import layout
from .reader import Artifact, ArtifactTensor


class MemoryArtifact(Artifact):
    in_memory = True

    def __init__(self, path: Path, tables: Mapping[int, Mapping[str, dict]],
                 produce: Mapping[int, Mapping[str, Callable[[], dict]]], metadata: Mapping[int, Mapping[str, Any]]):
        """tables[rank]: bloomery.tensors' entries, each with its GGUF bytes as `nbytes`;
        produce[rank][name](): the tensor's parts in its format; metadata[rank]: the first shard's keys."""
        self.path = Path(path)
        self.shards, self.sums, self._readers = {}, {}, {}
        self.digests, self.check = None, False      # no files: nothing to check bytes against
        self.tp = len(tables)
        self.ranks = list(range(self.tp))
        self._produce = {r: dict(p) for r, p in produce.items()}
        self._meta = {r: dict(m) for r, m in metadata.items()}
        self._tables = {r: {n: ArtifactTensor(n, e["format"], e["role"], tuple(e["shape"]), tuple(e["optional"]),
                                              tuple(e["sources"]), e["cut"], e["layout"], e["shard"],
                                              dict(e["parts"]), int(e["nbytes"]))
                            for n, e in t.items()} for r, t in tables.items()}

    def verify(self) -> None:
        """Nothing to check against: there are no files."""

    def metadata(self, rank: int = 0) -> dict[str, Any]:
        return self._meta[rank]

    def tensors(self, rank: int = 0) -> dict[str, ArtifactTensor]:
        return self._tables[rank]

    def nbytes(self, rank: int = 0) -> int:
        return sum(t.nbytes for t in self._tables[rank].values())

    def gguf_arrays(self, base: str, rank: int = 0) -> dict[str, np.ndarray]:
        """As GGUFReader gives them: BF16 as its bytes (uint8, the last axis doubled)."""
        info = self._info(base, rank)
        arrs = layout.to_gguf(info.format, self._produce[rank][base](), where=f"{self.path}: rank {rank}: {base}")
        return {k: (a.view(np.uint8) if a.dtype == layout.BF16 else a) for k, a in arrs.items()}
