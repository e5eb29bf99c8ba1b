"""The `bloomery` command line. It imports both sides (compiler and runtime), so it is not part of the core."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from bloomery.core.errors import BloomeryError


def refusals(fn):
    """Named refusals print as one line on stderr (no traceback) and exit non-zero."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except BloomeryError as e:
            click.echo(f"error: {type(e).__name__}: {e}", err=True)
            sys.exit(e.exit_code)
        except OSError as e:
            click.echo(f"error: {type(e).__name__}: {e}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bloomery")
def main():
    """Compile NVIDIA ModelOpt checkpoints ahead of time and run them.

    \b
    bloomery inspect <folder|artifact>     what a checkpoint or an artifact holds
    bloomery prepare <folder> <out>        compile a checkpoint into an artifact
    bloomery verify <artifact>             check every byte of an artifact against its digests
    bloomery run <artifact> --prompt TEXT  generate text (the CUDA executor on a GPU, else NumPy on the CPU)
    bloomery logits <artifact> --ids F     teacher-forced logits of a token-id list
    bloomery serve -m <artifact|folder>    an OpenAI-compatible HTTP server
    bloomery levers                        the environment switches and their cost
    """


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _verbatim(text: str) -> str:
    """Text click prints as is (it rewraps paragraphs not marked with \\b)."""
    return "\n\n".join("\b\n" + para for para in text.strip("\n").split("\n\n"))


def _is_artifact(path: Path) -> bool:
    from bloomery.core.artifact.reader import SUMS
    return (path / SUMS).is_file() or any(path.glob("rank*-*-of-*.gguf"))


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--rank", type=int, default=None, help="Artifact: the tensor-parallel rank to show (default: 0; "
              "totals cover every rank).")
@click.option("--tensor", "tensor_name", default=None, help="One tensor by name: in an artifact its base name "
              "(blk.1.ffn_down) or a GGUF tensor's (blk.1.ffn_down.weight); in a checkpoint folder its HF name.")
