"""The router's Prometheus metrics, on a registry owned by one router instance.

Per-engine gauges (health, in-flight, failures) are read from the engine registry at
scrape time by a collector, so the request path never touches them and a removed
engine's series disappear with it.

What every request updates (its outcome, its latencies, placements) is counted in
`_LoopCounter` / `_LoopHistogram`: plain numbers, updated only from the event loop
thread, rendered at scrape time exactly as prometheus_client's Counter and Histogram
render (same series, `_created` included). prometheus_client takes a lock per counter
increment and per bucket, and walks the buckets one by one: about half of a request's
metric cost. Anything updated off the loop (release results, from the release pool's
threads) stays a prometheus_client metric.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as _prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from pdconnect.router.breaker import BreakerState
from pdconnect.router.engines import EngineRegistry

__all__ = ["OUTCOMES", "RouterMetrics"]

# Every request ends with exactly one of these (label `outcome` of requests_total).
OUTCOMES = (
    "ok",  # served P/D as planned (possibly after retries)
    "ok_fallback",  # served decode-only after prefill failed
    "rejected",  # an engine refused the request itself (4xx), passed through
    "bad_request",  # the router could not parse or route the body
    "no_engine",  # no healthy engine of a needed role
    "prefill_failed",  # every prefill attempt failed, fallback off
    "decode_failed",  # every decode attempt failed before the first byte
    "decode_timeout",  # non-streaming decode exceeded decode_timeout
    "decode_dropped",  # decode stream broke, stalled or ended with an engine error event after the client got bytes
    "client_disconnect",  # the client went away; decode aborted, prefill released
    "client_stalled",  # the client stopped reading: dropped after client_write_timeout
    "unauthorized",  # client API keys are on and the request carried no known key (401)
    "rate_limited",  # the key was over its request or token rate (429)
)

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class _EngineCollector(Collector):
    def __init__(self, engines: EngineRegistry) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "engine"]
        healthy = GaugeMetricFamily(
            "pdconnect_router_engine_healthy",
            "1 if the engine may get traffic now (polls and breaker agree)",
            labels=labels,
        )
        breaker_open = GaugeMetricFamily(
            "pdconnect_router_engine_breaker_open",
            "1 while the engine's circuit breaker is open or half-open",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "pdconnect_router_engine_in_flight", "Requests this router has open at the engine", labels=labels
        )
        failures = CounterMetricFamily(
            "pdconnect_router_engine_failures",
            "Failed requests (connect, timeout, 5xx, dropped) per engine",
            labels=labels,
        )
        opens = CounterMetricFamily(
            "pdconnect_router_engine_breaker_opens", "Times the engine's circuit breaker opened", labels=labels
        )
        for engine in self._engines.all_engines():
            values = [engine.role.value, engine.name]  # a data-parallel rank: <url>#dp<rank>
            healthy.add_metric(values, 1.0 if engine.routable else 0.0)
            breaker_open.add_metric(values, 0.0 if engine.breaker.state is BreakerState.CLOSED else 1.0)
            in_flight.add_metric(values, engine.in_flight)
            failures.add_metric(values, engine.failures)
            opens.add_metric(values, engine.breaker.opens)
        yield from (healthy, breaker_open, in_flight, failures, opens)


class _KVEventsCollector(Collector):
    """Per engine, the last KV-event batch the router's index took in (`KVEventsFeed.applied_sequences`)."""

    def __init__(self, sequences: Callable[[], Mapping[str, int]]) -> None:
        self._sequences = sequences

    def collect(self) -> Iterator[Metric]:
        last = GaugeMetricFamily(
            "pdconnect_router_kv_events_last_seq",
            "Sequence number of the last KV-event batch the engine's index took in (kv-aware policy); "
            "absent while the index is empty",
            labels=["engine"],
        )
        for url, seq in self._sequences().items():
            last.add_metric([url], float(seq))
        yield last


def _created_series() -> bool:
    """Whether prometheus_client emits `_created` series (PROMETHEUS_DISABLE_CREATED_SERIES)."""
    return bool(getattr(_prometheus_metrics, "_use_created", True))


class _CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _LoopCounter(Collector):
    """A labelled counter for the event loop thread only; renders as prometheus_client's."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _CounterChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _CounterChild()
        return child

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        created = _created_series()
        for values, child in self._children.items():
            family.add_metric(values, child.value, created=child.created if created else None)
        yield family


class _HistogramChild:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ends with +Inf
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        # The first bound >= value: prometheus' `le` bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _LoopHistogram(Collector):
    """A histogram (labelled or not) for the event loop thread only; renders as
    prometheus_client's. Unlabelled, it has its one series from the start, as theirs."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = (*buckets, math.inf) if buckets[-1] != math.inf else tuple(buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        if not self._labelnames:
            self.labels()
        registry.register(self)

    def labels(self, *values: str) -> _HistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """For an unlabelled histogram."""
        self._children[()].observe(value)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        created = _created_series()
        for values, child in self._children.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip(child.bounds, child.counts):
                cumulative += count
                # prometheus_client leaves floatToGoString unannotated.
                buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
            family.add_metric(values, buckets, child.sum)
            if created:
                family.samples.append(
                    Sample(self._name + "_created", dict(zip(self._labelnames, values)), child.created, None, None)
                )
        yield family


