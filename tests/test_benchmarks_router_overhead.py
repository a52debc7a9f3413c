"""bench-router's interleaving: a router's latency block is slower right after some other
target's block, so no target may always follow the same one."""

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