@click.option("--decode", "decode_to", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --tensor: write its decoded float32 values to this .npy file ([out, in]; routed "
              "experts [expert, out, in]).")
@click.option("--plan", "show_plan", is_flag=True, help="Artifact: print the execution plan of --rank (buffers "
              "and the decode / prefill op lists; with --json, the plan's JSON).")
@refusals
def inspect(path, as_json, rank, tensor_name, decode_to, show_plan):
    """Show what PATH holds: a checkpoint folder or a bloomery artifact.

    A checkpoint folder: each weight with its resolved stored format, shape, bytes and
    scales (weight_scale, weight_scale_2, input_scale, pre_quant_scale), then totals by
    format, then the tensors that are not weights (integer buffers, dtypes no format reads:
    I64, BOOL, F64, ...) with their dtype and shape; prepare judges those by the family's
    spec. Every weight is checked against the quantization config; a malformed folder is
    refused with a named error and a non-zero exit.

    An artifact (from `bloomery prepare`): each artifact tensor (llama.cpp's names) with its
    format, GGUF layout, role, TP cut, this rank's shape and bytes, then bytes per rank.

    \b
    Examples:
      bloomery inspect ./Llama-3.1-8B-Instruct-FP4
      bloomery inspect ./ckpt --json | jq '.totals'
      bloomery inspect ./artifact --rank 1
      bloomery inspect ./artifact --tensor blk.0.attn_q --rank 1 --decode q.npy
      bloomery inspect ./artifact --tensor blk.1.ffn_down.weight
      bloomery inspect ./artifact --plan --rank 1
    """
    if decode_to is not None and tensor_name is None:
        raise click.UsageError("--decode needs --tensor NAME")
    if show_plan:
        if not _is_artifact(path):
            raise click.UsageError(f"--plan applies to an artifact; {path} is a checkpoint folder")
        return _inspect_plan(path, rank or 0, as_json)
    if _is_artifact(path):
        return _inspect_artifact(path, as_json, rank or 0, tensor_name, decode_to)
    if rank is not None:
        raise click.UsageError(f"--rank applies to an artifact; {path} is a checkpoint folder")
    from bloomery.compiler.checkpoint import Checkpoint

    ckpt = Checkpoint.open(path)
    others = {**{n: (t, "integer") for n, t in ckpt.integers.items()},
              **{n: (t, "no format reads this dtype") for n, t in ckpt.unread.items()}}
    if tensor_name is not None:
        if tensor_name in others:
            t, kind = others[tensor_name]
            if decode_to is not None:
                raise click.UsageError(f"{tensor_name} is stored as {t.dtype}, not a weight: nothing to decode")
            return _show_one(t.name, t.dtype, t.shape, t.nbytes, None, None, as_json, {"kind": kind})
        if tensor_name not in ckpt.tensors:
            raise click.UsageError(f"{path} has no tensor {tensor_name!r} (see `bloomery inspect {path}`)")
        t = ckpt.tensors[tensor_name]
        return _show_one(t.name, t.format.name, t.shape, t.nbytes, t.decode if decode_to else None, decode_to,
                         as_json, {"scales": t.scales})
    rows = [
        {"name": t.name, "format": t.format.name, "shape": list(t.shape), "bytes": t.nbytes, "scales": t.scales}
        for t in sorted(ckpt.tensors.values(), key=lambda t: t.name)
    ]
    other_rows = [{"name": n, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "kind": kind}
                  for n, (t, kind) in sorted(others.items())]
    totals = ckpt.totals()
    q = ckpt.quant
    if as_json:
        click.echo(json.dumps({
            "folder": str(ckpt.folder),
            "quantization": {"source": q.source, "quant_algo": q.quant_algo,
                             "kv_cache_quant_algo": q.kv_cache_quant_algo},
            "tensors": rows,
            "other_tensors": other_rows,
            "kv_scales": sorted(ckpt.kv_scales),
            "totals": totals,
        }, indent=1))
        return
    _table(rows, ("format", "shape", "bytes", "scales"))
    if other_rows:
        click.echo("\nnot weights (prepare judges them by the family's spec):")
        _table(other_rows, ("dtype", "shape", "bytes", "kind"))
    click.echo(f"\nquantization: {q.quant_algo or 'none'} (kv cache: {q.kv_cache_quant_algo or 'as computed'}) "
               f"from {q.source}")
    _totals(totals)


def _show_one(name, fmt, shape, nbytes, decode, decode_to, as_json, extra):
    info = {"name": name, "format": fmt, "shape": list(shape), "bytes": nbytes, **extra}
    if decode is not None:
        import numpy as np
        values = decode()
        np.save(decode_to, values)
        info["decoded"] = {"file": str(decode_to), "dtype": str(values.dtype), "shape": list(values.shape)}
    click.echo(json.dumps(info, indent=1) if as_json else "\n".join(f"{k}: {v}" for k, v in info.items()))


def _table(rows, cols):
    w = max((len(r["name"]) for r in rows), default=6)
    click.echo(f"{'tensor':<{w}}  " + " ".join(f"{c:<12}" if c != "bytes" else f"{c:>10}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            if c == "bytes":
                cells.append(f"{_human(v):>10}")
            elif c == "scales":
                cells.append(", ".join(s.rsplit(".", 1)[-1] for s in v))
            else:
                cells.append(f"{str(v):<12}")
        click.echo(f"{r['name']:<{w}}  " + " ".join(cells))


def _totals(totals):
    click.echo(f"{'format':<12} {'tensors':>8} {'parameters':>14} {'bytes':>12}")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]):
        click.echo(f"{name:<12} {t['tensors']:>8} {t['elements']:>14,} {_human(t['bytes']):>12}")
    click.echo(f"{'total':<12} {sum(t['tensors'] for t in totals.values()):>8} "
               f"{sum(t['elements'] for t in totals.values()):>14,} "
               f"{_human(sum(t['bytes'] for t in totals.values())):>12}")


def _inspect_artifact(path, as_json, rank, tensor_name, decode_to):
    import numpy as np
    from bloomery.core.artifact.reader import Artifact

    art = Artifact.open(path)
    if rank not in art.ranks:
        raise click.UsageError(f"{path} holds ranks {art.ranks}; there is no rank {rank}")
    tensors = art.tensors(rank)
    if tensor_name is not None:
        gguf = {g: (b, part) for b, t in tensors.items() for part, g in t.parts.items()}
        base, part = (tensor_name, None) if tensor_name in tensors else gguf.get(tensor_name, (None, None))
        if base is None:
            raise click.UsageError(f"{path} rank {rank} has no tensor {tensor_name!r}, by base or GGUF name (see "
                                   f"`bloomery inspect {path}`)")
        t = tensors[base]
        named = {} if part is None else {"gguf_tensor": tensor_name,
                                         "parts": sorted(p for p, g in t.parts.items() if g == tensor_name)}
        return _show_one(t.name, t.format, t.shape, t.nbytes, (lambda: art.decode(base, rank)) if decode_to else None,
                         decode_to, as_json,
                         {**named, "rank": rank, "role": t.role, "cut": t.cut, "layout": t.layout,
                          "sources": list(t.sources), "gguf": t.parts})
    rows = [{"name": t.name, "format": t.format, "layout": t.layout, "role": t.role, "cut": t.cut,
             "shape": list(t.shape), "bytes": t.nbytes, "sources": list(t.sources)}
            for t in sorted(tensors.values(), key=lambda t: _natural(t.name))]
    totals: dict = {}
    for t in tensors.values():
        row = totals.setdefault(t.format, {"tensors": 0, "elements": 0, "bytes": 0})
        row["tensors"] += 1
        row["elements"] += int(np.prod(t.shape))
        row["bytes"] += t.nbytes
    md = art.metadata(rank)
    from bloomery.core.artifact import kernels as K
    rec = K.decode(md[K.KEY], str(path)) if K.KEY in md else None
    kernels = None if rec is None else {"target": rec.target, "compiler": rec.compiler,
                                        "names": sorted(rec.kernels)}
    ranks = [{"rank": r, "bytes": art.nbytes(r), "shards": [p.name for p in art.shards[r]]} for r in art.ranks]
    if as_json:
        click.echo(json.dumps({"artifact": str(path), "tp": art.tp, "rank": rank, "ranks": ranks,
                               "architecture": md.get("general.architecture"), "kernels": kernels,
                               "tensors": rows, "totals": totals},
                              indent=1))
        return
    _table(rows, ("format", "layout", "cut", "shape", "bytes"))
    click.echo(f"\nartifact: {md.get('general.architecture')} {md.get('general.name', '')}, tp {art.tp}, "
               f"showing rank {rank}")
    _totals(totals)
    for r in ranks:
        click.echo(f"rank {r['rank']}: {_human(r['bytes'])} in {len(r['shards'])} shard(s)")
    if kernels:
        click.echo(f"kernels compiled ahead of time: {kernels['target']} ({kernels['compiler']}): "
                   f"{', '.join(kernels['names'])}")


def _inspect_plan(path, rank, as_json):
    from bloomery.core import plan as P
    from bloomery.core.artifact.reader import Artifact
    from bloomery.runtime.engine import read_plans

    art = Artifact.open(path)
    if rank not in art.ranks:
        raise click.UsageError(f"{path} holds ranks {art.ranks}; there is no rank {rank}")
    plan = read_plans(art)[rank]
    if as_json:
        click.echo(json.dumps(plan, indent=1, sort_keys=True))
        return
    click.echo(f"plan v{plan['version']}: {plan['family']}, rank {plan['rank']} of tp {plan['tp']}, "
               f"model {json.dumps(plan['model'], sort_keys=True)}")
    click.echo("\nbuffers (symbols: slots, ubatch, ctx bound at load; rows = the program's rows):")
    w = max(len(n) for n in plan["buffers"])
    for kind in P.KINDS:
        for n, b in sorted(plan["buffers"].items()):
            if b["kind"] == kind:
                click.echo(f"  {n:<{w}}  {kind:<7} {b['dtype']}  [{', '.join(str(d) for d in b['shape'])}]")
    for prog, body in plan["programs"].items():
        click.echo(f"\n{prog} (rows = {body['rows']}): {len(body['ops'])} ops")
        for i, op in enumerate(body["ops"]):
            sig = P.OPS[op["op"]]
            ins = ", ".join(op[k] for k in (*sig.reads, *sig.state))
            outs = ", ".join(op[k] for k in sig.writes)
            wts = ", ".join(op[k] for k in sig.weights)
            attrs = " ".join(f"{k}={op[k]}" for k in (*sig.attrs, *sig.optional) if k in op)
            click.echo(f"  {i:>4} {op['op']:<11} {ins} -> {outs}" + (f"  [{wts}]" if wts else "")
                       + (f"  {attrs}" if attrs else ""))


def _natural(name: str):
    import re
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _parse_size(text: str) -> int:
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.I)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size such as 4GiB, 512MiB or 1000000")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def _levers_text() -> str:
    from bloomery.core.levers import format_levers
    return format_levers()


