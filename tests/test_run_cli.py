"""`bloomery run` and `bloomery logits` on artifacts of every export the prepare tests use, at
TP=1 and TP=2 (same greedy tokens, logits within float32 rounding), and their refusals."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bloomery import runtime
from bloomery.cli import main
from runtime_artifacts import EXPORTS, REFUSED, artifact

pytestmark = pytest.mark.models


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.parametrize("name", EXPORTS)
def test_run_json_and_logits(tmp_path, name):
    small = name.startswith("tiny")
    n = 8 if small else 3
    got = {}
    for tp in (1, 2):
        if (name, tp) in REFUSED:
            continue
        art = artifact(name, tp)
        r = cli("run", art, "--prompt", "The capital of France is", "--json", "-n", n, "--device", "auto")
        g = json.loads(r.stdout)
        assert g["device"] == "cpu" and g["prompt_tokens"] == len(g["prompt_ids"]) > 5
        assert g["generated_tokens"] == len(g["token_ids"]) <= n and g["stop"] in ("eos", "length")
        assert isinstance(g["text"], str) and g["prompt_s"] > 0 and g["load_s"] > 0
        # the prefill gives the first token, each decode step one more (at EOS the last step gave EOS)
        assert g["decode_steps"] == len(g["token_ids"]) - (g["stop"] == "length")
        ids = g["prompt_ids"][:12] + g["token_ids"]
        (tmp_path / "ids.json").write_text(json.dumps(ids))
        cli("logits", art, "--ids", tmp_path / "ids.json", "--out", tmp_path / f"x{tp}.npy", "--ubatch", 5)
        x = np.load(tmp_path / f"x{tp}.npy")
        vocab = 512 if small else 49152
        assert x.dtype == np.float32 and x.shape == (len(ids), vocab) and np.isfinite(x).all()
        got[tp] = (g["token_ids"], g["text"], x)
    if len(got) == 2:
        assert got[2][:2] == got[1][:2]                          # TP=2: the same greedy tokens and text
        a, b = got[1][2], got[2][2]
        assert np.linalg.norm(b - a) / np.linalg.norm(a) < 1e-5


def test_run_streams_text_and_speed():
    art = artifact("tiny-llama/bf16")
    r = CliRunner().invoke(main, ["run", str(art), "-p", "hello", "-n", "6"])
    assert r.exit_code == 0, r.output
    g = runtime.generate(art, "hello", max_tokens=6)
    assert r.stdout == g.text + "\n"
    assert "tok/s" in r.stderr and "prompt" in r.stderr and "decode" in r.stderr


def test_sampling_is_seeded():
    art = artifact("tiny-llama/bf16")
    runs = [runtime.generate(art, "hello", max_tokens=10, temperature=0.9, top_k=40, top_p=0.9, seed=s).token_ids
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0
    greedy = runtime.generate(art, "hello", max_tokens=10).token_ids
    assert runs[0] != greedy or runs[2] != greedy


def test_raw_skips_the_template():
    art = artifact("tiny-llama/bf16")
    eng = runtime.Engine(art)
    templ = runtime.generate(eng, "hello", max_tokens=1)
    raw = runtime.generate(eng, "hello", raw=True, max_tokens=1)
    assert len(raw.prompt_ids) < len(templ.prompt_ids) and templ.prompt_ids[0] == 1    # <|im_start|>


def test_refusals(tmp_path):
    art = artifact("tiny-llama/bf16")
    from bloomery.runtime.device import gpu_present
    if not gpu_present():                 # with a GPU, --device cuda runs (tests/test_cuda_executor.py)
        r = CliRunner().invoke(main, ["run", str(art), "-p", "hi", "--device", "cuda"])
        assert r.exit_code != 0 and "DeviceUnavailable" in r.output and "--device cuda" in r.output
    (tmp_path / "ids.json").write_text("[1, 2, 512]")
    r = CliRunner().invoke(main, ["logits", str(art), "--ids", str(tmp_path / "ids.json"), "--out", str(tmp_path / "x.npy")])
    assert r.exit_code != 0 and "TokenOutOfVocab" in r.output and "id 512 at index 2" in r.output
    (tmp_path / "ids.json").write_text('{"ids": [1]}')
    r = CliRunner().invoke(main, ["logits", str(art), "--ids", str(tmp_path / "ids.json"), "--out", str(tmp_path / "x.npy")])
    assert r.exit_code != 0 and "JSON list of integers" in r.output
    r = CliRunner().invoke(main, ["run", str(art), "-p", "hello " * 200, "--ctx-size", "64"])
    assert r.exit_code != 0 and "PromptTooLong" in r.output and "--ctx-size" in r.output
    assert not (tmp_path / "x.npy").exists()


def test_generation_stops_when_the_context_is_full():
    g = runtime.generate(artifact("tiny-llama/bf16"), "hello", max_tokens=100, ctx=24)
    assert g.stop in ("ctx", "eos") and len(g.prompt_ids) + len(g.token_ids) <= 24 + 1


def test_runtime_imports_neither_compiler_nor_torch():
    import subprocess
    import sys
    code = ("import sys; from bloomery import runtime; runtime.logits(sys.argv[1], [1, 2, 3]); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('bloomery.compiler')]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, str(artifact("tiny-qwen3_moe/nvfp4", 2))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- llama.cpp's habits: --ignore-eos, -n/--n-predict; --verify -----------------------------------------------

def test_ignore_eos_masks_the_eos_ids():
    """With the greedy first token made the EOS id, generation stops at once; with ignore_eos every
    token is the argmax of the teacher-forced logits (runtime.logits) with the EOS id masked out."""
    art = artifact("tiny-llama/bf16")
    eng = runtime.Engine(art)
    first = runtime.generate(eng, "hello", max_tokens=1).token_ids[0]
    eng.eos_ids = [first]
    assert runtime.generate(eng, "hello", max_tokens=8).stop == "eos"
    g = runtime.generate(eng, "hello", max_tokens=8, ignore_eos=True)
    assert g.stop == "length" and len(g.token_ids) == 8 and first not in g.token_ids
    x = runtime.logits(art, g.prompt_ids + g.token_ids)
    x[:, first] = -np.inf
    assert g.token_ids == [int(i) for i in np.argmax(x[len(g.prompt_ids) - 1:-1], axis=1)]


def test_n_predict_and_ignore_eos_flags():
    art = artifact("tiny-llama/bf16")
    for flag in ("-n", "--n-predict", "--max-tokens"):
        g = json.loads(cli("run", art, "-p", "hi", "--json", "--ignore-eos", flag, 5).stdout)
        assert g["generated_tokens"] == 5 and g["stop"] == "length", (flag, g)
    g = json.loads(cli("run", art, "-p", "hi", "--json", "--ignore-eos", "-n", -1, "--ctx-size", 24).stdout)
    assert g["stop"] == "ctx" and g["prompt_tokens"] + g["generated_tokens"] == 25
    r = CliRunner().invoke(main, ["run", str(art), "-p", "hi", "-n", "0"])
    assert r.exit_code == 2 and "-1 for until EOS" in r.output
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "bloomery verify <artifact>" in help_text and "CUDA executor on a GPU, else NumPy on the CPU" in help_text


def test_verify_flag_refuses_a_flipped_tensor_byte(tmp_path):
    import shutil

    from gguf import GGUFReader
    src = artifact("tiny-llama/nvfp4")
    art = tmp_path / "art"
    shutil.copytree(src, art)
    shard = next(art.glob("*.gguf"))
    t = next(t for t in GGUFReader(shard).tensors if t.name == "blk.1.ffn_down.weight")
    raw = bytearray(shard.read_bytes())
    raw[int(t.data_offset) + 7] ^= 0x01
    shard.write_bytes(bytes(raw))
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    for args in (["run", art, "-p", "hi", "-n", "2", "--verify"],
                 ["logits", art, "--ids", tmp_path / "ids.json", "--out", tmp_path / "x.npy", "--verify"]):
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
        assert "error: ArtifactChecksumMismatch:" in r.output and "'blk.1.ffn_down.weight'" in r.output
    cli("run", art, "-p", "hi", "-n", "2")          # without --verify the damage is not looked at (off by default)
    assert not (tmp_path / "x.npy").exists()
