"""compiler/writer.py's writer thread and what publish's re-read checks against it: the bytes and
digests it writes are those of the file (DIGESTS.json as a re-read computes it), the bytes in
flight stay within the budget, an error on the writer thread comes back by name without a hang or
a leftover folder, and bytes changed on disk after the write are caught."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from artifact_driver import plans as synthetic_plans
from bloomery.compiler import publish as pub
from bloomery.compiler import writer
from bloomery.core.artifact import integrity
from bloomery.core.errors import PublishVerifyFailed


def leftovers(out: Path):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.bloomery-"))


def test_digests_are_the_files(tmp_path):
    """DIGESTS.json (taken as the bytes were written) equals what a re-read of every shard computes,
    and SHA256SUMS each file's SHA-256: several shards, two ranks, every format of the driver."""
    out = tmp_path / "a"
    published = pub.publish(out, synthetic_plans(6, 0.3, tp=2, seed=3), max_shard_bytes=700_000)
    shards = sorted(out.glob("rank*.gguf"))
    assert len(shards) > 2
    digests = json.loads((out / integrity.DIGESTS).read_text())["shards"]
    for p in shards:
        r = GGUFReader(p)
        ranges = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in r.tensors]
        fh, th = integrity.hash_file(p, [(0, int(r.data_offset), integrity.HEADER), *ranges])
        header = th.pop(integrity.HEADER)
        assert digests[p.name] == {"bytes": p.stat().st_size, "header": {"bytes": int(r.data_offset), **header},
                                   "tensors": th}
        assert published.files[p.name] == fh


def test_bytes_in_flight_stay_within_the_budget(tmp_path, monkeypatch):
    seen = []
    real_put = writer._Sink.put

    def put(self, job, nbytes=0):
        real_put(self, job, nbytes)
        seen.append(self._waiting)
    monkeypatch.setattr(writer, "SINK_BYTES", 300_000)
    monkeypatch.setattr(writer, "BATCH_BYTES", 50_000)        # jobs of 50 KB .. a chunk (~110 KB)
    monkeypatch.setattr(writer._Sink, "put", put)
    pub.publish(tmp_path / "a", synthetic_plans(4, 2.0, seed=4), chunk_bytes=100_000)
    assert len(seen) > 40 and max(seen) <= 300_000, max(seen)


def test_an_error_on_the_writer_thread_comes_back(tmp_path, monkeypatch):
    """The disk fills while the writer thread writes: publish raises that OSError (not a hang, not
    a verify failure), writes nothing after it, and leaves neither an artifact nor its temporary
    folder."""
    real_init = writer._Out.__init__
    calls = []

    class Full:                                  # the shard file, full after 3 writes of tensor data
        def __init__(self, f):
            self.f = f

        def write(self, b):
            calls.append(len(b))
            if len(calls) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

    def init(self, sinks, fout, *a):
        real_init(self, sinks, fout, *a)
        self.fout = Full(fout)
    monkeypatch.setattr(writer._Out, "__init__", init)
    monkeypatch.setattr(writer, "BATCH_BYTES", 1)              # one job per chunk
    out = tmp_path / "a"
    with pytest.raises(OSError, match="No space left"):
        pub.publish(out, synthetic_plans(8, 0.5, seed=5))
    assert len(calls) == 4                      # nothing written after the failed write
    assert not out.exists() and leftovers(out) == []


def test_a_byte_changed_after_the_write_is_named(tmp_path, monkeypatch):
    """A byte of a tensor changed on disk between the write and the re-read: refused, naming the
    tensor (its word sum reads back differently)."""
    real = pub._hook

    def corrupt(point):
        if point == "shard":
            f = sorted(tmp_path.glob(".a.bloomery-tmp-*/*.gguf"))[-1]
            r = GGUFReader(f)
            t = r.tensors[1]
            with open(f, "r+b") as fh:
                fh.seek(int(t.data_offset) + 7)
                b = fh.read(1)
                fh.seek(int(t.data_offset) + 7)
                fh.write(bytes([b[0] ^ 0x10]))
            corrupt.name = t.name
        real(point)
    monkeypatch.setattr(pub, "_hook", corrupt)
    with pytest.raises(PublishVerifyFailed) as e:
        pub.publish(tmp_path / "a", synthetic_plans(3, 0.2, seed=6))
    assert repr(corrupt.name) in str(e.value) and "word sum" in str(e.value)
    assert not (tmp_path / "a").exists() and leftovers(tmp_path / "a") == []


def test_every_shard_is_fsynced_before_sha256sums(tmp_path, monkeypatch):
    """The shards' fsyncs run behind the re-read; SHA256SUMS is written only once all are done."""
    import time
    events = []
    real_fsync = writer._Fsync.run

    def slow_fsync(self):
        time.sleep(0.2)                         # a slow disk: the re-read finishes first
        real_fsync(self)
        events.append("fsynced")
    real_synced = pub._write_synced

    def synced(path, text):
        events.append("wrote")
        return real_synced(path, text)
    monkeypatch.setattr(writer._Fsync, "run", slow_fsync)
    monkeypatch.setattr(pub, "_write_synced", synced)
    pub.publish(tmp_path / "a", synthetic_plans(4, 0.2, tp=2, seed=7), max_shard_bytes=400_000)
    shards = len(list((tmp_path / "a").glob("rank*.gguf")))
    assert events.count("fsynced") == shards > 2
    assert events.index("wrote") > max(i for i, k in enumerate(events) if k == "fsynced")