@main.command(epilog=_verbatim("Levers (environment switches):\n\n" + _levers_text()))
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True,
              help="Tensor-parallel ranks: one GGUF split per rank, each weight cut on its format's block "
              "boundary (attention by whole KV head groups).")
@click.option("--keep-bf16", is_flag=True, help="Keep BF16 tensors as BF16 (the default; refused next to "
              "BLOOMERY_PREPARE_Q8=1).")
@click.option("--max-shard-size", default="4GiB", show_default=True, help="Largest GGUF file of a split.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@click.option("--target", type=click.Choice(["sm_90a"]), default=None,
              help="Also compile the GPU kernels ahead of time for this target (sm_90a: Hopper, H100 / H200) "
              "with the CUTLASS DSL (pip install nvidia-cutlass-dsl; no GPU needed) into the artifact; the "
              "runtime loads them without the DSL (lever BLOOMERY_AOT). Default: none (NVRTC kernels).")
@refusals
def prepare(folder, out, tp, keep_bf16, max_shard_size, progress, target):
    """Compile the checkpoint FOLDER (as ModelOpt exports it) into an artifact at OUT.

    Every weight keeps its stored format (NVFP4, MXFP8, FP8, BF16, ...) and decodes to
    exactly the checkpoint's value; only a lever rewrites anything. The artifact is a GGUF
    split per rank (rank{r}-{i:05d}-of-{n:05d}.gguf) that gguf-py opens, with the tokenizer and
    chat template inside, and SHA256SUMS. It is written beside OUT, re-read and verified, then
    renamed into place: an interrupted or concurrent prepare leaves the previous artifact
    whole. Whatever cannot be compiled is refused by name before anything is written.

    \b
    Examples:
      bloomery prepare ./SmolLM2-135M-Instruct-NVFP4 ./smollm2.art
      bloomery prepare ./Qwen3-30B-A3B-FP4 ./qwen3.art --tp 2
      BLOOMERY_PREPARE_Q8=1 bloomery prepare ./bf16-model ./q8.art
      bloomery prepare ./SmolLM2-135M-Instruct-NVFP4 ./smollm2.art --target sm_90a
    """
    import time

    from bloomery.compiler.prepare import prepare as run_prepare

    t0 = time.perf_counter()
    if target:
        click.echo(f"compiling the {target} kernels (CUTLASS DSL) ...", err=True)
    pub = run_prepare(folder, out, tp=tp, keep_bf16=keep_bf16, max_shard_bytes=_parse_size(max_shard_size),
                      progress=progress, target=target)
    dt = time.perf_counter() - t0
    click.echo(f"{pub.path}: {len(pub.files)} file(s), {_human(pub.nbytes)}, tp {tp}, {dt:.1f} s "
               f"({pub.nbytes / dt / 1e6:.0f} MB/s)", err=True)
    if target:
        from bloomery.core.artifact import kernels as K
        from bloomery.core.artifact.reader import Artifact
        rec = K.decode(Artifact.open(pub.path).metadata(0)[K.KEY], str(pub.path))
        click.echo(f"kernels: {rec.target}, {rec.compiler}: {', '.join(sorted(rec.kernels))} "
                   f"({sum(len(k.cubin) for k in rec.kernels.values())} B of cubin)", err=True)


