"""`bloomery serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the scheduler of
runtime/scheduler.py, with llama-server's flags and endpoints (docs/serve.md).

    GET  /health                 503 {"error": ...} while the model loads, then 200 {"status": "ok"}
    GET  /v1/models              the one model, named by --alias
    POST /v1/chat/completions    messages through the artifact's chat template
    POST /v1/completions         a raw prompt (text or token ids)
    GET  /metrics                Prometheus text, with --metrics

The model is an artifact (opened as `bloomery run` opens it) or a checkpoint folder, compiled in
memory at start (compiler/in_memory.py: prepare's planning and lowering, nothing written). It
lives beside the command line because it imports both sides; the runtime never imports the
compiler. Request fields are checked by hand so that a wrong one is a 400 naming it; unknown
fields are ignored.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from bloomery import __version__
from bloomery.runtime.errors import RuntimeRefusal
from bloomery.runtime.scheduler import EmptyPrompt, Params, QueueFull, Request, Scheduler


# -- loading ---------------------------------------------------------------------------------------

@dataclass
class Settings:
    model: Path
    ctx: int | None = None          # per slot; None: the model's, at most 4096
    parallel: int = 4
    ubatch: int | None = None       # None: 512 on a GPU, 64 on the CPU (at most batch)
    batch: int | None = None        # prompt tokens fed between two decode steps; None: 4 ubatch chunks
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    n_predict: int = -1             # the default max_tokens; -1: until a stop or the context is full
    alias: str | None = None
    device: str = "auto"
    tp: int | None = None           # a folder: ranks to compile (default 1); an artifact: must be its own
    metrics: bool = False
    threads: int = 1
    max_queue: int = 64
    check: bool = False             # --verify: each tensor against DIGESTS.json as it loads
    cache_types: tuple = ("f32", "f32")     # --cache-type-k, --cache-type-v
    draft: str = "auto"             # --draft: auto | off | ngram (a lone greedy request's verify passes)

    @property
    def model_id(self) -> str:
        return self.alias or self.model.resolve().name


class ServeRefusal(RuntimeRefusal):
    """The flags and the model do not fit together (e.g. --tp against an artifact of another TP)."""


def open_model(s: Settings):
    """An Artifact (a prepared folder) or a MemoryArtifact (a checkpoint folder compiled now)."""
    from bloomery.cli import _is_artifact
    from bloomery.core.artifact import Artifact
    if _is_artifact(s.model):
        art = Artifact.open(s.model, check=s.check)
        if s.tp is not None and s.tp != art.tp:
            raise ServeRefusal(f"{s.model} was prepared with --tp {art.tp}; --tp {s.tp} needs a checkpoint folder "
                               f"or an artifact prepared with it")
        return art
    from bloomery.compiler.in_memory import compile_folder
    return compile_folder(s.model, tp=s.tp or 1)


def load(s: Settings):
    """(engine, text, the start line)."""
    from bloomery.runtime import Engine
    from bloomery.runtime.engine import DEFAULT_DRAFT_MAX
    from bloomery.runtime import device as devices
    from bloomery.runtime.text import Text
    t0 = time.perf_counter()
    art = open_model(s)
    dev = devices.resolve(s.device)
    ub = min(s.ubatch or (512 if dev == "cuda" else 64), s.batch or 1 << 30)      # -ub at most -b, as llama.cpp
    s.batch = s.batch or 4 * ub
    # the verify program is bound (graphs captured on the GPU) only where a slot may draft: -np 1
    drafts_here = s.draft != "off" and s.parallel == 1
    eng = Engine(art, device=s.device, ctx=s.ctx, slots=s.parallel, ubatch=ub, threads=s.threads,
                 cache_type_k=s.cache_types[0], cache_type_v=s.cache_types[1],
                 draft_max=DEFAULT_DRAFT_MAX if drafts_here else 0)
    text = Text(eng.art, eng.eos_ids, eng.bos_id)
    from bloomery.runtime import draft as drafts
    if s.draft not in ("auto", "off", "ngram"):
        raise ServeRefusal(f"--draft {s.draft}: the server drafts with ngram (or off, auto)")
    # a verify row is computed as a one-row decode step: bit-equal to this server's own decode steps
    # only when they have one row (-np 1); with more, their rounding differs (bloomery levers,
    # BLOOMERY_DECODE_TC), so a draft could change a reply at a near tie
    if s.draft == "auto":
        s.draft = drafts.choose(eng, "auto", 0.0)[0] if eng.slots == 1 else "off"
    if s.draft == "ngram" and eng.slots > 1:
        raise ServeRefusal(f"--draft ngram with -np {eng.slots}: a verify pass computes a row as a one-row decode "
                           f"step, and this server's steps have {eng.slots} rows, rounded otherwise, so a reply "
                           f"could differ from --draft off at a near tie; use -np 1 for drafts")
    if s.draft == "ngram" and not eng.draft_max:
        raise ServeRefusal(eng._no_verify_why())
    mem = eng.memory()
    src = "artifact" if not getattr(art, "in_memory", False) else "checkpoint folder compiled in memory"
    line = (f"bloomery serve: {s.model_id} ({src}, {time.perf_counter() - t0:.1f} s) | device {eng.device} (--device) "
            f"| tp {art.tp} (--tp) | {eng.slots} slots (-np) | context {eng.ctx} per slot (-c; the model's "
            f"{eng.context_length}) | ubatch {eng.ubatch} (-ub) | batch {s.batch} (-b) | memory {_mib(mem['weights'])} weights + "
            f"{_mib(mem['state'])} KV/state (-c, -np; KV {'/'.join(eng.cache_types)}: -ctk, -ctv) | draft {s.draft} "
            f"(--draft) | http://{s.host}:{s.port} (--host, --port)")
    if getattr(eng.exec, "aot_line", None):                # the CUDA executor's kernels (BLOOMERY_AOT)
        line += f" | {eng.exec.aot_line}"
    return eng, text, line


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


# -- request fields ------------------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, want: str, v) -> ApiError:
    return ApiError(400, f"'{param}' must be {want}; got {json.dumps(v)[:80]}", param)


def _int(b: dict, k: str, lo: int | None = None, default=None):
    v = b.get(k)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise _bad(k, "an integer" + (f" >= {lo}" if lo is not None else ""), v)
    return v


def _num(b: dict, k: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = b.get(k)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise _bad(k, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", v)
    return float(v)


def _bool(b: dict, k: str, default: bool) -> bool:
    v = b.get(k)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(k, "true or false", v)
    return v


def _params(b: dict, default_max: int) -> Params:
    mt = _int(b, "max_tokens", 1)
    mt = _int(b, "max_completion_tokens", 1, mt)            # the newer name wins
    if mt is None and default_max > 0:
        mt = default_max
    stop = b.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise _bad("stop", "a string or a list of strings", stop)
    ids = b.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in ids)):
        raise _bad("stop_token_ids", "a list of integers", ids)
    top_k = _int(b, "top_k", -1, 0)
    if _int(b, "n", 1, 1) != 1:
        raise ApiError(400, "'n' must be 1: this server returns one choice per request", "n")
    return Params(max_tokens=mt, temperature=_num(b, "temperature", 0, 2, 1.0),
                  top_p=_num(b, "top_p", 0, 1, 1.0, lo_open=True), top_k=max(top_k, 0), seed=_int(b, "seed"),
                  stop=tuple(x for x in stop or () if x), stop_ids=tuple(ids or ()),
                  cache_prompt=_bool(b, "cache_prompt", True), ignore_eos=_bool(b, "ignore_eos", False))


def _stream_options(b: dict) -> tuple[bool, bool]:
    stream = _bool(b, "stream", False)
    so = b.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, dict):
        raise _bad("stream_options", "an object", so)
    if not stream:
        raise ApiError(400, "'stream_options' is allowed only with 'stream': true", "stream_options")
    return stream, _bool(so, "include_usage", False)


def _messages(b: dict) -> list[dict]:
    msgs = b.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list of {role, content} objects", msgs)
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(where, "an object with a string 'role'", m)
        c = m.get("content")
        if isinstance(c, list):                  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise _bad(f"{where}.content", "a string or a list of {\"type\": \"text\", \"text\": ...} parts", c)
            c = "".join(p["text"] for p in c)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise _bad(f"{where}.content", "a string or a list of text parts", c)
        out.append({"role": m["role"], "content": c})
    return out


def _prompt_ids(b: dict, text) -> list[int]:
    p = b.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                 # a batch of one
    if isinstance(p, str):
        return text.encode(p, raw=True)
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return list(p)
    raise _bad("prompt", "a string or a list of token ids (one prompt per request)", p)


# -- the server ----------------------------------------------------------------------------------------

class Server:
    """The app's state: loading, then the engine and its scheduler."""

    def __init__(self, s: Settings):
        self.s = s
        self.sched: Scheduler | None = None
        self.text = None
        self.error: str | None = None
        self.started = time.time()

    def load(self) -> str:
        eng, self.text, line = load(self.s)
        self.sched = Scheduler(eng, self.text, max_queue=self.s.max_queue, draft=self.s.draft,
                               batch=self.s.batch)
        return line

    def ready(self) -> Scheduler:
        if self.sched is None:
            raise ApiError(503, "Loading model", type_="unavailable_error", code="model_loading")
        return self.sched


