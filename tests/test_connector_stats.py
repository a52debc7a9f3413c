"""The connector's metrics: every counter a component reports has a Prometheus series; gauges survive aggregation."""

from __future__ import annotations

from connectors.stats import COUNTERS, PDConnectorStats, StatsRecorder
from pdconnect.sidechannel import SERVER_COUNTERS


def test_every_side_channel_server_counter_is_exported():
    # The scheduler half exports `server.counts()` as `side_channel_<name>`; a name missing
    # here would fail an assertion on the scheduler thread.
    assert {f"side_channel_{name}" for name in SERVER_COUNTERS} <= set(COUNTERS)


def test_notifier_counters_are_exported():
    assert {"notification_failures", "notifier_callback_errors", "notifier_errors", "notifier_overflow"} <= set(
        COUNTERS
    )


def test_blocks_held_gauge_is_reported_when_it_changes_and_back_to_zero():
    recorder = StatsRecorder()
    recorder.set_gauge("blocks_held", 0)
    first = recorder.take()
    assert first is not None and first.data["gauges"] == {"blocks_held": 0}
    recorder.set_gauge("blocks_held", 0)
    assert recorder.take() is None  # unchanged: nothing to send
    recorder.set_gauge("blocks_held", 5)
    recorder.take()
    recorder.set_gauge("blocks_held", 0)
    last = recorder.take()
    assert last is not None and last.data["gauges"] == {"blocks_held": 0}


def test_gauges_survive_aggregation_across_halves():
    scheduler, worker = PDConnectorStats(), PDConnectorStats()
    scheduler.set_gauge("blocks_held", 3)
    worker.count("transfers")
    merged = worker.aggregate(scheduler)
    assert merged.reduce() == {"transfers": 1, "blocks_held": 3}
