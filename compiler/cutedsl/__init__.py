"""Kernels compiled ahead of time in the CUTLASS DSL (CuTe DSL, package nvidia-cutlass-dsl) for a
named GPU target, with no GPU: `bloomery prepare ... --target sm_90a` puts them into the artifact
(the record: core/artifact/kernels.py) and the runtime loads them with cupy.RawModule
(runtime/cuda/aot.py), never importing cutlass; an artifact without them runs the NVRTC kernels.

Each module of MODULES defines build() -> {name: (launch, fake_args, threads)}: a cute.jit launch
function, the fake arguments it is compiled for (pointers and integers only, so that the kernel's
parameters are a plain C ABI) and the threads of a CTA. The compile runs in a child process in a
temporary folder (the DSL writes its PTX and cubin files into the working folder; cutlass and its
MLIR stay out of the compiler's process) and gives the same bytes for the same inputs.

    python -m bloomery.compiler.cutedsl --target sm_90a [--list]    # compile here, print a summary
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from bloomery.core.artifact import kernels as K
from bloomery.core.errors import KernelCompileUnavailable as CuteDslUnavailable

MODULES = ("act_split",)
PIN = "nvidia-cutlass-dsl==4.8.1"           # requirements.txt pins the same
RESULT = "kernels.json"


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl version, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return None


def compile_record(target: str, timeout_s: float = 600.0) -> str:
    """The artifact's kernel record (JSON text, core/artifact/kernels.py) for `target`."""
    if target not in K.TARGETS:
        raise K.BadKernelRecord(f"--target {target!r}: known targets {', '.join(K.TARGETS)}")
    ver = dsl_version()
    if ver is None or importlib.util.find_spec("cutlass") is None:
        raise CuteDslUnavailable(f"--target {target} compiles kernels with the CUTLASS DSL, which is not installed "
                                 f"here: pip install '{PIN}' (no GPU needed), or prepare without --target "
                                 f"(the runtime then uses its NVRTC kernels)")
    with tempfile.TemporaryDirectory(prefix="bloomery-cutedsl-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
        env["CUTE_DSL_DUMP_DIR"] = tmp
        p = subprocess.run([sys.executable, "-m", "bloomery.compiler.cutedsl", "--target", target, "--write", tmp],
                           cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-12:])
            raise CuteDslUnavailable(f"compiling the {target} kernels with nvidia-cutlass-dsl {ver} failed "
                                     f"(exit {p.returncode}):\n{tail}")
        with open(os.path.join(tmp, RESULT)) as f:
            got = json.load(f)
    ks = [K.Kernel(e["name"], e["symbol"], e["block"], tuple(e["params"]), base64.b64decode(e["cubin"]))
          for e in got]
    return K.encode(target, f"nvidia-cutlass-dsl {ver}", ks)


def ptx_params(ptx: str, symbol: str) -> list[str]:
    """The parameter types of `symbol`'s .entry in `ptx` (ptr, i32, i64)."""
    at = ptx.index(f".entry {symbol}(")
    body = ptx[at:ptx.index(")", at)]
    out = []
    for line in body.splitlines()[1:]:
        line = line.strip()
        if not line.startswith(".param"):
            continue
        if ".ptr" in line:
            out.append("ptr")
        elif ".u64" in line or ".s64" in line or ".b64" in line:
            out.append("i64")
        elif ".u32" in line or ".s32" in line or ".b32" in line:
            out.append("i32")
        else:
            raise ValueError(f"{symbol}: parameter {line!r} is not a pointer or an integer")
    return out


def _compile_here(target: str) -> list[dict]:
    """In the child: compile every module's kernels for `target` (the working folder is a temporary one)."""
    import re

    import cutlass.cute as cute
    out = []
    for mod in MODULES:
        m = importlib.import_module(f"bloomery.compiler.cutedsl.{mod}")
        for name, (launch, fake_args, threads) in m.build().items():
            t0 = time.perf_counter()
            f = cute.compile(launch, *fake_args(), options=f"--gpu-arch={target} --keep-ptx --keep-cubin")
            cubin, ptx = f.artifacts.CUBIN, f.artifacts.PTX          # bytes, and the PTX text
            if not cubin or not ptx:
                raise RuntimeError(f"{name}: the DSL returned no cubin or PTX for {target}")
            if f".target {target}" not in ptx:
                raise RuntimeError(f"{name}: PTX target is not {target}")
            entries = re.findall(r"\.visible \.entry (\w+)\(", ptx)
            if len(entries) != 1:
                raise RuntimeError(f"{name}: {len(entries)} kernels in one compile; expected one")
            req = re.search(r"\.reqntid (\d+), 1, 1", ptx)
            if not req or int(req.group(1)) != threads:
                raise RuntimeError(f"{name}: .reqntid is not {threads}, 1, 1")
            out.append({"name": name, "symbol": entries[0], "block": threads, "params": ptx_params(ptx, entries[0]),
                        "cubin": base64.b64encode(cubin).decode(), "seconds": time.perf_counter() - t0})
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bloomery.compiler.cutedsl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="sm_90a", choices=sorted(K.TARGETS))
    ap.add_argument("--write", metavar="DIR", help="(the child process) compile here and write DIR/" + RESULT)
    a = ap.parse_args(argv)
    if a.write:
        got = _compile_here(a.target)
        with open(os.path.join(a.write, RESULT), "w") as f:
            json.dump(got, f)
        return 0
    rec = K.decode(compile_record(a.target), "(compiled here)")
    print(f"{rec.target}, {rec.compiler}:")
    for k in rec.kernels.values():
        print(f"  {k.name}: {k.symbol} block {k.block} params ({', '.join(k.params)}) cubin {len(k.cubin)} B")
    return 0