def create_app(srv: Server) -> FastAPI:
    app = FastAPI(title="bloomery", docs_url=None, redoc_url=None, openapi_url=None)
    s = srv.s

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def auth(http: HttpRequest) -> None:
        if s.api_key is None:
            return
        h = http.headers.get("authorization", "")
        key = h[7:].strip() if h[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(key.encode(), s.api_key.encode()):
            raise ApiError(401, "Invalid API key (send it as 'Authorization: Bearer <key>')",
                           type_="authentication_error", code="invalid_api_key")

    async def body_of(http: HttpRequest) -> dict:
        raw = await http.body()
        try:
            b = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(b, dict):
            raise ApiError(400, "the request body must be a JSON object")
        m = b.get("model")
        if m is not None and m != s.model_id:
            raise ApiError(404, f"The model `{m}` does not exist; this server serves `{s.model_id}` (GET /v1/models)",
                           "model", code="model_not_found")
        return b

    @app.get("/health")
    async def health():
        srv.ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        auth(http)
        sched = srv.ready()
        return {"object": "list", "data": [{"id": s.model_id, "object": "model", "created": int(srv.started),
                                            "owned_by": "bloomery", "max_model_len": sched.eng.ctx}]}

    @app.get("/metrics")
    async def metrics(http: HttpRequest):
        auth(http)
        if not s.metrics:
            raise ApiError(501, "this server has no metrics endpoint: start it with --metrics", type_="not_supported_error")
        return PlainTextResponse(prometheus(srv.ready().stats()), media_type="text/plain; version=0.0.4")

    @app.get("/props")
    async def props(http: HttpRequest):            # llama-server's: what a client needs to know of the server
        auth(http)
        sched = srv.ready()
        return {"total_slots": len(sched.slots), "model_alias": s.model_id, "model_path": str(s.model),
                "chat_template": srv.text.template or "",
                "default_generation_settings": {"n_ctx": sched.eng.ctx, "n_predict": s.n_predict},
                "build_info": f"bloomery {__version__}"}

    @app.get("/slots")
    async def slots(http: HttpRequest):            # llama-server's: each slot's state
        auth(http)
        return srv.ready().slot_states()

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):         # llama-server's: the ids of a text, as a raw prompt takes them
        auth(http)
        srv.ready()
        b = await body_of(http)
        content = b.get("content")
        if not isinstance(content, str):
            raise _bad("content", "a string", content)
        special, pieces = _bool(b, "add_special", False), _bool(b, "with_pieces", False)
        ids = srv.text.ids(content, special)
        if pieces:
            return {"tokens": [{"id": i, "piece": srv.text.decode([i], special=True)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):       # llama-server's: the text of ids (special tokens kept)
        auth(http)
        sched = srv.ready()
        b = await body_of(http)
        ids = b.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise _bad("tokens", "a list of token ids", ids)
        try:
            sched.eng.check_ids(ids, "tokens")
        except (RuntimeRefusal, OverflowError) as e:
            raise ApiError(400, str(e), "tokens") from None
        return {"content": srv.text.decode(ids, special=True)}

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        auth(http)
        sched = srv.ready()
        b = await body_of(http)
        msgs = _messages(b)
        params = _params(b, s.n_predict)
        stream, usage = _stream_options(b)
        try:
            ids = srv.text.encode_messages(msgs)
        except RuntimeRefusal as e:          # no chat template, or the template refused the conversation
            raise ApiError(400, str(e), "messages") from None
        return await complete(http, sched, ids, params, stream, usage, chat=True, param="messages")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        auth(http)
        sched = srv.ready()
        b = await body_of(http)
        ids = _prompt_ids(b, srv.text)
        params = _params(b, s.n_predict)
        stream, usage = _stream_options(b)
        return await complete(http, sched, ids, params, stream, usage, chat=False, param="prompt")

    async def complete(http, sched, ids, params, stream, usage, *, chat: bool, param: str):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(ids, params, lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload)))
        try:
            sched.submit(req)
        except QueueFull as e:
            raise ApiError(503, str(e), type_="unavailable_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except (EmptyPrompt, RuntimeRefusal) as e:      # too long, empty, ids outside the vocabulary
            raise ApiError(400, str(e), param) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        shape = Shape(rid, s.model_id, chat)
        if stream:
            return StreamingResponse(sse(req, events, shape, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        req.cancel()
                        return JSONResponse({}, status_code=499)
                    continue
                if kind == "error":
                    raise ApiError(500, payload, type_="server_error")
                if kind == "done":
                    return shape.whole(req)
        except asyncio.CancelledError:
            req.cancel()
            raise

    async def sse(req, events, shape, usage):
        try:
            if shape.chat:
                yield shape.event(shape.chunk({"role": "assistant", "content": ""}, None, usage))
            while True:
                kind, payload = await events.get()
                if kind == "text":
                    yield shape.event(shape.chunk({"content": payload} if shape.chat else payload, None, usage))
                elif kind == "error":
                    yield shape.event(ApiError(500, payload, type_="server_error").body())
                    break
                else:                        # the finish chunk carries llama-server's timings
                    yield shape.event({**shape.chunk({} if shape.chat else "", req.finish, usage),
                                       "timings": shape.timings(req)})
                    if usage:
                        yield shape.event({**shape.head(), "choices": [], "usage": shape.usage(req)})
                    break
            yield "data: [DONE]\n\n"
        finally:                             # the client went away (or the reply is complete: a no-op)
            req.cancel()

    return app


class Shape:
    """The OpenAI response objects of one request (chat.completion / text_completion and their chunks)."""

    def __init__(self, rid: str, model: str, chat: bool):
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())

    def head(self, chunk: bool = True) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(req: Request) -> dict:
        n, m = len(req.prompt_ids), len(req.ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": req.reused}}

    @staticmethod
    def timings(req: Request) -> dict:
        """llama-server's timings: prompt (submit to first token) and generation, in ms."""
        first = (req.t_first or req.t_done) - req.t_submit
        gen = req.t_done - (req.t_first or req.t_done)
        rest = max(len(req.ids) - 1, 0)
        return {"cache_n": req.reused, "prompt_n": len(req.prompt_ids) - req.reused, "prompt_ms": first * 1e3,
                "predicted_n": len(req.ids), "predicted_ms": gen * 1e3,
                "predicted_per_second": rest / gen if gen > 0 else 0.0}

    def chunk(self, delta, finish: str | None, usage: bool) -> dict:
        c = {"index": 0, "logprobs": None, "finish_reason": finish}
        c.update({"delta": delta} if self.chat else {"text": delta})
        return {**self.head(), "choices": [c], **({"usage": None} if usage else {})}

    def whole(self, req: Request) -> dict:
        c = {"index": 0, "logprobs": None, "finish_reason": req.finish}
        c.update({"message": {"role": "assistant", "content": req.text}} if self.chat else {"text": req.text})
        return {**self.head(chunk=False), "choices": [c], "usage": self.usage(req), "timings": self.timings(req)}

    @staticmethod
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def prometheus(st: dict) -> str:
    """The scheduler's counters as Prometheus text (llama-server's set, named bloomery_*)."""
    rows = [
        ("requests_total", "counter", "requests finished, by finish reason",
         [({"finish": f}, st[f"requests_{f}"]) for f in ("stop", "length", "cancelled", "error")]),
        ("prompt_tokens_total", "counter", "prompt tokens computed (reused ones left out)", st["prompt_tokens"]),
        ("prompt_tokens_reused_total", "counter", "prompt tokens a slot already held (cache_prompt)",
         st["prompt_tokens_reused"]),
        ("tokens_predicted_total", "counter", "tokens generated", st["tokens_predicted"]),
        ("prompt_seconds_total", "counter", "time spent in prompt chunks", st["prompt_s"]),
        ("decode_seconds_total", "counter", "time spent in decode steps", st["decode_s"]),
        ("decode_steps_total", "counter", "decode steps (one row per generating slot)", st["decode_steps"]),
        ("decode_rows_total", "counter", "tokens decoded: the generating rows of every decode step", st["decode_rows"]),
        ("draft_steps_total", "counter", "verify passes of a drafted slot (--draft)", st["draft_steps"]),
        ("draft_tokens_total", "counter", "drafted tokens verified", st["draft_tokens"]),
        ("draft_accepted_total", "counter", "drafted tokens kept (each the greedy choice)", st["draft_accepted"]),
        ("prompt_tokens_seconds", "gauge", "prompt throughput, tok/s",
         st["prompt_tokens"] / st["prompt_s"] if st["prompt_s"] else 0.0),
        ("predicted_tokens_seconds", "gauge", "aggregate decode throughput, tok/s (rows of every step)",
         st["decode_rows"] / st["decode_s"] if st["decode_s"] else 0.0),
        ("slots_busy", "gauge", "slots holding a request", st["slots_busy"]),
        ("slots_total", "gauge", "slots (-np)", st["slots_total"]),
        ("queue_length", "gauge", "requests waiting for a slot", st["queue_length"]),
    ]
    out = []
    for name, kind, doc, v in rows:
        out += [f"# HELP bloomery_{name} {doc}", f"# TYPE bloomery_{name} {kind}"]
        for labels, x in (v if isinstance(v, list) else [({}, v)]):
            lab = "{" + ",".join(f'{k}="{x_}"' for k, x_ in labels.items()) + "}" if labels else ""
            out.append(f"bloomery_{name}{lab} {x:g}" if isinstance(x, float) else f"bloomery_{name}{lab} {x}")
    return "\n".join(out) + "\n"


def serve(s: Settings) -> int:
    """Runs until interrupted: binds at once (GET /health answers 503 while the model loads)."""
    import uvicorn
    srv = Server(s)
    server = uvicorn.Server(uvicorn.Config(create_app(srv), host=s.host, port=s.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=2))
    failed: list[str] = []

    def loader():
        try:
            line = srv.load()
            print(line, file=sys.stderr, flush=True)
        except Exception as e:       # a refusal by name, or anything else: the server stops
            from bloomery.core.errors import BloomeryError
            failed.append(f"error: {type(e).__name__}: {e}" if isinstance(e, (BloomeryError, OSError))
                          else f"error: loading {s.model}: {type(e).__name__}: {e}")
            server.should_exit = True

    threading.Thread(target=loader, name="bloomery-load", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:        # uvicorn re-raises the Ctrl-C it shut down on
        pass
    if srv.sched is not None:
        srv.sched.close()
    if failed:
        print(failed[0], file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1

