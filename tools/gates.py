"""The numerical gates: teacher-forced logits of an artifact against the float32 oracle.

    python -m bloomery.tools.gates                 # `make gates`: every gated model and format, tp 2 rows
    python -m bloomery.tools.gates --only 'tiny-*' --limit 64
    python -m bloomery.tools.gates --candidate artifact-oracle    # the oracle forward on the artifact's values
    python -m bloomery.tools.gates --q8            # measure the BLOOMERY_PREPARE_Q8 lever on SmolLM2 BF16

For each (model, format): prepare the checkpoint (tp 1) into a cache folder outside the
repository ($BLOOMERY_GATES_DIR, default ~/.cache/bloomery/gates), run the candidate on every
sequence of the pinned prompt set (specs/prompts/gate_prompts.yaml), compare with the oracle
(tools/oracle.py) and check the metrics against the bands of their comparison kind
(specs/bands.yaml). The tp 2 rows compare the executor on a tp 2 artifact with the executor
on the tp 1 artifact of the same checkpoint. Prints one table; exits 1 on any band failure
or error (a row that could not be computed fails).

Metrics, per position, over all sequences (logits compared in float64):
    argmax agreement   fraction of positions where argmax(candidate) == argmax(reference)
    KL                 KL(reference || candidate) from log-softmax, float64 (mean and max)
    rel L2             ||candidate - reference||_2 / ||reference||_2 over the vocab (mean and max)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import yaml

SPECS = Path(__file__).resolve().parent.parent / "specs"
BANDS_YAML = SPECS / "bands.yaml"
PROMPTS_YAML = SPECS / "prompts" / "gate_prompts.yaml"
GATES_ENV = "BLOOMERY_GATES_DIR"
METRICS = ("argmax_agreement", "kl_mean", "kl_max", "rel_l2_mean", "rel_l2_max")

# The gated checkpoints (tools/models.py names), in table order. A name with a reason is
# listed in the table as SKIP with that reason, never silently left out.
SMOLLM2 = ("smollm2-135m/bf16", "smollm2-135m/nvfp4", "smollm2-135m/fp8", "smollm2-135m/mxfp8",
           "smollm2-135m/nvfp4_awq")
TINY_LLAMA = ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv", "fp8_channel", "fp8_pb_wo", "nvfp4_w4a16",
              "mxfp4", "mixed_nvfp4_fp8", "nvfp4_awq", "w4a8_nvfp4_fp8")
TINY_QWEN3_MOE = ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv")
TINY_GLM4_MOE = ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv")
TINY_QWEN3_NEXT = ("bf16", "nvfp4", "fp8", "mxfp8", "nvfp4_fp8kv")
# the flagships (tools/tiny.py FLAGSHIP_FORMATS: NVIDIA's mixed form among them)
TINY_FLAGSHIP = ("bf16", "nvfp4", "fp8", "mxfp8", "mixed_nvfp4_mxfp8")
FLAGSHIPS = tuple(f"tiny-{m}/{f}" for m in ("qwen4_exp", "glm5_next") for f in TINY_FLAGSHIP)
# Llama 3.x rope scaling (and attention_bias), Qwen3 dense with YaRN, Qwen2's q/k/v biases (tools/tiny.py DENSE)
DENSE = tuple(f"tiny-{m}/{f}" for m in ("llama3-rope", "qwen3", "qwen2") for f in ("bf16", "nvfp4", "fp8"))
GATED = SMOLLM2 + tuple(f"tiny-llama/{f}" for f in TINY_LLAMA) + tuple(f"tiny-qwen3_moe/{f}" for f in TINY_QWEN3_MOE) \
    + tuple(f"tiny-glm4_moe/{f}" for f in TINY_GLM4_MOE) + tuple(f"tiny-qwen3_next/{f}" for f in TINY_QWEN3_NEXT) \
    + FLAGSHIPS + DENSE
SKIP: dict[str, str] = {}
# tp 2 rows: the executor at tp 2 against tp 1 of the same checkpoint
TP2 = ("smollm2-135m/nvfp4", "smollm2-135m/bf16") + tuple(f"tiny-llama/{f}" for f in TINY_LLAMA) + tuple(
    f"tiny-qwen3_moe/{f}" for f in TINY_QWEN3_MOE) + tuple(f"tiny-glm4_moe/{f}" for f in TINY_GLM4_MOE) \
    + tuple(f"tiny-qwen3_next/{f}" for f in TINY_QWEN3_NEXT) + FLAGSHIPS + DENSE
TP2_SKIP = {
    **{f"tiny-qwen4_exp/{f}": "qwen4_exp is prepared for one GPU: prepare refuses tp 2 by name (TPNotDivisible)"
       for f in TINY_FLAGSHIP},
    "tiny-llama/fp8_pb_wo": "prepare refuses tp 2 (NotOnBlockBoundary: the 128x128 FP8 blocks of a 128-row "
                            "attn_q cannot be cut in two)",
}


class GateError(RuntimeError):
    pass


# --------------------------------------------------------------------------- prompt set


@dataclass
class Seq:
    name: str
    kind: str
    ids: list[int]


def load_prompts(path: Path = PROMPTS_YAML) -> dict:
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or not isinstance(raw.get("prompts"), list) or not raw["prompts"]:
        raise GateError(f"{path}: expected a mapping with a non-empty 'prompts' list")
    for i, p in enumerate(raw["prompts"]):
        if not isinstance(p, dict) or not {"name", "kind", "text"} <= set(p):
            raise GateError(f"{path}: prompt {i} needs name, kind and text")
    return raw


def sequences(folder, limit: int | None = None, path: Path = PROMPTS_YAML) -> list[Seq]:
    """The prompt set tokenized with the folder's tokenizer.json: one sequence per prompt, its
    first max_tokens ids (capped by max_position_embeddings, then by `limit`)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    raw = load_prompts(path)
    cap = int(raw.get("max_tokens", 256))
    cfg = json.loads((folder / "config.json").read_text())
    ctx = cfg.get("max_position_embeddings")
    if isinstance(ctx, int) and ctx > 0:
        cap = min(cap, ctx)
    if limit:
        cap = min(cap, int(limit))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out = []
    for p in raw["prompts"]:
        ids = tok.encode(p["text"], add_special_tokens=False).ids[:cap]
        if ids:
            out.append(Seq(p["name"], p["kind"], [int(i) for i in ids]))
    return out


