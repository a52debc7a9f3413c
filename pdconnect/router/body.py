"""The client's request body, read within a size limit and a deadline, inflated within the same limit.

The HTTP server hands this module the raw bytes (its own decompression is off): an
announced `Content-Length` over the limit is refused before a byte is read; a chunked
or lying body is counted as it arrives; `gzip`/`deflate` bodies are inflated in steps
that never produce more than the limit, so a small bomb cannot balloon memory; and the
whole read runs under one deadline, so a body that never finishes cannot hold a
connection (and a file descriptor) forever.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from pdconnect.router.errors import BadRequest, BodyTimeout, BodyTooLarge, UnsupportedEncoding

__all__ = ["read_body"]

# zlib window bits: 16+ = gzip wrapper, 32+ = detect gzip or zlib (HTTP "deflate" is zlib).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": 32 + zlib.MAX_WBITS}


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:  # noqa: ASYNC109 - raises BodyTimeout
    """The (inflated) body, at most `limit` bytes both on the wire and after inflating."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        inflater = None
    elif encoding in _WBITS:
        inflater = zlib.decompressobj(_WBITS[encoding])
    else:
        raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not supported (gzip, deflate, identity)")
    content = request.content
    if content.is_eof():
        # The whole body came in with the headers (most requests): nothing to wait for,
        # so no deadline to arm; uncompressed, only its size to check.
        if inflater is None:
            body = content.read_nowait()
            if len(body) > limit:
                raise BodyTooLarge(f"request body is over the {limit}-byte limit")
            return body
        sink = _Sink(limit, inflater, encoding)
        sink.add(content.read_nowait())
        return sink.body()
    sink = _Sink(limit, inflater, encoding)
    try:
        async with asyncio.timeout(timeout):
            while chunk := await content.readany():
                sink.add(chunk)
    except TimeoutError:
        raise BodyTimeout(f"request body not received within {timeout}s") from None
    return sink.body()


class _Sink:
    """The body so far: counted on the wire and after inflating, both within `limit`."""

    def __init__(self, limit: int, inflater: zlib._Decompress | None, encoding: str) -> None:
        self._limit = limit
        self._inflater = inflater
        self._encoding = encoding
        self._parts: list[bytes] = []
        self._received = 0
        self._produced = 0

    def add(self, chunk: bytes) -> None:
        limit = self._limit
        self._received += len(chunk)
        if self._received > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit")
        if self._inflater is not None:
            try:
                # Never ask for more than one byte past the limit: the bomb stays small.
                chunk = self._inflater.decompress(chunk, limit + 1 - self._produced)
            except zlib.error as exc:
                raise BadRequest(f"request body is not valid {self._encoding}: {exc}") from None
            if self._inflater.unconsumed_tail:
                raise BodyTooLarge(f"request body inflates to more than the {limit}-byte limit")
        self._produced += len(chunk)
        if self._produced > limit:
            raise BodyTooLarge(f"request body inflates to more than the {limit}-byte limit")
        self._parts.append(chunk)

    def body(self) -> bytes:
        if self._inflater is not None and not self._inflater.eof:
            raise BadRequest(f"request body is truncated {self._encoding} data")
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)
