"""The artifact's ahead-of-time kernels on the GPU (the record: core/artifact/kernels.py; compiled by
`bloomery prepare --target sm_90a`, compiler/cutedsl). Each cubin is loaded with cupy.RawModule; the
runtime never imports cutlass. Lever BLOOMERY_AOT (specs/levers.yaml): auto (the default) uses the
artifact's kernels where its target runs on this GPU, off the NVRTC kernels always.

    from bloomery.runtime.cuda import aot
    ks, why = aot.load(metadata, capability=(9, 0), env=os.environ)   # ks: {name: Launcher} or {}
    ks["act_split"]((grid,), (x, hi, lo, np.int64(n)))                # block: the compiled one

`why` is one line for the start message: which kernels run and from where, or why none do."""

from __future__ import annotations

import os
import tempfile
from typing import Mapping

from bloomery.core import levers
from bloomery.core.artifact import kernels as K


class Launcher:
    """One loaded kernel: call with (grid, args); the block is the one it was compiled for."""

    def __init__(self, k: K.Kernel, fn):
        self.kernel, self.fn = k, fn

    def __call__(self, grid, args):
        if len(args) != len(self.kernel.params):
            raise TypeError(f"AOT kernel {self.kernel.name}: {len(args)} arguments for parameters "
                            f"({', '.join(self.kernel.params)})")
        self.fn(tuple(grid), (self.kernel.block,), tuple(args))


def record(metadata: Mapping, where: str) -> K.Record | None:
    text = metadata.get(K.KEY)
    return None if text is None else K.decode(text, where)


def choose(rec: K.Record | None, capability: tuple[int, int], env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether to load `rec`'s kernels on a GPU of `capability`, and the line that says so."""
    mode = levers.value("BLOOMERY_AOT", env)
    if rec is None:
        return False, "kernels: NVRTC (the artifact has no ahead-of-time kernels: bloomery prepare --target sm_90a)"
    names = ", ".join(sorted(rec.kernels))
    if mode == "off":
        return False, f"kernels: NVRTC (BLOOMERY_AOT=off; the artifact's {rec.target} kernels {names} not used)"
    if tuple(capability) != rec.capability:
        cc = ".".join(map(str, capability))
        return False, (f"kernels: NVRTC (the artifact's kernels are for {rec.target}, this GPU is compute "
                       f"capability {cc}; prepare with --target for it, or without --target)")
    return True, f"kernels: {rec.target} ahead of time ({names}; {rec.compiler}), NVRTC for the rest"


def load(metadata: Mapping, capability: tuple[int, int], env: Mapping[str, str] = os.environ,
         where: str = "artifact") -> tuple[dict[str, Launcher], str]:
    rec = record(metadata, where)
    use, why = choose(rec, capability, env)
    if not use:
        return {}, why
    import cupy as cp
    out = {}
    with tempfile.TemporaryDirectory(prefix="bloomery-aot-") as tmp:
        for k in rec.kernels.values():
            path = os.path.join(tmp, f"{k.name}.cubin")
            with open(path, "wb") as f:
                f.write(k.cubin)
            mod = cp.RawModule(path=path)
            out[k.name] = Launcher(k, mod.get_function(k.symbol))      # loads the module now
    return out, why
