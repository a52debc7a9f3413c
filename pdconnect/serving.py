"""Runs an asyncio service until SIGINT or SIGTERM: what `pdconnect router` and `pdconnect metrics-proxy` share."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

__all__ = ["Closable", "serve_until_signalled"]


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
