"""Publish an artifact atomically: write into a temporary folder beside `out`, re-read and
verify every shard, write SHA256SUMS, fsync, then swap it into place.

Names beside `out` (same parent, so the same filesystem):
    .{name}.lock               fcntl lock file; a second publish to the same out waits for
                               the first (or, with wait=False, fails with ArtifactLocked).
                               Never deleted (deleting a lock file races with its waiters).
    .{name}.bloomery-tmp-*     the folder being written; after a swap, the previous artifact.
    .{name}.bloomery-old-*     the previous artifact during the two-rename fallback only.

Protocol, and what a SIGKILL at each point leaves (docs/artifact.md has the table):
    1. lock; recover: if `out` is absent and an -old- folder exists (a kill inside the
       fallback swap), rename it back to `out`; then delete every -tmp- and -old- folder
       (all stale: their owner held the lock we now hold).
    2. write every rank's shards into -tmp- (each fsynced)    kill: out untouched
    3. re-open every shard with GGUFReader; check names, types, shapes, split.* keys;
       re-read each file once: its SHA-256 and every tensor's SHA-256 against what was
       written; decode a few rows of every tensor from the file and compare them bit for
       bit with the planned parts' decode                      kill: out untouched
    4. write SHA256SUMS (sorted, sha256sum format), fsync it and the folder
    5. swap: `out` absent -> rename(tmp, out). `out` present -> renameat2(RENAME_EXCHANGE)
       swaps the two names in one step (the old artifact now sits at the -tmp- name);
       where the kernel or filesystem lacks it: rename(out, old); rename(tmp, out).
       fsync the parent.                                       kill: out is old or new, whole
       (fallback only, between its two renames: out absent, the old whole at -old-; step 1
       of the next publish puts it back)
    6. delete the previous artifact; unlock                    kill: a stale folder that the
                                                               next publish deletes
`out` is replaced only when it is an empty folder or a bloomery artifact (SHA256SUMS and
rank*.gguf files only); anything else is refused (OutputNotArtifact).

BLOOMERY_TEST_KILL_AT=<point>[:<n>] is a test hook: the process SIGKILLs itself at the n-th
time (default first) it reaches point (tensor, shard, verify, sums, swap, swapped, cleaned).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from gguf import GGUFReader

from bloomery.core import formats
from bloomery.core.artifact import layout
from bloomery.core.artifact.reader import SHARD_RE, SUMS
from bloomery.core.errors import (ArtifactError, ArtifactLocked, ArtifactMalformed, OutputNotArtifact,
                                  PublishVerifyFailed)

from . import writer
from .planned import RankPlan

_KILL_COUNTS: dict[str, int] = {}


def _hook(point: str) -> None:
    spec = os.environ.get("BLOOMERY_TEST_KILL_AT")
    if not spec:
        return
    name, _, n = spec.partition(":")
    if name != point:
        return
    _KILL_COUNTS[point] = _KILL_COUNTS.get(point, 0) + 1
    if _KILL_COUNTS[point] >= int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Published:
    path: Path
    files: dict[str, str]        # file name -> SHA-256 (SHA256SUMS)
    nbytes: int                  # tensor bytes written, all ranks
    seconds: dict[str, float]    # write, verify, swap


def side_names(out: Path) -> tuple[Path, str, str]:
    """(lock file, tmp prefix, old prefix) beside `out`."""
    return (out.parent / f".{out.name}.lock", f".{out.name}.bloomery-tmp-", f".{out.name}.bloomery-old-")


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE); False where the kernel or filesystem lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(e, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(e)}")


def is_replaceable(out: Path) -> bool:
    """An empty folder, or one holding only SHA256SUMS and rank*.gguf files."""
    if not out.is_dir() or out.is_symlink():
        return False
    names = [p.name for p in out.iterdir()]
    return not names or (SUMS in names and all(n == SUMS or SHARD_RE.fullmatch(n) for n in names))


def recover(out: Path) -> list[Path]:
    """Under the lock: restore a previous artifact left at -old- by a kill inside the fallback
    swap (when `out` is absent), then delete the stale -tmp- / -old- folders. Returns them."""
    _, tmp_p, old_p = side_names(out)
    olds = sorted(p for p in out.parent.iterdir() if p.name.startswith(old_p))
    if not os.path.lexists(out) and olds:
        os.rename(olds[-1], out)
        _fsync_dir(out.parent)
        olds = olds[:-1]
    stale = olds + sorted(p for p in out.parent.iterdir() if p.name.startswith(tmp_p))
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


class _Lock:
    def __init__(self, path: Path, wait: bool):
        self.path, self.wait, self.fd = path, wait, None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(self.fd)
            raise ArtifactLocked(f"{self.path}: another prepare is publishing to the same output; "
                                 f"wait for it or choose another output") from None
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def check_plans(rank_plans: Sequence[RankPlan]) -> int:
    """Every rank 0..tp-1 once, one tp; every tensor has a layout (refused before writing)."""
    if not rank_plans:
        raise ArtifactMalformed("publish: no rank plans")
    tp = rank_plans[0].tp
    ranks = sorted(p.rank for p in rank_plans)
    if ranks != list(range(tp)) or any(p.tp != tp for p in rank_plans):
        raise ArtifactMalformed(f"publish: rank plans {[(p.rank, p.tp) for p in rank_plans]} are not "
                                f"ranks 0..{tp - 1} of tp={tp}")
    return tp


def publish(out, rank_plans: Sequence[RankPlan], extra_metadata: Mapping[str, Any] | None = None, *,
            tokenizer_json: str | None = None, chat_template: str | None = None,
            max_shard_bytes: int = writer.DEFAULT_MAX_SHARD_BYTES, wait: bool = True,
            progress: bool | None = None, chunk_bytes: int = writer.CHUNK_BYTES) -> Published:
    """Write, verify and atomically publish the artifact of `rank_plans` at `out` (a folder).
    progress: None = a bar when stderr is a terminal."""
    out = Path(os.path.abspath(out))
    tp = check_plans(rank_plans)
    plans = sorted(rank_plans, key=lambda p: p.rank)
    shard_plans = {p.rank: writer.plan_shards(p, max_shard_bytes) for p in plans}   # refuses before writing
    total = sum(sh.nbytes for s in shard_plans.values() for sh in s)
    if os.path.lexists(out) and not is_replaceable(out):
        raise OutputNotArtifact(f"{out}: exists and is not a bloomery artifact (nor an empty folder); "
                                f"refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    lock, tmp_p, old_p = side_names(out)
    t = {}
    with _Lock(lock, wait):
        recover(out)
        if os.path.lexists(out) and not is_replaceable(out):
            raise OutputNotArtifact(f"{out}: exists and is not a bloomery artifact; refusing to replace it")
        tmp = out.parent / f"{tmp_p}{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            bar = None
            if progress or (progress is None and sys.stderr.isatty()):
                from tqdm import tqdm
                bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare")
            t0 = time.perf_counter()
            writes = [writer.write_rank(tmp, p, max_shard_bytes=max_shard_bytes, extra_metadata=extra_metadata,
                                        tokenizer_json=tokenizer_json, chat_template=chat_template,
                                        progress=bar, chunk_bytes=chunk_bytes, hook=_hook,
                                        shards=shard_plans[p.rank])
                      for p in plans]
            if bar is not None:
                bar.close()
            t1 = time.perf_counter()
            sums = {}
            for p, w in zip(plans, writes):
                sums.update(verify_rank(tmp, p, w, tp))
            sums_text = "".join(f"{h}  {n}\n" for n, h in sorted(sums.items()))
            with open(tmp / SUMS, "w", encoding="ascii") as f:
                f.write(sums_text)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _hook("sums")
            t2 = time.perf_counter()
            _swap(tmp, out, old_p)
            t3 = time.perf_counter()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _hook("cleaned")
    t = {"write": t1 - t0, "verify": t2 - t1, "swap": t3 - t2}
    return Published(out, sums, total, t)


def _swap(tmp: Path, out: Path, old_p: str) -> None:
    _hook("swap")
    if not os.path.lexists(out):
        os.rename(tmp, out)
        _fsync_dir(out.parent)
        _hook("swapped")
        return
    if _exchange(tmp, out):               # out is the new artifact; tmp holds the old one
        _fsync_dir(out.parent)
        _hook("swapped")
        shutil.rmtree(tmp)
    else:
        old = out.parent / f"{old_p}{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
        _hook("swap-fallback")
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        _fsync_dir(out.parent)
        _hook("swapped")
        shutil.rmtree(old)
    _fsync_dir(out.parent)


# -- verification ----------------------------------------------------------------------------------


def _fail(msg):
    raise PublishVerifyFailed(msg)


def verify_rank(folder: Path, plan: RankPlan, w: writer.RankWrite, tp: int) -> dict[str, str]:
    """Re-open every shard of a rank; check structure, SHA-256 of the file and of every tensor,
    and the decoded spot checks. Returns {file name: file SHA-256}."""
    sums = {}
    by_name = {t.name: t for t in plan.tensors}
    for i, sh in enumerate(w.shards):
        path = folder / sh.name
        r = GGUFReader(path)
        where = f"{sh.name}"
        got = [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())), int(t.n_bytes))
               for t in r.tensors]
        want = [(g.name, int(g.qtype), tuple(g.shape), g.nbytes) for g in sh.gguf]
        if got != want:
            diff = next(((a, b) for a, b in zip(got, want) if a != b), (len(got), len(want)))
            _fail(f"{where}: tensors read back differ from the plan (first difference: read {diff[0]}, "
                  f"planned {diff[1]})")
        f = {k: r.fields[k].contents() for k in ("split.no", "split.count", "split.tensors.count",
                                                   writer.KEY_RANK, writer.KEY_TP) if k in r.fields}
        if f != {"split.no": i, "split.count": len(w.shards),
                 "split.tensors.count": sum(len(s.gguf) for s in w.shards), writer.KEY_RANK: plan.rank,
                 writer.KEY_TP: tp}:
            _fail(f"{where}: split / rank keys read back as {f}")
        ranges = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in r.tensors]
        fh, th = hash_file(path, ranges)
        for name, h in th.items():
            if h != w.sha256[name]:
                _fail(f"{where}: tensor {name!r} reads back with SHA-256 {h[:16]}..., written "
                      f"{w.sha256[name][:16]}...")
        sums[sh.name] = fh
        data = {t.name: t.data for t in r.tensors}
        for t in sh.tensors:
            _spot_check(t, by_name[t.name], data, w.samples[t.name], where)
        _hook("verify")
        del r, data
    return sums


def _spot_check(t, planned, data, samples, where):
    fmt = formats.get(t.format)
    arrays = {s: data[layout.gguf_name(t.name, s)] for s, _, _ in layout.gguf_parts(t.format, t.shape, t.optional)}
    for li, r0, r1, digest in samples:
        if len(t.shape) < 2:
            sub = arrays
        else:
            sub = layout.rows_of_gguf(t.format, t.shape, layout.take_lead(arrays, t.shape[:-2], li), r0, r1)
        got = writer.decoded_digest(fmt.decode(layout.from_gguf(t.format, sub, where)))
        if got != digest:
            _fail(f"{where}: artifact tensor {t.name!r} ({t.format}) matrix {li} rows [{r0}, {r1}) "
                  f"decodes differently from the planned parts ({', '.join(planned.sources[:2])})")


def hash_file(path: Path, ranges: list[tuple[int, int, str]], block: int = 16 << 20) -> tuple[str, dict[str, str]]:
    """One sequential read: the file's SHA-256 and each [start, stop) range's SHA-256."""
    fh = hashlib.sha256()
    hs = {name: hashlib.sha256() for _, _, name in ranges}
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
                    hs[name].update(chunk[lo - pos:hi - pos])
                k += 1
            pos = end
            try:
                os.posix_fadvise(f.fileno(), 0, pos, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                pass
    return fh.hexdigest(), {k: h.hexdigest() for k, h in hs.items()}


__all__ = ["publish", "Published", "recover", "side_names", "verify_rank", "hash_file", "is_replaceable",
           "ArtifactError"]
