"""A router replica that starts late (a restart, a scale-up) catches up on the engines' KV index from their replay.

The decode engine's KV events come from vLLM's own `ZmqEventPublisher` (its PUB socket and
its replay buffer, as an engine runs it, without the engine); the engine's HTTP face is
FAKE. A first router follows the stream from the start while the engine caches `prompts`
prompts; then the engine goes idle and a second router starts, as a restarted replica
does. It asks the replay buffer for everything from batch 0 as it subscribes (and again
after every gap in the reply, which a reply of thousands of batches has): the test
waits for it to hold the engine's last batch, checks that it then knows every sampled
older prompt exactly as the first router does, and prints how long the catch-up took
(docs/benchmarks.md, router section).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from pdconnect.kvdescribe import VERSION, DescribedGroup, EngineDescribed
from pdconnect.router import RunningRouter, start_router
from pdconnect.router.kvevents import KVEventsFeed
from pdconnect.testbed.fake_engine import FakeCluster
from pdconnect.testbed.processes import free_port
from tests.router_support import router_config_for
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from tests.vllm_kv_events import stored_blocks  # noqa: E402

BS = 16
BLOCKS = 8  # a 128-token prompt per batch
DESCRIBED = EngineDescribed(VERSION, [DescribedGroup("full_attention", BS, None, False)], 0)


def _prompt(i: int) -> list[int]:
    return [10_000 + i * 1000 + j for j in range(BS * BLOCKS)]


def _batch(i: int) -> Any:
    stored = stored_blocks(range(BLOCKS), _prompt(i), block_size=BS, group=0, kind="full_attention", tag=f"p{i}-")
    # The connector's description of the engine's groups rides with its events (`connectors.describe`).
    return kv_events.KVEventBatch(ts=0.0, events=[stored, DESCRIBED])


class _Engine:
    """The FAKE engines, and vLLM's publisher for the decode engine's KV events."""

    def __init__(self, fakes: FakeCluster) -> None:
        self.fakes = fakes
        events, replay = free_port(), free_port()
        self.endpoints = [f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"]
        # `tcp://*:port` binds, as an engine's publisher does; the routers connect to 127.0.0.1.
        self.publisher = kv_events.ZmqEventPublisher(0, f"tcp://*:{events}", f"tcp://*:{replay}")
        self.published = 0

    def publish(self, i: int) -> None:
        self.publisher.publish(_batch(i))
        self.published += 1

    async def router(self) -> RunningRouter:
        config = router_config_for(
            self.fakes,
            policy="kv-aware",
            decode_first=True,
            kv_cache_groups=f"full:{BS}",
            health_interval=0,
            kv_events_endpoints={self.fakes.decode_urls[0]: self.endpoints},
        )
        return await start_router(config)


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[_Engine]:
    fakes = await FakeCluster.start(1, 1)
    engine = _Engine(fakes)
    try:
        yield engine
    finally:
        engine.publisher.shutdown()
        await fakes.close()


def _last_seq(router: RunningRouter, engine: _Engine) -> float | None:
    return router.router.metrics.registry.get_sample_value(
        "pdconnect_router_kv_events_last_seq", {"engine": engine.fakes.decode_urls[0]}
    )


def _hit(route: str) -> int:
    """The predicted hit in an `x-pdconnect-route` header (decode-first's detail), 0 without one."""
    fields = dict(part.strip().partition("=")[::2] for part in route.split(";")[1:])
    return int(fields.get("hit", 0))


async def _route(router: RunningRouter, prompt: list[int]) -> str:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(f"{router.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-pdconnect-route"]


# Batches the engine published before the late replica starts (vLLM's buffer keeps 10000).
# 5000 overruns the replay's sockets: vLLM's ROUTER queues 1000 messages a peer and drops the rest.
@pytest.mark.parametrize("prompts", [500, 5000])
async def test_a_late_replica_of_an_idle_engine_catches_up_to_its_peer_from_the_replay(
    engine: _Engine, prompts: int
) -> None:
    early = await engine.router()
    late: RunningRouter | None = None
    try:
        # The early router's subscription joins asynchronously: publish until it hears one.
        def early_heard() -> bool:
            if _last_seq(early, engine) is not None:
                return True
            engine.publish(0)
            return False

        await wait_until_async(early_heard, "the early router to hear the engine")
        for i in range(1, prompts):
            engine.publish(i)
        last = engine.published - 1
        await wait_until_async(
            lambda: _last_seq(early, engine) == last,
            "the early router to take in every batch",
            within=120,
            observe=lambda: _last_seq(early, engine),
        )
        assert (await _route(early, [*_prompt(7), 1])).startswith("decode-first; reason=cached")

        # The engine publishes nothing more: the late router asks the replay buffer when it
        # subscribes, and again after each gap in the reply, until it has the last batch.
        started = time.perf_counter()
        late = await engine.router()
        await wait_until_async(
            lambda: _last_seq(late, engine) == last,
            "the late router to catch up from the replay of an idle engine",
            within=120,
            observe=lambda: _last_seq(late, engine),
        )
        caught_up = time.perf_counter()
        known = 0
        sampled = range(0, prompts, prompts // 20)
        for i in sampled:
            early_hit = _hit(await _route(early, [*_prompt(i), 1]))
            late_hit = _hit(await _route(late, [*_prompt(i), 1]))
            assert early_hit == BS * BLOCKS, i
            assert late_hit in (0, early_hit), i  # what it knows is true: the engine's own blocks
            known += late_hit == early_hit
        print(
            f"\ncatch-up: the engine's replay buffer held {engine.published} batches ({engine.published * BLOCKS} "
            f"blocks), the engine idle; the late router was up to date {caught_up - started:.3f} s after it "
            f"started and knew {known} of {len(sampled)} sampled prompts",
            flush=True,
        )
        assert known == len(sampled)  # its peer's view, the oldest prompts included
    finally:
        if late is not None:
            await late.close()
        await early.close()


async def test_a_long_replay_lets_the_loop_run_between_any_two_batches(engine: _Engine) -> None:
    """A replay of 5000 batches never holds the router's loop: another task on it gets a
    turn between any two batches applied (each is received by an await that yields; a
    replay that read its socket in a loop without awaiting would apply a round, about a
    thousand batches, in one turn)."""
    for i in range(5000):
        engine.publish(i)
    feed = KVEventsFeed(lambda url, dp_rank: (engine.endpoints[0], engine.endpoints[1]))
    name = engine.fakes.decode_urls[0]
    seen: list[int] = []
    running = True

    async def ticker() -> None:
        while running:
            seen.append(feed.applied_sequences().get(name, -1))
            await asyncio.sleep(0)

    tick = asyncio.get_running_loop().create_task(ticker())
    try:
        feed.watch(name)
        await wait_until_async(
            lambda: feed.applied_sequences().get(name) == engine.published - 1,
            "the feed to replay every batch",
            within=120,
            observe=lambda: feed.applied_sequences().get(name),
        )
    finally:
        running = False
        await tick
        await feed.close()
    steps = [b - a for a, b in itertools.pairwise(seen)]
    assert max(steps) == 1, max(steps)


async def test_a_replay_an_idle_FAKE_engine_did_not_answer_is_asked_again() -> None:
    """A FAKE engine (a silent PUB socket and a ROUTER replay socket in the test) ignores the
    first replay request, as a busy or restarting engine may, and publishes nothing more:
    the subscription asks again once its stream has been quiet, and takes the buffer."""
    context = zmq.asyncio.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    endpoints = (
        f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}",
        f"tcp://127.0.0.1:{replay.bind_to_random_port('tcp://127.0.0.1')}",
    )
    encoder = msgspec.msgpack.Encoder()
    requests: list[int] = []

    async def answer_the_second() -> None:
        while True:
            client, _, start = await replay.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            if len(requests) >= 2:
                for seq in range(int.from_bytes(start, "big"), 10):
                    await replay.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), encoder.encode(_batch(seq))])
                await replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = asyncio.get_running_loop().create_task(answer_the_second())
    feed = KVEventsFeed(lambda url, dp_rank: endpoints)
    try:
        feed.watch("http://fake-d0:8000")
        await wait_until_async(
            lambda: feed.applied_sequences().get("http://fake-d0:8000") == 9,
            "the feed to ask the replay again and apply it",
            observe=lambda: (requests, feed.applied_sequences()),
        )
        assert requests[:2] == [0, 0]
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        await feed.close()
        context.destroy(linger=0)
