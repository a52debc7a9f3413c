"""`make bench-handoff`'s pure pieces, no engine: percentiles read from histogram buckets, the
histogram's growth between two scrapes, and the tables, ratios and goal line it prints."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from benchmarks.handoff import (
    PATHS,
    Histogram,
    PathResult,
    PullMetrics,
    Pulls,
    TimedPulls,
    _parse_paths,
    format_bare,
    format_paths,
    format_pulls,
    goal,
    goal_beside_load,
    histogram_quantile,
    ratio,
)
from pdconnect.bench.loadgen import RoleCounters, StepResult
from pdconnect.bench.scrape import MetricsSnapshot, PrefixCacheCounters

INF = math.inf


def test_quantiles_interpolate_linearly_inside_the_bucket_that_holds_the_rank() -> None:
    # 10 observations: 2 <= 1 ms, 4 in (1, 2] ms, 4 in (2, 5] ms.
    buckets = ((0.001, 2.0), (0.002, 6.0), (0.005, 10.0), (INF, 10.0))
    # p50: rank 5 is the 3rd of 4 in (1, 2] ms -> 1 + 3/4 ms.
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.00175)
    # p99: rank 9.9 is 3.9 of 4 into (2, 5] ms -> 2 + 3 * 0.975 ms.
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.004925)
    # p10: rank 1 is half-way through the first bucket, which starts at 0.
    assert histogram_quantile(buckets, 0.1) == pytest.approx(0.0005)


def test_a_rank_in_the_inf_bucket_gives_the_largest_finite_bound_and_empty_is_nan() -> None:
    assert histogram_quantile(((0.01, 1.0), (0.1, 2.0), (INF, 4.0)), 0.9) == 0.1
    assert math.isnan(histogram_quantile(((0.01, 0.0), (INF, 0.0)), 0.5))
    assert math.isnan(histogram_quantile((), 0.5))


def _scrape(buckets: dict[str, float], count: float, total: float, ranges: float = 0.0) -> MetricsSnapshot:
    name = "pdconnect:transfer_seconds"
    samples: list[tuple[str, tuple[tuple[str, str], ...], float]] = [
        (f"{name}_bucket", (("engine", "0"), ("le", le)), v) for le, v in buckets.items()
    ]
    samples += [(f"{name}_count", (("engine", "0"),), count), (f"{name}_sum", (("engine", "0"),), total)]
    samples += [("pdconnect:ranges_transferred_total", (("engine", "0"),), ranges)]
    return MetricsSnapshot(tuple(samples))


def test_a_histogram_between_two_scrapes_holds_only_the_observations_in_between() -> None:
    before = _scrape({"0.001": 1.0, "0.002": 3.0, "+Inf": 3.0}, 3.0, 0.004)
    after = _scrape({"0.001": 1.0, "0.002": 5.0, "+Inf": 7.0}, 7.0, 0.024)
    h = Histogram.between(before, after, "pdconnect:transfer_seconds")
    assert h.buckets == ((0.001, 0.0), (0.002, 2.0), (INF, 4.0))
    assert (h.count, h.total) == (4.0, pytest.approx(0.02)) and h.mean == pytest.approx(0.005)
    # Nothing observed in between: no pulls to report.
    names = PullMetrics("pdconnect:transfer_seconds", "pdconnect:transfer_seconds")
    assert Pulls.between(after, after, names) is None


def test_ranges_per_pull_are_the_counters_growth_over_the_pulls_in_between() -> None:
    before = _scrape({"0.001": 1.0, "+Inf": 3.0}, 3.0, 0.004, ranges=144.0)
    after = _scrape({"0.001": 1.0, "+Inf": 7.0}, 7.0, 0.024, ranges=336.0)
    counted = PullMetrics("pdconnect:transfer_seconds", "pdconnect:transfer_seconds", "pdconnect:ranges_transferred")
    pulls = Pulls.between(before, after, counted)
    assert pulls is not None and pulls.ranges == 48.0  # (336 - 144) ranges over 4 pulls
    # A connector that does not count ranges (the stock one): one range per pull.
    uncounted = Pulls.between(before, after, PullMetrics("pdconnect:transfer_seconds", "pdconnect:transfer_seconds"))
    assert uncounted is not None and uncounted.ranges == 1.0


def test_ratios_are_a_over_b_and_say_when_there_is_nothing_to_divide() -> None:
    assert ratio(3.0, 2.0) == "1.50x"
    assert ratio(0.0, 0.0) == "-" and ratio(math.nan, 1.0) == "-" and ratio(1.0, 0.0) == "inf"


def _step(ok: int, hits: float, pulled: float, wall: float, ttfts: tuple[float, ...]) -> StepResult:
    decode = RoleCounters(engines=1, cache=PrefixCacheCounters(1000.0, hits, 1000.0, pulled))
    return StepResult(
        scenario="shared-prefix",
        step="s",
        requests=4,
        concurrency=2,
        output_len=8,
        ok=ok,
        fallbacks=0,
        prompt_tokens=0,
        output_tokens=0,
        duration_s=wall,
        ttft_s=ttfts,
        decode=decode,
        prefill=RoleCounters(engines=1),
    )


def _pulls(p50_bucket: float, mean_bytes: float, ranges: float = 48.0) -> Pulls:
    # Two pulls, both in (p50_bucket / 2, p50_bucket]: p50 is half-way up that bucket.
    seconds = Histogram(
        "pdconnect:transfer_seconds", ((p50_bucket / 2, 0.0), (p50_bucket, 2.0), (INF, 2.0)), 2.0, p50_bucket
    )
    return Pulls(seconds, Histogram("pdconnect:transfer_bytes", ((INF, 2.0),), 2.0, 2 * mean_bytes), ranges)


def _cells(table: str, row: int) -> list[str]:
    return re.split(r"\s{2,}", table.splitlines()[row])


def test_the_path_table_puts_each_figure_beside_its_ratio_to_the_stock_connector() -> None:
    results = [
        PathResult("stock-nixl", _step(4, 800.0, 2000.0, 10.0, (0.1, 0.2, 0.3, 0.4))),
        PathResult("ours-nixl", _step(4, 1600.0, 1000.0, 5.0, (0.05, 0.1, 0.15, 0.25))),
    ]
    table = format_paths(results)
    # TTFT p99 of 4 values: rank 3 x 0.99 = 2.97, so 0.3 + 0.97 x 0.1 and 0.15 + 0.97 x 0.1.
    assert _cells(table, 2) == ["stock-nixl", "4/4", "800", "2000", "10.0 s", "250 ms", "397 ms"]
    assert _cells(table, 3) == [
        "ours-nixl",
        "4/4",
        "1600 (2.00x)",
        "1000 (0.50x)",
        "5.0 s (0.50x)",
        "125 ms (0.50x)",
        "247 ms (0.62x)",
    ]
    # Without the stock path there is no baseline: figures alone.
    assert _cells(format_paths(results[1:]), 2)[2] == "1600"


def test_the_pull_table_and_goal_compare_in_engine_p50_with_nixl_and_bare_mooncake() -> None:
    step = _step(4, 0.0, 0.0, 1.0, (0.1,))
    results = [PathResult("ours-nixl", step, _pulls(0.004, 2e6)), PathResult("ours-mooncake", step, _pulls(0.008, 2e6))]
    bare = [
        TimedPulls("nixl", "bare", 2_000_000, 1, 10, 0.001, 0.002),
        TimedPulls("mooncake", "bare", 2_000_000, 1, 10, 0.002, 0.003),
    ]
    table = format_pulls(results, bare)
    # ours-nixl: p50 = 2 + 2 * 1/2 = 3 ms, p99 = 2 + 2 * 0.99 = 3.98 ms, bare 1 ms;
    # ours-mooncake: p50 = 4 + 4 * 1/2 = 6 ms, p99 = 7.96 ms, bare 2 ms.
    # Not served again beside bare pulls: "-".
    not_served_again = ["-"] * 5
    assert _cells(table, 2)[2:] == ["2", "2.00 MB", "48.0", "3.0 ms", "4.0 ms", "1.0 ms", "3.00x", *not_served_again]
    assert _cells(table, 3)[2:] == ["2", "2.00 MB", "48.0", "6.0 ms", "8.0 ms", "2.0 ms", "3.00x", *not_served_again]
    # 6 ms against max(3 ms NIXL, 2 ms bare Mooncake) = 2.00x: over 1.5x.
    met, line = goal(results, bare)
    assert met is False and "-> 2.00x of 3.0 ms; GOAL NOT MET" in line
    # p50 = 2.9 + 1.45 = 4.35 ms, 1.45x of 3 ms.
    faster = [results[0], PathResult("ours-mooncake", step, _pulls(0.0058, 2e6))]
    assert goal(faster, bare)[0] is True
    assert goal(results[:1], bare)[0] is None


def test_the_goal_beside_the_load_reads_in_engine_and_bare_pulls_from_the_same_serving() -> None:
    step = _step(4, 0.0, 0.0, 1.0, (0.1,))
    beside = TimedPulls("mooncake", "bare", 2_000_000, 13, 40, 0.005, 0.02)
    ours = TimedPulls("mooncake", "ours", 2_000_000, 13, 40, 0.0055, 0.03)
    # The measured step's figures (3 ms, 12 ms) differ from the second serving's (3 ms, 6 ms):
    # only the second serving is compared with the bare pulls made during it.
    results = [
        PathResult("ours-nixl", step, _pulls(0.004, 2e6), rerun=_pulls(0.004, 2e6)),
        PathResult(
            "ours-mooncake", step, _pulls(0.016, 2e6), beside=beside, rerun=_pulls(0.008, 2e6), ours_beside=ours
        ),
    ]
    # 6 ms against max(3 ms NIXL, 5 ms bare Mooncake in the same seconds) = 1.20x: within 1.5x.
    met, line = goal_beside_load(results)
    assert met is True and "-> 1.20x of 5.0 ms; MET" in line
    # Our transport outside an engine, in the same seconds: 5.5 ms, 1.10x the bare library.
    assert _cells(format_pulls(results, []), 3)[-5:] == ["6.0 ms", "5.0 ms", "1.20x", "5.5 ms", "1.10x"]
    beside_rows = [row for row in format_bare([], results).splitlines() if "beside ours-mooncake" in row]
    assert [row.split()[:2] for row in beside_rows] == [["mooncake", "bare"], ["mooncake", "ours"]]
    # Mooncake's second serving at 12 ms: 2.40x of 5 ms.
    slower = [results[0], replace(results[1], rerun=_pulls(0.016, 2e6))]
    assert goal_beside_load(slower)[0] is False
    # Without the bare pulls, the second serving's histogram or NIXL's, nothing is claimed.
    assert goal_beside_load([results[0], replace(results[1], beside=None)])[0] is None
    assert goal_beside_load([results[0], replace(results[1], rerun=None)])[0] is None
    assert goal_beside_load([replace(results[0], rerun=None), results[1]])[0] is None
    assert goal_beside_load(results[1:])[0] is None


def test_paths_are_a_known_comma_separated_subset_in_the_order_given() -> None:
    assert _parse_paths("colocated, ours-nixl") == ["colocated", "ours-nixl"]
    assert list(PATHS) == ["stock-nixl", "ours-nixl", "ours-mooncake", "colocated"]
    with pytest.raises(Exception, match="subset"):
        _parse_paths("ours-tcp")