class RouterMetrics:
    """All router metrics; `render()` is the `/metrics` body."""

    def __init__(self, engines: EngineRegistry) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Updated by every request, on the loop thread: the lock-free kind.
        self.requests = _LoopCounter(
            "pdconnect_router_requests", "Requests by endpoint and final outcome", ["endpoint", "outcome"], r
        )
        self.prefill_seconds = _LoopHistogram(
            "pdconnect_router_prefill_seconds",
            "Prefill leg, successful attempt, send to parsed answer",
            [],
            _LATENCY_BUCKETS,
            r,
        )
        self.decode_seconds = _LoopHistogram(
            "pdconnect_router_decode_seconds", "Decode leg, send to last byte relayed", [], _LATENCY_BUCKETS, r
        )
        self.request_seconds = _LoopHistogram(
            "pdconnect_router_request_seconds", "Whole request as the router saw it", ["endpoint"], _LATENCY_BUCKETS, r
        )
        self.ttft_seconds = _LoopHistogram(
            "pdconnect_router_time_to_first_token_seconds",
            "Streaming requests: arrival to first decode chunk relayed",
            ["endpoint"],
            _LATENCY_BUCKETS,
            r,
        )
        self.retries = Counter(
            "pdconnect_router_retries",
            "Attempts sent to another engine after a failure",
            ["role", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pdconnect_router_fallbacks",
            "Requests served decode-only (local prefill) instead of P/D",
            ["reason"],
            registry=r,
        )
        self.affinity = _LoopCounter(
            "pdconnect_router_affinity",
            "Prefix-affinity placements: keep (same engine as the key's last "
            "request), move (another engine), new (key not seen recently)",
            ["role", "outcome"],
            r,
        )
        self.releases = Counter(
            "pdconnect_router_prefill_releases",
            "Release notices sent to prefill engines (client gone, decode failed)",
            ["result"],
            registry=r,
        )
        self.dns_failures = Counter("pdconnect_router_dns_failures", "Failed DNS re-resolutions", registry=r)
        self.kv_events = Counter(
            "pdconnect_router_kv_events",
            "KV event batches applied (ok), gaps, replays and errors (kv-aware policy)",
            ["result"],
            registry=r,
        )
        self.oversized_answers = Counter(
            "pdconnect_router_oversized_answers",
            "Engine answers over their size limit, dropped unread (leg: prefill = max_prefill_answer_bytes, "
            "decode = a whole answer over max_answer_bytes, event = one streamed event over max_event_bytes, "
            "error = an error body, models = a /v1/models answer, each over the router's own limit)",
            ["leg"],
            registry=r,
        )
        self.client_write_timeouts = Counter(
            "pdconnect_router_client_write_timeouts",
            "Client connections dropped because one write did not complete within client_write_timeout "
            "(a client that stopped reading)",
            registry=r,
        )
        self.health_errors = Counter(
            "pdconnect_router_health_errors",
            "Unexpected errors in the health monitor, logged; polling goes on",
            registry=r,
        )
        self.kv_events_invalid = Counter(
            "pdconnect_router_kv_events_invalid",
            "KV events, frames and blocks dropped unapplied, by reason (kv-aware policy)",
            ["reason"],
            registry=r,
        )
        # The decode-first decider (`decider.py`): every decided request's route and why,
        # what a full-attention-only reading would have chosen, and each decode-local hit
        # checked against the hit the engine reported.
        self.decode_routes = _LoopCounter(
            "pdconnect_router_decode_routes",
            "Decided requests by route (decode-first: no prefill leg; pd) and reason",
            ["route", "reason"],
            r,
        )
        self.decode_routes_full_attention_only = _LoopCounter(
            "pdconnect_router_decode_routes_full_attention_only",
            "The route a decider reading full-attention KV state alone would have chosen for the same requests",
            ["route"],
            r,
        )
        self.decode_local_hit_checks = _LoopCounter(
            "pdconnect_router_decode_local_hit_checks",
            "Decode-local requests whose engine reported its prefix-cache hit: the prediction matched, "
            "or was over or under what the engine found (a misprediction)",
            ["result"],
            r,
        )
        self.decode_first_prefill_tokens = _LoopCounter(
            "pdconnect_router_decode_first_prefill_tokens",
            "Prompt tokens the decider predicted a decode engine computes itself (requests on the local route)",
            [],
            r,
        )
        r.register(_EngineCollector(engines))
        # Labelled children, looked up once per label set.
        self._ends: dict[tuple[str, str], tuple[_CounterChild, _HistogramChild]] = {}
        self._ttft: dict[str, _HistogramChild] = {}
        self._placements: dict[tuple[str, str], _CounterChild] = {}

    def request_done(self, endpoint: str, outcome: str, seconds: float) -> None:
        children = self._ends.get((endpoint, outcome))
        if children is None:
            children = (self.requests.labels(endpoint, outcome), self.request_seconds.labels(endpoint))
            self._ends[(endpoint, outcome)] = children
        children[0].inc()
        children[1].observe(seconds)

    def first_token(self, endpoint: str, seconds: float) -> None:
        child = self._ttft.get(endpoint)
        if child is None:
            child = self._ttft[endpoint] = self.ttft_seconds.labels(endpoint)
        child.observe(seconds)

    def placement(self, role: str, outcome: str) -> None:
        child = self._placements.get((role, outcome))
        if child is None:
            child = self._placements[(role, outcome)] = self.affinity.labels(role, outcome)
        child.inc()

    def track_kv_events(self, sequences: Callable[[], Mapping[str, int]]) -> None:
        """Export, per engine, the last KV-event batch applied (`sequences`: the feed's, read at scrape time)."""
        self.registry.register(_KVEventsCollector(sequences))

    def render(self) -> bytes:
        return generate_latest(self.registry)
