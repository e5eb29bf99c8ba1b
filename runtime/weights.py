"""Weights for the NumPy executor: every tensor a plan reads, decoded to float32 once at load
through the artifact reader and the format library (the CUDA executor reads the stored bytes)."""

from __future__ import annotations

import numpy as np

from bloomery.core.artifact import Artifact

from .errors import PlanMismatch


class CpuWeights:
    """One rank's decoded weights: values[name] float32 [out, in] / [E, out, in] / [n], and
    pre_quant[name] (NVFP4_AWQ's per-input scale, float32) where the tensor carries one."""

    def __init__(self, art: Artifact, rank: int, names: list[str], shared: dict | None = None):
        table = art.tensors(rank)
        self.values: dict[str, np.ndarray] = {}
        self.pre_quant: dict[str, np.ndarray] = {}
        for n in names:
            if n not in table:
                raise PlanMismatch(f"{art.path}: rank {rank}'s plan reads tensor {n!r}, which the artifact "
                                   f"does not hold; re-prepare the artifact")
            t = table[n]
            key = n if t.cut == "replicated" else (n, rank)
            if shared is not None and key in shared:      # a replicated tensor: the same bytes on every rank
                self.values[n], pq = shared[key]
            else:
                self.values[n] = art.decode(n, rank)
                pq = None
                if "pre_quant_scale" in t.optional:
                    pq = np.asarray(art.parts(n, rank)["pre_quant_scale"], np.float32)
                if shared is not None:
                    shared[key] = (self.values[n], pq)
            if pq is not None:
                self.pre_quant[n] = pq

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.values.values())
