"""The connector's telemetry: counters collected by both halves, exported through vLLM's metrics hooks.

Both halves fill a `PDConnectorStats`; vLLM aggregates the workers' and the scheduler's
each step, ships the dict to the API server process, rebuilds it with
`PDConnector.build_kv_connector_stats` and hands it to `PDPromMetrics.observe`, which
increments the Prometheus series served on the engine's `/metrics`.

Bytes are also kept per tensor-parallel rank (`rank_bytes`, keyed by the rank as a string
so the dict survives msgpack and JSON): vLLM sums the workers' stats into one object, and a
total cannot show that each decode rank pulled its own share and no byte twice. They are
exported as `pdconnect:rank_bytes_transferred_total{tp_rank="r"}` (data-parallel ranks are
engines of their own: the `engine` label) and logged as `bytes_transferred_rank<r>`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from pdconnect.protocol import COMPAT_REASONS

_Metric = TypeVar("_Metric", Gauge, Counter, Histogram)

__all__ = ["COUNTERS", "GAUGES", "RANK_BYTES", "REASON_COUNTERS", "PDConnectorStats", "PDPromMetrics", "StatsRecorder"]

# Counter name -> help text. Names become `pdconnect:<name>_total` series.
COUNTERS: dict[str, str] = {
    "transfers": "KV loads completed successfully",
    "transfer_failures": "KV loads that failed (reported to vLLM as failed_recving)",
    "bytes_transferred": "Bytes pulled from prefill engines",
    "ranges_transferred": "Byte ranges pulled (one per layer and run of adjacent blocks)",
    "blocks_full_attention": "Full-attention blocks pulled",
    "blocks_tail": "Sliding-window tail blocks pulled (what stock connectors move)",
    "blocks_slack": "Sliding-window replay-slack blocks pulled (beyond the stock tail)",
    "slack_blocks_published": "Replay-slack blocks published into the decode prefix cache",
    "slack_blocks_held": "Replay-slack blocks held on the prefill engine for a decode engine",
    "slack_runs_dropped": "Replay-slack runs dropped because a block was gone before it could be held",
    "slack_skipped_pool_full": "Requests whose replay slack was skipped for lack of free blocks",
    "lease_expiries": "Prefill-side holds freed because no decode engine reported within the lease",
    "releases": "Prefill-side holds freed early on a release notice (client gone, decode aborted)",
    "handoffs_refused": "Prefill requests not handed off: the side-channel desk process was gone",
    "handshake_refusals": "Side-channel handshakes refused (incompatible engine, wrong secret, unknown engine)",
    "notification_failures": "Heartbeat/done/release notices that did not reach the prefill engine",
    "bad_transfer_params": "Decode requests whose well-typed plan this engine refused (another prompt, engine, lease)",
    "invalid_transfer_params": "Requests whose kv_transfer_params had wrong JSON types: ignored, computed locally",
    "leases_lost": "Decode loads failed because the prefill engine no longer held (or refused) the lease",
    "claim_retries": "Lease claims sent again because the prefill engine did not answer in time",
    "coalesced_waits": "Decode requests that waited for a sibling's load instead of pulling the same blocks",
    "coalesce_timeouts": "Decode requests that stopped waiting for a sibling's load after coalesce_wait_seconds",
    "notifier_callback_errors": "Errors raised while handling a prefill engine's reply to a notice (logged)",
    "notifier_errors": "Unexpected errors in a notifier round (logged; the notifier keeps running)",
    "notifier_overflow": "Notices sent through the shared overflow worker (more prefill peers than max_peers)",
    # The prefill engine's side-channel server (pdconnect.sidechannel.SERVER_COUNTERS).
    "side_channel_received": "Side-channel messages that passed the envelope checks",
    "side_channel_refused_frames": "Side-channel messages refused for their frame count",
    "side_channel_refused_malformed": "Side-channel messages refused as malformed",
    "side_channel_refused_version": "Side-channel messages refused for their protocol version",
    "side_channel_refused_unauthenticated": "Side-channel messages refused: missing or wrong signature",
    "side_channel_refused_forbidden": "Side-channel messages refused: a role sending what it may not",
    "side_channel_refused_stale": "Side-channel messages refused: timestamp outside the allowed age",
    "side_channel_refused_replayed": "Side-channel messages refused: nonce seen before (replay)",
    "side_channel_refused_overloaded": "Side-channel messages refused: replay guard full",
    "side_channel_refused_wrong_engine": "Side-channel lease messages refused: they name another prefill engine",
    "side_channel_dropped_over_budget": "Side-channel messages dropped unread: their connection was refused too often",
    "side_channel_connections_over_host_limit": (
        "Side-channel connections closed on arrival: their host held side_channel_max_connections_per_host"
    ),
    "side_channel_connections_over_limit": (
        "Side-channel connections closed on arrival: the server held side_channel_max_connections"
    ),
    "side_channel_connections_closed": (
        "Side-channel connections closed, by their peer, a cut or an error (every close counts)"
    ),
    "side_channel_handler_errors": "Side-channel handler errors (logged; the server keeps serving)",
    "side_channel_serve_errors": "Side-channel serving-loop errors (logged; the server keeps serving)",
    "side_channel_late_rounds": (
        "Side-channel serving rounds that began a second or more late: every peer's messages waited"
    ),
}

# Counters with a `reason` label: name -> (help text, the reasons it may count). Names
# become `pdconnect:<name>_total{reason=...}`; the reasons are a fixed set, never peer text.
REASON_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "compat_refusals": (
        "Decode requests refused because the prefill engine's compat record differs, by the first differing field",
        COMPAT_REASONS,
    ),
}

# Gauge name -> help text; the latest value is exported as `pdconnect:<name>`.
GAUGES: dict[str, str] = {
    "blocks_held": "KV blocks the connector holds an extra reference on (prefill slack and leases, decode shadows)",
}


# The per-rank byte counter: `pdconnect:<RANK_BYTES>_total{..., tp_rank="r"}`.
RANK_BYTES = "rank_bytes_transferred"


@dataclass
class PDConnectorStats(KVConnectorStats):
    """Counters plus per-transfer samples; plain data so it can cross processes."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {
            "counters": {},
            "gauges": {},
            "transfer_seconds": [],
            "transfer_bytes": [],
            "transport": "",
            "rank_bytes": {},
        }

    def count(self, name: str, amount: float = 1) -> None:
        assert name in COUNTERS, name
        self.data["counters"][name] = self.data["counters"].get(name, 0) + amount

    def set_gauge(self, name: str, value: float) -> None:
        assert name in GAUGES, name
        self.data.setdefault("gauges", {})[name] = value

    def count_reason(self, name: str, reason: str, amount: float = 1) -> None:
        assert name in REASON_COUNTERS and reason in REASON_COUNTERS[name][1], (name, reason)
        by_reason = self.data.setdefault("reasons", {}).setdefault(name, {})
        by_reason[reason] = by_reason.get(reason, 0) + amount

    def observe_transfer(self, seconds: float, nbytes: int, tp_rank: int | None = None) -> None:
        """One finished load; with `tp_rank`, its bytes are also counted for that rank."""
        self.data["transfer_seconds"].append(seconds)
        self.data["transfer_bytes"].append(nbytes)
        if tp_rank is not None:
            ranks = self.data.setdefault("rank_bytes", {})
            ranks[str(tp_rank)] = ranks.get(str(tp_rank), 0) + nbytes

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        for name, value in theirs.get("counters", {}).items():
            self.data["counters"][name] = self.data["counters"].get(name, 0) + value
        # Gauges are per engine, set by the scheduler half alone: the latest value wins.
        self.data.setdefault("gauges", {}).update(theirs.get("gauges", {}))
        for name, by_reason in theirs.get("reasons", {}).items():
            ours = self.data.setdefault("reasons", {}).setdefault(name, {})
            for reason, value in by_reason.items():
                ours[reason] = ours.get(reason, 0) + value
        self.data["transfer_seconds"].extend(theirs.get("transfer_seconds", ()))
        self.data["transfer_bytes"].extend(theirs.get("transfer_bytes", ()))
        self.data["transport"] = self.data["transport"] or theirs.get("transport", "")
        ranks = self.data.setdefault("rank_bytes", {})
        for rank, nbytes in theirs.get("rank_bytes", {}).items():
            ranks[rank] = ranks.get(rank, 0) + nbytes
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = dict(self.data["counters"])
        summary.update(self.data.get("gauges", {}))
        for name, by_reason in self.data.get("reasons", {}).items():
            summary.update({f"{name}[{reason}]": value for reason, value in by_reason.items()})
        seconds = self.data["transfer_seconds"]
        if seconds:
            summary["avg_transfer_ms"] = round(1000 * sum(seconds) / len(seconds), 3)
            summary["gbps"] = round(sum(self.data["transfer_bytes"]) / max(sum(seconds), 1e-9) / 1e9, 3)
        for rank, nbytes in sorted(self.data.get("rank_bytes", {}).items(), key=lambda item: int(item[0])):
            summary[f"bytes_transferred_rank{rank}"] = nbytes
        return summary

    def is_empty(self) -> bool:
        return not (
            self.data["counters"]
            or self.data.get("gauges")
            or self.data.get("reasons")
            or self.data["transfer_seconds"]
            or self.data["transport"]
        )