# --------------------------------------------------------------------------- metrics


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def position_metrics(ref: np.ndarray, cand: np.ndarray) -> dict[str, np.ndarray]:
    """Per position: argmax equal (bool), KL(ref || cand) (float64), relative L2 (float64)."""
    ref = np.asarray(ref)
    cand = np.asarray(cand)
    if ref.shape != cand.shape or ref.ndim != 2:
        raise GateError(f"logits of shapes {list(ref.shape)} and {list(cand.shape)} cannot be compared "
                        "(expected the same [n, vocab])")
    if not np.isfinite(cand).all():
        bad = int((~np.isfinite(cand)).any(axis=-1).sum())
        raise GateError(f"candidate logits hold NaN/Inf at {bad} of {cand.shape[0]} positions")
    lp, lq = _log_softmax64(ref), _log_softmax64(cand)
    kl = np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)   # >= 0 up to rounding
    r64, c64 = ref.astype(np.float64), cand.astype(np.float64)
    rel = np.linalg.norm(c64 - r64, axis=-1) / np.maximum(np.linalg.norm(r64, axis=-1), 1e-300)
    agree = ref.argmax(axis=-1) == cand.argmax(axis=-1)
    return {"agree": agree, "kl": kl, "rel_l2": rel}


# Router ties: a position where some MoE router's k-th and (k+1)-th choice scores of the reference
# differ by less than TIE_MARGIN of the row's largest |score| (tools/oracle.py router_margins; with
# the flagships' QSA / DSA indexers, their block / pool scores at the top-k cut likewise:
# tie_margins, the smaller of the two) is
# a tie at float32 noise: an executor that rounds differently may pick the other expert there (a
# discrete change, e.g. rel L2 0.135 at the one tied position of tiny-qwen3_moe/mxfp8 on the H200).
# Such positions are left out of the metrics and counted; the reference alone decides which, so a
# candidate cannot widen the set. 5e-5 is 10x the relative difference of the hidden states measured
# between the CUDA and NumPy executors (<= 5e-6). Over the prompt set it leaves out 2 of 2,304
# positions of tiny-qwen3_moe/mxfp8 (6.9e-6, 1.5e-5), 1 of fp8 (4.0e-5), none of nvfp4 and bf16
# (>= 1.5e-4). The flagships add their indexers' top-k cuts (4 of up to 256 blocks / pools, every
# indexed layer): over the full prompt set 1-10 of 2,304 positions (make gates, 2026-12-01), over
# the 576 of make test's fast subset up to 4 (0.7%: tiny-qwen4_exp/bf16). More than MAX_TIES of the
# positions is an error: the prompt set would then not gate the model. It was 0.5% before the
# flagships; 1% still leaves 99% of the positions judged.
TIE_MARGIN = 5e-5
MAX_TIES = 0.01


