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
    2. write every rank's shards into -tmp- (each fsynced, behind step 3)  kill: out untouched
    3. re-open every shard with GGUFReader; check names, types, shapes, offsets, size and
       split.* keys; re-read each file once (a second thread, beside the other checks): its
       SHA-256 (for SHA256SUMS), and the word sums of its header and of every tensor against
       those of the bytes written (the writer takes DIGESTS.json's SHA-256 and word sums as it
       writes); decode a few rows of every tensor from the file and compare them bit for bit
       with the planned parts' decode                          kill: out untouched
    4. write DIGESTS.json (core/artifact/integrity.py) and SHA256SUMS (sorted, sha256sum
       format, DIGESTS.json listed too), fsync them and the folder
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from gguf import GGUFReader

from bloomery.core import formats
from bloomery.core.artifact import integrity, layout
from bloomery.core.artifact.integrity import DIGESTS, hash_file
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
    """An empty folder, or one holding only SHA256SUMS, DIGESTS.json and rank*.gguf files."""
    if not out.is_dir() or out.is_symlink():
        return False
    names = [p.name for p in out.iterdir()]
    return not names or (SUMS in names and all(n in (SUMS, DIGESTS) or SHARD_RE.fullmatch(n) for n in names))


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
            sums, digests = {}, {}
            for p, w in zip(plans, writes):
                sums.update(verify_rank(tmp, p, w, tp, digests))
            for w in writes:
                w.wait_synced()                     # every shard on disk before SHA256SUMS names it
            sums[DIGESTS] = _write_synced(tmp / DIGESTS, integrity.dumps(digests))
            sums_text = "".join(f"{h}  {n}\n" for n, h in sorted(sums.items()))
            _write_synced(tmp / SUMS, sums_text)
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


def _write_synced(path: Path, text: str) -> str:
    """Writes an ASCII file, fsynced; returns its SHA-256."""
    data = text.encode("ascii")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


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


def verify_rank(folder: Path, plan: RankPlan, w: writer.RankWrite, tp: int,
                digests: dict | None = None) -> dict[str, str]:
    """Re-open every shard of a rank; check its structure, size and offsets against what was
    written, the word sum (core/artifact/integrity.py) of its header and of every GGUF tensor read
    back against the bytes written (whose SHA-256 and word sums the writer took: DIGESTS.json), and
    the decoded spot checks; take the file's SHA-256 in one sequential read meanwhile (a second
    thread). Returns {file name: file SHA-256}; fills `digests` with each shard's DIGESTS.json entry."""
    sums = {}
    by_name = {t.name: t for t in plan.tensors}
    for i, sh in enumerate(w.shards):
        path = folder / sh.name
        written = w.digests[sh.name]
        regions = [(0, written["header"]["bytes"], integrity.HEADER),
                   *((w.offsets[g.name], w.offsets[g.name] + g.nbytes, g.name) for g in sh.gguf)]
        with ThreadPoolExecutor(1) as pool:             # the file's one sequential read beside the checks
            read_back = pool.submit(hash_file, path, regions, kinds=("sum",))
            try:
                _check_shard(path, i, sh, plan, w, tp, by_name)
                failed = None
            except PublishVerifyFailed as e:            # reported after the word sums, which name the bytes
                failed = e
            sums[sh.name], sums_back = read_back.result()
        for name, d in sums_back.items():
            if name == integrity.HEADER and d["sum"] != written["header"]["sum"]:
                _fail(f"{sh.name}: its header reads back differently from what was written (word sum)")
            if name != integrity.HEADER and d["sum"] != written["tensors"][name]["sum"]:
                _fail(f"{sh.name}: tensor {name!r} reads back differently from what was written (word sum; "
                      f"SHA-256 written {written['tensors'][name]['sha256'][:16]}...)")
        if failed is not None:
            raise failed
        if digests is not None:
            digests[sh.name] = written
        _hook("verify")
    return sums


def _check_shard(path: Path, i: int, sh, plan: RankPlan, w: writer.RankWrite, tp: int, by_name: dict) -> None:
    """verify_rank's checks of shard i as read back: structure, offsets, size, spot checks."""
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
    written = w.digests[sh.name]
    moved = [t.name for t in r.tensors if int(t.data_offset) != w.offsets[t.name]]
    if int(r.data_offset) != written["header"]["bytes"] or moved or path.stat().st_size != written["bytes"]:
        _fail(f"{where}: reads back with data at byte {int(r.data_offset)} and {path.stat().st_size} bytes, "
              f"written {written['header']['bytes']} and {written['bytes']}"
              + (f" (tensor {moved[0]!r} moved)" if moved else ""))
    data = {t.name: t.data for t in r.tensors}
    for t in sh.tensors:
        _spot_check(t, by_name[t.name], data, w.samples[t.name], where)


def _spot_check(t, planned, data, samples, where):
    fmt = formats.get(t.format)
    arrays = {s: data[layout.gguf_name(t.name, s)] for s, _, _ in layout.gguf_parts(t.format, t.shape, t.optional)}
    for li, r0, r1, digest in samples:
        if len(t.shape) < 2:
            sub = arrays
        else:
            sub = layout.rows_of_gguf(t.format, t.shape, layout.take_lead(arrays, t.shape[:-2], li), r0, r1)
        got = writer.decoded_digest(fmt.decode(layout.from_gguf(t.format, sub, where), check=False))  # checked there
        if got != digest:
            _fail(f"{where}: artifact tensor {t.name!r} ({t.format}) matrix {li} rows [{r0}, {r1}) "
                  f"decodes differently from the planned parts ({', '.join(planned.sources[:2])})")


__all__ = ["publish", "Published", "recover", "side_names", "verify_rank", "hash_file", "is_replaceable",
           "ArtifactError"]
