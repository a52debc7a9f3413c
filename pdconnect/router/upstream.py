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

Time limits cost one timer per exchange, not one per wait: `post(..., timeout)` bounds
the whole exchange (connect, headers, whatever body the caller reads before
`clear_deadline()`), `chunk(idle)` bounds each wait for the next bytes; a single
`TimerHandle` per connection serves both and, when it fires early (a stream's waits
move on), re-arms itself for the limit now in force. `asyncio.timeout` per call, or
a `call_later` per streamed chunk, was a timer, a task lookup and (CPython 3.11) a
`getpid()` syscall in `get_running_loop()` each time. The loop is looked up once per
pool for the same reason.
"""

from __future__ import annotations

import asyncio
import collections
import math
import ssl
import zlib
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

__all__ = ["AnswerTooLarge", "ConnectFailed", "UpstreamError", "UpstreamPool", "UpstreamResponse"]

_HIGH_WATER = 1 << 20
# A limit within this of its end counts as reached: uvloop's clock and timers tick in
# milliseconds, so a timer may fire a hair before the instant it was set for.
_SLACK = 0.001
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": 32 + zlib.MAX_WBITS}


class UpstreamError(Exception):
    """The connection failed, closed early, or sent something that is not HTTP."""


class ConnectFailed(UpstreamError):
    """No connection could be opened."""


class AnswerTooLarge(UpstreamError):
    """The body is over the caller's limit; nothing past the limit was kept."""


