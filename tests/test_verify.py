"""Integrity of an artifact: what prepare writes (SHA256SUMS, DIGESTS.json) checked against
independent references (hashlib and gguf-py over the files themselves, a word sum written out
word by word), `bloomery verify`, the checks at load (a shard's size and header always, each
tensor with --verify), a metadata string that is not UTF-8, and the GPU's fit decision."""

import hashlib
import json
import shutil
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from artifact_driver import plans as synthetic_plans
from bloomery.cli import main
from bloomery.compiler.publish import publish
from bloomery.core.artifact import Artifact
from bloomery.core.artifact.integrity import DIGESTS, WordSum, word_sum
from bloomery.core.errors import ArtifactChecksumMismatch, ArtifactMalformed, ShardSizeMismatch
from bloomery.runtime import device as devices
from bloomery.runtime.errors import InsufficientDeviceMemory
from bloomery.tools import fuzz


def reference_sum(data: bytes) -> str:
    """The word sum as docs/artifact.md defines it, word by word: s1 = sum of the little-endian
    u64 words (the last zero-padded), s2 = sum of word * (its 4 KiB block's index + 1), mod 2^64."""
    data = data + b"\0" * (-len(data) % 8)
    s1 = s2 = 0
    for i in range(0, len(data), 8):
        (w,) = struct.unpack_from("<Q", data, i)
        s1 += w
        s2 += w * (i // 4096 + 1)
    return f"{s1 % 2**64:016x}{s2 % 2**64:016x}"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    out = tmp_path_factory.mktemp("pub") / "art"
    publish(out, synthetic_plans(5, 0.02, tp=2), tokenizer_json="{}", chat_template="{{ 'é' }}",
            max_shard_bytes=30_000)
    return out


@pytest.fixture
def art(tmp_path, published):
    dst = tmp_path / "art"
    shutil.copytree(published, dst)
    return dst


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def flip(path, offset, bit=0x10):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= bit
    path.write_bytes(bytes(raw))


def tensor_at(path, k=0):
    t = GGUFReader(path).tensors[k]
    return t.name, int(t.data_offset), int(t.n_bytes)


def test_word_sum_against_its_definition():
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 8, 4095, 4096, 4097, 20011):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert word_sum(b) == reference_sum(b), n
        w, i = WordSum(), 0
        while i < n:                                    # fed in pieces of any size
            k = int(rng.integers(1, 6000))
            w.update(b[i:i + k])
            i += k
        assert w.hexdigest() == reference_sum(b), n
    a = bytearray(rng.integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes())
    b = a[4096:8192] + a[:4096] + a[8192:]               # two blocks swapped: the weighted sum sees it
    assert word_sum(bytes(a)) != word_sum(bytes(b))


def test_what_prepare_writes(published):
    sums = dict(line.split("  ")[::-1] for line in (published / "SHA256SUMS").read_text().splitlines())
    files = sorted(p.name for p in published.iterdir())
    assert sorted([*sums, "SHA256SUMS"]) == files and DIGESTS in files and len(files) > 4   # shards per rank
    for n, h in sums.items():
        assert hashlib.sha256((published / n).read_bytes()).hexdigest() == h
    d = json.loads((published / DIGESTS).read_text())
    assert d["version"] == 1 and sorted(d["shards"]) == sorted(n for n in files if n.endswith(".gguf"))
    for n, e in d["shards"].items():
        raw = (published / n).read_bytes()
        r = GGUFReader(published / n)
        assert e["bytes"] == len(raw) and e["header"]["bytes"] == r.data_offset
        head = raw[:r.data_offset]
        assert e["header"] == {"bytes": r.data_offset, "sha256": hashlib.sha256(head).hexdigest(),
                               "sum": reference_sum(head)}
        assert sorted(e["tensors"]) == sorted(t.name for t in r.tensors)
        for t in r.tensors:
            b = raw[t.data_offset:t.data_offset + t.n_bytes]
            assert e["tensors"][t.name] == {"sha256": hashlib.sha256(b).hexdigest(), "sum": reference_sum(b)}
    r = cli("verify", published)
    assert r.exit_code == 0 and "OK" in r.output and "match DIGESTS.json" in r.output, r.output


def test_verify_names_every_damaged_tensor(art):
    a, b = sorted(art.glob("rank0-*.gguf"))[0], sorted(art.glob("rank1-*.gguf"))[-1]
    (na, oa, _), (nb, ob, nbytes) = tensor_at(a), tensor_at(b, -1)
    flip(a, oa + 3)
    flip(b, ob + nbytes - 1)
    r = cli("verify", art)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "error: ArtifactChecksumMismatch:" in r.output and "4 problem(s)" in r.output
    for w in (a.name, b.name, repr(na), repr(nb), "SHA256SUMS"):
        assert w in r.output, (w, r.output)


def test_size_checked_at_load(art):
    shard = sorted(art.glob("rank1-*.gguf"))[0]
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-1])
    with pytest.raises(ShardSizeMismatch, match=f"{shard.name}.*truncated"):
        Artifact.open(art)
    shard.write_bytes(raw + b"\0")
    with pytest.raises(ShardSizeMismatch, match=f"{shard.name}.*bytes added"):
        Artifact.open(art)
    r = cli("inspect", art)
    assert r.exit_code == 2 and "error: ShardSizeMismatch:" in r.output


