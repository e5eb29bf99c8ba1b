"""The `bloomery` command line. It imports both sides (compiler and runtime), so it is not part of the core."""

from __future__ import annotations

import functools
import json
import sys

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
    bloomery inspect <folder>     what a checkpoint holds, format by format
    """


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@refusals
def inspect(folder, as_json):
    """Show what a checkpoint FOLDER holds: each weight with its resolved stored format,
    shape, bytes and scales, then totals by format.

    Every weight is grouped with its scales (weight_scale, weight_scale_2, input_scale,
    pre_quant_scale) and checked against the quantization config; a malformed folder is
    refused with a named error and a non-zero exit.

    \b
    Examples:
      bloomery inspect ./Llama-3.1-8B-Instruct-FP4
      bloomery inspect ./ckpt --json | jq '.totals'
    """
    from bloomery.compiler.checkpoint import Checkpoint

    ckpt = Checkpoint.open(folder)
    rows = [
        {"name": t.name, "format": t.format.name, "shape": list(t.shape), "bytes": t.nbytes, "scales": t.scales}
        for t in sorted(ckpt.tensors.values(), key=lambda t: t.name)
    ]
    totals = ckpt.totals()
    if as_json:
        click.echo(json.dumps({
            "folder": str(ckpt.folder),
            "quantization": {"source": ckpt.quant.source, "quant_algo": ckpt.quant.quant_algo,
                             "kv_cache_quant_algo": ckpt.quant.kv_cache_quant_algo},
            "tensors": rows,
            "kv_scales": sorted(ckpt.kv_scales),
            "totals": totals,
        }, indent=1))
        return
    w = max((len(r["name"]) for r in rows), default=4)
    click.echo(f"{'tensor':<{w}}  {'format':<12} {'shape':<20} {'bytes':>10}  scales")
    for r in rows:
        scales = ", ".join(s.rsplit(".", 1)[-1] for s in r["scales"])
        click.echo(f"{r['name']:<{w}}  {r['format']:<12} {str(r['shape']):<20} {_human(r['bytes']):>10}  {scales}")
    click.echo("")
    q = ckpt.quant
    click.echo(f"quantization: {q.quant_algo or 'none'} (kv cache: {q.kv_cache_quant_algo or 'as computed'}) "
               f"from {q.source}")
    click.echo(f"{'format':<12} {'tensors':>8} {'parameters':>14} {'bytes':>12}")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]):
        click.echo(f"{name:<12} {t['tensors']:>8} {t['elements']:>14,} {_human(t['bytes']):>12}")
    click.echo(f"{'total':<12} {sum(t['tensors'] for t in totals.values()):>8} "
               f"{sum(t['elements'] for t in totals.values()):>14,} "
               f"{_human(sum(t['bytes'] for t in totals.values())):>12}")


if __name__ == "__main__":
    main()
