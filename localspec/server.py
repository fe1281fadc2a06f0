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
import hmac
import ipaddress
import json
import logging
import math
import re
import threading
import time
from collections import deque
from typing import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, make_request
from .errors import LocalspecError
from .openai_shapes import Chat, Completion, error

log = logging.getLogger("uvicorn.error")
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request the server answers with an OpenAI error object instead of a completion."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error(str(self), type=self.type, param=self.param, code=self.code),
                            status_code=self.status, headers=self.headers)


# ---- request parsing: OpenAI fields -> engine options ----
# request field -> (engine option, type); the last three are llama.cpp server extensions
_OPTIONS = {"max_tokens": ("max_tokens", int), "max_completion_tokens": ("max_tokens", int),
            "temperature": ("temperature", float), "top_p": ("top_p", float), "seed": ("seed", int),
            "frequency_penalty": ("frequency_penalty", float), "presence_penalty": ("presence_penalty", float),
            "stop": ("stop", "stop"), "top_k": ("top_k", int), "min_p": ("min_p", float),
            "repeat_penalty": ("repeat_penalty", float)}
# under the request's "localspec" key
_SPECULATION = {"drafter": str, "k": int, "accept": str, "p_min": float, "threshold": float}
# sent by OpenAI clients and changing nothing here
_IGNORED = {"model", "stream", "stream_options", "user", "store", "metadata", "service_tier", "localspec"}
# honoured only at their no-op value (null always is one): anything else would be silently wrong here
_NOOP = {"n": (1,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
         "suffix": ("",), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none", "auto"),
         "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none", "auto"),
         "response_format": ({"type": "text"},), "modalities": (["text"],), "prediction": (), "audio": (),
         "reasoning_effort": (), "web_search_options": ()}
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
              "functions", "function_call", "response_format", "modalities", "prediction", "audio",
              "reasoning_effort", "web_search_options"}
_COMPLETION_ONLY = {"prompt", "best_of", "echo", "suffix"}
_KNOWN = _OPTIONS.keys() | _IGNORED | _NOOP.keys() | _CHAT_ONLY | _COMPLETION_ONLY
_KINDS = {int: "an integer in the 64-bit range", float: "a finite number", str: "a string",
          "stop": "a string or an array of strings"}
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's limits; each stop string is searched for after every token


def _typed(param: str, value, kind):
    try:
        ok = {int: lambda v: type(v) is int and -2**63 <= v < 2**63,
              float: lambda v: type(v) in (int, float) and math.isfinite(float(v)),
              str: lambda v: isinstance(v, str),
              "stop": lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
              }[kind](value)
    except OverflowError:  # float(10**400)
        ok = False
    if not ok:
        raise ApiError(f"{param} must be {_KINDS[kind]}, got {json.dumps(value)[:60]}", param=param)
    return float(value) if kind is float else value  # numpy cannot take a 400-digit int as a float


def parse_options(body: dict, *, chat: bool, defaults: dict) -> tuple[dict, dict]:
    """(engine options over `defaults`, engine option -> request field) from a request body, or ApiError
    naming the field."""
    other = _COMPLETION_ONLY if chat else _CHAT_ONLY
    for field in body:
        if field in other or field not in _KNOWN:
            raise ApiError(f"unknown field {field!r} for {'/v1/chat/completions' if chat else '/v1/completions'}",
                           param=field)
    for field, allowed in _NOOP.items():
        value = body.get(field)
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ApiError(f"{field}={json.dumps(value)[:60]} is not supported by localspec serve "
                           f"(supported: {', '.join(json.dumps(a) for a in (None, *allowed))})", param=field)
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        raise ApiError("stream must be true or false", param="stream")
    options, names = {}, {}
    for field, (name, kind) in _OPTIONS.items():
        if body.get(field) is not None:
            options[name], names[name] = _typed(field, body[field], kind), field
    spec = {} if body.get("localspec") is None else body["localspec"]
    if not isinstance(spec, dict):
        raise ApiError("localspec must be an object with drafter, k, accept, p_min or threshold", param="localspec")
    for field, value in spec.items():
        if field not in _SPECULATION:
            raise ApiError(f"unknown field localspec.{field}; allowed: {', '.join(_SPECULATION)}",
                           param=f"localspec.{field}")
        if value is not None:
            options[field], names[field] = _typed(f"localspec.{field}", value, _SPECULATION[field]), f"localspec.{field}"
    # Ranges the engine leaves open: numpy seeds are non-negative; OpenAI bounds the penalties.
    if options.get("seed", 0) < 0:
        raise ApiError(f"seed must be >= 0, got {options['seed']}", param="seed")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= options.get(name, 0) <= 2:
            raise ApiError(f"{name} must be in [-2, 2], got {options[name]}", param=name)
    stop = options.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters each "
                       f"(OpenAI's limits), got {len(stop)} of up to {max(map(len, stop), default=0)}", param="stop")
    options = defaults | options  # the server's defaults (the pair's, serve's flags); the request's fields win
    try:
        make_request(**options)  # the engine's own range checks, before the request waits its turn
    except LocalspecError as e:
        raise _bad_request(e, names, None) from None
    return options, names