def test_header_checked_at_load(art):
    shard = sorted(art.glob("rank0-*.gguf"))[0]
    flip(shard, GGUFReader(shard).data_offset - 40)       # the last tensor info
    with pytest.raises(ArtifactChecksumMismatch, match=f"{shard.name}: its header"):
        Artifact.open(art).tensors(0)
    r = cli("inspect", art)
    assert r.exit_code == 2 and "error: ArtifactChecksumMismatch:" in r.output and "header" in r.output


def test_tensor_bytes_checked_at_load_with_verify(art):
    shard = sorted(art.glob("rank0-*.gguf"))[-1]
    name, off, _ = tensor_at(shard)
    base = name.rsplit(".", 1)[0]
    flip(shard, off + 1)
    Artifact.open(art).decode(base, 0)                    # the default: damaged data is not looked at
    a = Artifact.open(art, check=True)
    with pytest.raises(ArtifactChecksumMismatch, match=f"{shard.name}: tensor '{name}'"):
        a.decode(base, 0)
    other = next(n for n, t in a.tensors(0).items() if t.shard != shard.name)
    a.decode(other, 0)                                    # an undamaged tensor reads


def test_digests_json_checked_at_open(art):
    text = (art / DIGESTS).read_text()
    (art / DIGESTS).write_text(text.replace('"bytes": ', '"bytes":  ', 1))
    with pytest.raises(ArtifactChecksumMismatch, match="DIGESTS.json: does not match"):
        Artifact.open(art)


def test_an_artifact_without_digests(art):
    """An older artifact (no DIGESTS.json) opens; with check each shard is checked whole against SHA256SUMS."""
    fuzz.seal(art)
    shard = sorted(art.glob("rank0-*.gguf"))[0]
    assert cli("verify", art).exit_code == 0
    name, off, _ = tensor_at(shard)
    flip(shard, off)
    Artifact.open(art).tensors(0)
    with pytest.raises(ArtifactChecksumMismatch, match=f"{shard.name}: SHA-256 .* does not match SHA256SUMS"):
        Artifact.open(art, check=True).tensors(0)
    r = cli("verify", art)
    assert r.exit_code == 2 and shard.name in r.output


def test_metadata_string_not_utf8(art):
    """The chat template's 'é' (0xc3 0xa9) with its continuation byte broken, checksums made to match."""
    shard = sorted(art.glob("rank0-*.gguf"))[0]
    raw = bytearray(shard.read_bytes())
    i = raw.index("{{ 'é' }}".encode()) + 5
    assert raw[i] == 0xA9
    raw[i] = 0x41
    shard.write_bytes(bytes(raw))
    fuzz.seal(art)
    with pytest.raises(ArtifactMalformed, match="'tokenizer.chat_template' holds a string that is not UTF-8"):
        Artifact.open(art).metadata(0)
    r = cli("inspect", art)
    assert r.exit_code == 2 and "error: ArtifactMalformed:" in r.output and "not UTF-8" in r.output


# -- a model that does not fit the GPU is refused before the upload -------------------------------------------

def test_device_bytes_and_the_fit_decision():
    plan = {"model": {}, "buffers": {
        "tokens": {"shape": ["rows"], "dtype": "i32", "kind": "input"},
        "x": {"shape": ["rows", 8], "dtype": "f32", "kind": "scratch"},
        "kv": {"shape": ["slots", "ctx", 4], "dtype": "f32", "kind": "state"},
        "ng": {"shape": ["slots", 3], "dtype": "i32", "kind": "state"}},
        "programs": {
            "decode": {"rows": "slots", "ops": [
                {"op": "embed", "ids": "tokens", "out": "x", "weight": "emb"},
                {"op": "linear", "x": "x", "out": "x", "weight": "w", "format": "nvfp4", "pre_quant_scale": False}]},
            "prefill": {"rows": "ubatch", "ops": [
                {"op": "embed", "ids": "tokens", "out": "x", "weight": "emb"}]}}}
    table = {"emb": type("T", (), {"nbytes": 1000})(), "w": type("T", (), {"nbytes": 234})()}
    need = devices.device_bytes(plan, table, {"slots": 2, "ubatch": 16, "ctx": 100})
    # weights 1000 + 234; decode: tokens 2 + x 16 + kv 800 + ng 6 (state once); prefill: tokens 16 + x 128
    assert need == {"weights": 1234, "buffers": 4 * (2 + 16 + 800 + 6 + 16 + 128)}
    total = sum(need.values())
    devices.check_fits(need, total, 10 * total, "art: rank 0")           # exactly enough: fits
    with pytest.raises(InsufficientDeviceMemory) as e:
        devices.check_fits(need, total - 1, 10 * total, "art: rank 0")
    msg = str(e.value)
    assert f"needs at least {total:,} bytes" in msg and f"{total - 1:,} of its {10 * total:,} bytes are free" in msg
    assert "weights 1,234" in msg and "art: rank 0" in msg and "--device cpu" in msg
