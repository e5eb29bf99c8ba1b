"""Whether a change to the CUDA sources changes the code they generate, without a GPU: each kernel module
is assembled as the runtime hands it to NVRTC (runtime/cuda/cu.py source(), gemv_src + gemm_src), at REV
and in the working tree, compiled by nvcc to PTX for sm_90 with explicit uses of a list of its kernel
instances, and the two PTX texts compared (spaces ignored: asm strings may be reformatted).

    python -m bloomery.tools.ptx_diff [--base HEAD] [--modules moe_gemm gemv_gemm ...] [--keep DIR]

Needs nvcc on PATH (CUDA 12.8 or later: the E4M3 conversions). Exit status 0 when every module's PTX is the
same, 1 when one differs, 2 when a module does not compile. Identical PTX means identical machine code, so a
pure refactor of the kernels (moving helpers, renaming) needs no GPU run to be trusted."""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
P = itertools.product

# module -> kernel instances compiled (a sample of every kernel family's template arguments)
INSTANCES = {
    "moe_gemm": ["moe_route_k"] + [f"moe_gemm_k<{f}, {p}, {w}, {s}>" for f, p, w, s in P((0, 1), (1, 2), (2, 4), (1, 2))],
    "attention_chunk": [f"attention_chunk_tc<{d}, 32, {pf}, {ck}, {cv}>" for d, pf, ck, cv in
                        P((64, 128), (0, 1), (0, 1, 2), (0, 1, 2))],
    "attention_decode": [f"attention_decode_k<{dpl}, {h}, {ck}, {cv}>" for dpl, h, ck, cv in
                         P((2, 4), (1, 2, 4), (0, 1, 2), (0, 1, 2))]
                        + [f"attention_decode_tc<{d}, {st}, {ck}, {cv}>" for d, st, ck, cv in P((64, 128), (2, 3), (1, 2), (1, 2))],
    "gemv_tc": [f"gemv_nvfp4_tc<{mt}, {w}, {nt}, {u}, {ns}, 0>" for mt, w, nt, (u, ns) in
                P((1, 2), (4, 8), (1, 4), ((1, 0), (2, 0), (4, 2), (4, 3)))]
               + [f"gemv_nvfp4_tc<{mt}, 8, {nt}, 4, 2, 1>" for mt, nt in P((1, 2), (1, 4))]
               + [f"gemv_tc_xfrag<{nt}>" for nt in (1, 2, 4)]
               + [f"gemv_bf16_tc<{mt}, {w}, {nt}, 0>" for mt, w, nt in P((1, 2), (4, 8), (1, 2))]
               + [f"gemv_bf16_tc<{mt}, {w}, {nt}, 1>" for mt, w, nt in P((1, 2), (4, 8), (1, 2))] + ["gemv_bf16_xsplit"],
    "gemv_tile": ["tile_repack_w", "tile_repack_s"] + [f"gemv_tile<{w}, {m}, {p}, {n}, {pr}>" for w, m, p, n, pr in
                                                       P((4, 8), (1, 2), (0, 16), (0, 1), (0, 1))],
    "gemv_row": ["row_repack_w", "row_repack_s"] + [f"gemv_row<{w}, {u}, {nb}, {n}, {pr}>" for w, u, nb, n, pr in
                                                    P((4, 8), (4, 8), (1, 3), (0, 1), (0, 1))],
}
GEMV = "gemv_gemm"                    # gemv_src.SOURCE + gemm_src.SOURCE, one NVRTC module (runtime/cuda/gemm.py)

_ASSEMBLE = r'''
import itertools, json, sys
sys.path.insert(0, sys.argv[1])
from bloomery.runtime.cuda import cu, gemm, gemm_src, gemv as G, gemv_src
names = list(gemm._NAMES)
for kind in ("f32", "bf16", "fp8_tensor", "mxfp8", "nvfp4_stored"):
    names += [G.kernel_name(kind, r, b, 1, 4) for r, b in ((1, 1), (4, 1), (2, 8))]
    names.append(G.kernel_name(kind, 2, 1, 1, 4, experts=True))
for kind in ("nvfp4_ggml", "q8_0"):
    names += [G.kernel_name(kind, r, b, 1, 1) for r, b in ((1, 1), (4, 1), (2, 8))]
names.append(G.kernel_name("nvfp4_ggml", 4, 1, 1, 1, experts=True))
mods = json.loads(sys.argv[2])
out = {m: cu.source(m) for m in mods if m != "gemv_gemm"}
if "gemv_gemm" in mods:
    out["gemv_gemm"] = gemv_src.SOURCE + gemm_src.SOURCE
print(json.dumps({"sources": out, "gemv_names": names}))
'''


def package(tree: Path, where: Path) -> Path:
    """A `bloomery` package rooted at a source tree (the repository's layout: bloomery/ plus core/, ...)."""
    pk = where / "pk"
    (pk / "bloomery").mkdir(parents=True)
    for d in ("core", "compiler", "runtime", "specs", "tools"):
        os.symlink(tree / d, pk / "bloomery" / d)
    for f in (tree / "bloomery").glob("*.py"):
        shutil.copy(f, pk / "bloomery" / f.name)
    return pk


def assemble(tree: Path, where: Path, modules) -> dict:
    import json
    pk = package(tree, where)
    r = subprocess.run([sys.executable, "-c", _ASSEMBLE, str(pk), json.dumps(list(modules))],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def ptx(src: str, names, path: Path) -> tuple[str | None, str]:
    keep = "\nstatic void *bloomery_keep[] = {" + ", ".join(f"(void *)&{n}" for n in names) + "};\n"
    path.write_text(src + keep)
    out = path.with_suffix(".ptx")
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-ftz=true", "-ptx", str(path), "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode:
        return None, r.stderr[-2000:]
    text = "".join(line for line in out.read_text().splitlines(keepends=True) if not line.startswith("//"))
    return "".join(text.split()), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the revision compared against (git)")
    ap.add_argument("--modules", nargs="+", default=[*INSTANCES, GEMV], choices=[*INSTANCES, GEMV])
    ap.add_argument("--keep", type=Path, default=None, help="leave the sources and PTX here")
    a = ap.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("ptx_diff: nvcc is not on PATH (the CUDA toolkit's compiler; no GPU needed)", file=sys.stderr)
        return 2
    work = Path(a.keep or tempfile.mkdtemp(prefix="ptx_diff-"))
    base_tree = work / "base-tree"
    base_tree.mkdir(parents=True, exist_ok=True)
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", a.base], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base_tree)], input=arch, check=True)
    sides = {"base": assemble(base_tree, work / "base", a.modules), "tree": assemble(ROOT, work / "tree", a.modules)}
    status = 0
    for m in a.modules:
        texts = {}
        for side, got in sides.items():
            names = got["gemv_names"] if m == GEMV else INSTANCES[m]
            texts[side], err = ptx(got["sources"][m], names, work / side / f"{m}.cu")
            if texts[side] is None:
                print(f"{m}: does not compile ({side}):\n{err}")
                status = 2
        if None in texts.values():
            continue
        n = len(sides["tree"]["gemv_names"]) if m == GEMV else len(INSTANCES[m])
        same = texts["base"] == texts["tree"]
        print(f"{m}: {n} instances, PTX {'identical' if same else 'DIFFERS'}")
        status = max(status, 0 if same else 1)
    if a.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
