"""The fuzzer (tools/fuzz.py): a short seeded run over the tiny test models passes (every case a named
refusal or a success, no traceback, no hang, nothing left behind, nothing damaged run silently), and
each reader bug it found stays fixed: one test per bug, the mutation that found it applied by hand."""

import json
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from bloomery.cli import main
from bloomery.compiler.prepare import prepare
from bloomery.tools import fuzz, models

pytestmark = pytest.mark.models


def need(name: str):
    if not models.is_built(name):
        pytest.skip(f"{name} not built in {models.models_dir()} (run: make models)")
    return models.model_dir(name)


def refused(args, name: str, *words):
    """The command exits non-zero with `error: <name>: ...` naming `words`, and no other exception."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"error: {name}: " in r.output, r.output
    for w in words:
        assert w in r.output, (w, r.output)
    return r


def test_seeded_subset():
    """120 cases of seed 0 (checkpoints and artifacts, sealed and not) through the command line."""
    need("tiny-llama/nvfp4")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "bloomery.tools.fuzz", "--cases", "120", "--seed", "0", "--json",
                        "--models", "tiny-llama/nvfp4,tiny-llama/fp8,tiny-llama/bf16,tiny-llama/mxfp8"],
                       capture_output=True, text=True, timeout=300)
    s = json.loads(r.stdout)
    assert r.returncode == 0 and s["failed"] == 0, (r.stderr[-3000:], s["failures"])
    assert s["cases"] == 120 and set(s["by_target"]) == {"checkpoint", "artifact"}
    refusals = {o for st in s["outcomes"].values() for o in st if o.startswith("refused:")}
    assert len(refusals) >= 8 and all(st.get("ok") for st in s["outcomes"].values()), s["outcomes"]
    print(f"fuzz subset: {s['cases']} cases in {time.monotonic() - t0:.1f} s, {len(refusals)} kinds of refusal")


def test_stage_classifier_fails_a_traceback(tmp_path):
    """The fuzzer counts a traceback, an unnamed error and a hang as failures (the machinery itself)."""
    fuzz.NAMED |= fuzz._named_errors()
    ok, _ = fuzz.run_stage(["levers"], tmp_path, 30, 4 << 30)
    assert ok == "ok"
    named, _ = fuzz.run_stage(["inspect", str(tmp_path)], tmp_path, 30, 4 << 30)
    assert named == "refused:CheckpointError"
    (tmp_path / "ids.json").write_text("[1]")
    bad, text = fuzz.run_stage(["logits", str(tmp_path), "--ids", str(tmp_path / "nope"), "--out", "x"], tmp_path,
                               30, 4 << 30)
    assert bad.startswith("unnamed:") and "Usage" in text


# -- one test per bug the fuzzer found ------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(need("tiny-llama/nvfp4"), dst)
    return dst


@pytest.fixture(scope="module")
def base_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "art"
    prepare(need("tiny-llama/nvfp4"), out, progress=False)
    return out


@pytest.fixture
def art(tmp_path, base_artifact):
    dst = tmp_path / "art"
    shutil.copytree(base_artifact, dst)
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    return dst


def edit_json(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def sealed_json(art, key, fn):
    """An artifact whose metadata JSON `key` is edited by fn(obj) and whose SHA256SUMS is made to match
    (DIGESTS.json dropped): the parser, not the checksums, meets the damage."""
    def edit(obj):
        fn(obj)
        return obj, "edited"
    assert fuzz.rewrite_gguf_json(art / "rank0-00001-of-00001.gguf", key, edit)
    fuzz.seal(art)


def logits(art):
    return ["logits", art, "--ids", art.parent / "ids.json", "--out", art.parent / "x.npy"]


def test_architectures_not_a_list(folder, tmp_path):
    edit_json(folder / "config.json", lambda c: c.update(architectures=2))
    refused(["prepare", folder, tmp_path / "out"], "UnreadableJSON", "architectures", "config.json")
    assert not (tmp_path / "out").exists()


def test_index_value_not_a_file_name(folder, tmp_path):
    fuzz.reshard(folder)
    edit_json(folder / "model.safetensors.index.json",
              lambda c: c["weight_map"].update({"model.norm.weight": -2**63}))
    refused(["inspect", folder], "UnreadableJSON", "weight_map['model.norm.weight']")


def test_eos_not_a_token_id(folder, tmp_path):
    (folder / "generation_config.json").write_text('{"eos_token_id": NaN}')
    refused(["prepare", folder, tmp_path / "out"], "UnreadableJSON", "generation_config.json", "eos_token_id")


@pytest.mark.parametrize("key,value", [("vocab_size", []), ("num_attention_heads", "x")])
def test_config_value_of_the_wrong_type(folder, tmp_path, key, value):
    edit_json(folder / "config.json", lambda c: c.update({key: value}))
    refused(["prepare", folder, tmp_path / "out"], "UnsupportedConfig", "config.json", repr(value))


def test_layer_count_beyond_the_tensors(folder, tmp_path):
    edit_json(folder / "config.json", lambda c: c.update(num_hidden_layers=1e308))
    refused(["prepare", folder, tmp_path / "out"], "MissingTensor", "layers", "stores")


def test_metadata_value_not_a_scalar(folder, tmp_path):
    edit_json(folder / "config.json", lambda c: c["rope_parameters"].update(rope_theta=[]))
    refused(["prepare", folder, tmp_path / "out"], "UnsupportedConfig", "config.json", "f32")


def test_tokenizer_not_utf8(folder, tmp_path):
    raw = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(raw[:100] + b"\xff" + raw[100:])
    refused(["prepare", folder, tmp_path / "out"], "UnreadableJSON", "tokenizer.json", "UTF-8")


def test_tokenizer_that_does_not_load(folder, tmp_path):
    edit_json(folder / "tokenizer.json", lambda t: t["model"]["merges"].append([1]))
    prepare(folder, tmp_path / "out", progress=False)        # the tokenizer travels as text
    refused(["run", tmp_path / "out", "-p", "hi", "-n", "2"], "NoTokenizer", "tokenizer", "does not load")


def test_chat_template_that_does_not_parse(folder, tmp_path):
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    prepare(folder, tmp_path / "out", progress=False)
    refused(["run", tmp_path / "out", "-p", "hi", "-n", "2"], "NoTokenizer", "chat template", "--raw")


def test_sums_not_ascii(art):
    raw = bytearray((art / "SHA256SUMS").read_bytes())
    raw[2] |= 0x80
    (art / "SHA256SUMS").write_bytes(bytes(raw))
    for args in (["inspect", art], ["verify", art], logits(art)):
        refused(args, "ArtifactMalformed", "SHA256SUMS", "not ASCII")


@pytest.mark.parametrize("edit,words", [
    (lambda t: t["blk.0.attn_norm"].update(optional=7), ["blk.0.attn_norm"]),
    (lambda t: t["blk.0.attn_norm"].update(format=None), ["blk.0.attn_norm", "format"]),
    (lambda t: t["blk.1.attn_k"].pop("shape"), ["blk.1.attn_k", "shape"]),
    (lambda t: t.update({"blk.0.attn_q": False}), ["blk.0.attn_q"]),
])
def test_tensor_table_entry_of_the_wrong_shape(art, edit, words):
    sealed_json(art, "bloomery.tensors", edit)
    for args in (["inspect", art], logits(art)):
        refused(args, "ArtifactMalformed", "bloomery.tensors", *words)


@pytest.mark.parametrize("edit,words", [
    (lambda p: p["programs"]["decode"]["ops"].__setitem__(9, 2), ["decode op 9", "not an object"]),
    (lambda p: p["programs"]["decode"]["ops"].__setitem__(3, None), ["decode op 3"]),
    (lambda p: p["buffers"]["o"]["shape"].__setitem__(0, False), ["buffer 'o'", "False"]),
])
def test_plan_of_the_wrong_shape(art, edit, words):
    sealed_json(art, "bloomery.plan", edit)
    refused(logits(art), "PlanInvalid", *words)


def test_plan_attribute_that_does_not_fit_its_buffers(art):
    def edit(p):
        op = next(o for o in p["programs"]["prefill"]["ops"] if o["op"] == "rope")
        op["head_dim"] = -1
    sealed_json(art, "bloomery.plan", edit)
    refused(logits(art), "PlanInvalid", "prefill op", "(rope)", "re-prepare")


def test_array_length_past_the_end_is_refused_at_once(art):
    """A GGUF array whose length runs past the file is refused before gguf-py loops over its elements."""
    shard = art / "rank0-00001-of-00001.gguf"
    regions, _ = fuzz.gguf_regions(shard)
    g = next(g for g in regions if g.name == "bloomery.eos_token_ids[4]")       # the array's length (u64)
    raw = bytearray(shard.read_bytes())
    raw[g.start:g.stop] = (10**7).to_bytes(8, "little")
    shard.write_bytes(bytes(raw))
    fuzz.seal(art)
    t0 = time.monotonic()
    refused(["inspect", art], "ArtifactMalformed", "runs past the end of the file")
    assert time.monotonic() - t0 < 5


def test_no_output_left_after_a_refused_prepare(folder, tmp_path):
    """The property every fuzz case checks, on one case: a refusal leaves no folder behind."""
    header, data = fuzz._st_split((folder / "model.safetensors").read_bytes())
    header["model.norm.weight"]["dtype"] = "F4"
    (folder / "model.safetensors").write_bytes(fuzz._st_join(header, data))
    refused(["prepare", folder, tmp_path / "out"], "UnsupportedDtype", "model.norm.weight", "F4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
