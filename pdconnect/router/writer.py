"""Writes to one client within a deadline per write and a bound on what waits unsent.

A client that stops reading must not hold its answer, its connection and the engine
request behind it forever: aiohttp waits for a full socket to drain with no deadline.
`ClientWriter` hands the transport at most `SLICE` bytes at a time, so the bytes a
connection holds in user space stay within one slice plus the transport's high-water
mark, and a write that has to wait for the client to read gets `timeout` seconds, after
which the connection is aborted and `ClientStalled` raised.

Only waits cost a timer. A write that starts with nothing queued in user space cannot
wait: the kernel takes what fits, and the rest (at most one slice, below the
transport's 64 KiB high-water mark) pauses nothing, so aiohttp's drain returns at once.
Only a write that finds bytes still queued (the client is behind) runs under
`asyncio.timeout`: a healthy stream pays one method call per write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

__all__ = ["SLICE", "ClientStalled", "ClientWriter", "HeadersWithBodyResponse"]

# Below the 64 KiB high-water mark of asyncio's and uvloop's transports, with room for a
# response head and the chunked framing written along with a slice.
SLICE = 32 * 1024


class ClientStalled(ConnectionResetError):
    """The client did not take a write within the deadline; its connection was aborted."""


class ClientWriter:
    """One response's writes to its client (see module doc)."""

    __slots__ = ("_on_stall", "_out", "_request", "_timeout")

    def __init__(
        self, request: web.Request, out: web.StreamResponse, timeout: float, on_stall: Callable[[], None]
    ) -> None:
        self._request = request
        self._out = out
        self._timeout = timeout
        self._on_stall = on_stall

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) <= SLICE:
            await self._write(data, eof=False)
            return
        view = memoryview(data)
        for start in range(0, len(data), SLICE):
            await self._write(view[start : start + SLICE], eof=False)

    async def write_eof(self, data: bytes | bytearray | memoryview = b"") -> None:
        """The last bytes and the end of the response."""
        if len(data) > SLICE:
            cut = len(data) - SLICE
            await self.write(memoryview(data)[:cut])
            data = memoryview(data)[cut:]
        await self._write(data, eof=True)

    async def _write(self, data: bytes | bytearray | memoryview, eof: bool) -> None:
        transport = self._request.transport
        if transport is None:
            raise ConnectionResetError("client connection closed")
        send = self._out.write_eof(data) if eof else self._out.write(data)
        if transport.get_write_buffer_size() == 0:
            await send
            return
        try:
            async with asyncio.timeout(self._timeout):
                await send
        except TimeoutError:
            self._on_stall()
            transport.abort()
            raise ClientStalled(f"client took no bytes for {self._timeout}s") from None


class HeadersWithBodyResponse(web.StreamResponse):
    """A stream whose status line and headers leave with its first bytes, in one write.

    aiohttp's StreamResponse writes the headers on `prepare()`, a write (and a wake-up of
    the client) of their own; its `Response` buffers them until the body. This flag (an
    aiohttp 3.12+ class attribute; older versions ignore it and send at `prepare()`) asks
    for the same on a stream. The first chunk follows `prepare()` at once, so no client
    waits longer for its headers.
    """

    _send_headers_immediately = False
