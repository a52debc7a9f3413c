"""Calls to engines on the request path: a lean HTTP/1.1 keep-alive client over asyncio.

Per routed request the router makes two engine calls, and a general-purpose client
(aiohttp's: request and response objects, tracing hooks, cookie and redirect logic)
was about half of the router's CPU per request. Engines speak plain HTTP/1.1 JSON and
server-sent events, so this client does only that: one request written in a single
`write`, the response parsed by httptools (the C parser uvicorn uses), body chunks
handed over as the bytes objects that arrived, connections pooled per engine.

Invariants: a connection carries one request at a time and goes back to its pool only
after its response was read to the end with keep-alive; anything else (an error, a
cancelled caller, a response left unread) closes it, which is also how an engine learns
that its caller left (vLLM aborts a request whose connection closes). Reads stop when
more than `_HIGH_WATER` bytes wait unread, so a slow client cannot make the router
buffer an engine's whole stream.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import zlib
from urllib.parse import urlsplit

import httptools

__all__ = ["UpstreamError", "ConnectFailed", "UpstreamResponse", "UpstreamPool"]

_HIGH_WATER = 1 << 20
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": 32 + zlib.MAX_WBITS}


class UpstreamError(Exception):
    """The connection failed, closed early, or sent something that is not HTTP."""


class ConnectFailed(UpstreamError):
    """No connection could be opened."""


class UpstreamResponse(asyncio.Protocol):
    """One connection's protocol and, while a request is out, that request's response."""

    def __init__(self, pool: _EnginePool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._header_name = b""
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._inflater: zlib._Decompress | None = None

    # --- the caller's side ----------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        assert self._transport is not None
        self._reset()
        self._transport.write(head + body)

    async def start(self) -> None:
        """Wait for the status line and headers."""
        while not self._headers_done:
            await self._wait()

    async def chunk(self, idle: float | None = None) -> bytes:
        """All body bytes that arrived since the last call (at least one); b"" once the
        response is complete. TimeoutError after `idle` seconds without a byte."""
        while not self._chunks:
            if self._complete:
                return b""
            await self._wait(idle)
        # Everything that is here, in one piece: one write to the client instead of many.
        if len(self._chunks) == 1:
            data = self._chunks.popleft()
        else:
            data = b"".join(self._chunks)
            self._chunks.clear()
        self._buffered -= len(data)
        if self._paused and self._buffered < _HIGH_WATER // 2 and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while data := await self.chunk():
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with this response: pool the connection if it can carry another request."""
        if (self._complete and not self._chunks and self._error is None and self._transport is not None
                and not self._transport.is_closing() and self._keep_alive):
            self._pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._error = self._error or UpstreamError("connection closed")

    @property
    def exhausted(self) -> bool:
        """The whole response arrived and every byte of it was handed over: the last
        `chunk()` was the last one (so its caller can finish the client's answer with it)."""
        return self._complete and not self._chunks

    @property
    def reusable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing() and self._error is None

    async def _wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        # A timer on the waiter, not asyncio.timeout: this runs once per streamed chunk.
        timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._chunks.clear()
        self._buffered = 0
        self.status = 0
        self.headers = {}
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._inflater = None

    # --- asyncio.Protocol -----------------------------------------------------------------

    def attach(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"engine sent malformed HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        if not self._complete:
            self._fail(UpstreamError(f"connection closed by the engine{f': {exc}' if exc else ''}"))

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._transport is not None:
            self._transport.close()
        self._wake()

    # --- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        # Read here: httptools forgets it once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        encoding = self.headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding in _WBITS:
            self._inflater = zlib.decompressobj(_WBITS[encoding])
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._inflater is not None:
            try:
                body = self._inflater.decompress(body)
            except zlib.error as exc:
                self._fail(UpstreamError(f"engine sent a corrupt compressed body: {exc}"))
                return
            if not body:
                return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _EnginePool:
    """Idle keep-alive connections to one engine (`scheme://host:port`).

    A connection idle for `keepalive` seconds is closed rather than reused: the engine
    closes idle connections on its own clock (uvicorn's keep-alive), and a request written
    just as it does is lost with the connection.
    """

    def __init__(self, origin: str, keep: int, keepalive: float) -> None:
        parts = urlsplit(origin)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc.encode()
        # (connection, when it went idle), oldest first.
        self._idle: list[tuple[UpstreamResponse, float]] = []
        self._keep = keep
        self._keepalive = keepalive

    async def get(self, connect_timeout: float) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        stale_before = loop.time() - self._keepalive
        while self._idle:
            conn, idle_since = self._idle.pop()
            if idle_since < stale_before:
                self.close()  # this one and every older one
                break
            if conn.reusable:
                return conn
        try:
            async with asyncio.timeout(connect_timeout):
                transport, protocol = await loop.create_connection(lambda: UpstreamResponse(self), self.host,
                                                                   self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc or type(exc).__name__}") from None
        # uvloop may call connection_made only after create_connection returned.
        protocol.attach(transport)
        return protocol

    def put(self, conn: UpstreamResponse) -> None:
        if len(self._idle) < self._keep:
            self._idle.append((conn, asyncio.get_running_loop().time()))
        else:
            conn.close()

    def forget(self, conn: UpstreamResponse) -> None:
        self._idle = [entry for entry in self._idle if entry[0] is not conn]

    def close(self) -> None:
        for conn, _ in self._idle:
            conn.close()
        self._idle.clear()


class UpstreamPool:
    """Pools by engine origin; `post` opens (or reuses) a connection and sends one request."""

    def __init__(self, connect_timeout: float, keepalive: float, keep_per_engine: int = 256) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._keep = keep_per_engine
        self._pools: dict[str, _EnginePool] = {}

    async def post(self, origin: str, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """The response, its status and headers read; the body is the caller's to read."""
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _EnginePool(origin, self._keep, self._keepalive)
        head = [f"POST {path} HTTP/1.1\r\n".encode(), b"Host: ", pool.host_header,
                b"\r\nAccept-Encoding: identity\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
        head.append(b"\r\n")
        conn = await pool.get(self._connect_timeout)
        # No resend on another connection if this one fails: the engine may have seen the
        # request (a decode may have claimed its plan); the flow decides what to retry.
        conn.send(b"".join(head), body)
        try:
            await conn.start()
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
