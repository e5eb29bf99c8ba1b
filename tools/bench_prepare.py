"""Prepare throughput against plain reading of the same files.

    python -m bloomery.tools.bench_prepare [FOLDER ...] [--synthetic llama3-8b --layers 4] [--tp 1 2]

For each checkpoint: read every safetensors byte once (warm-up, so both runs read from the
page cache), time a plain read of them all and a plain copy with fsync (the disk's floor for
writing as many bytes), then time `prepare` (read, repack, write, fsync, re-read, hash, verify,
publish) at each tp. Prints MB/s of checkpoint bytes and the ratios to both."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from bloomery.compiler.prepare import prepare


def plain_read(folder: Path, block: int = 16 << 20) -> tuple[int, float]:
    t0, n = time.perf_counter(), 0
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(block):
                n += len(chunk)
    return n, time.perf_counter() - t0


def plain_copy(folder: Path, dest: Path, block: int = 16 << 20) -> float:
    """Copy every safetensors file and fsync: the disk's floor for writing an artifact of that size."""
    dest.mkdir()
    t0 = time.perf_counter()
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as src, open(dest / p.name, "wb", buffering=0) as dst:
            while chunk := src.read(block):
                dst.write(chunk)
            os.fsync(dst.fileno())
    dt = time.perf_counter() - t0
    shutil.rmtree(dest)
    return dt


def bench(folder: Path, tps, work: Path) -> list[tuple]:
    plain_read(folder)
    n, t_read = plain_read(folder)
    t_copy = plain_copy(folder, work / "copy")
    rows = [(folder.name, "plain read", n / t_read / 1e6, 1.0, 1.0, t_read),
            (folder.name, "copy + fsync", n / t_copy / 1e6, t_read / t_copy, 1.0, t_copy)]
    for tp in tps:
        out = work / f"out-tp{tp}"
        t0 = time.perf_counter()
        prepare(folder, out, tp=tp, progress=False)
        dt = time.perf_counter() - t0
        rows.append((folder.name, f"prepare tp {tp}", n / dt / 1e6, t_read / dt, t_copy / dt, dt))
        shutil.rmtree(out)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=Path)
    ap.add_argument("--synthetic", default=None, help="generate a checkpoint of this shape (tools/synthetic.py)")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bloomery-bench-") as tmp:
        work = Path(tmp)
        folders = list(a.folders)
        if a.synthetic:
            from bloomery.tools import synthetic
            folders.append(synthetic.write(a.synthetic, work / f"{a.synthetic}-{a.format}", a.format, a.layers))
        rows = [r for f in folders for r in bench(f, a.tp, work)]
    print(f"{'checkpoint':<28} {'what':<14} {'MB/s':>8} {'x plain read':>13} {'x copy+fsync':>13} {'seconds':>8}")
    for name, what, mbs, r_read, r_copy, sec in rows:
        print(f"{name:<28} {what:<14} {mbs:>8.0f} {r_read:>13.3f} {r_copy:>13.2f} {sec:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
