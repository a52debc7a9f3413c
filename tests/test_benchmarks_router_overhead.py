"""bench-router: its interleaving (a router's latency block is slower right after some other
target's block, so no target may always follow the same one), and its span sink."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from benchmarks.router_overhead import round_orders


@pytest.mark.parametrize("targets", [3, 4])  # 4: --observed (direct, ours at two ratios, vllm-router)
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
