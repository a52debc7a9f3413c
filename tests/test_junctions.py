"""Shared-prefix junctions: every later sibling hits on decode what it hits on a colocated engine, in any arrival order.

vLLM keeps sliding-window blocks at a request's replay boundaries and at its shared-prefix
junction (`Request.shared_prefix_boundary`: where the full-attention hit ran past the
sliding window's). A colocated engine therefore serves the third sibling of a prefix even
when each sibling's suffix is longer than a block; a decode engine serves it only if the
plan moved and published the junction's run too. Every expected hit here is measured on
a real vLLM `KVCacheManager` serving the same sequence colocated (`kvsim.SimulatedEngine`); the
P/D side is a real prefill manager and a real decode manager holding only what each
request's plan moves (`kvsim.PrefillDecodePair`).

What a sibling hits depends on the order siblings arrive in, colocated as well: a prompt
that runs a block or more past the shared prefix keeps no sliding-window block at the
prefix, so a sibling after it misses there. The order tests hold decode to the colocated
engine order by order, with the second sibling arriving while the first one's load is in
flight (coalescing: it waits only when the consumer predicts a hit from that load).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from vllm.v1.request import Request, RequestStatus

from connectors.consumer import Consumer, _Load
from connectors.kvsim import PrefillDecodePair, SimulatedEngine, random_tokens
from connectors.plan_cli import main as plan_main
from connectors.replay_slack import RequestPlan, plan_request
from connectors.settings import ConnectorSettings
from connectors.vllm_adapter import CacheRules, Geometry, GroupGeometry
from pdconnect.protocol import GroupTransfer, TransferPlan
from tests.geometries import GEOMETRIES

SWA = 1
SIBLINGS = 4  # x+a, x+b, x+c, x+d


def _geometry(name: str, eagle: bool, cacheable: bool = True) -> Geometry:
    fa, swa, window = GEOMETRIES[name]
    return Geometry(
        (
            GroupGeometry("full_attention", fa, eagle=eagle),
            GroupGeometry("sliding_window", swa, window, eagle=eagle, prefix_cacheable=cacheable),
        )
    )


def _siblings(prefix_len: int, suffix_len: int, count: int = SIBLINGS) -> list[list[int]]:
    prefix = random_tokens(prefix_len, seed=prefix_len)
    return [prefix + random_tokens(suffix_len, seed=1000 + k) for k in range(count)]


@dataclass
class Served:
    """Per request of a sequence: hits at admission, colocated and on the P/D pair."""

    colocated: list[int]
    prefill: list[int]
    decode: list[int]
    unheld: list[dict[int, tuple[int, ...]]]
    colocated_cache_mismatches: list[str]


def _serve(geometry: Geometry, prompts: list[list[int]], chunk: int | None, junctions: bool = True) -> Served:
    size = sum(len(p) for p in prompts)
    colocated = SimulatedEngine.create(geometry, size)
    rules = CacheRules.for_geometry(geometry)
    pair = PrefillDecodePair.create(geometry, size, chunk=chunk, junctions=junctions)
    colocated_hits, mismatches = [], []
    for k, tokens in enumerate(prompts):
        request = colocated.new_request(f"r{k}", tokens)
        before = {g: colocated.cached_indices(request, g) for g in range(len(geometry.groups))}
        colocated_hits.append(colocated.prefill(request))
        # The plan for this request, from this engine's own junction, names exactly what
        # the real core just added to its prefix cache.
        plan = plan_request(rules, len(tokens), shared_prefix_tokens=CacheRules.shared_prefix_tokens(request))
        for group in plan.groups:
            after = colocated.cached_indices(request, group.group_id)
            if after != before[group.group_id] | set(group.cached_blocks):
                mismatches.append(
                    f"request {k} group {group.group_id}: core {sorted(after)}, "
                    f"before {sorted(before[group.group_id])}, plan {group.cached_blocks}"
                )
        colocated.free(request)
    served = [pair.serve(f"r{k}", tokens) for k, tokens in enumerate(prompts)]
    return Served(
        colocated=colocated_hits,
        prefill=[s.prefill_hit for s in served],
        decode=[s.decode_hit for s in served],
        unheld=[s.unheld_publish_blocks for s in served],
        colocated_cache_mismatches=mismatches,
    )


def _assert_parity(served: Served) -> None:
    assert served.colocated_cache_mismatches == []
    assert served.prefill == served.colocated  # P is a colocated engine that only prefills
    assert served.decode == served.colocated
    assert served.unheld == [{}] * len(served.decode), "P must have cached every block D publishes"


SIBLING_CASES = [
    pytest.param(
        name,
        eagle,
        prefix,
        suffix,
        chunk,
        id=f"{name}-{'eagle' if eagle else 'no-eagle'}-x{prefix}+{suffix}-"
        f"{'chunk' + str(chunk) if chunk else 'one-step'}",
    )
    for name in GEOMETRIES
    for eagle in (True, False)
    for prefix in (1100, 5131)
    for suffix in (40, 300)
    for chunk in (None, 512)
]


@pytest.mark.parametrize(("name", "eagle", "prefix", "suffix", "chunk"), SIBLING_CASES)
def test_every_sibling_hits_on_decode_what_it_hits_on_a_colocated_engine(name, eagle, prefix, suffix, chunk):
    served = _serve(_geometry(name, eagle), _siblings(prefix, suffix), chunk)
    _assert_parity(served)
    if suffix > GEOMETRIES[name][0]:
        # Long suffixes: x+b cannot reuse x+a's replay runs; from x+c on the junction serves.
        assert served.colocated[1] == 0 and served.colocated[2] > 0


@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "no-eagle"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_without_junction_planning_the_third_long_suffix_sibling_loses_its_hit(name, eagle):
    prompts = _siblings(1100, 300)
    colocated = _serve(_geometry(name, eagle), prompts, chunk=None)
    replay_only = _serve(_geometry(name, eagle), prompts, chunk=None, junctions=False)

    assert colocated.colocated[2] > 0
    assert replay_only.decode[2] == 0 < replay_only.colocated[2]


def test_junction_example_third_sibling_hits_896_on_decode():
    """The junction example measured on real engines (1100-token prefix, 300-token suffixes, blocks 128,
    window 64, EAGLE): colocated hits 0 on x+b and 896 on x+c; decode used to hit 0 on x+c."""
    geometry = _geometry("equal-blocks-128-w64", eagle=True)
    prompts = _siblings(1100, 300)

    with_junctions = _serve(geometry, prompts, chunk=512)
    replay_only = _serve(geometry, prompts, chunk=512, junctions=False)

    assert with_junctions.colocated == [0, 0, 896, 896]
    assert with_junctions.decode == [0, 0, 896, 896]
    assert replay_only.decode == [0, 0, 0, 0]


def _prompt_tree(seed: int, count: int = 7) -> list[list[int]]:
    """Prompts that branch off earlier ones at random points: chat-like sharing at many depths."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng.randrange(600, 3000), seed=seed * 100)]
    for k in range(1, count):
        parent = rng.choice(prompts)
        keep = rng.randrange(min(len(parent), 300), len(parent) + 1)
        prompts.append(parent[:keep] + random_tokens(rng.randrange(1, 700), seed=seed * 100 + k))
    return prompts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "no-eagle"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_branching_conversations_hit_on_decode_what_they_hit_colocated(name, eagle, seed):
    _assert_parity(_serve(_geometry(name, eagle), _prompt_tree(seed), chunk=700 if seed % 2 else None))


