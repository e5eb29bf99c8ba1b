"""compiler/publish.py: atomic publish under real SIGKILLs, concurrent runs, bounded memory."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifact_driver import plans as synthetic_plans
from bloomery.compiler import publish as pub
from bloomery.core.artifact import Artifact
from bloomery.core.errors import ArtifactLocked, OutputNotArtifact, PublishVerifyFailed

DRIVER = Path(__file__).parent / "artifact_driver.py"
# ~200 MB: 12 tensors of 16 MB, several shards
BIG = ["--tensors", "12", "--mb", "16", "--max-shard", "70"]


def run_driver(out, *args, kill_at=None, env=None, **kw):
    e = dict(os.environ, **(env or {}))
    e.pop("BLOOMERY_TEST_KILL_AT", None)
    if kill_at:
        e["BLOOMERY_TEST_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, str(DRIVER), str(out), *args], env=e, capture_output=True,
                          text=True, **kw)


def sums_of(out: Path) -> str:
    return (out / "SHA256SUMS").read_text()


def visible_state(out: Path):
    """None when out is absent, else its SHA256SUMS after a full verification (whole)."""
    if not os.path.lexists(out):
        return None
    a = Artifact.open(out, verify=True)
    for r in a.ranks:                          # and every tensor decodes
        for base in list(a.tensors(r))[:2]:
            a.decode(base, r)
    return sums_of(out)


def leftovers(out: Path):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.bloomery-"))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Reference artifacts: the previous one (seed 1, small) and the new one (seed 2, BIG)."""
    d = tmp_path_factory.mktemp("refs")
    r1 = run_driver(d / "old", "--seed", "1", "--tensors", "3", "--mb", "1")
    r2 = run_driver(d / "new", "--seed", "2", *BIG)
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    return d / "old", d / "new"


POINTS = ["tensor:1", "tensor:7", "shard", "verify", "verify:3", "sums", "swap", "swapped", "cleaned"]


@pytest.mark.parametrize("point", POINTS)
def test_kill_with_previous(tmp_path, refs, point):
    old, new = refs
    out = tmp_path / "out"
    assert run_driver(out, "--seed", "1", "--tensors", "3", "--mb", "1").returncode == 0
    assert sums_of(out) == sums_of(old)
    r = run_driver(out, "--seed", "2", *BIG, kill_at=point)
    assert r.returncode == -signal.SIGKILL, r.stderr
    state = visible_state(out)
    before_swap = point.split(":")[0] in ("tensor", "shard", "verify", "sums", "swap")
    assert state == (sums_of(old) if before_swap else sums_of(new))
    # the next publish cleans what the killed one left and publishes whole
    r = run_driver(out, "--seed", "2", *BIG)
    assert r.returncode == 0, r.stderr
    assert visible_state(out) == sums_of(new)
    assert leftovers(out) == []


@pytest.mark.parametrize("point", ["tensor:2", "sums", "swap", "swapped"])
def test_kill_first_publish(tmp_path, refs, point):
    out = tmp_path / "out"
    r = run_driver(out, "--seed", "2", *BIG, kill_at=point)
    assert r.returncode == -signal.SIGKILL
    state = visible_state(out)
    assert state == (sums_of(refs[1]) if point == "swapped" else None)


@pytest.mark.parametrize("point", ["swap-fallback", "swapped"])
def test_kill_in_fallback_swap(tmp_path, refs, point):
    """Without renameat2: a kill between the two renames leaves out absent and the previous
    artifact whole beside it; the next publish (or recover()) puts it back first."""
    old, new = refs
    out = tmp_path / "out"
    assert run_driver(out, "--seed", "1", "--tensors", "3", "--mb", "1").returncode == 0
    r = run_driver(out, "--seed", "2", *BIG, "--no-exchange", kill_at=point)
    assert r.returncode == -signal.SIGKILL
    if point == "swap-fallback":
        assert not out.exists()
        pub.recover(out)
        assert visible_state(out) == sums_of(old)
    else:
        assert visible_state(out) == sums_of(new)
    assert run_driver(out, "--seed", "2", *BIG, "--no-exchange").returncode == 0
    assert visible_state(out) == sums_of(new) and leftovers(out) == []