@main.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@refusals
def verify(artifact, progress):
    """Check every byte of ARTIFACT (from `bloomery prepare`) against what prepare wrote.

    Each file against its SHA-256 in SHA256SUMS, and each shard's header and every GGUF
    tensor against their SHA-256 in DIGESTS.json, in one sequential read per file. A damaged
    artifact is refused with every damaged file and tensor named and a non-zero exit.
    Loading always checks each shard's size and header; `run --verify` also checks each
    tensor as it loads.

    \b
    Example:
      bloomery verify ./smollm2.art
    """
    import time

    from bloomery.core.artifact.reader import Artifact

    t0 = time.perf_counter()
    art = Artifact.open(artifact)
    files = sorted(art.sums)
    total = sum((artifact / n).stat().st_size for n in files)
    bar = None
    if progress or (progress is None and sys.stderr.isatty()):
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify")
    try:
        art.verify(progress=bar)
    finally:
        if bar is not None:
            bar.close()
    tensors = sum(len(e["tensors"]) for e in (art.digests or {}).values())
    dt = time.perf_counter() - t0
    detail = (f"{tensors} GGUF tensors and every header match DIGESTS.json" if art.digests is not None else
              "no DIGESTS.json (prepared by an older bloomery): files checked, tensors not")
    click.echo(f"{artifact}: OK: {len(files)} file(s), {_human(total)} match SHA256SUMS; {detail} "
               f"({dt:.1f} s, {total / max(dt, 1e-9) / 1e6:.0f} MB/s)")


