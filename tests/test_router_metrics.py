"""The router's lock-free request metrics render exactly as prometheus_client's own
Counter and Histogram would for the same updates (a dashboard cannot tell them apart)."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdconnect.router.metrics import _LATENCY_BUCKETS, _LoopCounter, _LoopHistogram
from tests.router_support import COMPLETION


def _masked(registry: CollectorRegistry) -> str:
    """The exposition text, creation timestamps masked (they differ by construction)."""
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


def test_loop_metrics_render_like_prometheus_client() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counters = (
        Counter("c", "a counter", ["endpoint", "outcome"], registry=theirs),
        _LoopCounter("c", "a counter", ["endpoint", "outcome"], ours),
    )
    labelled = (
        Histogram("h", "a histogram", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=theirs),
        _LoopHistogram("h", "a histogram", ["endpoint"], _LATENCY_BUCKETS, ours),
    )
    plain = (
        Histogram("p", "an unlabelled histogram", buckets=_LATENCY_BUCKETS, registry=theirs),
        _LoopHistogram("p", "an unlabelled histogram", [], _LATENCY_BUCKETS, ours),
    )
    assert _masked(theirs) == _masked(ours)  # nothing observed yet: the unlabelled one has its series
    # On a bucket bound, between bounds, below the first and past the last.
    for value in (0.001, 0.0004, 0.03, 7.0, 600.0, 1e6, 0.0):
        for counter in counters:
            counter.labels("completions", "ok").inc()
        for histogram in labelled:
            histogram.labels("completions").observe(value)
            histogram.labels("chat").observe(value / 2)
        for histogram in plain:
            histogram.observe(value)
    for counter in counters:
        counter.labels("chat", "bad_request").inc()
    assert _masked(theirs) == _masked(ours)
    assert ours.get_sample_value("h_bucket", {"endpoint": "completions", "le": "0.001"}) == 3.0


@pytest.mark.asyncio
async def test_with_a_metrics_port_metrics_are_served_there_only(make) -> None:
    """Monitoring scrapes a port of its own; clients on the API port do not see /metrics,
    and the metrics port serves nothing else."""
    s = await make(metrics_port=0)
    metrics_url = s.router.metrics_url
    assert metrics_url is not None and metrics_url != s.router.url
    assert (await s.post("/v1/completions", COMPLETION))[0] == 200
    async with s.http.get(metrics_url + "/metrics") as resp:
        assert resp.status == 200
        assert 'pdconnect_router_requests_total{endpoint="completions",outcome="ok"} 1.0' in await resp.text()
    async with s.http.get(s.router.url + "/metrics") as resp:
        assert resp.status == 404
    async with s.http.post(metrics_url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status in (404, 405)


@pytest.mark.asyncio
async def test_without_a_metrics_port_metrics_share_the_client_port(make) -> None:
    s = await make()
    assert s.router.metrics_url is None
    async with s.http.get(s.router.url + "/metrics") as resp:
        assert resp.status == 200
