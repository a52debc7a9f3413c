"""Runs an asyncio service until SIGINT or SIGTERM: what `pdconnect router` and `pdconnect metrics-proxy` share.

`serve_http` starts an aiohttp application the way both serve theirs.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aiohttp import web

__all__ = ["Closable", "serve_http", "serve_until_signalled"]


class Closable(Protocol):
    """A started service: closing it stops serving and releases what it holds."""

    async def close(self) -> None: ...


Service = TypeVar("Service", bound=Closable)


async def serve_until_signalled(start: Callable[[], Awaitable[Service]], started: Callable[[Service], None]) -> None:
    """Start the service, call `started` with it, serve until SIGINT or SIGTERM, then close it.

    The handlers are installed before the service starts, so a signal during start-up
    still ends it cleanly once it has started.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = await start()
    try:
        started(running)
        await stop.wait()
    finally:
        await running.close()


async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    keepalive: float,
    runner: Callable[..., web.AppRunner] = web.AppRunner,
    **options: Any,
) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0: any free port) until the runner's cleanup; the runner
    (`runner(app, **options)`) and the bound URL. Both services log requests their own way
    (aiohttp's access log off), cancel a handler whose client left, and close a client
    connection idle `keepalive` seconds (aiohttp's own default is an hour)."""
    started = runner(app, access_log=None, handler_cancellation=True, keepalive_timeout=keepalive, **options)
    await started.setup()
    await web.TCPSite(started, host, port).start()
    bound_host, bound_port = started.addresses[0][:2]
    return started, f"http://{bound_host}:{bound_port}"