def test_kill_at_random_times(tmp_path, refs):
    """SIGKILL from outside at spread-out moments: out is always the old or the new artifact, whole."""
    old, new = refs
    out = tmp_path / "out"
    assert run_driver(out, "--seed", "1", "--tensors", "3", "--mb", "1").returncode == 0
    seen = set()
    for delay in (0.3, 0.8, 1.3, 1.8, 2.4, 3.0, 3.6):
        p = subprocess.Popen([sys.executable, str(DRIVER), str(out), "--seed", "2", *BIG],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.communicate()
        state = visible_state(out)
        assert state in (sums_of(old), sums_of(new))
        seen.add(state == sums_of(new))
        if state == sums_of(new):                 # start again from the old one
            assert run_driver(out, "--seed", "1", "--tensors", "3", "--mb", "1").returncode == 0
    assert False in seen                          # at least one kill landed before the swap


def test_concurrent_publishes(tmp_path, refs):
    """Three publishes to one out, started while the first is writing: each waits its turn
    (a second run's stale-folder cleanup would otherwise delete the first's folder), all
    succeed, and out ends whole: one of the inputs."""
    old, new = refs
    out = tmp_path / "out"
    runs = (["--seed", "2", *BIG], ["--seed", "1", "--tensors", "3", "--mb", "1"], ["--seed", "2", *BIG])
    ps = []
    for args in runs:
        ps.append(subprocess.Popen([sys.executable, str(DRIVER), str(out), *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))
        time.sleep(0.7)
    for p in ps:
        o, e = p.communicate()
        assert p.returncode == 0, e
    assert visible_state(out) == sums_of(new)
    assert leftovers(out) == []


def test_locked_fails_by_name_without_wait(tmp_path):
    out = tmp_path / "out"
    lock = pub.side_names(out)[0]
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ArtifactLocked):
            pub.publish(out, synthetic_plans(1, 0.01), wait=False)
    finally:
        os.close(fd)
    pub.publish(out, synthetic_plans(1, 0.01), wait=False)
    assert visible_state(out)


def test_refuses_to_replace_other_folders(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(OutputNotArtifact):
        pub.publish(out, synthetic_plans(1, 0.01))
    assert (out / "notes.txt").read_text() == "precious"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputNotArtifact):
        pub.publish(f, synthetic_plans(1, 0.01))
    empty = tmp_path / "empty"
    empty.mkdir()
    pub.publish(empty, synthetic_plans(1, 0.01))
    assert visible_state(empty)


def test_verify_catches_a_changed_byte(tmp_path, monkeypatch):
    """A byte changed on disk after writing: the tensor's SHA-256 read back differs."""
    out = tmp_path / "out"
    pub.publish(out, synthetic_plans(2, 0.05, seed=1))
    before = sums_of(out)
    real = pub._hook

    def corrupt(point):
        if point == "shard":
            f = sorted(Path(p) for p in out.parent.glob(".out.bloomery-tmp-*/*.gguf"))[-1]
            with open(f, "r+b") as fh:
                fh.seek(-64, 2)
                b = fh.read(1)
                fh.seek(-64, 2)
                fh.write(bytes([b[0] ^ 1]))
        real(point)
    monkeypatch.setattr(pub, "_hook", corrupt)
    with pytest.raises(PublishVerifyFailed, match="SHA-256"):
        pub.publish(out, synthetic_plans(2, 0.05, seed=2))
    assert sums_of(out) == before and leftovers(out) == []


def test_verify_spot_check_catches_a_wrong_layout(tmp_path, monkeypatch):
    """Bytes written consistently but wrong (a layout bug): only the decode spot check sees it."""
    from bloomery.core.artifact import layout
    real = layout.iter_gguf

    def swapped_nibbles(fmt, parts, *a, **k):
        for suffix, chunk in real(fmt, parts, *a, **k):
            if fmt == "nvfp4" and suffix == "weight":
                chunk = chunk.copy()
                chunk[40] ^= 0x11
            yield suffix, chunk
    monkeypatch.setattr(layout, "iter_gguf", swapped_nibbles)
    with pytest.raises(PublishVerifyFailed, match="decodes differently"):
        pub.publish(tmp_path / "out", synthetic_plans(1, 0.05, fmts=("nvfp4",)))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@pytest.mark.slow
def test_peak_rss_bounded(tmp_path):
    """~3 GB published (48 tensors of 64 MB made by produce()): the child's peak RSS stays
    under 1.5 GB."""
    r = run_driver(tmp_path / "out", "--tensors", "48", "--mb", "64", "--formats", "nvfp4,fp8_block128,nvfp4,mxfp4",
                   "--max-shard", "1000")
    assert r.returncode == 0, r.stderr
    _, rss_kib, secs = r.stdout.split()
    total = sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    assert total > 3.0e9
    print(f"published {total / 1e9:.2f} GB in {float(secs):.1f} s, peak RSS {int(rss_kib) / 1024:.0f} MiB")
    assert int(rss_kib) * 1024 < 1.5e9
