"""How far the router has read each engine's KV events, exported per engine
(`pdconnect_router_kv_events_last_seq`): fed by a real ZMQ PUB socket standing in for
the engine's publisher (FAKE publisher: the batches are vLLM's own classes, encoded as
vLLM's ZmqEventPublisher encodes them)."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events

from pdconnect.router.breaker import CircuitBreaker
from pdconnect.router.engines import EngineRegistry
from pdconnect.router.kvevents import KVEventsFeed
from pdconnect.router.metrics import RouterMetrics
from tests.waiting import wait_until_async

ENGINE = "http://fake-d0:8000"
OTHER = "http://fake-d1:8000"  # publishes nothing: no series


def _last_seq(metrics: RouterMetrics, url: str) -> float | None:
    return metrics.registry.get_sample_value("pdconnect_router_kv_events_last_seq", {"engine": url})


@pytest.mark.asyncio
async def test_the_last_batch_applied_is_exported_per_engine_and_only_once_one_was() -> None:
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{publisher.bind_to_random_port('tcp://127.0.0.1')}"
    metrics = RouterMetrics(EngineRegistry(make_breaker=lambda: CircuitBreaker(3, 10.0), probed=False))
    feed = KVEventsFeed(lambda url, dp_rank: (endpoint, None) if url == ENGINE else None)
    metrics.track_kv_events(feed.applied_sequences)
    batch = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=0.0, events=[]))
    sent = -1

    def publish() -> None:
        nonlocal sent
        sent += 1
        publisher.send_multipart([b"", sent.to_bytes(8, "big"), batch])

    try:
        feed.watch(ENGINE)
        feed.watch(OTHER)
        assert _last_seq(metrics, ENGINE) is None  # nothing applied yet: no series, not 0

        # The SUB joins asynchronously: publish until the router has heard one batch.
        async def heard() -> bool:
            publish()
            return _last_seq(metrics, ENGINE) is not None

        await wait_until_async(heard, "the first batch applied", observe=lambda: sent)
        first = _last_seq(metrics, ENGINE)
        assert first is not None and 0 <= first <= sent
        for _ in range(3):
            publish()
        await wait_until_async(
            lambda: _last_seq(metrics, ENGINE) == sent,
            f"batch {sent} applied",
            observe=lambda: _last_seq(metrics, ENGINE),
        )
        assert _last_seq(metrics, OTHER) is None

        feed.forget(ENGINE)  # the engine left: its series goes with it
        assert _last_seq(metrics, ENGINE) is None
    finally:
        await feed.close()
        context.destroy(linger=0)