def _bad_request(e: LocalspecError, names: dict, fallback: str | None) -> ApiError:
    """An engine error as a 400; its message starts with the option it is about ('top_p=1.5 is ...')."""
    head = re.match(r"\w+", str(e))
    return ApiError(str(e), param=names.get(head.group() if head else "", fallback))


def parse_messages(value, *, n_ctx: int) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty array of {role, content} objects", param="messages")
    if len(value) > n_ctx:  # each message takes a token of template markup at least: spare rendering them
        raise ApiError(f"{len(value)} messages cannot fit in this model's context of {n_ctx} tokens",
                       param="messages", code="context_length_exceeded")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{p} must be an object with role and content", param=p)
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise ApiError(f"{p}: tool and function calls are not supported by localspec serve", param=p)
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"{p}.role must be system, developer, user or assistant, got {json.dumps(role)[:40]}",
                           param=f"{p}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(f"{p}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                               param=f"{p}.content")
            content = "\n".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(f"{p}.content must be a string or an array of text parts", param=f"{p}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(body) -> None:
    """Refuse lone UTF-16 surrogates ("\\ud800"): valid JSON escapes, but no text, so UTF-8 cannot encode them."""
    todo = [("", body)]
    while todo:  # not recursive: the JSON parser allows deeper nesting than Python's stack
        path, value = todo.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            raise ApiError(f"{path or 'the body'} contains a lone UTF-16 surrogate, which is not text; "
                           "send the string as valid UTF-8", param=path or None)
        if isinstance(value, dict):
            for key, v in value.items():
                if _SURROGATE.search(key):
                    raise ApiError(f"a field name in {path or 'the body'} contains a lone UTF-16 surrogate",
                                   param=path or None)
                todo.append((f"{path}.{key}" if path else key, v))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def parse_prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ApiError("prompt is empty", param="prompt")
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ApiError(f"prompt: a batch of {len(value)} prompts is not supported; send one request per prompt",
                       param="prompt")
    raise ApiError("prompt must be a non-empty string or array of token ids", param="prompt")


# ---- the worker: the only thread that touches the engine ----
class Job:
    """One request's generation, handed from the event loop to the worker and answered item by item."""

    def __init__(self, kind: str, prompt, options: dict, names: dict):
        self.kind, self.prompt, self.options, self.names = kind, prompt, options, names
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
    """Runs jobs one at a time in arrival order; at most `queue_size` wait behind the running one."""

    def __init__(self, engine: Engine, queue_size: int):
        self.engine, self.queue_size = engine, queue_size
        self.waiting: deque[Job] = deque()  # FIFO; a job whose client leaves is removed at once (`cancel`)
        self.lock = threading.Condition()  # guards waiting, current and closing
        self.current: Job | None = None
        self.closing = False
        self._thread = threading.Thread(target=self._run, name="localspec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closing:
                raise _shutting_down()
            if len(self.waiting) >= self.queue_size:
                raise ApiError(f"the server is busy ({self.queue_size} requests waiting); retry shortly",
                               status=503, type="server_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
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

        The running one's response ends at once; the thread stops within a prefill chunk or a round.
        """
        with self.lock:
            self.closing = True
            jobs = [*self.waiting, *([self.current] if self.current else [])]
            self.waiting.clear()
            self.lock.notify()
        for job in jobs:
            job.cancelled.set()
            job.put(("error", _shutting_down()))

    def stop(self) -> None:
        """Close, then wait for the thread."""
        self.close()
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():
            log.info("waiting for the current engine step to finish")
            self._thread.join()

    def _next(self) -> Job | None:
        with self.lock:
            while not self.waiting and not self.closing:
                self.lock.wait()
            self.current = None if self.closing else self.waiting.popleft()
            return self.current

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._serve(job)
            except Exception as e:  # a bug or a llama.cpp failure: answer 500 and keep serving
                log.exception("generation failed")
                job.put(("error", ApiError(f"generation failed: {e}", status=500, type="server_error")))
            finally:
                self.current = None

    def _tokens(self, job: Job) -> list[int]:
        llm = self.engine
        if job.kind == "chat":
            tokens = llm.chat_tokens(job.prompt)
        else:
            tokens = llm.tokenize(job.prompt) if isinstance(job.prompt, str) else job.prompt
        if len(tokens) > llm.target.n_ctx:
            raise ApiError(f"this model's context is {llm.target.n_ctx} tokens but the {job.prompt_param} "
                           f"take {len(tokens)}; shorten them or restart the server with a larger --n-ctx",
                           param=job.prompt_param, code="context_length_exceeded")
        return tokens

    def _serve(self, job: Job) -> None:
        try:
            # the engine checks `cancel` between prefill chunks and between rounds: a client that leaves, or
            # a shutdown, stops even a long prefill within a chunk
            stream = self.engine.stream(self._tokens(job), cancel=job.cancelled.is_set, **job.options)
        except ApiError as e:
            job.put(("error", e))
            return
        except LocalspecError as e:
            job.put(("error", _bad_request(e, job.names, job.prompt_param)))
            return
        job.put(("start", None))
        events = iter(stream)
        try:
            for ev in events:
                if ev.text:
                    job.put(("text", ev.text))
        finally:
            events.close()  # runs the loop's cleanup now: both KV caches match their token lists
        log.info("%s%s: %s", job.kind, " (cancelled)" if job.cancelled.is_set() else "", stream.stats.line())
        job.put(("error", _shutting_down()) if self.closing else ("end", stream.stats))


def _shutting_down() -> ApiError:
    return ApiError("the server is shutting down", status=503, type="server_error", code="shutting_down")


# ---- HTTP ----
MAX_BODY = 8 << 20  # bytes: far more text than a local model's context holds


async def _read_body(request: Request, timeout_s: float) -> bytes:
    """The body, refused when over MAX_BODY or slower than timeout_s: either would hold a connection.

    Refusals close the connection, which would otherwise wait for the rest of the body.
    """
    close = {"Connection": "close"}
    too_large = ApiError(f"the request body is over {MAX_BODY >> 20} MiB", status=413, code="request_too_large",
                         headers=close)
    if int(request.headers.get("content-length") or 0) > MAX_BODY:  # uvicorn has checked it is a number
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY:  # a chunked upload has no Content-Length to check first
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(f"the request body did not arrive within {timeout_s:g} s", status=408,
                       code="request_timeout", headers=close) from None
    except ClientDisconnect:
        log.info("%s %s: the client left before sending its whole body", request.method, request.url.path)
        raise ApiError("the request body is incomplete") from None  # nobody is left to read this
    return b"".join(chunks)


async def _disconnected(receive) -> None:
    """Returns once the client has gone (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events; the chunks' own cleanup (client gone, or done) cancels the job.

    Starlette's version watches for a disconnect itself (or not, by ASGI version); the chunks already do.
    """

    def __init__(self, chunks: AsyncIterator[bytes]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            await self.body_iterator.aclose()


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class App:
    """The routes over one engine; `create_app` wraps it in Starlette."""

    def __init__(self, engine: Engine, *, api_key: str | None, queue_size: int, defaults: dict,
                 body_timeout_s: float):
        self.engine, self.api_key, self.body_timeout_s = engine, api_key, body_timeout_s
        self.defaults = engine.defaults | defaults
        self.worker = Worker(engine, queue_size)
        self.created = int(time.time())

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError("missing or incorrect API key: send 'Authorization: Bearer KEY' with the server's "
                           "--api-key", status=401, code="invalid_api_key")

    async def _body(self, request: Request) -> dict:
        self._authorize(request)
        # a web page may POST text/plain or a form to any site without asking first (no CORS preflight)
        if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
            raise ApiError("the request body must be JSON sent with 'Content-Type: application/json'", status=415,
                           code="unsupported_media_type")
        raw = await _read_body(request, self.body_timeout_s)
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, undecodable bytes, absurd nesting
            raise ApiError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        check_text(body)
        if body.get("model") is not None:  # any name: one model is served (as llama.cpp's server does)
            _typed("model", body["model"], str)
        return body

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.name, "busy": self.worker.current is not None,
                             "queued": len(self.worker.waiting)})

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

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        messages = parse_messages(body.get("messages"), n_ctx=self.engine.target.n_ctx)
        options, names = parse_options(body, chat=True, defaults=self.defaults)
        options.setdefault("max_tokens", self.engine.target.n_ctx)  # OpenAI: until the context is full
        return await self._run(request, Job("chat", messages, options, names), Chat(self.engine.name),
                               bool(body.get("stream")))

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        prompt = parse_prompt(body.get("prompt"))
        options, names = parse_options(body, chat=False, defaults=self.defaults)
        options.setdefault("max_tokens", 16)  # OpenAI's default for /v1/completions
        return await self._run(request, Job("completion", prompt, options, names),
                               Completion(self.engine.name), bool(body.get("stream")))

    async def _run(self, request: Request, job: Job, shape, stream: bool) -> Response:
        self.worker.submit(job)
        gone = asyncio.ensure_future(_disconnected(request.receive))
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
                return _EventStream(self._events(job, gone, shape))
            texts = []
            while (item := await job.next(gone)) is not None:
                what, value = item
                if what == "text":
                    texts.append(value)
                elif what == "end":
                    return JSONResponse(shape.response("".join(texts), value))
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
                yield _sse(c)
            while (item := await job.next(gone)) is not None:
                what, value = item
                if what == "text":
                    yield _sse(shape.chunk(value))
                    continue
                if what == "end":
                    yield _sse(shape.final_chunk(value))
                else:  # the response has started: the error goes in the stream, as OpenAI sends it
                    yield _sse(error(str(value), type=value.type, param=value.param, code=value.code))
                yield b"data: [DONE]\n\n"
                return
        finally:
            self.worker.cancel(job)
            gone.cancel()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _api_error(request: Request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                    code=code, headers=exc.headers).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    return ApiError(f"internal error: {exc}", status=500, type="server_error").response()


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _hostname(host: str) -> str:
    """'[::1]:8080' -> '::1', 'LocalHost:8080' -> 'localhost'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host if host.count(":") > 1 else host.partition(":")[0]  # a bare IPv6 address has no port


class _HostCheck:
    """Refuses a Host header that names another site. A web page whose name is rebound to 127.0.0.1 (DNS
    rebinding) reaches this port, but its requests still carry that name; an IP address cannot be rebound."""

    def __init__(self, app, hosts: tuple[str, ...]):
        self.app, self.hosts = app, {_hostname(h) for h in hosts}

    def allowed(self, host: str) -> bool:
        if not host or "*" in self.hosts or host in self.hosts:  # no Host at all: not a browser
            return True
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            return False

    async def __call__(self, scope, receive, send) -> None:
        host = _hostname(Headers(scope=scope).get("host", "")) if scope["type"] == "http" else ""
        if not self.allowed(host):
            response = ApiError(f"this server does not answer to the name {host!r}: start it with --allow-host "
                                f"{host} (or with --api-key) to use that name", status=403,
                                code="host_not_allowed").response()
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _Cors(CORSMiddleware):
    """Starlette's, with a refused preflight answered by an OpenAI error object instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        return ApiError(f"CORS preflight refused ({response.body.decode()}): start the server with --cors ORIGIN "
                        "to let a web page from ORIGIN call the API", status=response.status_code,
                        code="cors_refused").response()


def create_app(engine: Engine, *, api_key: str | None = None, cors: tuple[str, ...] = (),
               queue_size: int = 16, hosts: tuple[str, ...] = LOOPBACK, defaults: dict | None = None,
               body_timeout_s: float = 30.0) -> Starlette:
    """The ASGI app: /v1/models, /v1/chat/completions, /v1/completions, /health over one engine.

    hosts: the Host names answered when there is no api_key ('*': any; IP addresses always).
    defaults: generation options for requests that leave them out (over the engine's own).
    """
    app = App(engine, api_key=api_key, queue_size=queue_size, defaults=defaults or {},
              body_timeout_s=body_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        app.worker.start()
        yield
        await asyncio.to_thread(app.worker.stop)

    # with a key, a rebound page still cannot authenticate: Host names are then free
    middleware = [Middleware(_HostCheck, hosts=hosts)] if api_key is None else []
    if cors:
        middleware.append(Middleware(_Cors, allow_origins=list(cors), allow_methods=["GET", "POST"],
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


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          cors: tuple[str, ...] = (), queue_size: int = 16, allow_hosts: tuple[str, ...] = (),
          defaults: dict | None = None) -> None:
    """Serve until SIGINT/SIGTERM, which end the running and waiting generations with a 'shutting down' error.

    Without an api_key, only requests naming this server in their Host header are answered: loopback names,
    `host`, IP addresses and `allow_hosts`.
    """
    app = create_app(engine, api_key=api_key, cors=cors, queue_size=queue_size, defaults=defaults,
                     hosts=(*LOOPBACK, host, *allow_hosts))
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5, log_level="info")
    if host not in LOOPBACK and api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model "
                    "(by IP address, or by a name given with --allow-host)", host)
    _Server(config, app.state.worker).run()