class UpstreamResponse(asyncio.Protocol):
    """One connection's protocol and, while a request is out, that request's response."""

    def __init__(self, pool: _EnginePool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self._transport: asyncio.Transport | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0  # bytes read since the caller last took the body (its upper bound)
        # httptools' body callback is the deque's own append (httptools looks its callbacks
        # up when a parser is made): no Python frame per chunk of a chunked body, and an
        # SSE stream has one per event. Bytes are counted, and inflated, when taken (`chunk`).
        self.on_body: Callable[[bytes], None] = self._chunks.append
        # Likewise for headers: stored as sent, lower-cased once they are all here.
        self._raw_headers: dict[bytes, bytes] = {}
        self.on_header: Callable[[bytes, bytes], None] = self._raw_headers.__setitem__
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._inflater: zlib._Decompress | None = None
        # Time limits (loop clock): the exchange's deadline, the current wait's idle limit
        # and when that wait began; one timer enforces whichever ends first.
        self._expires = math.inf
        self._idle: float | None = None
        self._wait_began = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- the caller's side ----------------------------------------------------------------

    def send(self, head: bytes, body: bytes, expires: float = math.inf) -> None:
        """Write one request; every wait for its answer fails with TimeoutError once the
        loop clock passes `expires`, until `clear_deadline()`."""
        assert self._transport is not None
        self._reset()
        self._expires = expires
        self._transport.write(head + body)

    def clear_deadline(self) -> None:
        """The exchange's deadline no longer applies (the caller has what it was for);
        waits are bounded by `chunk(idle)` alone from here."""
        self._expires = math.inf

    async def start(self) -> None:
        """Wait for the status line and headers."""
        while not self._headers_done:
            await self._wait()

    async def chunk(self, idle: float | None = None) -> bytes:
        """All body bytes that arrived since the last call (at least one); b"" once the
        response is complete. TimeoutError after `idle` seconds without a byte."""
        while True:
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
            self._buffered = 0
            if self._paused and self._transport is not None:
                self._paused = False
                self._transport.resume_reading()
            if self._inflater is None:
                return data
            try:
                data = self._inflater.decompress(data)
            except zlib.error as exc:
                error = UpstreamError(f"engine sent a corrupt compressed body: {exc}")
                self._fail(error)
                raise error from None
            if data:  # compressed bytes may inflate to nothing yet
                return data

    async def read(self, limit: int | None = None) -> bytes | bytearray:
        """The whole (rest of the) body; AnswerTooLarge once it is over `limit` bytes
        (inflated), at once when the engine announces a longer one. The caller closes.

        An announced length is read into one buffer of that size: joining the pieces
        would hold a long answer twice."""
        declared = self.headers.get(b"content-length", b"") if self._inflater is None else b""
        if declared.isdigit():
            size = int(declared)
            if limit is not None and size > limit:
                raise AnswerTooLarge(f"engine announced {size} bytes, over the {limit}-byte limit")
            if size > _HIGH_WATER:
                return await self._read_into(bytearray(size))
        parts = []
        size = 0
        while data := await self.chunk():
            size += len(data)
            if limit is not None and size > limit:
                raise AnswerTooLarge(f"engine answer over the {limit}-byte limit")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_into(self, buffer: bytearray) -> bytearray:
        """The rest of an announced-length body, into `buffer` (its size)."""
        view = memoryview(buffer)
        at = 0
        while data := await self.chunk():
            end = at + len(data)
            if end > len(buffer):
                raise UpstreamError("engine sent more than its Content-Length")
            view[at:end] = data
            at = end
        if at != len(buffer):
            raise UpstreamError("engine sent less than its Content-Length")
        return buffer

    def release(self) -> None:
        """Done with this response: pool the connection if it can carry another request."""
        self._disarm()
        if (
            self._complete
            and not self._chunks
            and self._error is None
            and self._transport is not None
            and not self._transport.is_closing()
            and self._keep_alive
        ):
            self._pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self._disarm()
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

    async def _wait(self, idle: float | None = None) -> None:
        if self._error is not None:
            raise self._error
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        self._idle = idle
        if idle is not None or self._expires != math.inf:
            self._wait_began = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._limit(), self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None

    def _limit(self) -> float:
        """When the current wait must end (loop clock)."""
        if self._idle is None:
            return self._expires
        return min(self._expires, self._wait_began + self._idle)

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits now; the next wait arms a timer of its own
        limit = self._limit()
        if limit - _SLACK <= self._loop.time():
            waiter.set_exception(TimeoutError())
        elif limit != math.inf:
            self._timer = self._loop.call_at(limit, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _reset(self) -> None:
        self._disarm()
        self._idle = None
        # The parser carries on to the next response: a connection is reused only after a
        # complete keep-alive response, where llhttp expects the next message anyway.
        self._chunks.clear()
        self._buffered = 0
        self.status = 0
        self.headers = {}
        self._raw_headers.clear()
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._inflater = None

    # --- asyncio.Protocol -----------------------------------------------------------------

    def attach(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = transport  # type: ignore[assignment]  # uvloop's: see above

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"engine sent malformed HTTP: {exc}"))
            return
        # The callbacks only record; the waiter is woken once per read here. httptools calls
        # on_body once per chunk of a chunked body, so a stream's read of many events made
        # as many wake-ups (and pause checks) before.
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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

    def on_headers_complete(self) -> None:
        self.headers = {name.lower(): value for name, value in self._raw_headers.items()}
        self.status = self._parser.get_status_code()
        # Read here: httptools forgets it once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        encoding = self.headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding in _WBITS:
            self._inflater = zlib.decompressobj(_WBITS[encoding])
        self._headers_done = True

    def on_message_complete(self) -> None:
        self._complete = True


class _EnginePool:
    """Idle keep-alive connections to one engine (`scheme://host:port`).

    A connection idle for `keepalive` seconds is closed rather than reused: the engine
    closes idle connections on its own clock (uvicorn's keep-alive), and a request written
    just as it does is lost with the connection.
    """

    def __init__(self, origin: str, keep: int, keepalive: float, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        parts = urlsplit(origin)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc.encode()
        # (connection, when it went idle), oldest first.
        self._idle: list[tuple[UpstreamResponse, float]] = []
        self._keep = keep
        self._keepalive = keepalive
        # Request line and fixed headers per path, built once.
        self._heads: dict[str, bytes] = {}

    def head(self, path: str) -> bytes:
        """`POST path`, Host and Accept-Encoding, ending with the `Content-Length: ` name."""
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = (
                f"POST {path} HTTP/1.1\r\nHost: ".encode()
                + self.host_header
                + b"\r\nAccept-Encoding: identity\r\nContent-Length: "
            )
        return head

    def take(self) -> UpstreamResponse | None:
        """An idle connection still fit to carry a request, if any (no await: the common case)."""
        stale_before = self.loop.time() - self._keepalive
        while self._idle:
            conn, idle_since = self._idle.pop()
            if idle_since < stale_before:
                self.close()  # this one and every older one
                break
            if conn.reusable:
                return conn
        return None

    async def connect(self, connect_timeout: float, expires: float = math.inf) -> UpstreamResponse:
        """A new connection within `connect_timeout` and before `expires` (TimeoutError when
        `expires` is what ran out: the caller's deadline, not the engine's connect, failed)."""
        loop = self.loop
        now = loop.time()
        deadline_binds = expires - now < connect_timeout
        try:
            async with asyncio.timeout(min(connect_timeout, expires - now)):
                transport, protocol = await loop.create_connection(
                    lambda: UpstreamResponse(self), self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            if deadline_binds:
                raise
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: TimeoutError") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc or type(exc).__name__}") from None
        # uvloop may call connection_made only after create_connection returned.
        protocol.attach(transport)
        return protocol

    def put(self, conn: UpstreamResponse) -> None:
        if len(self._idle) < self._keep:
            self._idle.append((conn, self.loop.time()))
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
        self._loop: asyncio.AbstractEventLoop | None = None

    async def post(
        self,
        origin: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeout: float | None = None,  # noqa: ASYNC109 - outlives the call
    ) -> UpstreamResponse:
        """The response, its status and headers read; the body is the caller's to read.

        `timeout` bounds the whole exchange: connecting, the answer's headers, and every
        read of its body until the response's `clear_deadline()` (TimeoutError).
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        expires = math.inf if timeout is None else loop.time() + timeout
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _EnginePool(origin, self._keep, self._keepalive, loop)
        head = [pool.head(path), str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
        head.append(b"\r\n")
        conn = pool.take() or await pool.connect(self._connect_timeout, expires)
        # No resend on another connection if this one fails: the engine may have seen the
        # request (a decode may have claimed its plan); the flow decides what to retry.
        conn.send(b"".join(head), body, expires)
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
