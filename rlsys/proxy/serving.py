"""The proxy's HTTP layer: uvicorn inside the caller's event loop, and what stands between a client and the app.

- ``ProxyServer`` runs uvicorn as a task of the *running* event loop (the rollout actor is an async Ray actor):
  ``await start()`` binds 127.0.0.1 on a free port and returns once listening.
- ``_GuardMiddleware`` (pure ASGI, in front of every route): 431 over ``max_header_bytes`` of headers, then 401
  without the bearer token (``hmac.compare_digest``; every path, unknown ones included: vLLM's ``--api-key``
  leaves ``/health``, ``/tokenize``, ``/metrics`` open, see shared/TRAPS.md), then the body read with a size
  cap (413), then a JSON 500 for any exception of the app on a connection that stays open. Starlette's own
  catch-all handler re-raises after its response, and uvicorn then closes the connection, which cost an agent
  its next request too (issue #30).
- ``_RequestDeadline``, mixed into uvicorn's own HTTP protocol: a request's head and body must arrive within
  ``read_timeout_s`` of its first byte (of the connection, for a fresh one), else 408 and the connection
  closes; its head may take at most ``max_header_bytes`` (431). uvicorn has neither: its keep-alive timer runs
  only between requests, so a client sending slowly held a connection for as long as it liked (the request
  timeouts of uvicorn issue #157 were never built). h11's own head limit (``h11_max_incomplete_event_size``)
  is set too, as a backstop, when h11 is the parser.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

logger = logging.getLogger(__name__)

# An idle keep-alive connection stays open this long (uvicorn's default, 5 s, equals httpx's keep-alive expiry:
# a client reusing a connection in the very second the server drops it gets "Server disconnected" mid-request,
# which is what a learner phase of ~5 s between two rollouts produced). The client side expires first.
KEEP_ALIVE_S = 600
MAX_HEADER_BYTES = 64 * 1024  # a request head (request line + headers) over this is a 431
READ_TIMEOUT_S = 30.0  # a request (head and body) must arrive within this of its first byte: 408 and close
REFUSAL_LINGER_S = 1.0  # after a 408/431 the rest of the input is read and dropped this long, then the close


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- The guard: bearer token and body size, before any routing ------------------------------------


class _GuardMiddleware:
    """Pure ASGI: 431 over ``max_header_bytes`` of headers, 401 without the right bearer token (any path),
    413 over ``max_body`` bytes, and a JSON 500 for any exception of the app, the connection kept.

    The body is read here in full (it is small JSON) and replayed to the app, so the size cap also
    holds for chunked requests that carry no Content-Length.
    """

    def __init__(self, app: Any, *, api_token: str, max_body: int, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.token = api_token.encode()
        self.max_body = max_body
        self.max_header_bytes = max_header_bytes
        self.drain_limit = 16 * max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets: nothing here speaks them
            await send({"type": "websocket.close", "code": 1008})
            return
        # the protocol (_RequestDeadline) stops reading a head over the limit; a head that arrived in one read
        # is checked here, before the token, so that nobody without it has megabytes of headers parsed
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > self.max_header_bytes:
            await _send_json(send, 431, error_body(f"request headers over {self.max_header_bytes} bytes",
                                                   param="headers", code="headers_too_large"), close=True)
            return
        headers = dict(scope["headers"])  # lower-case byte names; a repeated header keeps its last value
        if not self._authorized(headers.get(b"authorization")):
            await _send_json(send, 401, error_body("invalid or missing bearer token", code="invalid_api_key"),
                             extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            await _send_json(send, 400, error_body("bad Content-Length header", param="body"), close=True)
            return
        chunks, size = [], 0
        more = True
        if declared is None or int(declared) <= self.max_body:
            while more and size <= self.max_body:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client went away: nobody to answer
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
        if more or size > self.max_body:
            drain = more and (declared is None or int(declared) <= self.drain_limit)
            await self._refuse_too_large(receive, send, size, drain)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception as exc:  # a bug in the proxy: this request fails, the connection and the server go on
            if started:
                raise  # half a response is out: only closing the connection (uvicorn) ends it
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            await _send_json(send, 500, error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    async def _refuse_too_large(self, receive: Any, send: Any, size: int, more: bool) -> None:
        # Read (and drop) the rest of a moderately large body (up to drain_limit) first: closing a
        # socket with unread input makes the kernel send a reset, which the client would see
        # instead of the 413.
        while more and size <= self.drain_limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = error_body(f"request body over {self.max_body} bytes", param="body", code="request_too_large")
        await _send_json(send, 413, body, close=True)

    def _authorized(self, value: bytes | None) -> bool:
        if value is None:
            return False
        scheme, _, token = value.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.token)


async def _send_json(send: Any, status: int, body: dict, *, extra_headers: list | None = None,
                     close: bool = False) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:  # the unread rest of the body makes the connection unusable for another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": payload})


# ---- Running inside an existing event loop -------------------------------------------------------


class _RequestDeadline:
    """Mixed into uvicorn's HTTP protocol (httptools' or h11's): a request must arrive whole (head and body)
    within ``read_timeout_s`` of its first byte, or of the connection for a fresh one (408, then close), and a
    head still incomplete after ``max_header_bytes`` is refused (431, then close).

    It relies on what both of uvicorn's protocols share: ``self.cycle``, the request being served, is replaced
    when a head is complete, and its ``more_body`` turns False when the body is."""

    read_timeout_s: float = READ_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_bytes = 0
        self._refused = False
        self._deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # input after a 408/431: dropped until the close
        before = self.cycle
        reading_head = before is None or before.response_complete
        if reading_head and self._deadline is None:  # the first bytes of the next request on a kept connection
            self._deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        super().data_received(data)  # type: ignore[misc]
        cycle = self.cycle
        if cycle is not before:
            self._head_bytes = 0
        elif reading_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(431, f"request headers over {self.max_header_bytes} bytes", "headers_too_large")
                return
        reading = cycle if cycle is not before or not reading_head else None  # a request whose head is in
        if reading is not None and not reading.more_body:
            self._stop_deadline()  # the whole request is in: the app's time is not the client's

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.response_started:
            self.transport.close()  # answered early (a 413 draining its body): just stop
            return
        self._refuse(408, f"the request did not arrive within {self.read_timeout_s:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer with a raw JSON error and end the connection: the request never reached (or will not finish
        for) the app. The input is then read and dropped for ``REFUSAL_LINGER_S`` before the close: closing a
        socket with unread input makes the kernel send a reset, which the client would see instead of the answer."""
        self._stop_deadline()
        self._refused = True
        payload = json.dumps(error_body(message, code=code)).encode()
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, len(payload), payload))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._deadline = self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def _guarded_protocol(http: str, read_timeout_s: float, max_header_bytes: int) -> type:
    """uvicorn's HTTP protocol class named by ``http`` ("auto", "h11", "httptools"), with ``_RequestDeadline``."""
    base = import_from_string(HTTP_PROTOCOLS.get(http, http))
    return type(f"Guarded{base.__name__}", (_RequestDeadline, base),
                {"read_timeout_s": read_timeout_s, "max_header_bytes": max_header_bytes})


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn.Server that leaves signal handling to the host process (Ray's actor, pytest):
    ``serve()`` would otherwise install SIGINT/SIGTERM handlers when called from the main thread."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class ProxyServer:
    """Serve an ASGI app with uvicorn as a task of the *running* event loop.

    ``await start()`` binds ``host`` (127.0.0.1) on ``port`` (0: a free one, read back from the bound
    socket) and returns once the server listens; ``url`` is then ``http://127.0.0.1:PORT/v1``.
    ``await stop()`` closes the listener, lets open requests finish (up to ``shutdown_timeout_s``)
    and waits for the task. Also an async context manager.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, http: str = "auto",
                 startup_timeout_s: float = 30.0, shutdown_timeout_s: int = 5,
                 read_timeout_s: float = READ_TIMEOUT_S, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        """``http``: uvicorn's HTTP implementation; `auto` = httptools (a dependency; h11 if it is missing).
        ``read_timeout_s``, ``max_header_bytes``: see ``_RequestDeadline``."""
        self.app = app
        self.http = http
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes
        self.host = host
        self.port: int | None = None if port == 0 else port
        self._requested_port = port
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        if self.port is None or self._task is None:
            raise RuntimeError("ProxyServer.url: the server is not started")
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> str:
        """Start listening; returns ``url``."""
        if self._task is not None:
            raise RuntimeError("ProxyServer.start: already started")
        config = uvicorn.Config(
            self.app, host=self.host, port=self._requested_port, lifespan="off",
            http=_guarded_protocol(self.http, self.read_timeout_s, self.max_header_bytes),
            # h11's own head limit, when h11 parses: a backstop one read (256 KiB) above ours, so that the 431
            # comes from the check above (h11's would be uvicorn's plain-text 400 and an abrupt close)
            h11_max_incomplete_event_size=self.max_header_bytes + 2**18,
            log_config=None,  # keep the host process's logging configuration (no dictConfig)
            access_log=False, proxy_headers=False, server_header=False,
            timeout_graceful_shutdown=self.shutdown_timeout_s, timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.create_task(self._serve(), name=f"rlsys-proxy-{self.host}")
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if self._task.done():
                task, self._task = self._task, None
                raise RuntimeError("ProxyServer.start: uvicorn stopped before listening") from task.exception()
            if time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(f"ProxyServer.start: not listening after {self.startup_timeout_s} s")
            await asyncio.sleep(0.005)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info("rlsys proxy listening on %s", self.url)
        return self.url

    async def _serve(self) -> None:
        assert self._server is not None
        try:
            await self._server.serve()
        # uvicorn calls sys.exit() when it cannot bind; SystemExit out of a task would stop the loop.
        except SystemExit as exc:
            raise RuntimeError(f"uvicorn exited with code {exc.code} (see the 'uvicorn.error' log)") from exc

    async def stop(self) -> None:
        """Stop serving and wait for it; a second call does nothing."""
        if self._task is None or self._server is None:
            return
        task, self._task = self._task, None
        self._server.should_exit = True
        await task

    async def __aenter__(self) -> "ProxyServer":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()
