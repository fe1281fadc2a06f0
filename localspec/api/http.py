"""HTTP plumbing of the server, below its routes: bounded request bodies and compiles, server-sent events, the
Host-header and CORS checks (a browser tab is a client too), OpenAI-shaped error responses, and binding the sockets.
"""
from __future__ import annotations

import asyncio
import errno
import hashlib
import ipaddress
import json
import logging
import os
import socket
import threading
from collections import OrderedDict
from typing import AsyncIterator

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..core.errors import LocalspecError
from ..core.grammar import Grammar, GrammarError, compile_spec
from .request import ApiError
from .shapes import error

log = logging.getLogger("uvicorn.error")


def response(e: ApiError) -> JSONResponse:
    return JSONResponse(error(str(e), type=e.type, param=e.param, code=e.code), status_code=e.status,
                        headers=e.headers)


# ---- the worker: the only thread that runs the engine (request parsing, in other threads, only tokenizes) ----
# ---- HTTP ----
MAX_BODY = 8 << 20  # bytes: far more text than a local model's context holds


class BodyBudget:
    """Bytes of request bodies held at once: taken as they arrive, given back once parsed. Past the limit a
    request gets a 503 with Retry-After; a connection that has sent nothing holds nothing."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise ApiError(f"the server is busy reading other requests ({self.held >> 20} MiB arriving); retry "
                           "shortly", status=503, type="server_error", code="queue_full",
                           headers={"Retry-After": "1", "Connection": "close"})
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


class Constraints:
    """Compiles requests' schemas, grammars and regexes on arrival, within bounds. One can take seconds of CPU
    that llguidance's limits do not bound (a 9.6 KB schema of 300 pattern properties that refer to it: 8-9 s to
    refuse, each time it was sent), and a request compiles before it reaches the queue: so at most `slots`
    compile at once (another meanwhile is a 503 queue_full, as a full queue), and each text's outcome, compiled
    or refused, is kept by its hash (the last `kept` texts): an app resends its schema, and a refused one sent
    again costs nothing."""

    def __init__(self, engine, *, slots: int = 2, kept: int = 256):
        self.engine, self.kept = engine, kept
        self.slots = threading.Semaphore(slots)  # each compile takes a core: a small machine has few
        self.outcomes: OrderedDict[bytes, str | None] = OrderedDict()  # hash -> None (compiled) or the refusal
        self.lock = threading.Lock()  # guards outcomes: requests are parsed in several threads

    def __call__(self, fields: dict, *, matcher: bool = True) -> None:
        """Compile a constraint ({"json_schema": ...}) as the engine will, or GrammarError; with `matcher`, build
        its matcher and first mask too (llguidance refuses some grammars only there: a schema that refers to
        itself)."""
        key = hashlib.sha256(json.dumps([matcher, fields]).encode()).digest()
        with self.lock:
            known = key in self.outcomes
            if known:
                self.outcomes.move_to_end(key)
                refusal = self.outcomes[key]
        if not known:
            if not self.slots.acquire(blocking=False):
                raise ApiError("the server is busy compiling other requests' schemas or grammars; retry shortly",
                               status=503, type="server_error", code="queue_full", headers={"Retry-After": "1"})
            try:
                spec = compile_spec(**fields)
                if matcher:
                    Grammar(self.engine.target, spec).allowed()
                refusal = None
            except GrammarError as e:
                refusal = str(e)
            finally:
                self.slots.release()
            with self.lock:
                self.outcomes[key] = refusal
                if len(self.outcomes) > self.kept:
                    self.outcomes.popitem(last=False)
        if refusal is not None:
            raise GrammarError(refusal)


async def read_body(request: Request, timeout_s: float, budget: BodyBudget) -> bytes:
    """The body, refused when over MAX_BODY or slower than timeout_s: either would hold a connection. Its
    bytes are taken from `budget` as they arrive; the caller gives them back once it is done with the body.

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
                if size + len(chunk) > MAX_BODY:  # a chunked upload has no Content-Length to check first
                    raise too_large
                budget.take(len(chunk))
                size += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        budget.give(size)
        raise ApiError(f"the request body did not arrive within {timeout_s:g} s", status=408,
                       code="request_timeout", headers=close) from None
    except ClientDisconnect:
        budget.give(size)
        log.info("%s %s: the client left before sending its whole body", request.method, request.url.path)
        raise ApiError("the request body is incomplete") from None  # nobody is left to read this
    except BaseException:
        budget.give(size)
        raise
    return b"".join(chunks)


