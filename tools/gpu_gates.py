"""GPU gates: the CUDA executor against the NumPy executor on the same artifacts.

    python -m bloomery.tools.gpu_gates ART [ART ...] [--steps 256] [--tf 320] [--out DIR]
    python -m bloomery.tools.gpu_gates --synthetic smollm2-135m --steps 64     # made and prepared here
    python -m bloomery.tools.gpu_gates TP2_ART --pair TP2_ART=TP1_ART --synthetic smollm2-135m --tp 2
    python -m bloomery.tools.gpu_gates --oracle CKPT[=ART]      # CUDA against the f32 oracle of CKPT, gate prompts
    python -m bloomery.tools.gpu_gates CKPT ...                 # a checkpoint folder is prepared first (tp 1)

TP (tp > 1 artifacts run on the CUDA executor's NCCL ranks, runtime/cuda/tp.py): an artifact
argument of tp 2 is gated CUDA tp2 against NumPy tp2; `--pair A=B` gates CUDA on A against CUDA on
B (tp2 against the tp1 artifact of the same checkpoint); `--tp N` prepares the synthetic shapes at
tp N and gates them against NumPy at tp N and against CUDA on their tp 1 artifact.

Per artifact:
- greedy: the same prompt on both executors, then `--steps` decode steps, each executor fed its
  own greedy token: the token sequences must be equal, and while they are, the logits' relative
  L2 (||cuda - numpy|| / ||numpy||) <= 1e-3 at every step. At a divergence the NumPy logits'
  top-2 margin there is printed (a near-tie flips on rounding).
- teacher-forced: `--tf` random token ids through prefill (ubatch rows, the prefill program) on
  both: relative L2 per position <= 1e-3 and the argmax agreement.
Prints one row per artifact and a table last; exit status 1 if any gate fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BAND = 1e-3


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    r = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return r if np.isfinite(r) else float("inf")          # NaN never passes


def label(art: Path) -> str:
    """An artifact's name in the tables: its folder, with the parent's when the folder is a generic one."""
    art = Path(art)
    return f"{art.parent.name}/{art.name}" if art.name in ("art", "artifact", "out") else art.name


def _close(eng) -> None:
    if eng is not None and hasattr(eng.exec, "close"):      # the TP ranks' processes
        eng.exec.close()


def gate(art: Path, steps: int, tf: int, seed: int = 0, ubatch: int = 64, ref: Path | None = None,
         ref_device: str = "cpu") -> dict:
    """CUDA on `art` against `ref_device` on `ref` (default: NumPy on the same artifact)."""
    from bloomery.runtime import Engine, logits

    ref = ref or art
    res = {"artifact": label(art), "vs": f"{ref_device}:{label(ref)}", "steps": steps, "tf": tf}
    t0 = time.perf_counter()
    cu = Engine(art, device="cuda", ctx=max(steps + 40, tf + 8), ubatch=ubatch)
    res["cuda_load_s"] = round(time.perf_counter() - t0, 3)
    res["tp"] = cu.art.tp
    try:
        npx = Engine(ref, device=ref_device, ctx=max(steps + 40, tf + 8), ubatch=ubatch)
        try:
            return _compare(cu, npx, res, steps, tf, seed, logits)
        finally:
            _close(npx)
    finally:
        _close(cu)


def _compare(cu, npx, res, steps, tf, seed, logits) -> dict:
    rng = np.random.default_rng(seed)
    V = cu.vocab_size
    prompt = [int(i) for i in rng.integers(0, V, 12)]
    # greedy
    a_last, b_last = cu.prefill(prompt, last_only=True), npx.prefill(prompt, last_only=True)
    worst = rel(a_last, b_last)
    ta, tb = int(np.argmax(a_last)), int(np.argmax(b_last))
    toks_a, toks_b = [ta], [tb]
    diverged = None
    t_cuda = 0.0
    for i in range(steps):
        t1 = time.perf_counter()
        la, na = cu.decode([toks_a[-1]])
        t_cuda += time.perf_counter() - t1
        lb, nb = npx.decode([toks_b[-1]])
        if diverged is None:
            worst = max(worst, rel(la[0], lb[0]))
            if int(na[0]) != int(np.argmax(la[0])):
                res.setdefault("errors", []).append(f"step {i}: device argmax {int(na[0])} != argmax of its logits")
        toks_a.append(int(na[0]))
        toks_b.append(int(nb[0]))
        if diverged is None and toks_a[-1] != toks_b[-1]:
            s = np.sort(lb[0])[::-1]
            diverged = {"step": i, "cuda": toks_a[-1], "numpy": toks_b[-1], "numpy_top2_margin": float(s[0] - s[1]),
                        "logit_scale": float(np.abs(lb[0]).max())}
    res["greedy_equal"] = sum(int(x == y) for x, y in zip(toks_a, toks_b))
    res["greedy_total"] = len(toks_a)
    res["greedy_rel_l2_max"] = worst
    res["diverged"] = diverged
    res["cuda_decode_tok_s"] = round(steps / t_cuda, 1) if t_cuda else 0.0
    # teacher-forced (the prefill program)
    if tf:
        ids = [int(i) for i in rng.integers(0, V, tf)]
        t1 = time.perf_counter()
        xa = logits(cu, ids)
        res["cuda_prefill_tok_s"] = round(tf / (time.perf_counter() - t1), 1)
        xb = logits(npx, ids)
        per = [rel(xa[i], xb[i]) for i in range(tf)]
        res["tf_rel_l2_max"] = max(per)
        res["tf_argmax_agree"] = float(np.mean(np.argmax(xa, -1) == np.argmax(xb, -1)))
    dis = getattr(cu.exec, "disagreements", 0)
    if dis:
        res.setdefault("errors", []).append(f"{dis} run(s) where the TP ranks' next tokens differ")
    res["pass"] = bool(diverged is None and worst <= BAND and not res.get("errors")
                       and (not tf or res["tf_rel_l2_max"] <= BAND))
    return res


def oracle_gate(folder: Path, art: Path, device: str = "cuda", limit: int | None = None, ubatch: int = 64) -> dict:
    """The executor on `device` against the float32 transformers oracle (tools/oracle.py) on every
    sequence of the pinned gate prompt set (specs/prompts/gate_prompts.yaml), teacher-forced.
    `folder`: the checkpoint folder `art` was prepared from, weights included: the oracle
    dequantizes them itself (tools/dequant.py), sharing no decoder with bloomery, so a wrong
    layout in the artifact or a kernel shows. Bands: specs/bands.yaml, kind cuda_vs_oracle."""
    from bloomery.runtime import Engine, logits
    from bloomery.tools import gates, oracle

    t0 = time.perf_counter()
    if not any(Path(folder).glob("*.safetensors")):
        raise gates.GateError(f"{folder}: no .safetensors weights; --oracle takes the checkpoint folder the "
                              "artifact was prepared from (the oracle dequantizes its weights itself)")
    seqs = gates.sequences(folder, limit)
    ref = oracle.Oracle(folder)
    eng = Engine(art, device=device, ctx=max(len(s.ids) for s in seqs), ubatch=ubatch)
    refs, cands, margins = [], [], []
    try:
        for sq in seqs:
            refs.append(ref.logits(sq.ids))
            margins.append(ref.tie_margins(sq.ids))
            cands.append(logits(eng, sq.ids))
    finally:
        _close(eng)
    m = gates.compare(refs, cands, margins)
    fails = gates.check(m, gates.load_bands()["cuda_vs_oracle"])
    return {"artifact": label(art), "vs": "f32 oracle", "device": eng.device, "sequences": len(seqs), **m,
            "fails": fails, "pass": not fails, "seconds": round(time.perf_counter() - t0, 1)}


def synthetic_artifact(shape: str, fmt: str, root: Path, layers: int | None = None, tp: int = 1) -> Path:
    from bloomery.compiler.prepare import prepare
    from bloomery.tools import synthetic
    ck = root / f"{shape}-{fmt}-ckpt"
    art = root / (f"{shape}-{fmt}" + (f"-tp{tp}" if tp > 1 else ""))
    if not ck.exists():
        synthetic.write(shape, ck, fmt, layers=layers)
    if not art.exists():
        prepare(ck, art, tp=tp, progress=False)
    return art


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="*", type=Path)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--tf", type=int, default=320, help="teacher-forced positions (0: skip)")
    ap.add_argument("--synthetic", nargs="*", default=[], help="shapes of tools/synthetic.py, made here (NVFP4)")
    ap.add_argument("--synthetic-steps", type=int, default=64)
    ap.add_argument("--synthetic-layers", type=int, default=None, help="fewer layers than the real shapes")
    ap.add_argument("--work", type=Path, default=None, help="where synthetic checkpoints go")
    ap.add_argument("--out", type=Path, default=None, help="write gates.json here")
    ap.add_argument("--pair", action="append", default=[], metavar="A=B",
                    help="gate CUDA on artifact A against CUDA on artifact B (e.g. tp2 against tp1)")
    ap.add_argument("--pair-steps", type=int, default=None, help="greedy steps of --pair gates (default --steps)")
    ap.add_argument("--pair-tf", type=int, default=0, help="teacher-forced positions of --pair gates")
    ap.add_argument("--oracle", action="append", default=[], metavar="CKPT[=ART]",
                    help="gate CUDA on artifact ART against the f32 oracle of checkpoint folder CKPT (weights "
                         "included: the oracle dequantizes them itself); without =ART, CKPT is prepared here")
    ap.add_argument("--oracle-limit", type=int, default=None, help="first N gate prompts only")
    ap.add_argument("--prefill", choices=("bf16", "bf16x2", "off"), default=None,
                    help="the CUDA executor's prompt-chunk GEMM mode (lever BLOOMERY_PREFILL_GEMM; default: its setting)")
    ap.add_argument("--tp", type=int, default=1, help="prepare the synthetic shapes at this tp (and gate them "
                                                       "also against CUDA on their tp 1 artifact)")
    a = ap.parse_args(argv)
    if a.prefill:
        os.environ["BLOOMERY_PREFILL_GEMM"] = a.prefill         # read by every CUDA executor (and TP rank)
    from bloomery.core import levers
    mode = levers.value("BLOOMERY_PREFILL_GEMM", os.environ)
    print(f"prompt-chunk GEMM mode: {mode}", flush=True)
    pairs = []
    for p in a.pair:
        if "=" not in p:
            ap.error(f"--pair {p!r}: expected A=B (two artifact folders)")
        x, y = p.split("=", 1)
        pairs.append((Path(x), Path(y)))
    if a.tp < 1:
        ap.error("--tp must be >= 1")
    rows = []

    def one(name, fn):
        try:
            r = fn()
        except Exception as e:                       # one broken artifact does not hide the others
            import traceback
            traceback.print_exc()
            r = {"artifact": name, "pass": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(r), flush=True)
        rows.append(r)

    prepared: dict = {}

    def artifact_of(path: Path) -> Path:
        """An artifact folder as given, or a checkpoint folder prepared (tp 1) into the work folder."""
        if (path / "SHA256SUMS").is_file() or not (path / "config.json").is_file():
            return path
        if path not in prepared:
            from bloomery.compiler.prepare import prepare
            root = a.work or Path(tempfile.mkdtemp(prefix="bloomery-gpu-gates-"))
            out = root / "prepared" / f"{path.parent.name}-{path.name}"
            t0 = time.perf_counter()
            prepare(path, out, progress=False)
            print(f"{path}: prepared into {out} ({time.perf_counter() - t0:.1f} s)", flush=True)
            prepared[path] = out
        return prepared[path]

    for art in a.artifacts:
        one(art.name, lambda art=art: gate(artifact_of(art), a.steps, a.tf))
    for x, y in pairs:
        one(f"{x.name} vs cuda:{y.name}",
            lambda x=x, y=y: gate(x, a.pair_steps or a.steps, a.pair_tf, ref=y, ref_device="cuda"))
    orows = []
    for spec in a.oracle:
        cfg, _, art = spec.partition("=")
        cfg = Path(cfg)
        art = Path(art) if art else cfg
        try:
            r = oracle_gate(cfg, artifact_of(art), limit=a.oracle_limit)
        except Exception as e:
            import traceback
            traceback.print_exc()
            r = {"artifact": art.name, "pass": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(r), flush=True)
        orows.append(r)
    work = a.work or (Path(tempfile.mkdtemp(prefix="bloomery-gpu-gates-")) if a.synthetic else None)
    for shape in a.synthetic:
        def syn(shape=shape, tp=a.tp):
            t0 = time.perf_counter()
            art = synthetic_artifact(shape, "nvfp4", work, layers=a.synthetic_layers, tp=tp)
            print(f"{shape}: synthetic + prepare (tp {tp}) {time.perf_counter() - t0:.1f} s", flush=True)
            return gate(art, a.synthetic_steps, 0)
        one(f"{shape}-nvfp4" + (f"-tp{a.tp}" if a.tp > 1 else ""), syn)
        if a.tp > 1:
            def syn_pair(shape=shape, tp=a.tp):
                art = synthetic_artifact(shape, "nvfp4", work, tp=tp)
                ref = synthetic_artifact(shape, "nvfp4", work, tp=1)
                return gate(art, a.synthetic_steps, 0, ref=ref, ref_device="cuda")
            one(f"{shape}-nvfp4-tp{a.tp} vs cuda:tp1", syn_pair)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gates.json").write_text(json.dumps({"mode": mode, "engines": rows, "oracle": orows}, indent=1))
    print()
    print("| artifact | vs | greedy equal | max rel L2 (decode) | tf max rel L2 | tf argmax agree | cuda decode tok/s | pass |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['artifact']} | | ERROR {r['error'][:80]} | | | | | FAIL |")
            continue
        tfx = f"{r['tf_rel_l2_max']:.1e}" if "tf_rel_l2_max" in r else "-"
        tfa = f"{100 * r['tf_argmax_agree']:.1f}%" if "tf_argmax_agree" in r else "-"
        div = "" if not r["diverged"] else f" (first diff step {r['diverged']['step']}, margin {r['diverged']['numpy_top2_margin']:.2e})"
        print(f"| {r['artifact']} (tp {r.get('tp', 1)}) | {r.get('vs', '')} | {r['greedy_equal']}/{r['greedy_total']}{div} | {r['greedy_rel_l2_max']:.1e} | {tfx} | "
              f"{tfa} | {r['cuda_decode_tok_s']} | {'PASS' if r['pass'] else 'FAIL'} |")
    if orows:
        print()
        print("| artifact | vs | positions | argmax agree | KL mean | KL max | rel L2 mean | rel L2 max | pass |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in orows:
            if "error" in r:
                print(f"| {r['artifact']} | f32 oracle | ERROR {r['error'][:80]} | | | | | | FAIL |")
                continue
            ties = f" (+{r['ties_excluded']} ties)" if r.get("ties_excluded") else ""
            print(f"| {r['artifact']} | f32 oracle | {r['positions']}{ties} | {r['argmax_agreement']:.4f} | {r['kl_mean']:.2e} | "
                  f"{r['kl_max']:.2e} | {r['rel_l2_mean']:.2e} | {r['rel_l2_max']:.2e} | "
                  f"{'PASS' if r['pass'] else 'FAIL ' + '; '.join(r['fails'])} |")
    allr = rows + orows
    if not allr:
        print("gpu_gates: no gate row was produced (give artifacts, --pair, --oracle or --synthetic)",
              file=sys.stderr)
        return 1
    ok = all(r["pass"] for r in allr)
    print(f"{sum(r['pass'] for r in allr)}/{len(allr)} passed (prompt-chunk GEMM mode {mode})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
