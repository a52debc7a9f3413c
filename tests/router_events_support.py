"""What the router tests that publish KV events share: publish until the router applied a batch; one completion.

A router's SUB socket joins its publisher asynchronously, so a batch sent before it joined
is lost: these tests send the batch again (the next sequence number each time) until the
router's `kv_events{result="ok"}` counter moves.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from pdconnect.router import RunningRouter
from tests.waiting import wait_until_async


async def publish_until_applied(router: RunningRouter, socket: Any, payload: bytes, seq: int = 0) -> int:
    """Send `payload` on the ZMQ PUB `socket` (vLLM's frames, sequence numbers from `seq`)
    until `router` applied a batch more than before; returns the next sequence number."""
    applied = router.router.metrics.kv_events.labels("ok")
    before = applied._value.get()

    def heard() -> bool:
        nonlocal seq
        socket.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        return bool(applied._value.get() > before)

    await wait_until_async(heard, "the router to apply a published batch", observe=applied._value.get)
    return seq


async def complete_through(router: RunningRouter, prompt: list[int]) -> dict[str, str]:
    """A 2-token completion of `prompt` through `router`, answered 200; its response headers."""
    async with (
        aiohttp.ClientSession() as http,
        asyncio.timeout(15),
        http.post(
            router.url + "/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 2}
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return dict(resp.headers)
