"""`bloomery serve` over real HTTP on 127.0.0.1: the openai client and raw requests against
servers of the SmolLM2 NVFP4 export (an artifact, and the checkpoint folder compiled in memory)
and of a tiny Qwen3-Next (recurrent state). Every reply is checked against `bloomery run` or
against the same prompt served alone; every wait is bounded."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from click.testing import CliRunner

from bloomery.cli import main
from runtime_artifacts import artifact, need

pytestmark = pytest.mark.models

KEY = "test-key"
SMOL = "smollm2-135m/nvfp4"
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `bloomery serve` process (started by this test module, stopped by its pid)."""

    def __init__(self, tmp: Path, *args, key: str | None = None):
        self.port, self.key = free_port(), key
        self.log = tmp / f"serve-{self.port}.log"
        env = {**os.environ, "BLOOMERY_API_KEY": key} if key else {k: v for k, v in os.environ.items()
                                                                   if k != "BLOOMERY_API_KEY"}
        self.proc = subprocess.Popen([sys.executable, "-m", "bloomery.cli", "serve", *map(str, args),
                                      "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "w"), env=env)
        self.health = []                   # the statuses GET /health gave while starting
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                st, _, _ = self.request("GET", "/health")
            except OSError:
                time.sleep(0.05)
                continue
            self.health.append(st)
            if st == 200:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the server did not come up in 120 s: {self.log.read_text()}")
        self.start_line = self.log.read_text().strip().splitlines()[-1]

    def client(self, key: str | None = "default", timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1",
                             api_key=(self.key or "none") if key == "default" else key,
                             max_retries=0, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers=None, key: str | None = "default"):
        """(status, headers, body bytes) of one raw HTTP request."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        h = {"Content-Type": "application/json", **(headers or {})}
        k = self.key if key == "default" else key
        if k:
            h["Authorization"] = f"Bearer {k}"
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        try:
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            return r.status, r.headers, r.read()           # headers: case-insensitive
        finally:
            c.close()

    def post(self, path: str, body, **kw):
        st, h, b = self.request("POST", path, body, **kw)
        return st, h, json.loads(b)

    def metrics(self) -> dict:
        st, _, b = self.request("GET", "/metrics")
        assert st == 200
        out = {}
        for line in b.decode().splitlines():
            if line and not line.startswith("#"):
                name, v = line.rsplit(" ", 1)
                out[name] = float(v)
        return out

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def smol(tmp):
    """The SmolLM2 artifact behind an API key, 4 slots, metrics."""
    s = Served(tmp, "-m", artifact(SMOL), "-np", 4, "-c", 512, "-ub", 32, "--metrics", "--alias", "smol", key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def smol_folder(tmp):
    """The SmolLM2 checkpoint folder, compiled in memory: one slot, a queue of one."""
    s = Served(tmp, "-m", need(SMOL), "-np", 1, "-c", 256, "--max-queue", 1, "--metrics")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny(tmp):
    """A tiny Llama artifact with 8 slots, for the crowd of clients (fast enough for 64 of them)."""
    s = Served(tmp, "-m", artifact("tiny-llama/nvfp4"), "-np", 8, "-c", 128, "-ub", 16, "--metrics", "--alias", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hybrid(tmp):
    """A tiny Qwen3-Next folder (conv windows and delta-rule states per slot), 3 slots, no metrics."""
    s = Served(tmp, "-m", need("tiny-qwen3_next/nvfp4"), "-np", 3, "-c", 256, "-ub", 8, "--alias", "hybrid")
    yield s
    s.stop()


def run_cli(art, prompt: str, n: int, raw: bool = False) -> dict:
    r = CliRunner().invoke(main, ["run", str(art), "-p", prompt, "-n", str(n), "--json", "--device", "cpu",
                                  *(["--raw"] if raw else [])])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def chat(client, content, n=8, model="smol", **kw):
    msgs = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return client.chat.completions.create(model=model, messages=msgs, max_tokens=n, temperature=0, **kw)


def sse(s: Served, path: str, body: dict) -> list:
    """The data: events of a streamed reply, in order ("[DONE]" kept as a string)."""
    st, _, b = s.request("POST", path, body)
    assert st == 200, b
    lines = b.decode().split("\n\n")
    assert lines[-1] == "" and all(x.startswith("data: ") for x in lines[:-1])
    return [x[6:] if x[6:] == "[DONE]" else json.loads(x[6:]) for x in lines[:-1]]


# -- start, health, models, auth ------------------------------------------------------------------

def test_health_is_503_while_loading_then_ok(tmp):
    """In process: the app answers before the model is loaded (503, llama-server's body), then 200."""
    import uvicorn

    from bloomery.serve import Server, Settings, create_app
    srv = Server(Settings(model=need("tiny-llama/nvfp4"), parallel=1, port=free_port()))
    server = uvicorn.Server(uvicorn.Config(create_app(srv), host="127.0.0.1", port=srv.s.port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        c = http.client.HTTPConnection("127.0.0.1", srv.s.port, timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 503 and json.loads(r.read())["error"]["message"] == "Loading model"
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi"}))
        r = c.getresponse()
        assert r.status == 503 and r.read()
        line = srv.load()
        assert "device cpu (--device)" in line and "1 slots (-np)" in line
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
        c.close()
    finally:
        server.should_exit = True
        th.join(10)
        if srv.sched is not None:
            srv.sched.close()


def test_start_line_names_every_choice_and_its_flag(smol, smol_folder):
    for s, src in ((smol, "artifact"), (smol_folder, "checkpoint folder compiled in memory")):
        line = s.start_line
        assert line.startswith("bloomery serve: ") and src in line, line
        for part in ("device cpu (--device)", "tp 1 (--tp)", "(-np)", "per slot (-c", "(-ub)", "MiB weights",
                     "KV/state", f"http://127.0.0.1:{s.port} (--host, --port)"):
            assert part in line, (part, line)
    assert "4 slots (-np)" in smol.start_line and "context 512 per slot" in smol.start_line
    assert "ubatch 32 (-ub)" in smol.start_line and "ubatch 64 (-ub)" in smol_folder.start_line
    assert "batch 128 (-b)" in smol.start_line and "batch 256 (-b)" in smol_folder.start_line
    assert set(smol.health) <= {503, 200} and smol.health[-1] == 200


def test_models_and_api_key(smol):
    assert [m.id for m in smol.client().models.list().data] == ["smol"]
    for key in (None, "wrong-key"):
        st, _, b = smol.request("GET", "/v1/models", key=key)
        assert st == 401 and json.loads(b)["error"]["code"] == "invalid_api_key"
        st, _, b = smol.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                key=key)
        assert st == 401 and json.loads(b)["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):                   # the client refuses to send no key
        chat(smol.client(key="wrong-key"), "hi", n=1)
    st, _, b = smol.request("GET", "/health", key=None)               # /health needs no key
    assert st == 200 and json.loads(b) == {"status": "ok"}


def test_props_tokenize_detokenize_as_llama_server(smol):
    """llama-server's /props, /tokenize and /detokenize: the ids are the checkpoint's own tokenizer's
    (the tokenizers library on its tokenizer.json), /detokenize gives the text back, a wrong field is a
    400 that names it, and each needs the key. (SmolLM2's tokenizer adds no special tokens, so
    add_special gives the same ids here either way: its value is checked against the library's, its
    type for a 400.)"""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(need(SMOL) / "tokenizer.json"))
    st, _, b = smol.request("GET", "/props")
    p = json.loads(b)
    assert st == 200 and p["total_slots"] == 4 and p["default_generation_settings"]["n_ctx"] == 512
    assert p["model_alias"] == "smol" and "im_start" in p["chat_template"]
    text = "The capital of France is Paris. <|im_end|>"
    for special in (False, True):
        st, _, b = smol.request("POST", "/tokenize", {"content": text, "add_special": special})
        assert st == 200 and json.loads(b)["tokens"] == tok.encode(text, add_special_tokens=special).ids
    ids = tok.encode(text, add_special_tokens=False).ids
    st, _, b = smol.request("POST", "/tokenize", {"content": text, "with_pieces": True})
    pieces = json.loads(b)["tokens"]
    assert [x["id"] for x in pieces] == ids and "".join(x["piece"] for x in pieces) == text
    st, _, b = smol.request("POST", "/detokenize", {"tokens": ids})
    assert st == 200 and json.loads(b) == {"content": tok.decode(ids, skip_special_tokens=False)} and text in b.decode()
    for path, body, field in (("/tokenize", {"content": 7}, "content"), ("/tokenize", {"content": "a", "add_special": 1},
                              "add_special"), ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens")):
        st, _, b = smol.request("POST", path, body)
        assert st == 400 and json.loads(b)["error"]["param"] == field, (path, body, b)
    assert "outside the vocabulary" in json.loads(b)["error"]["message"]
    for path, method in (("/props", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST")):
        st, _, _ = smol.request(method, path, {"content": "a", "tokens": [1]}, key=None)
        assert st == 401, path


def test_slots_say_what_each_holds(smol):
    """llama-server's GET /slots: after a request of 37 prompt ids and 5 generated tokens, the slot it
    ran in holds 37 + 4 tokens (the last chosen token is not fed), and no slot is busy."""
    prompt = [int(i) for i in np.random.default_rng(7).integers(100, 5000, 37)]
    st, _, b = smol.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                       "ignore_eos": True})
    assert st == 200 and json.loads(b)["usage"]["completion_tokens"] == 5
    st, _, b = smol.request("GET", "/slots")
    slots = json.loads(b)
    assert st == 200 and [x["id"] for x in slots] == [0, 1, 2, 3]
    assert all(x["n_ctx"] == 512 and not x["is_processing"] and x["n_prompt_left"] == 0 for x in slots), slots
    assert 37 + 4 in [x["n_cached"] for x in slots], slots
    assert smol.request("GET", "/slots", key=None)[0] == 401


# -- replies ----------------------------------------------------------------------------------------

def test_chat_and_completion_are_bloomery_run_greedy(smol, smol_folder):
    """The artifact and the folder give `bloomery run`'s greedy text and its token counts."""
    ref = run_cli(artifact(SMOL), QUESTION, 8)
    for s, model in ((smol, "smol"), (smol_folder, need(SMOL).resolve().name)):
        r = chat(s.client(), QUESTION, model=model)
        assert r.choices[0].message.content == ref["text"] and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == ref["prompt_tokens"] and r.usage.completion_tokens == ref["generated_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.choices[0].finish_reason == {"length": "length", "eos": "stop"}[ref["stop"]]
    raw = run_cli(artifact(SMOL), "The capital of France is", 6, raw=True)
    c = smol.client().completions.create(model="smol", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert c.choices[0].text == raw["text"] and c.usage.prompt_tokens == raw["prompt_tokens"]
    assert c.usage.completion_tokens == raw["generated_tokens"]
    c2 = smol.client().completions.create(model="smol", prompt=raw["prompt_ids"], max_tokens=6, temperature=0)
    assert c2.choices[0].text == raw["text"]                        # a prompt of token ids


def test_seeded_sampling_repeats(tiny):
    def ask(seed):
        return tiny.client().completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=1.0,
                                                top_p=0.95, seed=seed, extra_body={"top_k": 50}).choices[0].text
    greedy = tiny.client().completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0)
    a, b, c = ask(7), ask(7), ask(8)
    assert a == b and (a != c or a != greedy.choices[0].text)


def test_streaming_gives_the_same_text_then_usage_and_done(smol):
    whole = chat(smol.client(), QUESTION)
    ev = sse(smol, "/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": QUESTION}],
                                            "max_tokens": 8, "temperature": 0, "stream": True,
                                            "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == ev[0]["id"] for e in ev[:-1])
    pieces = [e["choices"][0]["delta"].get("content", "") for e in ev[:-2]]
    assert "".join(pieces) == whole.choices[0].message.content and len([p for p in pieces if p]) > 3
    assert ev[-3]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert all(e["usage"] is None for e in ev[:-2])
    # the openai client's stream, and /v1/completions streamed
    got = "".join(c.choices[0].delta.content or "" for c in
                  chat(smol.client(), QUESTION, stream=True) if c.choices)
    assert got == whole.choices[0].message.content
    ref = smol.client().completions.create(model="smol", prompt="Once upon a time", max_tokens=4, temperature=0)
    ev = sse(smol, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
                                       "stream": True})
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == ref.choices[0].text
    assert ev[-2]["choices"][0]["finish_reason"] == ref.choices[0].finish_reason and "usage" not in ev[-2]


def test_stop_strings_and_stop_token_ids(smol):
    from tokenizers import Tokenizer
    full = chat(smol.client(), QUESTION, n=8).choices[0].message.content
    assert "Paris" in full
    r = chat(smol.client(), QUESTION, n=8, stop=["Paris", "never-there"])
    assert r.choices[0].message.content == full[:full.index("Paris")] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       chat(smol.client(), QUESTION, n=8, stop="Paris", stream=True) if c.choices)
    assert streamed == full[:full.index("Paris")]
    # a stop string across tokens: its first pieces are held back until it is ruled in or out
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       chat(smol.client(), QUESTION, n=8, stop=["e is P"], stream=True) if c.choices)
    assert streamed == full[:full.index("e is P")]
    tok = Tokenizer.from_file(str(need(SMOL) / "tokenizer.json"))
    paris = tok.encode(" Paris", add_special_tokens=False).ids
    assert len(paris) == 1
    r = chat(smol.client(), QUESTION, n=8, extra_body={"stop_token_ids": paris})
    assert r.choices[0].message.content == full[:full.index(" Paris")] and r.choices[0].finish_reason == "stop"


# -- refusals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"max_tokens": "ten"}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": 2.5}, 400, "max_completion_tokens"),
    ({"temperature": 5}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": "many"}, 400, "top_k"),
    ({"seed": 1.5}, 400, "seed"),
    ({"stop": 5}, 400, "stop"),
    ({"stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"n": 2}, 400, "n"),
    ({"model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_name_the_field(smol, body, status, param):
    if isinstance(body, dict):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body}
    st, _, b = smol.post("/v1/chat/completions", body)
    assert st == status and b["error"]["param"] == param and b["error"]["type"] == "invalid_request_error", b
    if param:
        assert f"'{param}'" in b["error"]["message"] or f"`{body['model']}`" in b["error"]["message"]


def test_unknown_fields_are_ignored_and_bad_prompts_refused(smol, smol_folder):
    st, _, b = smol.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "temperature": 0, "frequency_penalty": 0.5, "whatever": {"x": 1}})
    assert st == 200 and b["usage"]["completion_tokens"] >= 1
    st, _, b = smol.post("/v1/completions", {"prompt": {"text": "hi"}})
    assert st == 400 and b["error"]["param"] == "prompt"
    st, _, b = smol.post("/v1/completions", {"prompt": [1, 2, 10 ** 6]})
    assert st == 400 and b["error"]["param"] == "prompt" and "vocabulary" in b["error"]["message"]
    long = " ".join(["word"] * 600)
    for s, ctx in ((smol, 512), (smol_folder, 256)):
        with pytest.raises(openai.BadRequestError) as e:
            s.client().completions.create(model=s.client().models.list().data[0].id, prompt=long, max_tokens=1)
        err = e.value.response.json()["error"]
        n = int(re.search(r"holds (\d+) tokens", err["message"]).group(1))
        assert err["param"] == "prompt" and n >= 600 and f"context {ctx} per slot" in err["message"], err


def test_a_reply_that_fills_the_context_ends_with_length(smol_folder):
    c = smol_folder.client()
    ids = list(np.random.default_rng(0).integers(1000, 20000, 250))
    r = c.completions.create(model=c.models.list().data[0].id, prompt=[int(i) for i in ids], max_tokens=100,
                             temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 250 and r.usage.completion_tokens == 256 - 250 + 1   # the last one is not fed


# -- scheduling --------------------------------------------------------------------------------------------

PROMPTS = ["Name a color.", "What is 2+2?", "Say hello.", "Name a fruit.", "What is the sun?", "Count to three."]
RAW = ["Once upon a time", "The best way to learn is", "In 1492,", "Water boils at"]


def _ask(s: Served, model: str, i: int, disconnect: bool = False, n: int = 6):
    """Client i: a chat or a completion, streamed or not; a disconnecting one leaves after one piece."""
    c = s.client()
    if i % 2:
        kw = dict(model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=n,
                  temperature=0)
        fn, get = c.chat.completions.create, lambda ch: ch.choices[0].delta.content or "" if ch.choices else ""
    else:
        kw = dict(model=model, prompt=RAW[i % len(RAW)], max_tokens=n, temperature=0)
        fn, get = c.completions.create, lambda ch: ch.choices[0].text if ch.choices else ""
    if not (disconnect or i % 3 == 0):
        r = fn(**kw)
        return r.choices[0].message.content if i % 2 else r.choices[0].text
    stream = fn(stream=True, **kw)
    text = ""
    for ch in stream:
        text += get(ch)
        if disconnect:
            stream.close()
            return None
    return text


def _key(i: int):
    return ("chat", PROMPTS[i % len(PROMPTS)]) if i % 2 else ("raw", RAW[i % len(RAW)])


def _alone(s: Served, model: str, clients, n: int = 6) -> dict:
    """What each prompt gets served one at a time."""
    ref = {}
    for i in clients:
        if _key(i) not in ref:
            ref[_key(i)] = _ask(s, model, i, n=n)
    return ref


def test_concurrent_requests_get_what_each_gets_alone(smol):
    ref = _alone(smol, "smol", range(1, 5), n=5)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: _ask(smol, "smol", i, n=5), range(1, 5), timeout=300))
    assert got == [ref[_key(i)] for i in range(1, 5)]


def test_64_concurrent_clients_some_leaving(tiny):
    """Every finished reply is the one its prompt gets alone; the ones that left free their slots;
    the server is healthy after and its memory did not grow."""
    ref = _alone(tiny, "tiny", range(64))
    rss0 = tiny.rss()
    m0 = tiny.metrics()
    leaving = {i for i in range(64) if i % 5 == 2}
    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        done = list(pool.map(lambda i: _ask(tiny, "tiny", i, i in leaving), range(64), timeout=300))
    took = time.monotonic() - t0
    for i, text in enumerate(done):
        assert text is None if i in leaving else text == ref[_key(i)], (i, text, ref[_key(i)])
    deadline = time.monotonic() + 30
    while tiny.metrics()["bloomery_slots_busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    m = tiny.metrics()
    assert m["bloomery_slots_busy"] == 0 and m["bloomery_queue_length"] == 0
    fin = {k: m[f'bloomery_requests_total{{finish="{k}"}}'] - m0[f'bloomery_requests_total{{finish="{k}"}}']
           for k in ("stop", "length", "cancelled", "error")}
    assert sum(fin.values()) == 64 and fin["error"] == 0 and fin["cancelled"] >= 1, fin
    assert m["bloomery_decode_steps_total"] - m0["bloomery_decode_steps_total"] < 64 * 5 / 2   # rows share steps
    assert _ask(tiny, "tiny", 1) == ref[_key(1)]                                            # still serving
    grew = tiny.rss() - rss0
    print(f"\n64 clients ({len(leaving)} leaving) in {took:.1f} s; RSS {rss0 / 2**20:.0f} MiB -> "
          f"{(rss0 + grew) / 2**20:.0f} MiB")
    assert grew < 32 << 20, f"RSS grew by {grew / 2**20:.0f} MiB"


def test_queue_full_is_503_with_retry_after_and_a_leaving_client_frees_its_slot(smol_folder):
    s = smol_folder
    c = s.client()
    model = c.models.list().data[0].id
    long = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
                                     max_tokens=200, temperature=0, stream=True)
    first = next(iter(long))                                   # the one slot now generates
    assert first.choices[0].delta.role == "assistant"
    queued: list = []
    th = threading.Thread(target=lambda: queued.append(
        c.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)), daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while s.metrics()["bloomery_queue_length"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    st, h, b = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert st == 503 and int(h["Retry-After"]) >= 1 and b["error"]["code"] == "queue_full", b
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=model, prompt="Hi", max_tokens=1)
    assert e.value.status_code == 503
    t0 = time.monotonic()
    long.close()                                               # the streaming client leaves
    th.join(60)
    assert queued and queued[0].usage.completion_tokens >= 1 and time.monotonic() - t0 < 30
    m = s.metrics()
    assert m['bloomery_requests_total{finish="cancelled"}'] == 1 and m["bloomery_slots_busy"] == 0


def test_prompt_reuse_keeps_the_reply_and_skips_the_shared_prefix(smol):
    """A second turn reuses the slot's first turn (its KV rows): the same greedy text as with
    cache_prompt off, fewer prompt tokens computed."""
    msgs = [{"role": "user", "content": QUESTION}]
    a = chat(smol.client(), msgs, n=10)
    msgs = msgs + [{"role": "assistant", "content": a.choices[0].message.content},
                   {"role": "user", "content": "And of Spain?"}]
    body = {"model": "smol", "messages": msgs, "max_tokens": 10, "temperature": 0}
    st, _, warm = smol.post("/v1/chat/completions", body)
    st2, _, cold = smol.post("/v1/chat/completions", {**body, "cache_prompt": False})
    assert st == st2 == 200
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == cold["usage"]["prompt_tokens"]
    assert warm["timings"]["cache_n"] > a.usage.prompt_tokens, (warm["timings"], a.usage)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["timings"]["cache_n"]
    print(f"\nsecond turn of {warm['usage']['prompt_tokens']} tokens: time to first token "
          f"{warm['timings']['prompt_ms']:.0f} ms reusing {warm['timings']['cache_n']}, "
          f"{cold['timings']['prompt_ms']:.0f} ms cold")


def test_hybrid_resumes_from_its_state_snapshots(hybrid):
    """The hybrid keeps a snapshot of its recurrent state at the end of a prompt and of a reply: a
    prompt that continues either resumes there, with the text of a cold request."""
    from bloomery.compiler.in_memory import compile_folder
    from bloomery.runtime import Engine, generate
    c = hybrid.client()
    p = [int(i) for i in np.random.default_rng(1).integers(3, 500, 20)]
    g = generate(Engine(compile_folder(need("tiny-qwen3_next/nvfp4")), ctx=256), ids=p, max_tokens=10)
    ids = g.token_ids
    assert len(ids) == 10
    # the prompt-end snapshot, the reply-end one (the slot holds p + ids[:9]: the last token is never fed),
    # none inside a short shared prefix, none for the same prompt (one token is always computed)
    for prompt, kept in ((p + ids + [7, 8, 9], len(p) + 9), (p + [11, 12], len(p)), (p[:5] + [13], 0), (p, 0)):
        first = c.completions.create(model="hybrid", prompt=p, max_tokens=10, temperature=0)
        assert first.choices[0].text == g.text and first.usage.completion_tokens == 10
        body = {"model": "hybrid", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        st, _, warm = hybrid.post("/v1/completions", body)
        st2, _, cold = hybrid.post("/v1/completions", {**body, "cache_prompt": False})
        assert st == st2 == 200 and warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert cold["timings"]["cache_n"] == 0 and warm["timings"]["cache_n"] == kept, (prompt, warm["timings"])


def test_recurrent_state_is_per_request(hybrid):
    """The hybrid's slots: concurrent requests get what each gets alone, and a slot that served
    one request serves a different one as if new."""
    c = hybrid.client()
    prompts = ["alpha beta", "gamma", "delta epsilon zeta", "eta", "theta iota"]
    alone = [c.completions.create(model="hybrid", prompt=p, max_tokens=12, temperature=0, extra_body={
             "cache_prompt": False}).choices[0].text for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: c.completions.create(model="hybrid", prompt=p, max_tokens=12,
                                                                temperature=0).choices[0].text, prompts, timeout=120))
    assert together == alone
    again = [c.completions.create(model="hybrid", prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in reversed(prompts)]
    assert again == alone[::-1]
    st, _, _ = hybrid.request("GET", "/metrics")
    assert st == 501                                      # no --metrics


# -- in process: the folder compiled in memory -------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama/nvfp4_awq", "tiny-qwen3_next/nvfp4", "tiny-llama/bf16"])
def test_folder_in_memory_is_the_prepared_artifact(name):
    from bloomery.compiler.in_memory import compile_folder
    from bloomery.core.artifact import Artifact
    from bloomery.runtime import Engine, generate
    disk, mem = Artifact.open(artifact(name)), compile_folder(need(name))
    assert mem.metadata(0) == disk.metadata(0) and mem.tensors(0) == disk.tensors(0)
    for n in disk.tensors(0):
        a, b = disk.gguf_arrays(n), mem.gguf_arrays(n)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
        assert np.array_equal(disk.decode(n).view(np.uint32), mem.decode(n).view(np.uint32))
    ga, gb = (generate(Engine(x, ctx=64), "hello", max_tokens=8) for x in (disk, mem))
    assert ga.token_ids == gb.token_ids


def test_serve_refuses_a_tp_its_artifact_was_not_prepared_with(tmp):
    r = subprocess.run([sys.executable, "-m", "bloomery.cli", "serve", "-m", str(artifact("tiny-llama/bf16")),
                        "--tp", "2", "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "prepared with --tp 1" in r.stderr, r.stderr


def test_help_teaches():
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for flag in ("-m, --model", "-c, --ctx-size", "-np, --parallel", "-ub, --ubatch-size", "-b, --batch-size",
                 "--host", "--port",
                 "--api-key", "BLOOMERY_API_KEY", "-n, --n-predict", "--alias", "--device", "--tp", "--metrics",
                 "/v1/chat/completions", "/props", "/slots", "/tokenize", "curl"):
        assert flag in r.output, flag


# -- drafts (speculative decoding) ---------------------------------------------------------------------

def test_drafts_keep_every_reply(tmp):
    """-np 1 with the n-gram draft against --draft off, on the hybrid (recurrent states restored after
    each verify pass, and snapshots for prompt reuse): the same replies, a continued conversation
    included, and the draft did work; with -np 2 --draft ngram is refused by name."""
    art = artifact("tiny-qwen3_next/nvfp4")
    prompts = [[1] + list(range(40, 60)) * 2, [1, 5, 9, 13] * 6, [1] + list(range(100, 130))]
    out = {}
    for draft in ("ngram", "off"):
        s = Served(tmp, "-m", art, "-np", 1, "-c", 256, "--metrics", "--alias", "h", "--draft", draft)
        try:
            assert f"draft {draft} (--draft)" in s.start_line, s.start_line
            c, texts = s.client(), []
            for p in prompts:
                r = c.completions.create(model="h", prompt=p, max_tokens=40, temperature=0)
                texts.append(r.choices[0].text)
            # the same prompt again (the slot's snapshot at its end: reused) and one past it
            for p in (prompts[-1], prompts[-1] + [7, 8, 9]):
                texts.append(c.completions.create(model="h", prompt=p, max_tokens=20, temperature=0).choices[0].text)
            out[draft] = (texts, s.metrics())
        finally:
            s.stop()
    assert out["ngram"][0] == out["off"][0]
    m_on, m_off = out["ngram"][1], out["off"][1]
    assert m_on["bloomery_draft_steps_total"] > 0 and m_on["bloomery_draft_accepted_total"] > 0
    assert m_off["bloomery_draft_steps_total"] == 0
    assert m_on["bloomery_decode_steps_total"] < m_off["bloomery_decode_steps_total"]
    r = subprocess.run([sys.executable, "-m", "bloomery.cli", "serve", "-m", str(art), "-np", "2", "--draft", "ngram",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "-np 1 for drafts" in r.stderr, r.stderr


def _scheduled(art, draft, jobs):
    """In process: each (prompt ids, Params) through a one-slot Scheduler, in order; (ids, finish,
    reused) of each, the slot's tokens after each, and the scheduler's counters."""
    import threading

    from bloomery.runtime import Engine
    from bloomery.runtime.scheduler import Request, Scheduler
    from bloomery.runtime.text import Text
    eng = Engine(art, ctx=256, slots=1)
    sch = Scheduler(eng, Text(eng.art, eng.eos_ids, eng.bos_id), draft=draft)
    res, held = [], []
    try:
        for prompt, params in jobs:
            done = threading.Event()
            r = Request(list(prompt), params, on_event=lambda k, p, d=done: d.set() if k in ("done", "error") else None)
            sch.submit(r)
            assert done.wait(120) and r.finish in ("stop", "length"), r.finish
            res.append((r.ids, r.finish, r.reused))
            held.append(list(sch.slots[0].tokens))
    finally:
        sch.close()
    return res, held, dict(sch.metrics)


@pytest.mark.parametrize("batch", [None, 16, 41, 42])
def test_a_burst_of_prompts_is_fed_before_the_decode_steps_it_shares(batch):
    """Three requests arriving together on three slots (prompts of 12, 14 and 16 tokens; -ub 16):
    with -b 42 (their sum) all three prompts are fed before the first decode step, so every step decodes all
    three (with -b 41 the third waits for one step); with -b 16 (one chunk, the scheduler's default) one prompt
    goes in between two steps, so the first steps decode one and two rows. The replies are the same
    in each case, and the same as each request served alone."""
    from bloomery.runtime import Engine
    from bloomery.runtime.scheduler import Params, Request, Scheduler
    from bloomery.runtime.text import Text
    art = artifact("tiny-llama/nvfp4")
    prompts = [[1] + list(range(20 + 10 * i, 31 + 12 * i)) for i in range(3)]
    assert [len(p) for p in prompts] == [12, 14, 16]

    def served(jobs, slots):
        eng = Engine(art, ctx=64, slots=slots, ubatch=16)
        sch = Scheduler(eng, Text(eng.art, eng.eos_ids, eng.bos_id), batch=batch)
        done = [threading.Event() for _ in jobs]
        reqs = [Request(list(p), Params(max_tokens=6, ignore_eos=True),
                        on_event=lambda k, x, d=d: d.set() if k in ("done", "error") else None)
                for p, d in zip(jobs, done)]
        try:
            with sch.cond:                                # all waiting when the loop next looks
                for r in reqs:
                    sch.submit(r)
            assert all(d.wait(60) for d in done) and all(r.finish == "length" for r in reqs)
        finally:
            sch.close()
        return [r.ids for r in reqs], sch.metrics

    ids, m = served(prompts, 3)
    assert m["decode_rows"] == 3 * 5                        # 6 tokens a request: the first from its prompt
    assert m["decode_steps"] == {42: 5, 41: 5 + 1}.get(batch, 5 + 2), m
    assert ids == [served([p], 1)[0][0] for p in prompts]


def test_a_draft_that_overruns_a_stop_keeps_the_state_snapshot_right(monkeypatch):
    """The hybrid, one slot, drafts on: a request that stops (a stop token) inside a verify pass has
    fed the drafts after it all the same; the slot's tokens list them and its end-of-reply snapshot is
    the state after them, so a prompt that continues the slot resumes there with the reply of a cold
    request. The draft here proposes the reply itself (so every pass keeps its drafts)."""
    from bloomery.runtime import scheduler
    from bloomery.runtime.scheduler import Params
    art = artifact("tiny-qwen3_next/nvfp4")
    p = [1] + list(range(40, 56)) * 3
    plain = _scheduled(art, "off", [(p, Params(max_tokens=40))])[0][0][0]

    class Reply:                                          # proposes the plain reply's next tokens
        def follow(self, seq):
            self.n = len(seq) - len(p)

        def propose(self, k):
            return plain[self.n:self.n + k]

    monkeypatch.setattr(scheduler, "NgramDraft", Reply)
    stop = plain[4]                                       # taken inside the first pass, 4 drafts in it
    assert stop not in plain[:4]
    first = (p, Params(max_tokens=40, stop_ids=(stop,)))
    res, held, m = _scheduled(art, "ngram", [first])
    assert res[0][0] == plain[:4] and res[0][1] == "stop"
    assert len(held[0]) > len(p) + 4, "the pass fed no token past the stop"
    nxt = held[0] + [7, 8, 9]                             # continues all the slot holds
    warm, _, _ = _scheduled(art, "ngram", [first, (nxt, Params(max_tokens=16))])
    cold, _, _ = _scheduled(art, "off", [(nxt, Params(max_tokens=16, cache_prompt=False))])
    assert warm[1][2] == len(held[0]) and warm[1][0] == cold[0][0]
