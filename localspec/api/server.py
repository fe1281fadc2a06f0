"""`localspec serve`: an OpenAI-compatible HTTP API over one Engine (Starlette + uvicorn, the `server` extra).

llama.cpp contexts are not thread-safe, so one worker thread owns the engine and serves requests one at a
time in arrival order; the event loop only parses, validates and relays, so /health answers during a
generation. Each request is a Job: the worker puts ("start" | "text" | "end" | "error", value) items on the
job's asyncio queue, and the request handler turns them into a response or an SSE stream. A handler whose
client goes away cancels its job: a waiting job leaves the queue at once, a running one's engine stream
ends within a prefill chunk or a round, and its cleanup leaves both KV caches consistent. SIGINT/SIGTERM
cancel every job at once, so open streams end with an error event instead of being cut when the grace
period runs out.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from collections import deque
from typing import AsyncIterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..core.engine import Engine
from ..core.errors import LocalspecError
from ..core.llama import ContextFullError, DecodeError
from ..core.grammar import GrammarError
from .request import (ApiError, ChatRequest, CompletionRequest, bad_request, check_json_size, check_text,
                      parse_chat, parse_completion)
from .http import (LOOPBACK, MAX_BODY, BodyBudget, Constraints, Cors, EventStream, HostCheck, ServeError,  # noqa: F401
                   bind, disconnected, json_400_protocol, read_body, response, sse)
from .shapes import Chat, Completion, error
from .reasoning import FieldError, budget_of, span_for
from .tools import for_template

log = logging.getLogger("uvicorn.error")
RETRY_AFTER_S = 1
MAX_HELD = 64 * MAX_BODY  # bytes of request bodies held at once while they arrive and are parsed


class Job:
    """One request's generation, handed from the event loop to the worker and answered item by item."""

    def __init__(self, kind: str, req: ChatRequest | CompletionRequest, scope: str = ""):
        self.kind, self.req, self.scope = kind, req, scope  # scope: whose history it drafts from (per API key)
        self.prompt_param = "messages" if kind == "chat" else "prompt"
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, item: tuple) -> None:
        """From the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancelled.set()

    async def next(self, gone: asyncio.Future) -> tuple | None:
        """The next item, or None once the client has disconnected."""
        if gone.done():
            return None
        if not self.out.empty():
            return self.out.get_nowait()
        get = asyncio.ensure_future(self.out.get())
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        return None


class Worker:
    """Runs jobs in arrival order, as many at once as the engine decodes together (its `parallel`: one thread
    each, their rounds sharing each llama_decode); at most `queue_size` wait behind the running ones."""

    def __init__(self, engine: Engine, queue_size: int):
        self.engine, self.queue_size = engine, queue_size
        self.waiting: deque[Job] = deque()  # FIFO; a job whose client leaves is removed at once (`cancel`)
        self.lock = threading.Condition()  # guards waiting, running and closing
        self.running: set[Job] = set()
        self.closing = False
        self._threads = [threading.Thread(target=self._run, name=f"localspec-engine-{i}", daemon=True)
                         for i in range(engine.parallel)]
        engine.queued = lambda: len(self.waiting)  # ending a request sooner lets one of these in (auto's pricing)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closing:
                raise _shutting_down()
            if len(self.waiting) >= self.queue_size:
                raise _queue_full(f"{self.queue_size} requests waiting")
            self.waiting.append(job)
            self.lock.notify()

    def cancel(self, job: Job) -> None:
        """The client has gone: stop the job's generation, or give up its place in the queue."""
        with self.lock:
            job.cancelled.set()
            with contextlib.suppress(ValueError):
                self.waiting.remove(job)

    def close(self) -> None:
        """Refuse new jobs and answer the running and waiting ones 'shutting down' now (from the event loop).

        The running ones' responses end at once; the threads stop within a prefill chunk or a round.
        """
        with self.lock:
            self.closing = True
            jobs = [*self.waiting, *self.running]
            self.waiting.clear()
            self.lock.notify_all()
        for job in jobs:
            job.cancelled.set()
            job.put(("error", _shutting_down()))

    def stop(self) -> None:
        """Close, then wait for the threads."""
        self.close()
        for t in self._threads:
            t.join(timeout=1.0)
        if any(t.is_alive() for t in self._threads):
            log.info("waiting for the current engine step to finish")
            for t in self._threads:
                t.join()

    def _next(self) -> Job | None:
        with self.lock:
            while not self.waiting and not self.closing:
                self.lock.wait()
            if self.closing:
                return None
            job = self.waiting.popleft()
            self.running.add(job)
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._serve(job)
            except Exception as e:  # a llama.cpp failure or a bug: a typed 500, and the server goes on
                job.put(("error", _failed(job, e)))
            finally:
                with self.lock:
                    self.running.discard(job)

    def _tokens(self, job: Job) -> list[int]:
        llm, req = self.engine, job.req
        if job.kind == "chat":
            tokens = llm.chat_tokens(for_template(req.messages), tools=req.tools, variables=req.variables)
        else:
            tokens = llm.tokenize(req.prompt) if isinstance(req.prompt, str) else req.prompt
        if len(tokens) > llm.target.n_ctx:
            raise ApiError(f"this model's context is {llm.target.n_ctx} tokens but the {job.prompt_param} "
                           f"take {len(tokens)}; shorten them or restart the server with a larger --n-ctx",
                           param=job.prompt_param, code="context_length_exceeded")
        return tokens

    def _serve(self, job: Job) -> None:
        try:
            # the engine checks `cancel` between prefill chunks and between rounds: a client that leaves, or
            # a shutdown, stops even a long prefill within a chunk
            stream = self.engine.stream(self._tokens(job), cancel=job.cancelled.is_set, scope=job.scope,
                                        **job.req.options)
        except ApiError as e:
            job.put(("error", e))
            return
        except LocalspecError as e:
            job.put(("error", bad_request(e, job.req.names, job.prompt_param)))
            return
        job.put(("start", None))
        events = iter(stream)
        # with tool calls parsed, the stop strings end the content (openai_shapes.Chat): the stream ends at the
        # token that completes one, here, so that the reply's usage counts only the tokens it read
        gate = Chat("", job.req.tool_format, job.req.tools, stop=job.req.stop, spans=job.req.spans()) \
            if job.kind == "chat" and job.req.stop else None
        try:
            for ev in events:
                job.put(("event", ev))
                if gate is not None and gate.ends(ev.text):
                    break
        except GrammarError as e:  # the request's own constraint gave out midway (llguidance's limits)
            log.info("%s: %s", job.kind, e)
            job.put(("error", bad_request(e, job.req.names, job.prompt_param)))
            return
        finally:
            events.close()  # runs the loop's cleanup now: both KV caches match their token lists
        log.info("%s%s: %s", job.kind, " (cancelled)" if job.cancelled.is_set() else "", stream.stats.line())
        job.put(("error", _shutting_down()) if self.closing else ("end", stream.stats))