def test_shared_prefix_tokens_reads_the_junction_vllms_lookup_pinned():
    geometry = _geometry("equal-blocks-128-w64", eagle=True)
    engine = SimulatedEngine.create(geometry, 4000)
    first, second = _siblings(1100, 300, count=2)
    engine.serve("x+a", first)
    request = engine.new_request("x+b", second)
    assert CacheRules.shared_prefix_tokens(request) is None  # before admission: no lookup yet

    engine.prefill(request)

    assert CacheRules.shared_prefix_tokens(request) == request.shared_prefix_boundary == 896
    for absent in (
        object(),
        type("R", (), {"shared_prefix_boundary": None})(),
        type("R", (), {"shared_prefix_boundary": 0})(),
    ):
        assert CacheRules.shared_prefix_tokens(absent) is None


def test_junction_runs_join_the_slack_and_the_publish_set():
    rules = CacheRules.for_geometry(_geometry("equal-blocks-128-w64", eagle=True))
    without = plan_request(rules, 1400, expected_hits=True)
    with_junction = plan_request(rules, 1400, shared_prefix_tokens=896, expected_hits=True)
    swa, swa0 = with_junction.groups[SWA], without.groups[SWA]

    # The run vLLM keeps for a lookup resuming at 896 (EAGLE: blocks 6-7, 7 the peek block).
    assert {6, 7} <= set(swa.slack_blocks) and not {6, 7} & set(swa0.slack_blocks)
    assert set(swa0.slack_blocks) < set(swa.slack_blocks) == set(swa.publish_blocks)
    assert swa.tail_blocks == swa0.tail_blocks and swa.transfer_blocks == swa.slack_blocks + swa.tail_blocks
    assert with_junction.shared_prefix_tokens == 896 and without.shared_prefix_tokens is None
    assert with_junction.expected_junction_hit_tokens == 896
    assert with_junction.expected_sibling_hit_tokens == without.expected_sibling_hit_tokens
    assert plan_request(rules, 1400, shared_prefix_tokens=0) == plan_request(rules, 1400)  # 0: vLLM's "none"
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        plan_request(rules, 1400, shared_prefix_tokens=-1)


