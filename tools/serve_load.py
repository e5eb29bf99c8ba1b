"""A load generator for `bloomery serve`: a fixed number of streamed completions, `--parallel` of
them in flight at once, each a prompt of fixed length (random token ids, seeded) and a fixed
number of generated tokens (ignore_eos: every request generates them all).

    python -m bloomery.tools.serve_load -m ART --parallel 1 4 16 64 [--requests 128]
        [--prompt 512] [--max-tokens 128] [--serve-args "--device cuda"] [--json out.json]
    python -m bloomery.tools.serve_load --url http://127.0.0.1:8080 --parallel 8

With -m, for each --parallel value it starts `bloomery serve -m ART -np P -c (prompt +
max_tokens)` on a free port of 127.0.0.1, waits for /health, sends the load, reads /metrics and
stops the server. Per run it prints: the server's aggregate decode rate (rows of every decode step
/ time in decode steps, from /metrics), the end-to-end rate (generated tokens / wall time), the
mean per-request decode rate (the server's timings: tokens after the first / time after the first),
and the time to
first token (submit to the first streamed piece: queue wait and prefill), mean and p90.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import numpy as np


def _post_stream(host, port, body: dict, timeout: float):
    """(time to first piece, the server's per-request decode tok/s, completion tokens) of one streamed
    completion (the rate from the finish chunk's timings: pieces reach a client in bursts)."""
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first, usage, rate = None, None, 0.0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("choices") and first is None:
            first = time.perf_counter() - t0
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("timings"):
            rate = ev["timings"]["predicted_per_second"]
    c.close()
    return first, rate, usage["completion_tokens"]


def _get(host, port, path):
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read().decode()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def load(url: str, parallel: int, requests: int, prompt: int, max_tokens: int, vocab: int = 500,
         seed: int = 0, timeout: float = 600) -> dict:
    u = urlparse(url)
    host, port = u.hostname, u.port or 80
    rng = np.random.default_rng(seed)
    bodies = [{"prompt": [int(i) for i in rng.integers(3, vocab, prompt)], "max_tokens": max_tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
               "cache_prompt": False, "ignore_eos": True} for _ in range(requests)]
    st0, m0 = _get(host, port, "/metrics")
    res: list = [None] * requests
    todo = iter(range(requests))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            res[i] = _post_stream(host, port, bodies[i], timeout)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    wall = time.perf_counter() - t0
    st1, m1 = _get(host, port, "/metrics")
    done = [r for r in res if r is not None]
    ttft = np.array([r[0] for r in done])
    per = [rate for _, rate, n in done if n > 1]
    out = {"parallel": parallel, "requests": len(done), "prompt": prompt, "max_tokens": max_tokens,
           "wall_s": wall, "tokens": int(sum(r[2] for r in done)),
           "end_to_end_tok_s": sum(r[2] for r in done) / wall,
           "per_request_tok_s": float(np.mean(per)) if per else 0.0,
           "ttft_mean_s": float(ttft.mean()), "ttft_p90_s": float(np.percentile(ttft, 90))}
    if st0 == st1 == 200:
        d = {k: _metric(m1, f"bloomery_{k}_total") - _metric(m0, f"bloomery_{k}_total")
             for k in ("decode_steps", "decode_rows", "decode_seconds")}
        out.update(decode_steps=int(d["decode_steps"]), rows_per_step=d["decode_rows"] / max(d["decode_steps"], 1),
                   aggregate_decode_tok_s=d["decode_rows"] / d["decode_seconds"] if d["decode_seconds"] else 0.0)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, parallel: int, ctx: int, extra: list[str], timeout: float = 900):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bloomery.cli", "serve", "-m", model, "-np", str(parallel),
                             "-c", str(ctx), "--port", str(port), "--metrics", *extra], stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bloomery serve exited: {proc.stderr.read()}")
        try:
            if _get("127.0.0.1", port, "/health")[0] == 200:
                return proc, f"http://127.0.0.1:{port}", proc.stderr.readline().strip()
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("bloomery serve did not come up")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="an artifact or a checkpoint folder: a server is started per --parallel")
    ap.add_argument("--url", help="a running server instead (its -np is its own)")
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=None, help="per run (default: 4 x parallel, at least 8)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=500, help="prompt ids are drawn from [3, vocab)")
    ap.add_argument("--serve-args", default="", help="more flags for bloomery serve (e.g. \"--device cuda\")")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if not (a.model or a.url):
        ap.error("give -m (start servers) or --url (a running one)")
    rows = []
    for p in a.parallel:
        n = a.requests or max(8, 4 * p)
        if a.model:
            proc, url, line = start(a.model, p, a.prompt + a.max_tokens, shlex.split(a.serve_args))
            print(line, flush=True)
        else:
            proc, url = None, a.url
        try:
            rows.append(load(url, p, n, a.prompt, a.max_tokens, a.vocab))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
        r = rows[-1]
        print(f"parallel {p:>3}: {r['requests']} requests, prompt {a.prompt}, {a.max_tokens} tokens each | "
              f"aggregate decode {r.get('aggregate_decode_tok_s', 0):.1f} tok/s ({r.get('rows_per_step', 0):.2f} rows "
              f"a step) | end to end "
              f"{r['end_to_end_tok_s']:.1f} tok/s | per request {r['per_request_tok_s']:.1f} tok/s | "
              f"TTFT mean {r['ttft_mean_s'] * 1e3:.0f} ms, p90 {r['ttft_p90_s'] * 1e3:.0f} ms", flush=True)
    if len(rows) > 1 and rows[0].get("aggregate_decode_tok_s"):
        base = rows[0]["aggregate_decode_tok_s"]
        print("aggregate vs the first: " + ", ".join(f"{r['parallel']}: {r['aggregate_decode_tok_s'] / base:.1f}x"
                                                    for r in rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
