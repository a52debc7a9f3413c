"""Bytes pulled per decode rank survive vLLM's own aggregation, its msgpack hop, its logger and Prometheus.

Each TP worker's `StatsRecorder` counts its own rank's bytes; vLLM's `KVOutputAggregator`
sums the workers' stats into one object each step, the engine core ships its dict to the
API server through vLLM's `MsgpackEncoder`, where `KVConnectorLogging` accumulates it for
the log line and `PDPromMetrics` (built on vLLM's `KVConnectorPromMetrics`) counts it per
`engine` and `tp_rank`. All of those are vLLM's real classes; only the registry is fresh.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from connectors.stats import PDConnectorStats, PDPromMetrics, StatsRecorder

# What each rank pulled in one step (rank 1 pulled twice): distinct, so a swap shows.
PULLS = {0: [4096], 1: [8192, 1024]}


def _worker_output(recorder: StatsRecorder) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(kv_connector_stats=recorder.take())
    )


def _one_step() -> dict[str, Any]:
    """Two TP workers' stats through vLLM's aggregator, the scheduler's added, then vLLM's msgpack hop."""
    recorders = {rank: StatsRecorder("mooncake/tcp", tp_rank=rank) for rank in PULLS}
    for rank, pulls in PULLS.items():
        for nbytes in pulls:
            recorders[rank].observe_transfer(0.01, nbytes)
            recorders[rank].count("bytes_transferred", nbytes)
    aggregated = KVOutputAggregator(expected_finished_count=len(PULLS)).aggregate(
        [_worker_output(recorders[rank]) for rank in sorted(PULLS)]
    )
    assert aggregated is not None and aggregated.kv_connector_output is not None
    stats = aggregated.kv_connector_output.kv_connector_stats
    assert isinstance(stats, PDConnectorStats)
    scheduler = StatsRecorder()  # the scheduler half has no rank
    scheduler.count("transfers", 3)
    scheduler_stats = scheduler.take()
    assert scheduler_stats is not None
    stats = stats.aggregate(scheduler_stats)
    decoded: dict[str, Any] = MsgpackDecoder(dict).decode(MsgpackEncoder().encode(stats.data))
    return decoded


def test_each_rank_keeps_its_own_bytes_through_vllms_aggregation_and_log_line():
    data = _one_step()
    assert data["rank_bytes"] == {"0": 4096, "1": 9216}
    assert data["counters"]["bytes_transferred"] == 4096 + 9216  # the total is unchanged

    config = KVTransferConfig(
        kv_connector="PDConnector", kv_connector_module_path="connectors.pd_connector", kv_role="kv_both"
    )
    logging = KVConnectorLogging(config)
    logging.observe(data)
    logging.observe(_one_step())  # the next step: the logger adds them up per rank
    assert logging.transfer_stats_accumulator is not None
    summary = logging.transfer_stats_accumulator.reduce()
    assert (summary["bytes_transferred_rank0"], summary["bytes_transferred_rank1"]) == (8192, 18432)


class _Fresh:
    """prometheus_client's classes bound to a registry of the test's own (vLLM's are global)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry

        class FreshCounter(Counter):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["registry"] = registry
                super().__init__(*args, **kwargs)

        class FreshGauge(Gauge):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["registry"] = registry
                super().__init__(*args, **kwargs)

        class FreshHistogram(Histogram):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["registry"] = registry
                super().__init__(*args, **kwargs)

        self.types: dict[Any, Any] = {Counter: FreshCounter, Gauge: FreshGauge, Histogram: FreshHistogram}


class _Config:
    kv_transfer_config = None


def test_prometheus_counts_bytes_per_engine_and_tp_rank():
    fresh = _Fresh()
    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    metrics = PDPromMetrics(_Config(), fresh.types, ["model_name", "engine"], labels)
    metrics.observe(_one_step(), engine_idx=1)  # a data-parallel rank is an engine of its own
    metrics.observe(_one_step(), engine_idx=1)

    def rank_bytes(engine: str, rank: str) -> float | None:
        return fresh.registry.get_sample_value(
            "pdconnect:rank_bytes_transferred_total", {"model_name": "tiny", "engine": engine, "tp_rank": rank}
        )

    assert (rank_bytes("1", "0"), rank_bytes("1", "1")) == (8192, 18432)
    assert rank_bytes("0", "0") is None  # engine 0 pulled nothing
    total = fresh.registry.get_sample_value("pdconnect:bytes_transferred_total", {"model_name": "tiny", "engine": "1"})
    assert total == 8192 + 18432


def test_stats_without_a_rank_count_no_rank_bytes():
    recorder = StatsRecorder()  # the scheduler half, or a worker built before it knows its rank
    recorder.observe_transfer(0.01, 100)
    taken = recorder.take()
    assert taken is not None and taken.data["rank_bytes"] == {}
    assert "bytes_transferred_rank0" not in taken.reduce()