@main.command()
def levers():
    """The levers: environment switches that change what bloomery does, with their measured cost."""
    click.echo(_levers_text(), nl=False)


_DEVICE = click.Choice(["auto", "cpu", "cuda"])
_VERIFY_HELP = ("Check every tensor against its digest (DIGESTS.json) as it loads. Off by default: it costs 4-9% "
                "of the CPU load time (docs/artifact.md); each shard's size and header are checked always, and "
                "`bloomery verify` checks every byte.")


_CACHE_TYPES = click.Choice(["f32", "f16", "bf16", "q8_0", "fp8"])


def cache_type_options(fn):
    """--cache-type-k / --cache-type-v (llama.cpp's -ctk / -ctv): the KV cache's storage type."""
    for kv in ("v", "k"):
        fn = click.option(f"-ct{kv}", f"--cache-type-{kv}", f"cache_type_{kv}", type=_CACHE_TYPES, default="f32",
                          show_default=True, envvar=f"BLOOMERY_CACHE_TYPE_{kv.upper()}",
                          help=f"Store the KV cache's {'keys' if kv == 'k' else 'values'} as f32, f16, bf16, q8_0 "
                               f"or fp8 (with the checkpoint's {kv}_scale; ModelOpt's FP8 KV cache); written rounded, "
                               f"read decoded (runtime/kv_cache.py). Each type's measured KL against f32: "
                               f"`bloomery levers` (BLOOMERY_CACHE_TYPE_{kv.upper()}). On the GPU: f32, f16 or bf16 (tp 1).")(fn)
    return fn


@main.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", "-p", required=True, help="The user's message (through the chat template unless --raw).")
@click.option("--raw", is_flag=True, help="Tokenize the prompt as is, without the chat template.")
@click.option("--max-tokens", "--n-predict", "-n", type=click.IntRange(-1), default=256, show_default=True,
              help="Tokens to generate; -1: until EOS or the context is full (llama.cpp's -n).")
