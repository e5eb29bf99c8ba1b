"""Kernels compiled ahead of time (CUTLASS DSL, no GPU): `bloomery prepare --target sm_90a` puts
them into the artifact's metadata, the record refuses every damaged part by name, the runtime's
choice of them says why. Their values on the GPU: tests/test_cuda_aot.py."""

import base64
import hashlib
import json

import pytest
from click.testing import CliRunner

from bloomery.cli import main
from bloomery.compiler import cutedsl
from bloomery.compiler.prepare import prepare
from bloomery.core.artifact import kernels as K
from bloomery.core.artifact.reader import Artifact
from bloomery.runtime.cuda import aot
from bloomery.tools import models

needs_dsl = pytest.mark.skipif(cutedsl.dsl_version() is None,
                               reason=f"nvidia-cutlass-dsl is not installed (pip install '{cutedsl.PIN}')")


def need(name):
    if not models.is_built(name):
        pytest.skip(f"{name} not built in {models.models_dir()} (run: make models)")
    return models.model_dir(name)


@pytest.fixture(scope="module")
def record_text():
    if cutedsl.dsl_version() is None:
        pytest.skip(f"nvidia-cutlass-dsl is not installed (pip install '{cutedsl.PIN}')")
    return cutedsl.compile_record("sm_90a")


@needs_dsl
def test_compile_record_is_sm90a_cubins_with_their_abi(record_text):
    rec = K.decode(record_text, "here")
    assert rec.target == "sm_90a" and rec.capability == (9, 0) and rec.compiler.startswith("nvidia-cutlass-dsl ")
    assert set(rec.kernels) == {"act_split", "act_round"}
    for name, k in rec.kernels.items():
        assert k.symbol.startswith("kernel_cutlass_act_k_") and k.symbol in K.elf_functions(k.cubin)
        assert k.symbol.endswith(f"_{name == 'act_split'}_0")                # the split flag, a constant
        assert k.block == 256 and k.params == ("ptr", "ptr", "ptr", "i64")
    assert cutedsl.compile_record("sm_90a") == record_text          # the same bytes again


@needs_dsl
def test_record_refuses_each_damaged_part(record_text):
    d = json.loads(record_text)

    def bad(mutate, words):
        e = json.loads(record_text)
        mutate(e)
        with pytest.raises(K.BadKernelRecord) as ei:
            K.decode(json.dumps(e), "art")
        for w in words:
            assert w in str(ei.value), str(ei.value)
        assert "re-prepare" in str(ei.value) or "cubin" in str(ei.value)

    cubin = base64.b64decode(d["kernels"]["act_split"]["cubin"])
    flipped = base64.b64encode(cubin[:100] + bytes([cubin[100] ^ 1]) + cubin[101:]).decode()
    bad(lambda e: e["kernels"]["act_split"].update(cubin=flipped), ["act_split", "SHA-256"])
    bad(lambda e: e.update(version=2), ["version 2"])
    bad(lambda e: e.update(target="sm_80"), ["sm_80"])
    bad(lambda e: e["kernels"]["act_round"].pop("symbol"), ["act_round", "malformed"])

    def resign(e, name, blob):
        e["kernels"][name].update(cubin=base64.b64encode(blob).decode(),
                                  sha256=hashlib.sha256(blob).hexdigest())
    bad(lambda e: resign(e, "act_split", cubin[:40]), ["act_split", "ELF"])
    bad(lambda e: resign(e, "act_split", cubin[:18] + b"\x3e\x00" + cubin[20:]), ["act_split", "not CUDA"])
    bad(lambda e: e["kernels"]["act_split"].update(symbol="nope"), ["act_split", "'nope'"])
    bad(lambda e: e["kernels"]["act_split"].update(params=["ptr", "f32"]), ["act_split", "params"])
    bad(lambda e: e["kernels"]["act_split"].update(block=0), ["act_split", "block"])


@needs_dsl
@pytest.mark.models
def test_prepare_target_carries_the_kernels(tmp_path, record_text):
    folder = need("tiny-llama/nvfp4")
    r = CliRunner().invoke(main, ["prepare", str(folder), str(tmp_path / "a"), "--target", "sm_90a", "--tp", "2"])
    assert r.exit_code == 0, r.output
    assert "sm_90a" in r.output and "act_split" in r.output
    art = Artifact.open(tmp_path / "a", verify=True)
    for rank in (0, 1):
        assert art.metadata(rank)[K.KEY] == record_text
    prepare(folder, tmp_path / "b", tp=2, target="sm_90a", progress=False)
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    prepare(folder, tmp_path / "c", progress=False)
    assert K.KEY not in Artifact.open(tmp_path / "c").metadata(0)


@pytest.mark.models
def test_prepare_target_refusals(tmp_path, monkeypatch):
    folder = need("tiny-llama/nvfp4")
    r = CliRunner().invoke(main, ["prepare", str(folder), str(tmp_path / "x"), "--target", "sm_80"])
    assert r.exit_code != 0 and "sm_90a" in r.output and not (tmp_path / "x").exists()
    monkeypatch.setattr(cutedsl, "dsl_version", lambda: None)
    r = CliRunner().invoke(main, ["prepare", str(folder), str(tmp_path / "x"), "--target", "sm_90a"])
    assert r.exit_code != 0 and "pip install" in r.output and cutedsl.PIN in r.output, r.output
    assert "without --target" in r.output and not (tmp_path / "x").exists()


@needs_dsl
def test_runtime_choice_says_why(record_text):
    rec = K.decode(record_text, "art")
    use, why = aot.choose(rec, (9, 0), {})
    assert use and "sm_90a" in why and "act_split" in why
    use, why = aot.choose(rec, (8, 9), {})
    assert not use and "8.9" in why and "sm_90a" in why
    use, why = aot.choose(rec, (9, 0), {"BLOOMERY_AOT": "off"})
    assert not use and "BLOOMERY_AOT=off" in why
    use, why = aot.choose(None, (9, 0), {})
    assert not use and "--target sm_90a" in why
    assert aot.load({}, (9, 0))[0] == {}                            # no record: nothing loaded, no CuPy needed
