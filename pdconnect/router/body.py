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


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
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
    parts: list[bytes] = []
    received = produced = 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                received += len(chunk)
                if received > limit:
                    raise BodyTooLarge(f"request body is over the {limit}-byte limit")
                if inflater is not None:
                    # Never ask for more than one byte past the limit: the bomb stays small.
                    chunk = inflater.decompress(chunk, limit + 1 - produced)
                    if inflater.unconsumed_tail:
                        raise BodyTooLarge(f"request body inflates to more than the {limit}-byte limit")
                produced += len(chunk)
                if produced > limit:
                    raise BodyTooLarge(f"request body inflates to more than the {limit}-byte limit")
                parts.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"request body not received within {timeout}s") from None
    except zlib.error as exc:
        raise BadRequest(f"request body is not valid {encoding}: {exc}") from None
    if inflater is not None and not inflater.eof:
        raise BadRequest(f"request body is truncated {encoding} data")
    return parts[0] if len(parts) == 1 else b"".join(parts)
