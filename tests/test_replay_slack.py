"""The replay-slack planner against the installed vLLM's real KV cache manager and block pool (0.32 and 0.33).

Each case computes a prompt on a colocated manager (one step and chunked), loads it on a
decode-side manager that receives exactly the plan's transfer set, and compares what both
cache and what a sibling hits. The stock-tail variant shows the bug the slack fixes.
"""

from __future__ import annotations

import random

import pytest

from connectors.kvsim import SimulatedEngine, random_tokens
from connectors.replay_slack import plan_request
from connectors.vllm_adapter import CacheRules, Geometry, GroupGeometry
from tests.geometries import GEOMETRIES

SWA = 1  # group id of the sliding-window group in every geometry below


def _geometry(fa: int, swa: int, window: int, eagle: bool) -> Geometry:
    return Geometry(
        (
            GroupGeometry("full_attention", fa, eagle=eagle),
            GroupGeometry("sliding_window", swa, window, eagle=eagle),
        )
    )


FIXED_LENGTHS = [5119, 5120, 5131, 5376, 5377]
SAMPLED_LENGTHS = sorted(random.Random(20261129).sample(range(300, 65_601), 4))
LENGTHS = FIXED_LENGTHS + SAMPLED_LENGTHS
SIBLING_SUFFIX = 64

CASES = [
    pytest.param(name, eagle, n, id=f"{name}-{'eagle' if eagle else 'no-eagle'}-{n}")
    for name in GEOMETRIES
    for eagle in (True, False)
    for n in LENGTHS
]


def _setup(name: str, eagle: bool, n: int):
    geometry = _geometry(*GEOMETRIES[name], eagle=eagle)
    rules = CacheRules.for_geometry(geometry)
    return geometry, plan_request(rules, n, expected_hits=True)


def _colocated(geometry: Geometry, tokens: list[int], chunk: int | None) -> tuple[SimulatedEngine, object]:
    engine = SimulatedEngine.create(geometry, len(tokens) + SIBLING_SUFFIX)
    request = engine.new_request("x", tokens)
    engine.prefill(request, chunk)
    engine.finish_for_transfer(request)
    engine.free(request)
    return engine, request


@pytest.mark.parametrize("chunk", [None, 1000, 2048], ids=["one-step", "chunk1000", "chunk2048"])
@pytest.mark.parametrize(("name", "eagle", "n"), CASES)
def test_colocated_engine_caches_exactly_the_planned_sliding_window_blocks(name, eagle, n, chunk):
    geometry, plan = _setup(name, eagle, n)
    engine, request = _colocated(geometry, random_tokens(n, seed=n), chunk)
    swa = plan.groups[SWA]

    cached = engine.cached_indices(request, SWA)

    assert cached == set(swa.cached_blocks)
    assert cached == set(swa.slack_blocks) | (cached & set(swa.tail_blocks))
    assert not set(swa.slack_blocks) & set(swa.tail_blocks)


@pytest.mark.parametrize(("name", "eagle", "n"), CASES)
def test_decode_with_planned_transfer_set_hits_like_a_colocated_engine(name, eagle, n):
    geometry, plan = _setup(name, eagle, n)
    tokens = random_tokens(n + SIBLING_SUFFIX, seed=n)
    prompt, sibling = tokens[:n], tokens

    colocated, _ = _colocated(geometry, prompt, chunk=None)
    decode = SimulatedEngine.create(geometry, len(sibling))
    x = decode.new_request("x", prompt)
    decode.remote_load(x, plan)

    # The core allocated exactly the planned tail for the external tokens.
    assert decode.real_table_indices(x, SWA) == list(plan.groups[SWA].tail_blocks)
    assert decode.cached_indices(x, SWA) == colocated.cached_indices(x, SWA)
    decode.free(x)

    for label, tokens_, expected in (
        ("extension", sibling, plan.expected_sibling_hit_tokens),
        ("resend", prompt, plan.expected_resend_hit_tokens),
    ):
        colocated_hit = colocated.lookup(colocated.new_request(f"c-{label}", tokens_))
        decode_hit = decode.lookup(decode.new_request(f"d-{label}", tokens_))
        assert decode_hit == colocated_hit == expected, label


@pytest.mark.parametrize(("name", "eagle", "n"), CASES)
def test_stock_tail_only_transfer_loses_the_decode_side_hit(name, eagle, n):
    geometry, plan = _setup(name, eagle, n)
    tokens = random_tokens(n + SIBLING_SUFFIX, seed=n)
    decode = SimulatedEngine.create(geometry, len(tokens))
    x = decode.new_request("x", tokens[:n])

    decode.remote_load(x, plan, publish_slack=False)
    decode.free(x)
    hit = decode.lookup(decode.new_request("sibling", tokens))

    if plan.groups[SWA].slack_blocks:
        assert hit < plan.expected_sibling_hit_tokens
    else:
        assert hit == plan.expected_sibling_hit_tokens


def test_worked_example_5131_tokens_needs_blocks_74_to_76_and_hits_4864():
    geometry, plan = _setup("fa256-swa64-w128", True, 5131)
    swa = plan.groups[SWA]
    assert swa.tail_blocks == (78, 79, 80)
    assert swa.slack_blocks == (74, 75, 76)
    assert swa.transfer_blocks == (74, 75, 76, 78, 79, 80)
    assert plan.expected_sibling_hit_tokens == 4864

    tokens = random_tokens(5131 + SIBLING_SUFFIX, seed=1)
    stock = SimulatedEngine.create(geometry, len(tokens))
    x = stock.new_request("x", tokens[:5131])
    stock.remote_load(x, plan, publish_slack=False)
    stock.free(x)
    assert stock.lookup(stock.new_request("sibling", tokens)) == 0


@pytest.mark.parametrize(
    ("eagle", "n", "slack"),
    [
        (True, 5120, (70, 71, 72, 74, 75, 76)),  # block-aligned: resend and extension boundaries
        (False, 5131, ()),  # run 78-79 lies inside the tail
        (False, 5376, (78, 79)),  # tail 82-83: the stock clip misses it without EAGLE too
    ],
)
def test_slack_depends_on_eagle_and_prompt_length(eagle, n, slack):
    _, plan = _setup("fa256-swa64-w128", eagle, n)
    assert plan.groups[SWA].slack_blocks == slack


def test_slack_off_plans_only_the_tail():
    rules = CacheRules.for_geometry(_geometry(256, 64, 128, eagle=True))
    plan = plan_request(rules, 5131, replay_slack=False)
    assert plan.groups[SWA].transfer_blocks == plan.groups[SWA].tail_blocks == (78, 79, 80)
    assert plan.slack_block_count == 0


def test_full_attention_group_transfers_every_prompt_block():
    _, plan = _setup("fa256-swa64-w128", True, 5131)
    fa = plan.groups[0]
    assert fa.transfer_blocks == tuple(range(21)) and fa.slack_blocks == () and fa.publish_blocks == ()