class StatsRecorder:
    """A thread-safe accumulator handed out as a fresh `PDConnectorStats` each time it is taken.

    The side-channel thread counts refusals while the scheduler thread counts plans;
    `take()` swaps the accumulator under the lock so no increment is lost or doubled.
    """

    def __init__(self, transport: str = "", tp_rank: int | None = None) -> None:
        self._lock = threading.Lock()
        self._transport = transport
        self._tp_rank = tp_rank  # a worker's: its transfers' bytes are counted per rank too
        self._stats = PDConnectorStats()
        self._announced = False
        self._gauges_reported: dict[str, float] = {}

    def count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._stats.count(name, amount)

    def set_gauge(self, name: str, value: float) -> None:
        """Report a gauge's value; sent only when it changed since it was last taken."""
        with self._lock:
            if self._gauges_reported.get(name) != value:
                self._stats.set_gauge(name, value)

    def count_reason(self, name: str, reason: str, amount: float = 1) -> None:
        with self._lock:
            self._stats.count_reason(name, reason, amount)

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._stats.observe_transfer(seconds, nbytes, self._tp_rank)

    def take(self) -> PDConnectorStats | None:
        with self._lock:
            stats, self._stats = self._stats, PDConnectorStats()
            self._gauges_reported.update(stats.data.get("gauges", {}))
        if not self._announced and self._transport:
            # The transport really in use is reported once; the gauge keeps it.
            stats.data["transport"] = self._transport
            self._announced = True
        return None if stats.is_empty() else stats


