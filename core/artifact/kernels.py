"""Kernels compiled ahead of time, as the artifact carries them: the compiler writes this record
(compiler/cutedsl, `bloomery prepare --target sm_90a`), the runtime reads it (runtime/cuda/aot.py)
and loads each cubin with cupy.RawModule, never importing the compiler that made it.

Metadata key KEY in every rank's first shard, a JSON string:

    {"version": 1, "target": "sm_90a", "compiler": "nvidia-cutlass-dsl 4.8.1",
     "kernels": {"act_split": {"symbol": "kernel_cutlass_...", "block": 256,
                               "params": ["ptr", "ptr", "ptr", "i64"],
                               "sha256": "...", "cubin": "<base64>"}, ...}}

`params` are the kernel's parameters in order (ptr: a 64-bit device address, i32 / i64: integers),
read from its PTX; `block` the threads a CTA it was compiled for (its .reqntid: launch exactly
that). decode() checks every field, each cubin's SHA-256, that it is a CUDA ELF and that it
defines its symbol; a record that fails names the artifact and the fix (re-prepare)."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass

from bloomery.core.errors import BadKernelRecord

KEY = "bloomery.kernels"
VERSION = 1
TARGETS = {"sm_90a": (9, 0)}           # target -> the compute capability that runs it
PARAM_TYPES = ("ptr", "i32", "i64")
EM_CUDA = 190


@dataclass(frozen=True)
class Kernel:
    name: str
    symbol: str
    block: int
    params: tuple[str, ...]
    cubin: bytes


@dataclass(frozen=True)
class Record:
    target: str
    compiler: str
    kernels: dict[str, Kernel]

    @property
    def capability(self) -> tuple[int, int]:
        return TARGETS[self.target]


def encode(target: str, compiler: str, kernels: list[Kernel]) -> str:
    if target not in TARGETS:
        raise BadKernelRecord(f"kernel target {target!r}; known: {', '.join(TARGETS)}")
    ks = {}
    for k in sorted(kernels, key=lambda k: k.name):
        _check_kernel(k, f"kernel {k.name!r}")
        ks[k.name] = {"symbol": k.symbol, "block": k.block, "params": list(k.params),
                      "sha256": hashlib.sha256(k.cubin).hexdigest(), "cubin": base64.b64encode(k.cubin).decode()}
    return json.dumps({"version": VERSION, "target": target, "compiler": compiler, "kernels": ks},
                      sort_keys=True, separators=(",", ":"))


def decode(text: str, where: str) -> Record:
    """The record of `where` (an artifact path, for messages); BadKernelRecord if any part is wrong."""
    fix = "re-prepare the artifact (bloomery prepare ... --target TARGET), or prepare it without --target"
    try:
        d = json.loads(text)
    except (TypeError, ValueError) as e:
        raise BadKernelRecord(f"{where}: metadata {KEY} is not JSON ({e}); {fix}") from None
    if not isinstance(d, dict) or d.get("version") != VERSION:
        raise BadKernelRecord(f"{where}: metadata {KEY} version {d.get('version') if isinstance(d, dict) else d!r}; "
                              f"this runtime reads version {VERSION}: {fix}")
    target, compiler, ks = d.get("target"), d.get("compiler"), d.get("kernels")
    if target not in TARGETS or not isinstance(compiler, str) or not isinstance(ks, dict):
        raise BadKernelRecord(f"{where}: metadata {KEY}: target {target!r} (known: {', '.join(TARGETS)}), compiler "
                              f"and kernels are required; {fix}")
    out = {}
    for name, e in ks.items():
        at = f"{where}: kernel {name!r} ({KEY})"
        try:
            cubin = base64.b64decode(e["cubin"], validate=True)
            k = Kernel(name, e["symbol"], e["block"], tuple(e["params"]), cubin)
            digest = e["sha256"]
        except (KeyError, TypeError, ValueError) as err:
            raise BadKernelRecord(f"{at}: malformed entry ({err!r}); {fix}") from None
        if hashlib.sha256(cubin).hexdigest() != digest:
            raise BadKernelRecord(f"{at}: its cubin's SHA-256 is not the recorded {digest}; {fix}")
        try:
            _check_kernel(k, at)
        except BadKernelRecord as err:
            raise BadKernelRecord(f"{err}; {fix}") from None
        out[name] = k
    return Record(target, compiler, out)


def _check_kernel(k: Kernel, at: str) -> None:
    if not isinstance(k.symbol, str) or not k.symbol:
        raise BadKernelRecord(f"{at}: no symbol")
    if not isinstance(k.block, int) or not 1 <= k.block <= 1024:
        raise BadKernelRecord(f"{at}: block {k.block!r}; 1 to 1024 threads")
    if not all(p in PARAM_TYPES for p in k.params):
        raise BadKernelRecord(f"{at}: params {list(k.params)}; each one of {', '.join(PARAM_TYPES)}")
    syms = elf_functions(k.cubin, at)
    if k.symbol not in syms:
        raise BadKernelRecord(f"{at}: the cubin defines no function {k.symbol!r} (it has {sorted(syms)[:4]})")


def elf_functions(cubin: bytes, at: str = "cubin") -> set[str]:
    """The function symbols a CUDA ELF (64-bit, little-endian, machine EM_CUDA) defines."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise BadKernelRecord(f"{at}: not a 64-bit little-endian ELF")
    machine, = struct.unpack_from("<H", cubin, 18)
    if machine != EM_CUDA:
        raise BadKernelRecord(f"{at}: ELF machine {machine}, not CUDA ({EM_CUDA})")
    shoff, = struct.unpack_from("<Q", cubin, 40)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 58)
    try:
        secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        names = set()
        for s in secs:
            if s[1] != 2:                                 # SHT_SYMTAB
                continue
            strtab = secs[s[6]]                           # sh_link
            for j in range(s[5] // s[9]):                 # sh_size / sh_entsize
                st_name, st_info = struct.unpack_from("<IB", cubin, s[4] + j * s[9])
                if st_info & 0xF == 2:                    # STT_FUNC
                    o = strtab[4] + st_name
                    names.add(cubin[o:cubin.index(b"\0", o)].decode())
    except (struct.error, IndexError, ValueError, ZeroDivisionError):
        raise BadKernelRecord(f"{at}: its ELF section or symbol table is truncated") from None
    return names