@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "no-eagle"])
def test_bounded_replay_group_moves_its_window_and_publishes_nothing(eagle):
    """DeepSeek-V4.1's bounded SWA replay: vLLM does not prefix-cache the group (the spec's
    `prefix_cacheable` is False), so the plan moves the window tail only and publishes
    nothing, junction or not; decode still hits what a colocated engine hits."""
    geometry = _geometry("fa256-swa64-w128", eagle, cacheable=False)
    rules = CacheRules.for_geometry(geometry)
    assert not rules.groups[SWA].prefix_cacheable

    for junction in (None, 4864):
        swa = plan_request(rules, 5131, shared_prefix_tokens=junction).groups[SWA]
        assert swa.cached_blocks == swa.slack_blocks == swa.publish_blocks == ()
        assert swa.transfer_blocks == swa.tail_blocks == (78, 79, 80)

    _assert_parity(_serve(geometry, _siblings(5131, 300), chunk=None))


def test_plan_command_shows_the_junction_runs(capsys):
    args = [
        "--fa-block-size",
        "128",
        "--swa-block-size",
        "128",
        "--window",
        "64",
        "--eagle",
        "--prompt-tokens",
        "1400",
        "--json",
    ]
    assert plan_main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plan_main([*args, "--shared-prefix-tokens", "896"]) == 0
    report = json.loads(capsys.readouterr().out)

    assert plain["shared_prefix_tokens"] is None and plain["expected_junction_hit_tokens"] is None
    assert report["shared_prefix_tokens"] == 896 and report["expected_junction_hit_tokens"] == 896
    assert report["stock_junction_hit_tokens"] == 0
    swa = report["groups"][SWA]
    assert {6, 7} <= set(swa["publish_blocks"]) and not {6, 7} & set(plain["groups"][SWA]["publish_blocks"])

    assert plan_main([*args[:-1], "--shared-prefix-tokens", "896"]) == 0
    assert "junction 896" in capsys.readouterr().out
    assert plan_main([*args, "--shared-prefix-tokens", "-5"]) == 2
    assert "--shared-prefix-tokens" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Arrival order: concurrent siblings on decode against a colocated engine, order by order


def _wire_plan(plan: RequestPlan) -> TransferPlan:
    """The leader's plan as the consumer holds it; `_best_leader` reads each group's slack."""
    groups = [GroupTransfer(group=g.group_id, runs=[], slack=list(g.slack_blocks)) for g in plan.groups]
    return TransferPlan("prefill", "lead", "127.0.0.1", 1, "compat", plan.num_prompt_tokens, 0.0, groups)