def summarize(per: Sequence[dict[str, np.ndarray]], keep: Sequence[np.ndarray] | None = None) -> dict:
    agree = np.concatenate([p["agree"] for p in per])
    kl = np.concatenate([p["kl"] for p in per])
    rel = np.concatenate([p["rel_l2"] for p in per])
    n = int(agree.size)
    k = np.concatenate(keep) if keep is not None else np.ones(n, bool)
    excluded = int(n - k.sum())
    if excluded > MAX_TIES * n:
        raise GateError(f"{excluded} of {n} positions are router ties (margin < {TIE_MARGIN:g}); more than "
                        f"{MAX_TIES:.1%}: the prompt set cannot gate this model")
    agree, kl, rel = agree[k], kl[k], rel[k]
    return {"positions": int(agree.size), "argmax_agreement": float(agree.mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "rel_l2_mean": float(rel.mean()), "rel_l2_max": float(rel.max()), "ties_excluded": excluded}


def compare(refs: Sequence[np.ndarray], cands: Sequence[np.ndarray],
            margins: Sequence[np.ndarray | None] | None = None) -> dict:
    """Metrics over all positions of all sequences; `margins` (per sequence, the reference's router
    margins or None) leaves out the router ties (TIE_MARGIN)."""
    if len(refs) != len(cands):
        raise GateError(f"{len(refs)} reference sequences against {len(cands)} candidate ones")
    per = [position_metrics(r, c) for r, c in zip(refs, cands)]
    keep = None
    if margins is not None:
        keep = [np.ones(len(r), bool) if m is None else np.asarray(m) >= TIE_MARGIN for r, m in zip(refs, margins)]
    return summarize(per, keep)


# --------------------------------------------------------------------------- bands


@dataclass
class Band:
    kind: str
    compares: str
    limits: dict[str, dict]          # metric -> {"min": x} or {"max": x} (+ why / measured)


def load_bands(path: Path = BANDS_YAML) -> dict[str, Band]:
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise GateError(f"{path}: expected a mapping of comparison kinds")
    out = {}
    for kind, row in raw.items():
        if not isinstance(row, dict) or not isinstance(row.get("bands"), dict):
            raise GateError(f"{path}: {kind}: expected 'compares' and a 'bands' mapping")
        for metric, lim in row["bands"].items():
            if metric not in METRICS:
                raise GateError(f"{path}: {kind}: unknown metric {metric!r}; known: {', '.join(METRICS)}")
            if not isinstance(lim, dict) or len({"min", "max"} & set(lim)) != 1:
                raise GateError(f"{path}: {kind}.{metric}: give exactly one of min / max")
        out[kind] = Band(kind, " ".join(str(row.get("compares", "")).split()), row["bands"])
    return out


def check(m: dict, band: Band) -> list[str]:
    """The band failures of metrics `m` (empty when it passes)."""
    fails = []
    for metric, lim in band.limits.items():
        v = m[metric]
        if "min" in lim and not v >= float(lim["min"]):
            fails.append(f"{metric} {v:.6g} < {float(lim['min']):.6g}")
        if "max" in lim and not v <= float(lim["max"]):
            fails.append(f"{metric} {v:.6g} > {float(lim['max']):.6g}")
    return fails


# --------------------------------------------------------------------------- candidates


def gates_dir() -> Path:
    env = os.environ.get(GATES_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bloomery" / "gates"


def artifact_for(name: str, tp: int = 1, env: dict | None = None, tag: str = "") -> Path:
    """Prepare the test checkpoint `name` into the gates cache (re-prepared each call: the gate
    checks the current compiler; prepare is deterministic and publishes atomically)."""
    from bloomery.compiler.prepare import prepare
    from bloomery.tools.models import model_dir

    out = gates_dir() / "artifacts" / f"{name.replace('/', '__')}{tag}-tp{tp}"
    out.parent.mkdir(parents=True, exist_ok=True)
    prepare(model_dir(name), out, tp=tp, env=env if env is not None else {}, progress=False)
    return out


def executor_available() -> bool:
    """Whether the NumPy executor (bloomery.runtime.logits) exists. Only the absence of the
    bloomery.runtime package itself reads as False: a runtime that is there but fails to import
    (a broken import inside it, a missing dependency, a syntax error) raises, so that a broken
    executor is an error to see, never a silent switch to another comparison."""
    try:
        import bloomery.runtime as rt
    except ModuleNotFoundError as e:
        if e.name != "bloomery.runtime":
            raise
        return False
    return callable(getattr(rt, "logits", None))


def executor_logits(artifact, ids: Sequence[int]) -> np.ndarray:
    """bloomery.runtime.logits(artifact, ids, device="cpu"); `artifact` a path or a loaded Engine."""
    import bloomery.runtime as rt

    if not callable(getattr(rt, "logits", None)):
        raise GateError("bloomery.runtime.logits does not exist yet: the NumPy executor is not built "
                        "(use --candidate artifact-oracle to check the rest of the chain)")
    out = np.asarray(rt.logits(artifact if not isinstance(artifact, (str, Path)) else str(artifact),
                               list(ids), device="cpu"))
    if out.dtype != np.float32 or out.shape != (len(ids), out.shape[-1]):
        raise GateError(f"bloomery.runtime.logits returned {out.dtype} {list(out.shape)}, not float32 "
                        f"[{len(ids)}, vocab]")
    return out


def executor(artifact: Path, seqs: Sequence[Seq]):
    """The executor loaded once for all sequences (runtime.Engine, ctx = the longest sequence),
    or the artifact path (loaded per call) where the runtime has no Engine."""
    import bloomery.runtime as rt

    eng = getattr(rt, "Engine", None)
    if eng is None:
        return artifact
    return eng(str(artifact), device="cpu", ctx=max(len(s.ids) for s in seqs))


CANDIDATES = ("executor", "artifact-oracle")
KIND_OF = {"executor": "executor_vs_oracle", "artifact-oracle": "artifact_oracle_vs_oracle"}


def candidate_fn(candidate: str, name: str, artifact: Path, seqs: Sequence[Seq]) -> Callable[[Sequence[int]], np.ndarray]:
    if candidate == "executor":
        ex = executor(artifact, seqs)
        return lambda ids: executor_logits(ex, ids)
    if candidate == "artifact-oracle":
        from bloomery.tools import oracle
        from bloomery.tools.models import model_dir

        o = oracle.artifact_oracle(model_dir(name), artifact)
        return o.logits
    raise GateError(f"unknown candidate {candidate!r}; known: {', '.join(CANDIDATES)}")


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    model: str
    fmt: str
    kind: str
    positions: int = 0
    metrics: dict = field(default_factory=dict)
    verdict: str = ""                # PASS / FAIL / SKIP / ERROR
    why: str = ""
    seconds: float = 0.0


def _split(name: str) -> tuple[str, str]:
    model, _, fmt = name.partition("/")
    return model, fmt


def gate_row(name: str, bands: dict[str, Band], candidate: str = "executor", limit: int | None = None,
             memo: dict | None = None) -> Row:
    """One (model, format) against the oracle of the same checkpoint."""
    from bloomery.tools import oracle
    from bloomery.tools.models import model_dir

    model, fmt = _split(name)
    kind = KIND_OF[candidate]
    row = Row(model, fmt, kind)
    t0 = time.perf_counter()
    if name in SKIP:
        row.verdict, row.why = "SKIP", SKIP[name]
        return row
    try:
        folder = model_dir(name)
        seqs = sequences(folder, limit)
        art = artifact_for(name, tp=1)
        ref = oracle.Oracle(folder)
        cand = candidate_fn(candidate, name, art, seqs)
        refs, cands, margins = [], [], []
        for s in seqs:
            refs.append(ref.logits(s.ids))
            margins.append(ref.tie_margins(s.ids))
            c = cand(s.ids)
            cands.append(c)
            if memo is not None:
                memo[(name, 1, tuple(s.ids))] = c
        row.metrics = compare(refs, cands, margins)
        row.positions = row.metrics["positions"]
        fails = check(row.metrics, bands[kind])
        row.verdict, row.why = ("FAIL", "; ".join(fails)) if fails else ("PASS", "")
    except Exception as e:  # a row that cannot be computed fails, by name
        row.verdict, row.why = "ERROR", f"{type(e).__name__}: {e}"
    row.seconds = time.perf_counter() - t0
    return row


def tp2_row(name: str, bands: dict[str, Band], limit: int | None = None, memo: dict | None = None) -> Row:
    """The executor on a tp 2 artifact against the executor on the tp 1 artifact of the same checkpoint."""
    from bloomery.tools.models import model_dir

    model, fmt = _split(name)
    row = Row(model, fmt, "tp2_vs_tp1")
    t0 = time.perf_counter()
    if name in TP2_SKIP or name in SKIP:
        row.verdict, row.why = "SKIP", TP2_SKIP.get(name) or SKIP[name]
        return row
    try:
        seqs = sequences(model_dir(name), limit)
        a1, a2 = artifact_for(name, tp=1), artifact_for(name, tp=2)
        refs, cands = [], []
        e1, e2 = None, executor(a2, seqs)
        for s in seqs:
            r = (memo or {}).get((name, 1, tuple(s.ids)))
            if r is None:
                e1 = e1 or executor(a1, seqs)
                r = executor_logits(e1, s.ids)
            refs.append(r)
            cands.append(executor_logits(e2, s.ids))
        row.metrics = compare(refs, cands)
        row.positions = row.metrics["positions"]
        fails = check(row.metrics, bands["tp2_vs_tp1"])
        row.verdict, row.why = ("FAIL", "; ".join(fails)) if fails else ("PASS", "")
    except Exception as e:
        row.verdict, row.why = "ERROR", f"{type(e).__name__}: {e}"
    row.seconds = time.perf_counter() - t0
    return row


def table(rows: Sequence[Row]) -> str:
    head = (f"{'model':<16} {'format':<16} {'comparison':<26} {'pos':>5} {'argmax':>8} {'KL mean':>9} "
            f"{'KL max':>9} {'relL2 mean':>10} {'relL2 max':>9} {'s':>6}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.metrics:
            m = r.metrics
            nums = (f"{r.positions:>5}{'*' if m.get('ties_excluded') else ' '}{m['argmax_agreement']:>8.4f} {m['kl_mean']:>9.2e} {m['kl_max']:>9.2e} "
                    f"{m['rel_l2_mean']:>10.2e} {m['rel_l2_max']:>9.2e}")
        else:
            nums = f"{'-':>5} {'-':>8} {'-':>9} {'-':>9} {'-':>10} {'-':>9}"
        why = f" ({r.why})" if r.why else ""
        if r.metrics.get("ties_excluded"):
            why += f" [{r.metrics['ties_excluded']} router-tie positions left out]"
        lines.append(f"{r.model:<16} {r.fmt:<16} {r.kind:<26} {nums} {r.seconds:>6.1f}  {r.verdict}{why}")
    return "\n".join(lines)


def select(names: Sequence[str], only: Sequence[str] | None) -> list[str]:
    if not only:
        return list(names)
    return [n for n in names if any(n == p or _split(n)[0] == p or fnmatch.fnmatchcase(n, p) for p in only)]


def run(only=None, limit=None, candidate="executor", tp2=True, out=sys.stdout) -> list[Row]:
    bands = load_bands()
    rows, memo = [], {}
    for name in select(GATED, only):
        r = gate_row(name, bands, candidate, limit, memo)
        rows.append(r)
        print(table([r]).splitlines()[-1], file=out, flush=True)
    if tp2 and candidate == "executor":
        for name in select(TP2, only):
            r = tp2_row(name, bands, limit, memo)
            rows.append(r)
            print(table([r]).splitlines()[-1], file=out, flush=True)
    return rows


# --------------------------------------------------------------------------- the Q8 lever


def measure_q8(limit: int | None = None, route: str = "auto", name: str = "smollm2-135m/bf16") -> dict:
    """KL(stored BF16 || Q8_0) and argmax agreement of BLOOMERY_PREPARE_Q8=1 over the prompt set.
    route "executor": the executor on the tp 1 BF16 artifact vs on the Q8 artifact; route
    "oracle": the f32 oracle of the BF16 checkpoint vs the oracle forward on the Q8 artifact's
    decoded values. "auto": executor when the bloomery.runtime package exists, else oracle (a
    runtime that fails to import raises: executor_available); the route taken is in the result."""
    from bloomery.tools import oracle
    from bloomery.tools.models import model_dir

    if route == "auto":
        route = "executor" if executor_available() else "oracle"
    folder = model_dir(name)
    seqs = sequences(folder, limit)
    a_q8 = artifact_for(name, tp=1, env={"BLOOMERY_PREPARE_Q8": "1"}, tag="-q8")
    if route == "executor":
        e_bf, e_q8 = executor(artifact_for(name, tp=1), seqs), executor(a_q8, seqs)
        refs = [executor_logits(e_bf, s.ids) for s in seqs]
        cands = [executor_logits(e_q8, s.ids) for s in seqs]
    elif route == "oracle":
        ref, cand = oracle.Oracle(folder), oracle.artifact_oracle(folder, a_q8)
        refs = [ref.logits(s.ids) for s in seqs]
        cands = [cand.logits(s.ids) for s in seqs]
    else:
        raise GateError(f"unknown route {route!r}")
    m = compare(refs, cands)
    m["route"] = route
    m["model"] = name
    return m


def measure_cache_types(types: Sequence[str] | None = None, only=None, limit: int | None = None,
                        out=sys.stdout) -> dict:
    """Each KV-cache type (runtime/kv_cache.py, --cache-type-k/-v, keys and values alike) against the
    float32 cache, the NumPy executor on the same tp 1 artifact, over the gate prompt set of every
    gated model (fp8 where the checkpoint has ModelOpt's k_scale / v_scale). Per type: the
    positions, KL mean over them, KL max, the lowest argmax agreement of a model, and whether every
    model stays inside the executor_vs_oracle bands (what the default must keep)."""
    from bloomery.runtime import Engine
    from bloomery.runtime.kv_cache import TYPES, CacheTypeRefused
    from bloomery.tools.models import model_dir

    types = types or [t for t in TYPES if t != "f32"]

    band = load_bands()["executor_vs_oracle"]
    per: dict[str, list] = {t: [] for t in types}
    for name in select(GATED, only):
        art, seqs = artifact_for(name), sequences(model_dir(name), limit)
        ctx = max(len(q.ids) for q in seqs)
        ref = Engine(art, ctx=ctx)
        refs = [executor_logits(ref, q.ids) for q in seqs]
        for t in types:
            try:
                eng = Engine(art, ctx=ctx, cache_type_k=t, cache_type_v=t)
            except CacheTypeRefused:
                continue                                  # fp8 without the checkpoint's scales
            m = compare(refs, [executor_logits(eng, q.ids) for q in seqs])
            m["model"], m["inside_bands"] = name, not check(m, band)
            per[t].append(m)
            print(f"{name:<34} {t:<5} KL mean {m['kl_mean']:.2e} max {m['kl_max']:.2e} argmax "
                  f"{m['argmax_agreement']:.4f}", file=out, flush=True)
    res = {}
    for t, rows in per.items():
        if rows:
            n = sum(r["positions"] for r in rows)
            res[t] = {"models": len(rows), "positions": n,
                      "kl_mean": sum(r["kl_mean"] * r["positions"] for r in rows) / n,
                      "kl_max": max(r["kl_max"] for r in rows),
                      "argmax_agreement_min": min(r["argmax_agreement"] for r in rows),
                      "worst": max(rows, key=lambda r: r["kl_mean"])["model"],
                      "inside_bands": all(r["inside_bands"] for r in rows)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bloomery.tools.gates", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="model names, families or globs (tools/models.py names)")
    ap.add_argument("--limit", type=int, help="at most this many tokens per sequence (a shorter slice)")
    ap.add_argument("--candidate", choices=CANDIDATES, default="executor")
    ap.add_argument("--no-tp2", action="store_true", help="skip the tp 2 rows")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--q8", action="store_true", help="measure the BLOOMERY_PREPARE_Q8 lever instead")
    ap.add_argument("--route", choices=("auto", "executor", "oracle"), default="auto", help="with --q8")
    ap.add_argument("--cache-types", nargs="*", metavar="TYPE",
                    help="measure these KV-cache types against f32 instead (none given: every one)")
    a = ap.parse_args(argv)
    if a.cache_types is not None:
        print(json.dumps(measure_cache_types(a.cache_types, a.only, a.limit), indent=2))
        return 0
    if a.q8:
        m = measure_q8(a.limit, a.route)
        print(json.dumps(m, indent=2))
        return 0
    t0 = time.perf_counter()
    print(table([]), flush=True)
    rows = run(a.only, a.limit, a.candidate, not a.no_tp2)
    bad = [r for r in rows if r.verdict in ("FAIL", "ERROR")]
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    n = {v: sum(r.verdict == v for r in rows) for v in ("PASS", "FAIL", "ERROR", "SKIP")}
    print(f"\n{len(rows)} rows: {n['PASS']} pass, {n['FAIL']} fail, {n['ERROR']} error, {n['SKIP']} skipped "
          f"({time.perf_counter() - t0:.0f} s)")
    if not rows:
        print("no gate selected", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