@click.option("--ignore-eos", is_flag=True, help="Never stop at EOS: the EOS tokens are masked out of every pick "
              "(llama.cpp's --ignore-eos); generation runs to --max-tokens or the context's end.")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True,
              help="0: greedy (argmax).")
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0: off.")
@click.option("--top-p", type=click.FloatRange(0, 1), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed of the sampler (with --temperature > 0).")
@click.option("--ctx-size", "-c", type=click.IntRange(1), default=None,
              help="Context (KV cache) length  [default: the model's, at most 4096].")
@click.option("--device", type=_DEVICE, default="auto", show_default=True,
              help="auto: cuda when CuPy and a GPU are present (TP=1 artifacts), else cpu.")
@click.option("--threads", "-t", type=click.IntRange(1), default=1, show_default=True,
              help="CPU BLAS threads (one is fastest on a shared machine: runtime/blas.py).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, counts, timings) "
              "instead of streaming.")
@click.option("--verify", "check", is_flag=True, help=_VERIFY_HELP)
@click.option("--draft", type=click.Choice(["auto", "off", "ngram", "mtp"]), default="auto", show_default=True,
              help="Speculative decoding (greedy only): ngram drafts from the sequence's own repeats (prompt "
              "lookup), mtp from the checkpoint's MTP layer; each verify step checks the drafts in one pass and the "
              "output is the same as with off. auto: the one measured faster here, said on stderr.")
@click.option("--draft-max", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Drafted tokens one verify step checks at most (llama.cpp's --draft-max).")
@cache_type_options
@refusals
def run(artifact, prompt, raw, max_tokens, ignore_eos, temperature, top_k, top_p, seed, ctx_size, device, threads,
        as_json, check, draft, draft_max, cache_type_k, cache_type_v):
    """Generate a reply from ARTIFACT (from `bloomery prepare`) to --prompt.

    The tokenizer and chat template come from the artifact. The text streams to stdout as
    tokens decode; generation stops at EOS (bloomery.eos_token_ids; not with --ignore-eos),
    --max-tokens or the end of the context. Prompt and decode speed go to stderr at the end.

    \b
    Examples:
      bloomery run ./smollm2.art --prompt "What is the capital of France?"
      bloomery run ./smollm2.art -p "Once upon a time" --raw --temperature 0.8 --seed 1
      bloomery run ./smollm2.art -p "Hi" --json | jq .text
      bloomery run ./smollm2.art -p "Count to 100" -n 200 --ignore-eos --verify
      bloomery run ./smollm2.art -p "Write a Python class" --draft ngram --draft-max 4
    """
    import time

    from bloomery.runtime import Engine, draft as drafts, generate

    if max_tokens == 0:
        raise click.BadParameter("0 generates nothing; give a count, or -1 for until EOS or the context's end",
                                 param_hint="--max-tokens")
    t0 = time.perf_counter()
    eng = Engine(artifact, device=device, ctx=ctx_size, threads=threads, check=check,
                 draft_max=0 if draft == "off" or temperature > 0 else draft_max,   # verify bound only if it may draft
                 cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    load_s = time.perf_counter() - t0
    draft, why = drafts.choose(eng, draft, temperature)
    kv = "/".join(eng.cache_types)
    if getattr(eng.exec, "aot_line", None):
        click.echo(eng.exec.aot_line, err=True)
    click.echo(f"draft: {draft} ({why}) | kv cache k/v: {kv} (-ctk/-ctv; "
               f"{'the default: the only type inside the gate bands' if kv == 'f32/f32' else 'as asked'}, "
               f"each type's KL: bloomery levers)", err=True)

    def emit(piece):
        click.echo(piece, nl=False)
        sys.stdout.flush()

    g = generate(eng, prompt, raw=raw, max_tokens=None if max_tokens < 0 else max_tokens, ignore_eos=ignore_eos,
                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, on_text=None if as_json else emit,
                 draft=draft)
    if as_json:
        click.echo(json.dumps({**g.to_json(), "load_s": round(load_s, 3)}))
        return
    click.echo()
    click.echo(f"[{g.device}, tp {eng.art.tp}] load {load_s:.2f} s | prompt {len(g.prompt_ids)} tokens, "
               f"{g.prompt_tps:.1f} tok/s | decode {len(g.token_ids)} tokens, {g.decode_tps:.1f} tok/s "
               f"| stop: {g.stop}", err=True)
    if g.extra.get("verify_steps"):
        x = g.extra
        click.echo(f"draft {x['draft']}: {x['verify_steps']} verify steps, {x['accepted']} of {x['drafted']} drafted "
                   f"tokens accepted, {x['acceptance_length']:.2f} tokens a verify step", err=True)


@main.command(context_settings={"max_content_width": 100})
@click.option("-m", "--model", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="An artifact (from `bloomery prepare`) or a ModelOpt checkpoint folder (compiled in memory "
              "at start: nothing is written).")
@click.option("-c", "--ctx-size", type=click.IntRange(0), default=0, show_default=True,
              help="Context of each slot, in tokens (prompt + reply); 0: the model's, at most 4096. A longer "
              "prompt is refused (400); a reply that fills it ends with finish_reason \"length\".")
@click.option("-np", "--parallel", type=click.IntRange(1), default=4, show_default=True,
              help="Slots: requests decoded together, one row each of the same decode step.")
@click.option("-ub", "--ubatch-size", type=click.IntRange(1), default=None,
              help="Prompt tokens per prefill chunk (at most -b)  [default: 512 on a GPU, 64 on the CPU].")
@click.option("-b", "--batch-size", type=click.IntRange(1), default=None,
              help="Prompt tokens fed between two decode steps, in -ub chunks, across the new requests: the "
              "generating slots wait at most this long for a new prompt, and a burst of requests is prefilled "
              "before the decode steps it then shares  [default: 4 chunks: 2048 on a GPU, 256 on the CPU].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every "
              "interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="BLOOMERY_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health (or set BLOOMERY_API_KEY).")
@click.option("-n", "--n-predict", type=int, default=-1, show_default=True,
              help="Tokens to generate when a request sets no max_tokens; -1: until a stop or the context is full.")
@click.option("--alias", default=None, help="The model id clients name (GET /v1/models)  [default: the "
              "folder's name].")
@click.option("--device", type=_DEVICE, default="auto", show_default=True,
              help="auto: cuda when CuPy and a GPU are present, else cpu.")
@click.option("--tp", type=click.IntRange(1), default=None,
              help="Tensor-parallel ranks: a checkpoint folder is compiled for this many (default 1); an "
              "artifact runs at the TP it was prepared with.")
@click.option("--metrics", is_flag=True, help="Serve GET /metrics (Prometheus text).")
@click.option("--max-queue", type=click.IntRange(0), default=64, show_default=True,
              help="Requests that may wait for a slot; past that a request gets 503 with Retry-After.")
@click.option("--threads", "-t", type=click.IntRange(1), default=1, show_default=True,
              help="CPU BLAS threads.")
@click.option("--verify", "check", is_flag=True, help=_VERIFY_HELP + " (An artifact; a folder compiled in memory "
              "has no files to check.)")
@click.option("--draft", type=click.Choice(["auto", "off", "ngram"]), default="auto", show_default=True,
              help="Speculative decoding of a greedy request with -np 1: its n-gram drafts checked in one verify "
              "pass, the reply the same as with off. auto: ngram at -np 1 (measured faster on the CPU and the GPU), else off.")
@cache_type_options
@refusals
def serve(model, ctx_size, parallel, ubatch_size, batch_size, host, port, api_key, n_predict, alias, device, tp, metrics,
          max_queue, threads, check, draft, cache_type_k, cache_type_v):
    """Serve a model over HTTP with the OpenAI API (llama-server's flags).

    Each of the --parallel slots holds one request: the slots that generate are decoded
    together, one row each of one decode step, so the weights are read once per step for
    all of them; new requests' prompts are fed in --ubatch-size chunks, up to --batch-size
    tokens between two decode steps, and their slots then join the step (continuous batching). More requests than slots
    wait in a queue of --max-queue. A request starts in an empty slot, or in the slot that
    already holds the start of its prompt (the previous turn of a conversation, a shared
    system prompt): those tokens are not computed again (cache_prompt, on by default; the
    reply is the same either way).

    \b
    Endpoints:
      GET  /health                503 while the model loads, then {"status": "ok"}
      GET  /v1/models             the model id (--alias)
      POST /v1/chat/completions   messages, through the model's chat template
      POST /v1/completions        a raw prompt (text or token ids)
      GET  /metrics               Prometheus text (with --metrics)
      GET  /props                 slots, context, chat template (llama-server's)
      GET  /slots                 each slot: busy, tokens held (llama-server's)
      POST /tokenize, /detokenize text <-> token ids (llama-server's)
    Request fields: max_tokens (or max_completion_tokens), temperature (default 1; 0:
    greedy), top_p, top_k, seed, stop, stop_token_ids, stream, stream_options.include_usage,
    cache_prompt. Unknown fields are ignored; a wrong one is a 400 that names it.

    \b
    Examples:
      bloomery serve -m ./smollm2.art
      bloomery serve -m ./SmolLM2-135M-Instruct-NVFP4 -np 8 -c 2048 --metrics
      BLOOMERY_API_KEY=secret bloomery serve -m ./qwen3.art --host 0.0.0.0 --port 8000
      curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

    At start one line says what was chosen (device, TP, slots, context, ubatch, batch, memory)
    and which flag changes each. Ctrl-C stops the server. docs/serve.md has the rest.
    """
    from bloomery.serve import Settings, serve as run_server

    sys.exit(run_server(Settings(model=model, ctx=ctx_size or None, parallel=parallel, ubatch=ubatch_size,
                                 batch=batch_size, host=host, port=port, api_key=api_key or None, n_predict=n_predict, alias=alias,
                                 device=device, tp=tp, metrics=metrics, threads=threads, max_queue=max_queue,
                                 check=check, cache_types=(cache_type_k, cache_type_v), draft=draft)))


@main.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--ids", "ids_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON file holding a list of token ids.")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the logits (.npy, float32 [n, vocab]).")
@click.option("--device", type=_DEVICE, default="auto", show_default=True)
@click.option("--ubatch", type=click.IntRange(1), default=64, show_default=True, help="Rows per prompt chunk.")
@click.option("--threads", "-t", type=click.IntRange(1), default=1, show_default=True, help="CPU BLAS threads.")
@click.option("--verify", "check", is_flag=True, help=_VERIFY_HELP)
@cache_type_options
@refusals
def logits(artifact, ids_file, out_file, device, ubatch, threads, check, cache_type_k, cache_type_v):
    """Teacher-forced logits of a token-id list: row i is the distribution after ids[0..i].

    \b
    Example:
      echo '[1, 504, 3458]' > ids.json && bloomery logits ./smollm2.art --ids ids.json --out x.npy
    """
    import numpy as np

    from bloomery.runtime import logits as run_logits

    try:
        ids = json.loads(ids_file.read_text())
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"{ids_file} is not JSON ({e})", param_hint="--ids") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise click.BadParameter(f"{ids_file} must hold a non-empty JSON list of integers", param_hint="--ids")
    x = run_logits(artifact, ids, device=device, ubatch=ubatch, threads=threads, check=check,
                   cache_types=(cache_type_k, cache_type_v))
    np.save(out_file, x)
    click.echo(f"{out_file}: float32 {list(x.shape)}", err=True)


if __name__ == "__main__":
    main()