def _consumer_waits_for(rules: CacheRules, leader: Request, leader_plan: RequestPlan, follower: Request) -> bool:
    """Whether the decode consumer makes `follower` wait for `leader`'s load in flight.

    Runs the consumer's own `_best_leader` on a stand-in holding only what it reads: the
    rules, default settings and the leader's load (real requests, status as vLLM sets it
    while the pull runs).
    """
    leader.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    consumer = SimpleNamespace(
        rules=rules,
        settings=ConnectorSettings.from_extra_config({}),
        _loads={leader.request_id: _Load(leader, _wire_plan(leader_plan), shadows={})},
    )
    return Consumer._best_leader(consumer, follower, 0) == leader.request_id  # type: ignore[arg-type]


@dataclass
class InOrder:
    """Hits at admission, request by request in arrival order, colocated and on decode."""

    colocated: list[int]
    decode: list[int]
    predicted_wait: bool  # the second sibling waited for the first one's load


def _serve_in_order(geometry: Geometry, prompts: list[list[int]]) -> InOrder:
    """Colocated: one engine serves `prompts` one after another. P/D: the prefill engine
    prefills them in this order; on decode the first two arrive together (the second is
    admitted while the first one's load is in flight: it waits, then looks up what that
    load published, or is admitted at once and hits only what decode held before that
    load), the rest one after another."""
    size = sum(len(p) for p in prompts)
    colocated = SimulatedEngine.create(geometry, size)
    colocated_hits = [colocated.serve(f"c{k}", tokens) for k, tokens in enumerate(prompts)]
    rules = CacheRules.for_geometry(geometry)
    pair = PrefillDecodePair.create(geometry, size)
    plans: list[RequestPlan] = []
    for k, tokens in enumerate(prompts[:2]):
        on_prefill = pair.prefill.new_request(f"r{k}", tokens)
        pair.prefill.prefill(on_prefill)
        plans.append(plan_request(rules, len(tokens), shared_prefix_tokens=CacheRules.shared_prefix_tokens(on_prefill)))
        pair.prefill.finish_for_transfer(on_prefill)
        pair.prefill.free(on_prefill)
    leader, follower = (pair.decode.new_request(f"r{k}", prompts[k]) for k in (0, 1))
    waits = _consumer_waits_for(rules, leader, plans[0], follower)
    # Not waiting, the follower is admitted beside the leader's load, whose blocks are
    # allocated with caching delayed: it hits what decode cached before that load.
    at_once = pair.decode.lookup(pair.decode.new_request("r1-at-once", prompts[1]))
    decode_hits = [pair.decode.remote_load(leader, plans[0])]
    pair.decode.free(leader)
    # Waiting, it is admitted once the leader's load is published. Either way both loads
    # end up published, so what later siblings find is the same.
    after_leader = pair.decode.remote_load(follower, plans[1])
    pair.decode.free(follower)
    decode_hits.append(after_leader if waits else at_once)
    decode_hits += [pair.serve(f"r{k}", tokens).decode_hit for k, tokens in enumerate(prompts[2:], start=2)]
    return InOrder(colocated_hits, decode_hits, waits)


@pytest.mark.parametrize(("block", "window"), [(16, 16), (64, 32), (128, 64)])
def test_a_sibling_one_block_past_the_prefix_leaves_nothing_for_the_next_on_either_side(block, window):
    """Worked from the geometry (equal block sizes, window <= block, no EAGLE), as in
    `make bench-parallel`'s tiny Llama (block 128, window 64) with siblings of 870, 926 and
    918 tokens on a 768-token prefix: X = 6 blocks shared. The short sibling (X + 0.8
    block) hits at most X (the hit is capped below its last token), so vLLM keeps the
    window's block before X (block 5) at that boundary. The long one (X + 1.23 blocks)
    hits up to X + 1 block: it keeps block 6 only, and a sibling after it misses at X.
    The third one then hits X after the short one, whichever came first. Colocated:
    short first [0, X, X], long first [0, 0, X]; decode hits the same in each order, the
    second waiting for the first one's load only when that load publishes block 5."""
    prefix = 6 * block
    shared = random_tokens(prefix, seed=block)
    short = shared + random_tokens(round(0.8 * block), seed=1)
    long = shared + random_tokens(block + round(0.23 * block), seed=2)
    third = shared + random_tokens(block + round(0.17 * block), seed=3)
    geometry = Geometry((GroupGeometry("full_attention", block), GroupGeometry("sliding_window", block, window)))

    short_first = _serve_in_order(geometry, [short, long, third])
    long_first = _serve_in_order(geometry, [long, short, third])

    assert short_first.colocated == short_first.decode == [0, prefix, prefix]
    assert long_first.colocated == long_first.decode == [0, 0, prefix]
    assert short_first.predicted_wait and not long_first.predicted_wait


