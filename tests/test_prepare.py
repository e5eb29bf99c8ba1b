"""`bloomery prepare` end to end on the real ModelOpt exports of `make models`: every weight and
scale of the artifact decodes to exactly the checkpoint's value, at tp 1 and tp 2 (the ranks'
slices joined); refusals come before anything is written; the same input gives the same bytes;
a SIGKILL leaves the previous artifact whole; peak RSS stays bounded on a several-GB checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from bloomery.cli import main
from bloomery.compiler.checkpoint import Checkpoint
from bloomery.compiler.prepare import prepare, tokenizer_files
from bloomery.core import errors
from bloomery.core.artifact.reader import Artifact
from bloomery.tools import models
from ckpt import llama_tensors, write_folder

NAMES = [n for n in models.SPECS if n.startswith(("smollm2-135m/", "tiny-llama/", "tiny-qwen3_moe/"))]
REFUSED = {("tiny-llama/fp8_pb_wo", 2): errors.NotOnBlockBoundary}          # 128x128 blocks in a 128-row q
AXIS = {"column": -2, "row": -1}


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} not built in {models.models_dir()} (run: make models)")
    return models.model_dir(name)


def bits(a):
    a = np.ascontiguousarray(a, np.float32)
    return a.view(np.uint32)


def checkpoint_value(ck, sources):
    vals = [ck.tensors[s].decode() if s in ck.tensors else np.asarray(ck.kv_scales[s].array(), np.float32)
            for s in sources]
    return np.stack(vals) if len(vals) > 1 else vals[0]


def assert_artifact_exact(ck, art):
    """Every artifact tensor, its rank slices joined along its cut, equals the checkpoint's decode bit for bit,
    and every checkpoint tensor is in the artifact once (a tied head is read through the embedding)."""
    t0 = art.tensors(0)
    seen = set()
    for name, t in t0.items():
        pieces = [art.decode(name, r) for r in art.ranks]
        if t.cut == "replicated":
            for p in pieces[1:]:
                assert np.array_equal(bits(p), bits(pieces[0])), name
            got = pieces[0]
        else:
            got = np.concatenate(pieces, axis=AXIS[t.cut])
        want = checkpoint_value(ck, t.sources)
        if t.role.endswith("_exps") and want.ndim == got.ndim - 1:
            want = want[None]
        if want.ndim == 0:            # a one-value scale stored as [] is planned as [1]
            want = want.reshape(1)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert np.array_equal(bits(got), bits(want)), name
        seen.update(t.sources)
    tied = {"lm_head.weight"} if ck.config.get("tie_word_embeddings") else set()
    assert seen == (set(ck.tensors) | set(ck.kv_scales)) - tied


@pytest.mark.models
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_prepare_exact(tmp_path, name, tp):
    folder = need(name)
    out = tmp_path / "art"
    if (name, tp) in REFUSED:
        with pytest.raises(REFUSED[(name, tp)]):
            prepare(folder, out, tp=tp, progress=False)
        assert not out.exists() and not list(tmp_path.iterdir()), "nothing may be written before a refusal"
        return
    prepare(folder, out, tp=tp, progress=False)
    art = Artifact.open(out, verify=True)
    assert art.tp == tp and art.ranks == list(range(tp))
    ck = Checkpoint.open(folder)
    assert_artifact_exact(ck, art)
    tok, template = tokenizer_files(folder)
    assert art.tokenizer_json == tok and art.chat_template == template
    md = art.metadata(0)
    assert md["general.architecture"] == ("qwen3moe" if "qwen3_moe" in name else "llama")
    assert int(md["bloomery.tp.size"]) == tp
    if tp == 2:
        heads = [int(art.metadata(r)["bloomery.tp.head_count_kv"]) for r in art.ranks]
        assert sum(heads) == ck.config["num_key_value_heads"]


@pytest.mark.models
def test_same_input_same_bytes(tmp_path):
    folder = need("tiny-qwen3_moe/nvfp4_fp8kv")
    a, b = prepare(folder, tmp_path / "a", tp=2, progress=False), prepare(folder, tmp_path / "b", tp=2, progress=False)
    assert a.files == b.files
    for f in a.files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a" / "SHA256SUMS").read_bytes() == (tmp_path / "b" / "SHA256SUMS").read_bytes()


@pytest.mark.models
def test_q8_lever_cli(tmp_path):
    folder = need("smollm2-135m/bf16")
    r = CliRunner().invoke(main, ["prepare", str(folder), str(tmp_path / "q8")], env={"BLOOMERY_PREPARE_Q8": "1"})
    assert r.exit_code == 0, r.output
    art, ck = Artifact.open(tmp_path / "q8", verify=True), Checkpoint.open(folder)
    fmts = {t.role: t.format for t in art.tensors(0).values()}
    assert fmts["attn_q"] == fmts["ffn_down"] == fmts["token_embd"] == "q8_0"
    assert fmts["attn_norm"] == fmts["output_norm"] == "bf16"
    got, want = art.decode("blk.3.ffn_up"), ck.tensors["model.layers.3.mlp.up_proj.weight"].decode()
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01
    for env, args, cls in (({"BLOOMERY_PREPARE_Q8": "yes"}, [], "BadLeverValue"),
                           ({"BLOOMERY_PREPARE_Q8": "1"}, ["--keep-bf16"], "LeverConflict")):
        r = CliRunner().invoke(main, ["prepare", str(folder), str(tmp_path / "bad"), *args], env=env)
        assert r.exit_code != 0 and cls in r.output and "BLOOMERY_PREPARE_Q8" in r.output
        assert not (tmp_path / "bad").exists()


@pytest.mark.models
def test_inspect_artifact_and_decode(tmp_path):
    folder = need("tiny-qwen3_moe/nvfp4")
    prepare(folder, tmp_path / "art", tp=2, progress=False)
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "art"), "--json", "--rank", "1"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    assert obj["tp"] == 2 and obj["rank"] == 1 and len(obj["ranks"]) == 2
    rows = {t["name"]: t for t in obj["tensors"]}
    exps = rows["blk.0.ffn_down_exps"]
    assert exps["format"] == "nvfp4" and exps["cut"] == "row" and exps["shape"][0] == 8
    assert obj["totals"]["nvfp4"]["bytes"] == sum(t["bytes"] for t in rows.values() if t["format"] == "nvfp4")
    npy = tmp_path / "d.npy"
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "art"), "--tensor", "blk.0.ffn_down_exps", "--rank", "1",
                                  "--decode", str(npy)])
    assert r.exit_code == 0, r.output
    ck = Checkpoint.open(folder)
    full = checkpoint_value(ck, exps["sources"])
    got = np.load(npy)
    half = full.shape[-1] // 2
    assert got.dtype == np.float32 and np.array_equal(bits(got), bits(full[..., half:]))


def test_refusal_leaves_previous_artifact(tmp_path):
    rng = np.random.default_rng(1)
    good = write_folder(tmp_path / "good", llama_tensors(rng, "NVFP4", layers=2), {"quant_algo": "NVFP4"},
                        config={"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
                                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 96,
                                "max_position_embeddings": 64})
    prepare(good, tmp_path / "out", progress=False)
    before = (tmp_path / "out" / "SHA256SUMS").read_bytes()
    t = llama_tensors(rng, "NVFP4", layers=2)
    del t["model.layers.1.mlp.up_proj.weight_scale"]
    bad = write_folder(tmp_path / "bad", t, {"quant_algo": "NVFP4"}, config=json.loads((good / "config.json").read_text()))
    r = subprocess.run([sys.executable, "-m", "bloomery", "prepare", str(bad), str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "MissingScale" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "out" / "SHA256SUMS").read_bytes() == before
    Artifact.open(tmp_path / "out", verify=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["good", "bad", "out", ".out.lock"])


@pytest.fixture(scope="module")
def new_sums(tmp_path_factory):
    """SHA256SUMS of the new artifact of the SIGKILL tests (SmolLM2 NVFP4) at tp 1 and tp 2, each
    prepared separately, uninterrupted (prepare is deterministic: test_same_input_same_bytes)."""
    src, got = need("smollm2-135m/nvfp4"), {}

    def sums(tp):
        if tp not in got:
            ref = tmp_path_factory.mktemp(f"sigkill-ref-tp{tp}") / "art"
            prepare(src, ref, tp=tp, progress=False)
            got[tp] = (ref / "SHA256SUMS").read_bytes()
        return got[tp]
    return sums


# kill point -> (tp of the new artifact, the side `out` must be on after the kill). BLOOMERY_TEST_KILL_AT
# (compiler/publish.py) kills at the n-th time the point is reached: tensor:40 while writing; verify:2
# after the last shard is verified (tp 2: one shard per rank; a tp 1 SmolLM2 artifact has one shard,
# where verify:2 is never reached), before SHA256SUMS; swap on entering publish._swap, before its first
# rename: all leave the old artifact. swapped: right after the exchange (or the fallback's second
# rename): the new one. A timer kill lands anywhere: old or new.
KILLS = {"tensor:40": (1, "old"), "verify:2": (2, "old"), "swap": (1, "old"), "swapped": (1, "new"),
         "timer:0.4": (1, None), "timer:0.9": (1, None)}


@pytest.mark.models
@pytest.mark.parametrize("kill", list(KILLS))
def test_sigkill_leaves_old_or_new(tmp_path, kill, new_sums):
    """The real command SIGKILLed mid-way over a previous artifact: it was killed (not finished), and
    `out` is whole and exactly the old artifact or exactly the new one: the side the kill point implies."""
    old_src, new_src = need("tiny-llama/nvfp4"), need("smollm2-135m/nvfp4")
    tp, side = KILLS[kill]
    new = new_sums(tp)
    out = tmp_path / "out"
    prepare(old_src, out, progress=False)
    old = (out / "SHA256SUMS").read_bytes()
    assert old != new
    env = dict(os.environ)
    env.pop("BLOOMERY_TEST_KILL_AT", None)
    cmd = [sys.executable, "-m", "bloomery", "prepare", str(new_src), str(out), "--tp", str(tp)]
    if kill.startswith("timer"):
        # the whole command takes about 1.3 s here: where it finished before the timer, put the old
        # artifact back and try again sooner; it must have been killed in the end
        delays = [float(kill.split(":")[1]) / 2 ** i for i in range(6)]
        for delay in delays:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)          # nothing when it has already exited
            rc = p.wait(timeout=120)
            if rc == -signal.SIGKILL:
                break
            assert rc == 0, f"prepare exited {rc} before the timer of {delay} s"
            assert (out / "SHA256SUMS").read_bytes() == new
            prepare(old_src, out, progress=False)
        assert rc == -signal.SIGKILL, f"prepare finished before each of the timers {delays}"
    else:
        env["BLOOMERY_TEST_KILL_AT"] = kill
        rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120).returncode
        assert rc == -signal.SIGKILL, f"BLOOMERY_TEST_KILL_AT={kill} did not kill prepare: exit status {rc}"
    Artifact.open(out, verify=True)               # whole: every file against its SHA256SUMS
    sums = (out / "SHA256SUMS").read_bytes()
    assert sums in (old, new), f"after a kill at {kill}: SHA256SUMS is neither the old artifact's nor the new one's"
    if side is not None:
        assert sums == (old if side == "old" else new), \
            f"after a kill at {kill}: out is the {'new' if sums == new else 'old'} artifact, expected the {side} one"
    # the next run cleans what the killed one left and publishes
    prepare(new_src, out, tp=tp, progress=False)
    Artifact.open(out, verify=True)
    assert (out / "SHA256SUMS").read_bytes() == new
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "out"]


@pytest.mark.slow
def test_peak_rss_bounded_on_a_large_checkpoint(tmp_path):
    """A generated 2.6 GB Llama-3-8B-shaped NVFP4 checkpoint (4 layers, 1 GB BF16 embedding and head):
    prepare --tp 2 stays under 1.5 GB peak RSS (VmHWM of the prepare process itself)."""
    src = tmp_path / "src"
    subprocess.run([sys.executable, "-m", "bloomery.tools.synthetic", "llama3-8b", str(src), "--layers", "4"],
                   check=True, capture_output=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert size > 2.5e9
    code = ("import re, sys; from bloomery.compiler.prepare import prepare; "
            "prepare(sys.argv[1], sys.argv[2], tp=2, progress=False); "
            "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    peak_kib = int(r.stdout.split()[-1])
    assert peak_kib < 1.5 * 2**20, f"peak RSS {peak_kib / 2**20:.2f} GiB"
    Artifact.open(tmp_path / "out", verify=True)
