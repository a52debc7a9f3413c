"""The connector's telemetry: counters collected by both halves, exported through vLLM's metrics hooks.

Both halves fill a `PDConnectorStats`; vLLM aggregates the workers' and the scheduler's
each step, ships the dict to the API server process, rebuilds it with
`PDConnector.build_kv_connector_stats` and hands it to `PDPromMetrics.observe`, which
increments the Prometheus series served on the engine's `/metrics`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTERS", "PDConnectorStats", "PDPromMetrics", "StatsRecorder"]

# Counter name -> help text. Names become `pdconnect:<name>_total` series.
COUNTERS: dict[str, str] = {
    "transfers": "KV loads completed successfully",
    "transfer_failures": "KV loads that failed (reported to vLLM as failed_recving)",
    "bytes_transferred": "Bytes pulled from prefill engines",
    "blocks_full_attention": "Full-attention blocks pulled",
    "blocks_tail": "Sliding-window tail blocks pulled (what stock connectors move)",
    "blocks_slack": "Sliding-window replay-slack blocks pulled (beyond the stock tail)",
    "slack_blocks_published": "Replay-slack blocks published into the decode prefix cache",
    "slack_blocks_held": "Replay-slack blocks held on the prefill engine for a decode engine",
    "slack_runs_dropped": "Replay-slack runs dropped because a block was gone before it could be held",
    "slack_skipped_pool_full": "Requests whose replay slack was skipped for lack of free blocks",
    "lease_expiries": "Prefill-side holds freed because no decode engine reported within the lease",
    "releases": "Prefill-side holds freed early on a release notice (client gone, decode aborted)",
    "handshake_refusals": "Side-channel handshakes refused (incompatible engine, wrong secret, unknown engine)",
    "notification_failures": "Heartbeat/done/release notices that did not reach the prefill engine",
    "bad_transfer_params": "Decode requests with malformed or mismatched kv_transfer_params",
}


@dataclass
class PDConnectorStats(KVConnectorStats):
    """Counters plus per-transfer samples; plain data so it can cross processes."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "transfer_seconds": [], "transfer_bytes": [], "transport": ""}

    def count(self, name: str, amount: float = 1) -> None:
        assert name in COUNTERS, name
        self.data["counters"][name] = self.data["counters"].get(name, 0) + amount

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_seconds"].append(seconds)
        self.data["transfer_bytes"].append(nbytes)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        for name, value in theirs.get("counters", {}).items():
            self.data["counters"][name] = self.data["counters"].get(name, 0) + value
        self.data["transfer_seconds"].extend(theirs.get("transfer_seconds", ()))
        self.data["transfer_bytes"].extend(theirs.get("transfer_bytes", ()))
        self.data["transport"] = self.data["transport"] or theirs.get("transport", "")
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = dict(self.data["counters"])
        seconds = self.data["transfer_seconds"]
        if seconds:
            summary["avg_transfer_ms"] = round(1000 * sum(seconds) / len(seconds), 3)
            summary["gbps"] = round(sum(self.data["transfer_bytes"]) / max(sum(seconds), 1e-9) / 1e9, 3)
        return summary

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["transfer_seconds"] or self.data["transport"])


class StatsRecorder:
    """A thread-safe accumulator handed out as a fresh `PDConnectorStats` each time it is taken.

    The side-channel thread counts refusals while the scheduler thread counts plans;
    `take()` swaps the accumulator under the lock so no increment is lost or doubled.
    """

    def __init__(self, transport: str = "") -> None:
        self._lock = threading.Lock()
        self._transport = transport
        self._stats = PDConnectorStats()
        self._announced = False

    def count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._stats.count(name, amount)

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._stats.observe_transfer(seconds, nbytes)

    def take(self) -> PDConnectorStats | None:
        with self._lock:
            stats, self._stats = self._stats, PDConnectorStats()
        if not self._announced and self._transport:
            # The transport really in use is reported once; the gauge keeps it.
            stats.data["transport"] = self._transport
            self._announced = True
        return None if stats.is_empty() else stats


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
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"pdconnect:{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self._seconds = create_metric_per_engine(
            self._histogram_cls(
                name="pdconnect:transfer_seconds",
                documentation="Duration of one request's KV load (handshake excluded)",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._bytes = create_metric_per_engine(
            self._histogram_cls(
                name="pdconnect:transfer_bytes",
                documentation="Bytes of one request's KV load",
                buckets=[2 ** (10 + 2 * i) for i in range(13)],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._transport = self._gauge_cls(
            name="pdconnect:transport_info",
            documentation="The transport really in use (1 for the active transport/protocol pair)",
            labelnames=[*labelnames, "transport"],
            multiprocess_mode="mostrecent",
        )
        self._labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._counters:
                self._counters[name][engine_idx].inc(value)
        for seconds in transfer_stats_data.get("transfer_seconds", ()):
            self._seconds[engine_idx].observe(seconds)
        for nbytes in transfer_stats_data.get("transfer_bytes", ()):
            self._bytes[engine_idx].observe(nbytes)
        if transport := transfer_stats_data.get("transport"):
            self._transport.labels(*self._labelvalues[engine_idx], transport).set(1)
