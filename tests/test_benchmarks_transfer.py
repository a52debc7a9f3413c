"""`make bench-transfer`'s busy-caller table and bench-handoff's bare pulls, run small on real transports."""

from __future__ import annotations

import pytest

from benchmarks.handoff import BesidePuller, bare_pull
from benchmarks.transfer_speed import BUSY_RANGES, bench_busy_caller
from pdconnect.transfer import TRANSPORT_KINDS

pytestmark = [pytest.mark.transport, pytest.mark.timeout(300)]


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_the_busy_caller_table_has_a_row_per_range_count(kind: str) -> None:
    rows = bench_busy_caller(kind, repeats=2, step_s=0.002)
    assert [row.ranges for row in rows] == list(BUSY_RANGES)
    for row in rows:
        assert 0 < row.idle_p50_ms <= row.idle_p90_ms
        assert 0 < row.busy_p50_ms <= row.busy_p90_ms


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_bench_handoffs_bare_pull_moves_the_in_engine_pulls_bytes_in_as_many_ranges(kind: str) -> None:
    pull = bare_pull(kind, 3 << 19, repeats=2, ranges=48)
    assert (pull.ranges, pull.nbytes, pull.repeats) == (48, 48 * 32768, 2)
    assert 0 < pull.p50_s <= pull.p99_s


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_bench_handoffs_beside_puller_pulls_its_shape_from_begin_to_finish(kind: str) -> None:
    puller = BesidePuller(kind)
    try:
        puller.begin(13 * 65536, 13)
        # However long its peer takes to start, a begun puller pulls at least once with each client.
        pulls = puller.finish()
    finally:
        puller.close()
    assert pulls is not None
    assert [(p.transport, p.client, p.ranges, p.nbytes) for p in pulls] == [
        (kind, "bare", 13, 13 * 65536),
        (kind, "ours", 13, 13 * 65536),
    ]
    for pull in pulls:
        assert pull.repeats > 0 and 0 < pull.p50_s <= pull.p99_s


def test_a_beside_puller_stopped_before_it_began_reports_nothing() -> None:
    puller = BesidePuller("mooncake")
    try:
        assert puller.finish() is None
    finally:
        puller.close()
