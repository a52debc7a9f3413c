"""bench-router: its interleaving (a router's latency block is slower right after some other
target's block, so no target may always follow the same one), the intervals of its
added-latency ratios, and its span sink."""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import pytest

from benchmarks.router_overhead import added_ratio_intervals, round_orders, sample_ratios


# 3: direct, ours, vllm-router; 5: --observed (direct, ours plain and at two sample ratios, vllm-router)
@pytest.mark.parametrize("targets", [3, 4, 5])
def test_latency_rounds_let_every_target_follow_every_other_equally_often(targets: int) -> None:
    orders = round_orders(targets)
    count = math.factorial(targets)
    assert sorted(orders) == sorted({tuple(o) for o in orders}) and len(orders) == count  # every order once
    sequence = [target for order in orders for target in order]
    follows = Counter(zip(sequence, sequence[1:] + sequence[:1]))  # the cycle repeats
    assert all(a != b for a, b in follows)  # never a target after itself, junctions included
    pairs = targets * (targets - 1)
    assert set(follows.values()) == {len(sequence) // pairs} and len(follows) == pairs


def test_two_targets_alternate_which_goes_first() -> None:
    assert round_orders(2) == [(0, 1), (1, 0)]


def _rounds(
    added: float, slow: dict[int, float], rng: random.Random, rounds: int = 200, block: int = 25
) -> dict[int, list[float]]:
    """Latencies in seconds: a 1 ms floor with jitter plus `added`, every request of a
    round in `slow` that many times longer (the shared machine's slow stretch)."""
    return {
        r: [(0.001 + rng.expovariate(1 / 0.0002) + added) * slow.get(r, 1.0) for _ in range(block)]
        for r in range(rounds)
    }


def test_a_router_adding_half_as_much_gets_an_interval_around_half() -> None:
    """Slow stretches hit every target of a round (some rounds 3x slower): resampled by
    whole rounds, the p99 ratio stays near the truth (0.5). Resampled per target (rounds
    drawn apart), the slow rounds land in one target's draw and not another's, and the
    interval would spread far wider."""
    rng = random.Random(7)
    slow = dict.fromkeys(rng.sample(range(200), 4), 3.0)
    direct, ref, ours = (_rounds(added, slow, rng) for added in (0.0, 0.0004, 0.0002))
    spans = added_ratio_intervals(direct, ref, {"ours": ours}, draws=400)["ours"]
    for q in (0.5, 0.99):
        span = spans[q]
        assert span is not None
        low, high = span
        assert 0.3 < low < 0.5 < high < 0.75, (q, span)


def test_a_router_like_the_reference_gets_an_interval_holding_one() -> None:
    rng = random.Random(11)
    direct, ref, ours = (_rounds(added, {}, rng) for added in (0.0, 0.0003, 0.0003))
    for q, span in added_ratio_intervals(direct, ref, {"ours": ours}, draws=400)["ours"].items():
        assert span is not None and span[0] < 1.0 < span[1], (q, span)


def test_no_interval_where_the_reference_adds_nothing() -> None:
    rng = random.Random(3)
    direct, ours = _rounds(0.0, {}, rng), _rounds(0.0002, {}, rng)
    assert added_ratio_intervals(direct, direct, {"ours": ours}, draws=50) == {"ours": {0.5: None, 0.99: None}}


def test_the_observed_span_sink_counts_what_a_router_exports() -> None:
    """`--observed`'s receiver, a process apart from the load generator, counts the spans of
    the SDK's OTLP/HTTP exports (here: the router's `Tracing`, two requests of two spans)
    and refuses a body that is not an export."""
    import httpx

    from benchmarks.router_overhead import _span_sink
    from pdconnect.router.tracing import Tracing
    from tests.waiting import wait_until

    with _span_sink() as (url, received):
        tracing = Tracing(url, ratio=1.0)
        for _ in range(2):
            spans = tracing.start({}, "POST /v1/completions")
            spans.leg("decode", "http://d:1", 0).end(True)
            spans.end(200, "ok")
        tracing.close()  # exports what is buffered
        wait_until(lambda: received() == 4, "the sink to count 4 spans", observe=received)
        assert httpx.post(url, content=b"\xff\xff\xff").status_code == 400
        assert received() == 4


def test_sample_ratios_are_one_or_two_distinct_shares() -> None:
    assert sample_ratios("0.1") == (0.1,)
    assert sample_ratios("1,0.1,1.0") == (1.0, 0.1)  # a ratio named twice runs once
    for bad in ("", "0.1,x", "1.5", "-0.1", "0,0.5,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            sample_ratios(bad)