def _mimo_v2(eagle: bool) -> Geometry:
    """MiMo-V2's groups: two sliding windows of 64-token blocks (window 128), full attention
    in 256-token blocks numbered last; MTP takes the EAGLE drop."""
    return Geometry(
        (
            GroupGeometry("sliding_window", 64, 128, eagle=eagle),
            GroupGeometry("sliding_window", 64, 128, eagle=eagle),
            GroupGeometry("full_attention", 256, eagle=eagle),
        )
    )


ORDER_GEOMETRIES = {
    **{name: lambda eagle, n=name: _geometry(n, eagle) for name in GEOMETRIES},
    **{
        f"fa{fa}-swa{swa}-w{w}": lambda eagle, g=(fa, swa, w): Geometry(
            (
                GroupGeometry("full_attention", g[0], eagle=eagle),
                GroupGeometry("sliding_window", g[1], g[2], eagle=eagle),
            )
        )
        for fa, swa, w in ((16, 16, 32), (64, 64, 64), (16, 16, 257), (128, 128, 257), (64, 16, 128))
    },
    "mimo-v2": _mimo_v2,
}


def _order_prompts(geometry: Geometry, shape: str) -> list[list[int]]:
    """Three siblings of a shared prefix, the first two suffixes straddling one cache-hit alignment."""
    step = CacheRules.for_geometry(geometry).alignment
    prefix = 4 * step if shape != "unaligned" else 4 * step + step // 3
    window = max(g.sliding_window or 0 for g in geometry.groups)
    suffixes = {
        "aligned": (step // 3, step + step // 4, 2 * step + 1),
        "unaligned": (step // 2, step + 1, step // 5),
        "window": (max(1, step - window // 2), step + window + 1, 3 * step),
        # Both past the prefix by a block or more: the third hits only at the second
        # one's junction, which its plan must carry although it did not wait.
        "both-long": (step + step // 4, 2 * step + 1, step // 3),
    }[shape]
    shared = random_tokens(prefix, seed=prefix)
    return [shared + random_tokens(s, seed=1000 + k) for k, s in enumerate(suffixes)]


ORDER_CASES = [
    pytest.param(name, eagle, shape, id=f"{name}-{'eagle' if eagle else 'no-eagle'}-{shape}")
    for name in ORDER_GEOMETRIES
    for eagle in (True, False)
    for shape in ("aligned", "unaligned", "window", "both-long")
]


@pytest.mark.parametrize(("name", "eagle", "shape"), ORDER_CASES)
def test_concurrent_siblings_hit_on_decode_what_they_hit_colocated_in_each_order(name, eagle, shape):
    geometry = ORDER_GEOMETRIES[name](eagle)
    first, second, third = _order_prompts(geometry, shape)
    for order in ([first, second, third], [second, first, third]):
        served = _serve_in_order(geometry, order)
        assert served.decode == served.colocated, [len(p) for p in order]


def test_the_order_sweep_meets_siblings_whose_colocated_hits_depend_on_the_order():
    """Without such cases the sweep above would prove parity only where order is moot."""
    dependent = []
    for name, build in ORDER_GEOMETRIES.items():
        for eagle in (True, False):
            geometry = build(eagle)
            first, second, third = _order_prompts(geometry, "aligned")
            one = _serve_in_order(geometry, [first, second, third]).colocated
            other = _serve_in_order(geometry, [second, first, third]).colocated
            if one[1:] != other[1:]:
                dependent.append((name, eagle))
    assert len(dependent) >= 4, dependent
