"""Data-parallel engines in the router: each rank a cache of its own, chosen and pinned by header.

A `vllm serve --data-parallel-size N` server has N engine cores, each with its own prefix
cache and its own KV events stream (ports offset by rank, batches stamped with the rank).
Here a FAKE decode engine records the `X-data-parallel-rank` header of what it is sent,
and FAKE publishers (vLLM's own event classes) speak for its ranks; the index, the
kv-aware policy and the decode-first decider are the real ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
from aiohttp import web

from pdconnect.errors import ConfigError
from pdconnect.kvdescribe import VERSION, DescribedGroup, EngineDescribed
from pdconnect.router import RunningRouter, load_config, start_router
from pdconnect.router.breaker import CircuitBreaker
from pdconnect.router.engines import DP_RANK_HEADER, EngineRegistry, Role
from pdconnect.router.kvevents import offset_port
from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.prompt import RoutingPrompt
from pdconnect.testbed.fake_engine import FakeCluster, FakeEngine
from tests.router_support import router_config_for

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from tests.router_events_support import complete_through, publish_until_applied  # noqa: E402
from tests.vllm_kv_events import stored_blocks  # noqa: E402

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4
SIBLING = [*TOKENS[:28], 7, 8, 9, 10]  # shares the first 7 blocks


@dataclass
class RankedFake(FakeEngine):
    """A FAKE engine that records the data-parallel rank each request was pinned to (None: no header)."""

    ranks: list[str | None] = field(default_factory=list)

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        self.ranks.append(request.headers.get(DP_RANK_HEADER))
        return await super()._inference(request)


def _batch(rank: int | None, blocks: range = range(8)) -> bytes:
    """vLLM's KVEventBatch storing `blocks` of TOKENS, stamped with the publisher's rank."""
    stored = stored_blocks(blocks, TOKENS, block_size=BS, group=0, kind="full_attention", tag="g0")
    # With the description the rank's connector adds to its engine core's events.
    described = EngineDescribed(VERSION, [DescribedGroup("full_attention", BS, None, False)], 0)
    batch = kv_events.KVEventBatch(ts=0.0, events=[stored, described], data_parallel_rank=rank)
    return msgspec.msgpack.Encoder().encode(batch)


@contextlib.contextmanager
def _rank_publishers(context: zmq.Context[Any], ranks: int) -> Iterator[tuple[int, list[zmq.Socket[Any]]]]:
    """PUB sockets on `ranks` consecutive ports, as vLLM binds a data-parallel server's
    publishers (base port + rank); yields the base port and the sockets."""
    for _ in range(50):
        sockets: list[zmq.Socket[Any]] = []
        try:
            first = context.socket(zmq.PUB)
            sockets.append(first)
            base = first.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
            for rank in range(1, ranks):
                sockets.append(context.socket(zmq.PUB))
                sockets[-1].bind(f"tcp://127.0.0.1:{base + rank}")
        except zmq.ZMQError:
            for socket in sockets:
                socket.close(linger=0)
            continue  # the next port was taken: try another base
        try:
            yield base, sockets
        finally:
            for socket in sockets:
                socket.close(linger=0)
        return
    raise RuntimeError("no run of free ports")


@contextlib.asynccontextmanager
async def _dp_setup(**options: Any) -> AsyncIterator[tuple[FakeCluster, RunningRouter, list[zmq.Socket[Any]]]]:
    """A FAKE prefill engine, a FAKE decode engine of 2 data-parallel ranks (a publisher per
    rank), and a kv-aware router with `--decode-dp-size 2` in front."""
    fakes = FakeCluster([FakeEngine(name="fake-p0", side_channel=True)], [RankedFake(name="fake-d0")])
    for engine in fakes.prefill + fakes.decode:
        await engine.start()
    context: zmq.Context[Any] = zmq.Context()
    try:
        with _rank_publishers(context, 2) as (base, publishers):
            config = router_config_for(
                fakes,
                policy="kv-aware",
                decode_dp_size=2,
                kv_events_endpoints={fakes.decode_urls[0]: [f"tcp://127.0.0.1:{base}"]},
                **options,
            )
            router = await start_router(config)
            try:
                yield fakes, router, publishers
            finally:
                await router.close()
    finally:
        await fakes.close()
        context.destroy(linger=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("decode_first", [False, True], ids=["pd", "decode-first"])
async def test_kv_events_of_one_rank_route_the_siblings_to_that_rank_with_the_header(decode_first: bool) -> None:
    options: dict[str, Any] = {"decode_first": True} if decode_first else {}
    async with _dp_setup(**options) as (fakes, router, publishers):
        decode = fakes.decode[0]
        assert isinstance(decode, RankedFake)
        url = decode.url
        # No events yet: prefix affinity picks a rank, pins it, and keeps it.
        first = (await complete_through(router, TOKENS))["X-PDConnect-Decode"]
        assert first in (f"{url}#dp0", f"{url}#dp1")
        assert decode.ranks == [first[-1]]
        # The other rank reports (on its own port, stamped with its rank) that it holds the prompt.
        holder = 1 if first.endswith("#dp0") else 0
        await publish_until_applied(router, publishers[holder], _batch(holder))
        for prompt in (TOKENS, SIBLING):
            headers = await complete_through(router, prompt)
            assert headers["X-PDConnect-Decode"] == f"{url}#dp{holder}"
            assert decode.ranks[-1] == str(holder)
            if decode_first:
                assert headers["X-PDConnect-Route"].startswith("decode-first; reason=cached")
        if decode_first:
            assert len(fakes.prefill[0].seen) == 1  # only the request before the events
        in_flight = router.router.metrics.registry.get_sample_value(
            "pdconnect_router_engine_in_flight", {"role": "decode", "engine": f"{url}#dp{holder}"}
        )
        assert in_flight == 0  # one series per rank


@pytest.mark.asyncio
async def test_the_prefill_leg_of_a_data_parallel_prefill_engine_is_pinned_too() -> None:
    fakes = FakeCluster([RankedFake(name="fake-p0", side_channel=True)], [FakeEngine(name="fake-d0")])
    for engine in fakes.prefill + fakes.decode:
        await engine.start()
    router = await start_router(router_config_for(fakes, policy="prefix-affinity", prefill_dp_size=4))
    try:
        prefill = fakes.prefill[0]
        assert isinstance(prefill, RankedFake)
        chosen = {(await complete_through(router, TOKENS))["X-PDConnect-Prefill"] for _ in range(3)}
        assert len(chosen) == 1  # siblings stay on one rank's cache
        [name] = chosen
        assert prefill.ranks == [name.rpartition("#dp")[2]] * 3
        assert fakes.decode[0].seen[-1].body["kv_transfer_params"]["do_remote_prefill"] is True
    finally:
        await router.close()
        await fakes.close()


def test_an_index_applies_only_its_own_ranks_batches_and_counts_the_others() -> None:
    counted: list[str] = []
    index = EngineKVIndex(count=counted.append, dp_rank=1)
    assert index.apply_payload(_batch(0))  # rank 0's stream on rank 1's port: a misconfigured offset
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0 and counted == ["dp_rank"]
    assert index.apply_payload(_batch(1))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 32
    plain = EngineKVIndex(count=counted.append)  # no data parallelism: vLLM stamps rank 0
    assert plain.apply_payload(_batch(0)) and plain.hit_tokens(RoutingPrompt(TOKENS)) == 32
    assert counted == ["dp_rank"]


def test_a_data_parallel_server_is_one_engine_per_rank_added_and_removed_together() -> None:
    added: list[str] = []
    removed: list[str] = []
    registry = EngineRegistry(lambda: CircuitBreaker(3, 10.0), probed=False, dp_sizes={Role.DECODE: 3})
    registry.on_added.append(lambda e: added.append(e.name))
    registry.on_removed.append(lambda e: removed.append(e.name))
    registry.add(Role.DECODE, "http://d0:8000", "static")
    registry.add(Role.PREFILL, "http://p0:8000", "static")
    names = ["http://d0:8000#dp0", "http://d0:8000#dp1", "http://d0:8000#dp2"]
    assert [e.name for e in registry.engines(Role.DECODE)] == names
    assert [e.headers for e in registry.engines(Role.DECODE)] == [{DP_RANK_HEADER: str(r)} for r in range(3)]
    [prefill] = registry.engines(Role.PREFILL)
    assert prefill.name == "http://p0:8000" and prefill.headers == {}
    assert registry.remove(Role.DECODE, "http://d0:8000")
    assert added == [*names, "http://p0:8000"] and removed == names
    assert registry.engines(Role.DECODE) == ()


def test_rank_ports_follow_vllms_offset_and_overlapping_ranges_are_refused() -> None:
    assert offset_port("tcp://d0:5557", 0) == "tcp://d0:5557"
    assert offset_port("tcp://d0:5557", 3) == "tcp://d0:5560"
    assert offset_port("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_port("tcp://d0:0", 2) == "tcp://d0:0"  # left to the OS, as vLLM does
    base = {"decode": ["http://d0:8000"], "policy": "kv-aware", "kv_events_port": 5557}
    with pytest.raises(ConfigError, match="overlap"):
        load_config({**base, "kv_events_replay_port": 5558, "decode_dp_size": 2})
    load_config({**base, "kv_events_replay_port": 5558})  # one rank: the ports never meet
    load_config({**base, "kv_events_replay_port": 5600, "decode_dp_size": 8})


@pytest.mark.asyncio
async def test_a_retry_goes_to_another_server_before_another_rank_of_the_one_that_failed() -> None:
    fakes = await FakeCluster.start(prefill=1, decode=2)
    await fakes.decode[0].close()  # refuses connections: both of its ranks fail alike
    # Round robin over d0#dp0, d0#dp1, d1#dp0, d1#dp1: the first request starts at d0#dp0,
    # and with two attempts a retry on d0#dp1 would fail as well.
    config = router_config_for(fakes, policy="round-robin", decode_dp_size=2, health_interval=0, decode_attempts=2)
    router = await start_router(config)
    try:
        headers = await complete_through(router, TOKENS)
        assert headers["X-PDConnect-Decode"] == f"{fakes.decode_urls[1]}#dp0"
    finally:
        await router.close()
        await fakes.close()


@dataclass
class CountingFake(FakeEngine):
    """A FAKE engine that counts its `/health` polls."""

    polls: int = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.polls += 1
        return await super()._health(request)


@pytest.mark.asyncio
async def test_the_ranks_of_a_server_share_one_health_poll_and_its_verdict() -> None:
    import aiohttp

    from pdconnect.router.health import HealthMonitor

    fake = CountingFake(name="fake-d0")
    await fake.start()
    registry = EngineRegistry(lambda: CircuitBreaker(3, 10.0), probed=True, dp_sizes={Role.DECODE: 4})
    registry.add(Role.DECODE, fake.url, "static")
    try:
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(registry, session, interval=60.0, timeout=5.0, failures_to_down=1)
            await monitor.poll(registry.all_engines())
            assert fake.polls == 1
            assert [e.routable for e in registry.engines(Role.DECODE)] == [True] * 4
            fake.faults.health_status = 503
            await monitor.poll(registry.all_engines())
            assert fake.polls == 2
            assert [e.routable for e in registry.engines(Role.DECODE)] == [False] * 4
            await monitor.close()
    finally:
        await fake.close()
