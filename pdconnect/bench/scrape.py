"""Read vLLM engines' Prometheus counters: one `/metrics` scrape, and the prefix-cache counters.

`pdconnect bench` subtracts two scrapes to get a step's hits; the local test rig
(`pdconnect.testbed`) uses the same reader. httpx only: no vLLM, no torch.

vLLM 0.32 counter names used here (see `vllm/v1/metrics/loggers.py`), all in tokens:
`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (local APC, recorded at
admission), `vllm:external_prefix_cache_queries`, `vllm:external_prefix_cache_hits`
(tokens a KV connector supplied), `vllm:prompt_tokens_by_source{source=...}`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import httpx

__all__ = [
    "ENGINE_KEEPALIVE_S",
    "MetricsSnapshot",
    "PrefixCacheCounters",
    "engine_client",
    "fetch_metrics",
]

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"

# vLLM's API server (uvicorn) closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE
# seconds (5 by default), and httpx keeps one for 5 s too: a request sent on a pooled
# connection just as the server closes it fails with "connection reset by peer". A client
# that gives connections up well before the server does never sends on a closing one.
ENGINE_KEEPALIVE_S = 2.0


def engine_client(timeout: float) -> httpx.Client:
    """An httpx client for talking to vLLM engines: pooled, but never past their keep-alive."""
    return httpx.Client(timeout=timeout, limits=httpx.Limits(keepalive_expiry=ENGINE_KEEPALIVE_S))


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape of `/metrics`: every sample as (sample name, labels, value)."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        from prometheus_client.parser import text_string_to_metric_families

        samples = tuple(
            (s.name, tuple(sorted(s.labels.items())), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """Sum of `name` over every label set matching `labels`.

        A counter may be named with or without its `_total` suffix (the exposition
        format adds it; vLLM's code does not): `total("vllm:prefix_cache_hits")`.
        """
        wanted = {name, f"{name}_total"}
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name in wanted and all(dict(sample_labels).get(k) == v for k, v in labels.items())
        )

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}


def fetch_metrics(base_url: str, client: httpx.Client | None = None) -> MetricsSnapshot:
    """Scrape `{base_url}/metrics`."""
    url = f"{base_url}/metrics"
    response = httpx.get(url, timeout=10.0) if client is None else client.get(url)
    response.raise_for_status()
    return MetricsSnapshot.parse(response.text)


@dataclass(frozen=True)
class PrefixCacheCounters:
    """vLLM's prefix-cache token counters; subtract two scrapes to get a request's share."""

    queries: float
    hits: float
    external_queries: float
    external_hits: float

    @classmethod
    def scrape(cls, base_url: str, client: httpx.Client | None = None) -> PrefixCacheCounters:
        return cls.from_snapshot(fetch_metrics(base_url, client))

    @classmethod
    def from_snapshot(cls, snapshot: MetricsSnapshot) -> PrefixCacheCounters:
        return cls(
            queries=snapshot.total(PREFIX_CACHE_QUERIES),
            hits=snapshot.total(PREFIX_CACHE_HITS),
            external_queries=snapshot.total(EXTERNAL_PREFIX_CACHE_QUERIES),
            external_hits=snapshot.total(EXTERNAL_PREFIX_CACHE_HITS),
        )

    def __sub__(self, other: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)}
        )