def _failed(job: Job, e: Exception) -> ApiError:
    """A generation that failed midway, as the client is told: what failed, never Python's exception text (the
    server's log has the traceback of a bug)."""
    if isinstance(e, DecodeError):  # its message is ours: what llama.cpp refused
        log.warning("%s: generation failed: %s", job.kind, e)
        what = (f"the KV cache had no room left for this request ({e})" if isinstance(e, ContextFullError) else
                f"the model could not decode this request's tokens ({e})")
    else:
        log.exception("%s: generation failed", job.kind)
        what = "an internal error stopped it (the server's log says where)"
    return ApiError(f"generation failed: {what}; the request was stopped, and may be sent again", status=500,
                    type="server_error", code="generation_failed")


def _shutting_down() -> ApiError:
    return ApiError("the server is shutting down", status=503, type="server_error", code="shutting_down")


def _queue_full(why: str) -> ApiError:
    return ApiError(f"the server is busy ({why}); retry shortly", status=503, type="server_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class App:
    """The routes over one engine; `create_app` wraps it in Starlette."""

    def __init__(self, engine: Engine, *, api_key: str | Sequence[str] | None, queue_size: int, defaults: dict,
                 body_timeout_s: float, reasoning_budget: int | None = None):
        self.engine, self.api_keys, self.body_timeout_s = engine, api_keys(api_key), body_timeout_s
        self.reasoning_budget = reasoning_budget  # the most thinking tokens any request may have (None: no cap)
        self.defaults = engine.defaults | defaults
        self.worker = Worker(engine, queue_size)
        self.created = int(time.time())
        self.bodies = BodyBudget(MAX_HELD)  # bytes of request bodies arrived and not yet parsed
        self.constraints = Constraints(engine)

    def _authorize(self, request: Request) -> str:
        """The request's scope: which key it holds ('' where the server has none), or 401."""
        if not self.api_keys:
            return ""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip().encode()
        held = [i for i, key in enumerate(self.api_keys) if hmac.compare_digest(token, key.encode())]
        if scheme.lower() == "bearer" and held:
            # each key's outputs draft only its own requests (history_mb); named by the key's hash, so a kept
            # history follows its key whatever order the keys are given in next time
            return "key-" + hashlib.sha256(self.api_keys[held[0]].encode()).hexdigest()[:16]
        raise ApiError("missing or incorrect API key: send 'Authorization: Bearer KEY' with one of the server's "
                       "--api-key", status=401, code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        # a web page may POST text/plain or a form to any site without asking first (no CORS preflight)
        if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
            raise ApiError("the request body must be JSON sent with 'Content-Type: application/json'", status=415,
                           code="unsupported_media_type")
        return await read_body(request, self.body_timeout_s, self.bodies)

    @staticmethod
    def _decode(raw: bytes) -> dict:
        check_json_size(raw)  # before json.loads builds it: 8 MiB of '[{},...]' is 2.8 million objects
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, undecodable bytes, absurd nesting
            raise ApiError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        check_text(body)
        if body.get("model") is not None and not isinstance(body["model"], str):  # any name: one model is served
            raise ApiError(f"model must be a string, got {json.dumps(body['model'])[:60]}", param="model")
        return body

    def _parse_chat(self, raw: bytes):
        llm, body = self.engine, self._decode(raw)
        req = parse_chat(body, defaults=self.defaults, n_ctx=llm.target.n_ctx, template=llm.chat_template(),
                         token_of=llm.single_token, constraint=self.constraints)
        try:
            budget = budget_of(body, self.reasoning_budget)
        except FieldError as e:
            raise ApiError(str(e), param=e.param) from None
        if req.thinking is not None:  # does the prompt open the span? (the template's own generation prompt)
            try:
                span = span_for(llm, for_template(req.messages), tools=req.tools, variables=req.variables,
                                budget=budget)
            except LocalspecError as e:
                raise ApiError(str(e), param="messages") from None
            # the engine holds a constraint (JSON Schema, tools) to the answer after the span, and the budget
            req.options["span"] = span
        return req

    def _parse_completion(self, raw: bytes):
        return parse_completion(self._decode(raw), defaults=self.defaults, n_vocab=self.engine.target.n_vocab,
                                constraint=self.constraints)

    async def health(self, request: Request) -> Response:
        w = self.worker
        return JSONResponse({"status": "ok", "model": self.engine.name, "busy": bool(w.running),
                             "active": len(w.running), "queued": len(w.waiting), "parallel": self.engine.parallel,
                             "queue_size": w.queue_size})

    def _model(self) -> dict:
        return {"id": self.engine.name, "object": "model", "created": self.created, "owned_by": "localspec"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        if request.path_params["model"] != self.engine.name:
            raise ApiError(f"the model {request.path_params['model']!r} does not exist", status=404,
                           param="model", code="model_not_found")
        return JSONResponse(self._model())

    async def _parsed(self, request: Request, parse):
        """The request read and parsed. Parsing an 8 MiB body or compiling a schema takes a while: it runs off
        the event loop, which serves every other client (their streams, disconnects, /health) meanwhile. A
        request counts against the server's room only by the bytes of its body that have arrived (MAX_HELD in
        all until parsed; more get a 503): connections that send headers and then nothing hold nothing, and
        leave at the body timeout (64 of them once locked every client out, counted from their first byte)."""
        scope = self._authorize(request)
        raw = await self._body(request)
        try:
            w = self.worker
            if len(w.waiting) >= w.queue_size:  # it would be refused once parsed: spare the parse, and a compile
                raise _queue_full(f"{w.queue_size} requests waiting")
            return await asyncio.to_thread(parse, raw), scope
        finally:
            self.bodies.give(len(raw))

    async def chat(self, request: Request) -> Response:
        req, scope = await self._parsed(request, self._parse_chat)
        llm = self.engine
        shape = Chat(llm.name, req.tool_format, req.tools, piece=llm.target.piece, include_usage=req.include_usage,
                     stop=req.stop, spans=req.spans())
        return await self._run(request, Job("chat", req, scope), shape, req.stream)

    async def completions(self, request: Request) -> Response:
        req, scope = await self._parsed(request, self._parse_completion)
        shape = Completion(self.engine.name, piece=self.engine.target.piece, include_usage=req.include_usage)
        return await self._run(request, Job("completion", req, scope), shape, req.stream)

    async def _run(self, request: Request, job: Job, shape, stream: bool) -> Response:
        self.worker.submit(job)
        gone = asyncio.ensure_future(disconnected(request.receive))
        handed_over = False
        try:
            item = await job.next(gone)
            if item is None:
                return Response(status_code=499)  # the client left while waiting: nobody reads this
            what, value = item
            if what == "error":
                raise value
            if stream:
                handed_over = True
                return EventStream(self._events(job, gone, shape))
            while (item := await job.next(gone)) is not None:
                what, value = item
                if what == "event":
                    shape.add(value)
                elif what == "end":
                    return JSONResponse(shape.response(value))
                else:
                    raise value
            return Response(status_code=499)
        finally:
            if not handed_over:
                self.worker.cancel(job)
                gone.cancel()

    async def _events(self, job: Job, gone: asyncio.Future, shape) -> AsyncIterator[bytes]:
        try:
            for c in shape.first_chunks():
                yield sse(c)
            while (item := await job.next(gone)) is not None:
                what, value = item
                if what == "event":
                    for c in shape.chunks(value):
                        yield sse(c)
                    continue
                if what == "end":
                    for c in shape.final_chunks(value):
                        yield sse(c)
                else:  # the response has started: the error goes in the stream, as OpenAI sends it
                    yield sse(error(str(value), type=value.type, param=value.param, code=value.code))
                yield b"data: [DONE]\n\n"
                return
        finally:
            self.worker.cancel(job)
            gone.cancel()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _api_error(request: Request, exc: ApiError) -> Response:
    return response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return response(ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                    code=code, headers=exc.headers))


async def _server_error(request: Request, exc: Exception) -> Response:
    return response(ApiError(f"internal error: {exc}", status=500, type="server_error"))


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The keys a server accepts: one, several (each its own scope of history), or none."""
    return () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)


def create_app(engine: Engine, *, api_key: str | Sequence[str] | None = None, cors: tuple[str, ...] = (),
               queue_size: int = 16, hosts: tuple[str, ...] = LOOPBACK, defaults: dict | None = None,
               body_timeout_s: float = 30.0, reasoning_budget: int | None = None) -> Starlette:
    """The ASGI app: /v1/models, /v1/chat/completions, /v1/completions, /health over one engine.

    hosts: the Host names answered when there is no api_key, and by /health always ('*': any; IP addresses
    always).
    defaults: generation options for requests that leave them out (over the engine's own).
    reasoning_budget: the most thinking tokens a reasoning model may write before its span's end is forced (a
    request's reasoning_budget may ask for fewer); None: no limit.
    """
    app = App(engine, api_key=api_key, queue_size=queue_size, defaults=defaults or {},
              body_timeout_s=body_timeout_s, reasoning_budget=reasoning_budget)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        # measured (or read from where they are kept) before the first request, not inside it: any request may
        # ask for drafter 'auto', and measuring decodes in the models' own sequences
        await asyncio.to_thread(engine.calibration)
        app.worker.start()
        yield
        await asyncio.to_thread(app.worker.stop)

    # with a key, a rebound page still cannot authenticate: Host names are then free, except for /health, which
    # answers without one (a rebound page could watch the server's activity)
    middleware = [Middleware(HostCheck, hosts=hosts, paths=("/health",) if api_keys(api_key) else None)]
    if cors:
        middleware.append(Middleware(Cors, allow_origins=list(cors), allow_methods=["GET", "POST"],
                                     allow_headers=["*"]))
    routes = [Route("/health", app.health), Route("/v1/models", app.models),
              Route("/v1/models/{model:path}", app.model),
              Route("/v1/chat/completions", app.chat, methods=["POST"]),
              Route("/v1/completions", app.completions, methods=["POST"])]
    starlette = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                          exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                              Exception: _server_error})
    starlette.state.worker = app.worker
    return starlette


class _Server(uvicorn.Server):
    """uvicorn, plus: shutting down cancels the generations first (uvicorn would wait for open responses)."""

    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets=None) -> None:
        self.worker.close()
        await super().shutdown(sockets)


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | Sequence[str] | None = None,
          cors: tuple[str, ...] = (), queue_size: int = 16, allow_hosts: tuple[str, ...] = (),
          defaults: dict | None = None, socks: list[socket.socket] | None = None,
          reasoning_budget: int | None = None) -> None:
    """Serve until SIGINT/SIGTERM, which end the running and waiting generations with a 'shutting down' error.

    Requests whose Host header names another site are refused: every one without an api_key, those to /health
    (which needs no key) with one. This server's names: loopback names, `host`, IP addresses and `allow_hosts`.
    socks: from bind(host, port) beforehand (bound here if None).
    """
    socks = socks or bind(host, port)
    app = create_app(engine, api_key=api_key, cors=cors, queue_size=queue_size, defaults=defaults,
                     hosts=(*LOOPBACK, host, *allow_hosts), reasoning_budget=reasoning_budget)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5, log_level="info",
                            http=json_400_protocol())
    if host not in LOOPBACK and not api_keys(api_key):
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model "
                    "(by IP address, or by a name given with --allow-host)", host)
    shown = f"[{host}]" if ":" in host else host
    log.info("localspec serving on http://%s:%d (Press CTRL+C to quit)", shown, socks[0].getsockname()[1])
    _Server(config, app.state.worker).run(sockets=socks)
