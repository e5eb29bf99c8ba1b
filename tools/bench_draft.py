"""Speculative decoding end to end: greedy generation of a prompt with each draft against no draft
on the same engine, alternating rounds, the tokens checked equal.

    python -m bloomery.tools.bench_draft ART [--device cuda] [--tokens 256] [--rounds 3]
        [--drafts ngram] [--draft-max 4] [--prompt code] [--prompt prose] [--json out.json]

Per prompt and draft: verify passes, drafted and accepted tokens, tokens a pass gave (the
acceptance length), model passes (verify + decode steps; off: one per token), decode tok/s of
each (the minimum decode time of the rounds) and the speedup. The prompts are chat-templated
(the artifact's template); `--prompt` takes a name below or any text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = {
    "code": "Write a Python class Stack with push, pop, peek and is_empty methods, then a function that "
            "uses it to check whether the brackets in a string are balanced. Show the full code.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def bench(art, device: str, prompts: list[str], drafts: list[str], tokens: int, rounds: int,
          draft_max: int) -> list[dict]:
    from bloomery.runtime import generate
    from bloomery.runtime.engine import Engine
    eng = Engine(art, device=device, draft_max=draft_max)
    rows = []
    for p in prompts:
        text = PROMPTS.get(p, p)
        runs: dict = {d: [] for d in ["off", *drafts]}
        for _ in range(rounds):
            for d in runs:                               # alternating: off, draft, off, draft, ...
                runs[d].append(generate(eng, prompt=text, max_tokens=tokens, draft=d, ignore_eos=True))
        base = min(g.decode_s for g in runs["off"])
        ref = runs["off"][0].token_ids
        for d in drafts:
            g = min(runs[d], key=lambda g: g.decode_s)
            same = all(r.token_ids == ref for r in runs[d])
            x = g.extra
            rows.append({"prompt": p, "draft": d, "device": eng.device, "tokens": len(g.token_ids), "same": same,
                         "verify_steps": x.get("verify_steps"), "drafted": x.get("drafted"),
                         "accepted": x.get("accepted"), "acceptance_length": x.get("acceptance_length"),
                         "passes": g.decode_steps - x.get("accepted", 0),
                         "off_tok_s": (len(ref) - 1) / base, "tok_s": (len(g.token_ids) - 1) / g.decode_s,
                         "speedup": base / g.decode_s})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafts", nargs="+", default=["ngram"])
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--prompt", action="append", default=None, help="a name (code, prose) or any text; repeatable")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = bench(a.artifact, a.device, a.prompt or ["code", "prose"], a.drafts, a.tokens, a.rounds, a.draft_max)
    print("| prompt | draft | device | same tokens | verify passes | drafted / accepted | tokens a pass | "
          "model passes (off: %d) | off tok/s | tok/s | speedup |" % (a.tokens - 1))
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['draft']} | {r['device']} | {r['same']} | {r['verify_steps']} | "
              f"{r['drafted']} / {r['accepted']} | {r['acceptance_length']:.2f} | {r['passes']} | "
              f"{r['off_tok_s']:.1f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