HEADER_TIMEOUT_S = 15.0  # a client sends its request line and headers at once: a slower one holds a connection
# a refused upload's rest, read and dropped before closing: a client that sends its whole body before it reads
# (the OpenAI SDK) then gets the refusal
LINGER_S, LINGER_BYTES = 5.0, 64 << 20


def json_400_protocol(header_timeout_s: float = HEADER_TIMEOUT_S):
    """uvicorn's HTTP protocol, plus:

    - a request it cannot parse (Content-Length '-5' or 'abc', an empty Host) is answered with an OpenAI error
      object, as every other refusal is, instead of uvicorn's plain text;
    - a connection whose request headers have not all arrived within header_timeout_s of its opening, or of the
      first byte of its next request, is answered 408 and closed: uvicorn has no such timeout, and 300
      connections that sent half their headers, or nothing, were held for as long as their clients liked (an
      idle connection between requests is uvicorn's, closed after its timeout_keep_alive);
    - a connection closed while its client is still sending the body (a refusal: 413, 408, 503) is closed
      gently: the answer, then the end of our side, then the rest of the body read and dropped (LINGER_S and
      LINGER_BYTES at most) until the client closes. Closed with bytes unread, the kernel resets the
      connection, and a client that sends its whole body before reading lost the answer (the OpenAI SDK
      retried, then said "Connection error").
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Protocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            self._raw, self._lingering = transport, None  # _lingering: bytes still to drop, once closing gently
            self._headers_of = None  # the request whose headers arrived last (uvicorn's cycle: a new one each)
            self._timer = None  # the header timeout, then the lingering one
            super().connection_made(_Transport(transport, self))
            self._wait_headers()

        def data_received(self, data: bytes) -> None:
            if self._lingering is not None:
                self._lingering -= len(data)
                if self._lingering < 0:
                    self._raw.close()
                return
            super().data_received(data)
            if self.cycle is not self._headers_of:  # a request's headers have all arrived
                self._headers_of = self.cycle
                self._cancel_timer()
            elif self._timer is None and (self.cycle is None or self.cycle.response_complete):
                # the first bytes of the next request: uvicorn has stopped its keep-alive timer
                self._wait_headers()

        def _wait_headers(self) -> None:
            self._timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._timer = None
            if self.cycle is not self._headers_of or self._raw.is_closing():
                return
            self._answer(408, "Request Timeout", f"the request headers did not arrive within {header_timeout_s:g} s",
                         "request_timeout")

        def _cancel_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def close_connection(self) -> None:
            """Where uvicorn closes the connection."""
            if self._lingering is not None or self._raw.is_closing():
                self._raw.close()
            elif self.cycle is not None and self.cycle.more_body and self._raw.can_write_eof():
                self._lingering = LINGER_BYTES  # the client is still sending: close gently
                self._raw.write_eof()  # once the answer is sent
                self._raw.resume_reading()
                self._cancel_timer()
                self._timer = self.loop.call_later(LINGER_S, self._raw.close)
            else:
                self._raw.close()

        def connection_lost(self, exc) -> None:
            self._cancel_timer()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self._lingering is not None:
                self._raw.close()
            else:
                super().shutdown()

        def send_400_response(self, msg: str) -> None:
            self._answer(400, "Bad Request", "the request is not valid HTTP/1.1 (its request line or a header, such as "
                         "a Content-Length that is not a number or an empty Host, cannot be parsed)",
                         "invalid_http_request")

        def _answer(self, status: int, reason: str, message: str, code: str) -> None:
            body = json.dumps(error(message, code=code)).encode()
            self._raw.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                            b"content-length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body))
            self._raw.close()

    return Protocol


class _Transport:
    """A connection's transport as uvicorn sees it: its closing is the protocol's (gentle where the client is
    still sending), and once closing gently it is closing (uvicorn writes nothing more, keeps nothing alive)."""

    def __init__(self, transport, protocol):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol._lingering is not None or self._transport.is_closing()


async def disconnected(receive) -> None:
    """Returns once the client has gone (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events; the chunks' own cleanup (client gone, or done) cancels the job.

    Starlette's version watches for a disconnect itself (or not, by ASGI version); the chunks already do.
    """

    def __init__(self, chunks: AsyncIterator[bytes]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            await self.body_iterator.aclose()


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def hostname(host: str) -> str:
    """'[::1]:8080' -> '::1', 'LocalHost:8080' -> 'localhost'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host if host.count(":") > 1 else host.partition(":")[0]  # a bare IPv6 address has no port


class HostCheck:
    """Refuses a Host header that names another site. A web page whose name is rebound to 127.0.0.1 (DNS
    rebinding) reaches this port, but its requests still carry that name; an IP address cannot be rebound.

    paths: the routes checked (None: all); with an API key only those that answer without one."""

    def __init__(self, app, hosts: tuple[str, ...], paths: tuple[str, ...] | None = None):
        self.app, self.hosts, self.paths = app, {hostname(h) for h in hosts}, paths

    def allowed(self, host: str) -> bool:
        if not host or "*" in self.hosts or host in self.hosts:  # no Host at all: not a browser
            return True
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            return False

    async def __call__(self, scope, receive, send) -> None:
        checked = scope["type"] == "http" and (self.paths is None or scope["path"] in self.paths)
        host = hostname(Headers(scope=scope).get("host", "")) if checked else ""
        if not self.allowed(host):
            refusal = response(ApiError(f"this server does not answer to the name {host!r}: start it with --allow-host "
                                        f"{host}{' (or with --api-key)' if self.paths is None else ''} to use that "
                                        "name", status=403, code="host_not_allowed"))
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's, with a refused preflight answered by an OpenAI error object instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code == 200:
            return answer
        return response(ApiError(f"CORS preflight refused ({answer.body.decode()}): start the server with --cors ORIGIN "
                        "to let a web page from ORIGIN call the API", status=answer.status_code,
                        code="cors_refused"))


class ServeError(LocalspecError):
    """The server cannot listen where it was asked to (a port in use, an address not of this machine)."""


def bind(host: str, port: int) -> list[socket.socket]:
    """The server's sockets (one per address the host names, as asyncio would make them), listening: `localspec
    serve` takes them before loading the models, so that a port in use or a wrong --host is said at once, not
    after minutes of loading and measuring (connections made meanwhile wait for the server)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"--host {host}: not an address of this machine ({getattr(e, 'strerror', None) or e}); "
                         "give one such as 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    socks = []
    try:
        for family, kind, proto, addr in dict.fromkeys((f, k, p, a) for f, k, p, _, a in infos):
            try:
                socks.append(_listen(family, kind, proto, addr))
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:  # an address family this machine lacks is skipped, as by asyncio
                    raise
                skipped = e
        if not socks:
            raise skipped
    except OSError as e:
        for sock in socks:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is in use (another localspec serve, or another server): "
                             "stop it or pick another --port") from None
        raise ServeError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return socks


def _listen(family, kind, proto, addr) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # elsewhere it would let two servers share the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # '::' is IPv6 only, as asyncio has it
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(2048)  # now: a second server binding the same port meanwhile is refused
    except OSError:
        sock.close()
        raise
    return sock
