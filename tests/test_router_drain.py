"""Draining the router on SIGTERM: streams in flight finish; what outlives the drain is cut and released.

Each router is a real `pdconnect router` process (SIGTERM is what Kubernetes sends on a
rolling restart); the engines are FAKE (`pdconnect.testbed.fake_engine`, in this test's
event loop) so a stream can last as long as the test needs.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from pdconnect.testbed.fake_engine import FakeCluster
from tests.router_support import COMPLETION, start_router_process
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio

CHUNKS = 16
CHUNK_INTERVAL_S = 0.25  # a 4 s generation: long beside the SIGTERM, short for the test


@pytest_asyncio.fixture
async def fakes() -> AsyncIterator[FakeCluster]:
    cluster = await FakeCluster.start(chunks=CHUNKS)
    try:
        yield cluster
    finally:
        await cluster.close()


@dataclass
class Stream:
    """One streamed completion read to its end: its chunks, and whether [DONE] came."""

    first_chunk: asyncio.Event
    chunks: int = 0
    done: bool = False
    cut: bool = False


async def _stream(http: aiohttp.ClientSession, url: str, request_id: str, into: Stream) -> None:
    try:
        async with http.post(
            f"{url}/v1/completions",
            json={**COMPLETION, "max_tokens": CHUNKS, "stream": True},
            headers={"X-Request-Id": request_id},
        ) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    into.done = True
                elif line.startswith(b"data: "):
                    assert "error" not in json.loads(line[6:])
                    into.chunks += 1
                    into.first_chunk.set()
    except aiohttp.ClientPayloadError:
        into.cut = True


async def _refuses_connections(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as resp:
            await resp.read()
    except aiohttp.ClientConnectionError:
        return True
    return False


async def test_rolling_restart_of_one_router_cuts_no_stream(fakes: FakeCluster) -> None:
    """SIGTERM to one of two replicas while it relays long streams: each stream ends whole,
    the replica takes no new connection meanwhile, the other serves, and the drained one
    exits cleanly once its streams are done, releasing no prefill hold."""
    fakes.decode[0].faults.chunk_interval = CHUNK_INTERVAL_S
    draining, other = await start_router_process(fakes), await start_router_process(fakes)
    streams = [Stream(asyncio.Event()) for _ in range(3)]
    async with aiohttp.ClientSession() as http:
        tasks = [
            asyncio.create_task(_stream(http, draining.url, f"long-{i}", stream)) for i, stream in enumerate(streams)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.first_chunk.wait() for s in streams)), timeout=30)
        draining.process.send_signal(signal.SIGTERM)
        await wait_until_async(
            lambda: _refuses_connections(draining.url), "the draining router to stop accepting connections"
        )
        assert not any(task.done() for task in tasks), "a stream ended as the drain began"
        async with http.post(f"{other.url}/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 200
            assert json.loads(await resp.read())["choices"]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert [(s.chunks, s.done, s.cut) for s in streams] == [(CHUNKS, True, False)] * 3
    assert await asyncio.wait_for(draining.process.wait(), timeout=30) == 0
    assert fakes.prefill[0].released_ids() == []
    other.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(other.process.wait(), timeout=30) == 0


async def test_a_stream_outliving_the_drain_is_cut_and_its_prefill_hold_released(fakes: FakeCluster) -> None:
    fakes.decode[0].faults.stall_after_chunks = 2
    router = await start_router_process(fakes, "--drain-timeout", "1", "--stream-idle-timeout", "60")
    stream = Stream(asyncio.Event())
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(_stream(http, router.url, "stalled-1", stream))
        await asyncio.wait_for(stream.first_chunk.wait(), timeout=30)
        router.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(task, timeout=30)
    assert (stream.chunks, stream.done, stream.cut) == (2, False, True)
    assert await asyncio.wait_for(router.process.wait(), timeout=30) == 0
    await wait_until_async(
        lambda: fakes.prefill[0].released_ids() == ["stalled-1"], "the prefill engine to get the release"
    )