def _per_engine(metric: _Metric, per_engine_labelvalues: dict[int, list[object]]) -> dict[int, _Metric]:
    """vLLM's `create_metric_per_engine`, typed: the children of a histogram are histograms."""
    return cast("dict[int, _Metric]", create_metric_per_engine(metric, per_engine_labelvalues))


class PDPromMetrics(KVConnectorPromMetrics):
    """Prometheus series for `PDConnectorStats`, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types each of its classes as any of the three kinds (a dict type cannot say that
        # metric_types maps each kind to a class of that kind, its own or Ray's wrapper).
        counter_cls = cast("type[Counter]", self._counter_cls)
        gauge_cls = cast("type[Gauge]", self._gauge_cls)
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        self._counters = {
            name: _per_engine(
                counter_cls(name=f"pdconnect:{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self._seconds = _per_engine(
            histogram_cls(
                name="pdconnect:transfer_seconds",
                documentation="Duration of one request's KV load (handshake excluded)",
                # Fine below 100 ms, where a healthy pull lands, so percentiles read from
                # the buckets compare transports (benchmarks/handoff.py does).
                buckets=[
                    0.0005,
                    0.001,
                    0.002,
                    0.003,
                    0.005,
                    0.0075,
                    0.01,
                    0.015,
                    0.02,
                    0.03,
                    0.05,
                    0.075,
                    0.1,
                    0.15,
                    0.25,
                    0.5,
                    1.0,
                    2.5,
                    5.0,
                    10.0,
                    30.0,
                ],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._bytes = _per_engine(
            histogram_cls(
                name="pdconnect:transfer_bytes",
                documentation="Bytes of one request's KV load",
                buckets=[2 ** (10 + 2 * i) for i in range(13)],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._transport = gauge_cls(
            name="pdconnect:transport_info",
            documentation="The transport really in use (1 for the active transport/protocol pair)",
            labelnames=[*labelnames, "transport"],
            multiprocess_mode="mostrecent",
        )
        self._gauges = {
            name: _per_engine(
                gauge_cls(
                    name=f"pdconnect:{name}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
                ),
                per_engine_labelvalues,
            )
            for name, doc in GAUGES.items()
        }
        self._by_reason = {
            name: counter_cls(name=f"pdconnect:{name}", documentation=doc, labelnames=[*labelnames, "reason"])
            for name, (doc, _reasons) in REASON_COUNTERS.items()
        }
        self._rank_bytes = counter_cls(
            name=f"pdconnect:{RANK_BYTES}",
            documentation="Bytes pulled from prefill engines, per tensor-parallel rank of this engine",
            labelnames=[*labelnames, "tp_rank"],
        )
        self._labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._counters:
                self._counters[name][engine_idx].inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                self._gauges[name][engine_idx].set(value)
        for seconds in transfer_stats_data.get("transfer_seconds", ()):
            self._seconds[engine_idx].observe(seconds)
        for nbytes in transfer_stats_data.get("transfer_bytes", ()):
            self._bytes[engine_idx].observe(nbytes)
        for name, by_reason in transfer_stats_data.get("reasons", {}).items():
            if name in self._by_reason:
                for reason, value in by_reason.items():
                    if reason in REASON_COUNTERS[name][1]:
                        self._by_reason[name].labels(*self._labelvalues[engine_idx], reason).inc(value)
        for rank, nbytes in transfer_stats_data.get("rank_bytes", {}).items():
            self._rank_bytes.labels(*self._labelvalues[engine_idx], rank).inc(nbytes)
        if transport := transfer_stats_data.get("transport"):
            self._transport.labels(*self._labelvalues[engine_idx], transport).set(1)
