"""The router's HTTP listeners: aiohttp's server with a deadline on each request head, and draining on stop.

aiohttp bounds the wait for a request (keep-alive timeout) but not the time from a
head's first byte to its last; `_HeadDeadlineHandler` adds that deadline. `serve_app`
starts a listener for one app (the clients', the admin or the metrics one) with it, and
with the drain timeout the runner's cleanup waits for requests in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from pdconnect.router.errors import openai_error_body
from pdconnect.serving import serve_http

__all__ = ["serve_app"]


class _HeadDeadlineHandler(RequestHandler):
    """aiohttp's per-connection protocol, with a deadline on every request's head.

    aiohttp bounds the wait for a request (keep-alive timeout) but not the time from a
    head's first byte to its last, so a client sending a header byte every few seconds
    holds the connection forever (slowloris). Here a timer starts when bytes arrive while
    no request body is being received (they can only be a head), and stops when aiohttp's
    parser produces the message (the whole head, or a parse error aiohttp answers
    itself). When it fires the client gets a 408, unless an answer to an earlier
    pipelined request is being written, and the connection closes.

    Relies on `RequestHandler` internals of aiohttp 3.14 (`_request_count`, `_messages`,
    `_current_request`); tests/test_router_aiohttp_internals.py fails when they move, and
    pyproject.toml allows only the aiohttp series they were read from.
    """

    __slots__ = ("_body", "_head_timer")

    def __init__(self, manager: _HeadDeadlineServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # the last parsed request's body

    def data_received(self, data: bytes) -> None:
        in_head = self._body is None or self._body.is_eof()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:
            self._stop_head_timer()
            self._body = self._messages[-1][1] if self._messages else None
        elif in_head and data and self._head_timer is None and not (self._force_close or self._close):
            # aiohttp types it as its Server; ours made this handler.
            manager: _HeadDeadlineServer = self._manager  # type: ignore[assignment]
            self._head_timer = self._loop.call_later(manager.head_timeout, self._head_timed_out)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        manager = self._manager
        if self.transport is None or self._force_close or not isinstance(manager, _HeadDeadlineServer):
            return
        manager.on_head_timeout()
        if self._current_request is None and not self._messages:
            self.transport.write(manager.timeout_response)
        self.force_close()  # closes after what was written is sent


class _HeadDeadlineServer(web.Server):
    """aiohttp's connection manager for one app, making `_HeadDeadlineHandler`s."""

    def __init__(self, inner: web.Server, head_timeout: float, on_head_timeout: Callable[[], None]) -> None:
        super().__init__(
            inner.request_handler,
            request_factory=inner.request_factory,
            handler_cancellation=inner.handler_cancellation,
            loop=inner._loop,
            **inner._kwargs,
        )
        self.head_timeout = head_timeout
        self.on_head_timeout = on_head_timeout
        body = openai_error_body(408, f"request head not received within {head_timeout}s", "HeaderTimeout")
        self.timeout_response = (
            b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )

    def __call__(self) -> RequestHandler:
        return _HeadDeadlineHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """An AppRunner whose connections carry the head deadline (aiohttp has no option for it)."""

    __slots__ = ("_head_timeout", "_on_head_timeout")

    def __init__(
        self, app: web.Application, head_timeout: float, on_head_timeout: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._head_timeout = head_timeout
        self._on_head_timeout = on_head_timeout

    async def _make_server(self) -> web.Server:
        return _HeadDeadlineServer(await super()._make_server(), self._head_timeout, self._on_head_timeout)


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    head_timeout: float,
    on_head_timeout: Callable[[], None],
    keepalive: float,
    drain_timeout: float,
) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0: any free port) until the runner's cleanup; returns the
    runner and the bound URL. Cleanup drains: it waits up to `drain_timeout` for requests
    in flight before cancelling them."""
    # auto_decompress off: request bodies are inflated by `body.read_body`, within the limit.
    return await serve_http(
        app,
        host,
        port,
        keepalive,
        runner=_Runner,
        head_timeout=head_timeout,
        on_head_timeout=on_head_timeout,
        auto_decompress=False,
        shutdown_timeout=drain_timeout,
    )
