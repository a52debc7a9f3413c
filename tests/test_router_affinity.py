"""Prefix affinity: siblings (same long prefix, new suffix) stay on one engine, and the
bounded-load ring keeps every engine within `load_factor` x its share while they do
(above the bound's floor: below it a burst of siblings stays together).

4 decode engines, 64 prefix groups. The policy is exercised directly with real `Engine`
objects (their `in_flight` is the load the bound reads), then through the HTTP router
against FAKE engines to show the placement survives the whole request path.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict, deque
from collections.abc import Callable

import aiohttp
import pytest

from pdconnect.router import start_router
from pdconnect.router.breaker import CircuitBreaker
from pdconnect.router.engines import Engine, Role
from pdconnect.router.policy import (
    AffinityTracker,
    LeastLoaded,
    LoadBound,
    PrefixAffinity,
    RoundRobin,
    affinity_key,
    render_messages,
)
from pdconnect.testbed.fake_engine import FakeCluster
from tests.router_support import router_config_for

ENGINES = 4
GROUPS = 64
SIBLINGS = 6
FACTOR = 1.25
# The ring's own properties are tested on the plain bounded-load ring (floor 1); the
# floor has tests of its own.
PLAIN = LoadBound(FACTOR, floor=1)
PREFIX_CHARS = 256


def engines(n: int = ENGINES) -> tuple[Engine, ...]:
    return tuple(
        Engine(url=f"http://decode-{i}.svc:8000", role=Role.DECODE, breaker=CircuitBreaker(3, 10.0), probe_ok=True)
        for i in range(n)
    )


def group_prefix(group: int) -> str:
    rng = random.Random(group)
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(200))  # > PREFIX_CHARS


def sibling(group: int, k: int) -> dict[str, object]:
    return {"prompt": f"{group_prefix(group)} question {k}: " + "x" * k}


def key_of(body: dict[str, object]) -> int:
    key = affinity_key(body, chat=False, prefix_chars=PREFIX_CHARS, prefix_tokens=64)
    assert key is not None
    return key


# --- the key ---------------------------------------------------------------------------------


def test_siblings_share_a_key_and_other_prefixes_do_not() -> None:
    assert key_of(sibling(1, 0)) == key_of(sibling(1, 5))
    assert key_of(sibling(1, 0)) != key_of(sibling(2, 0))


def test_chat_key_is_the_rendered_leading_messages() -> None:
    system = {"role": "system", "content": group_prefix(3)}
    a = {"messages": [system, {"role": "user", "content": "first question"}]}
    b = {"messages": [system, {"role": "user", "content": "another one"}]}
    c = {"messages": [{"role": "user", "content": group_prefix(3)}, {"role": "user", "content": "x"}]}
    key = lambda body: affinity_key(body, chat=True, prefix_chars=PREFIX_CHARS, prefix_tokens=64)  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(c)  # same text, different role: a different rendered prompt
    assert render_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], 100) == "user\x1fhi\x1e"


def test_token_id_prompts_use_their_leading_ids() -> None:
    ids = list(range(100, 400))
    key = lambda body: affinity_key(body, chat=False, prefix_chars=PREFIX_CHARS, prefix_tokens=64)  # noqa: E731
    assert key({"prompt": [*ids, 1]}) == key({"prompt": [*ids, 2, 3]})
    assert key({"prompt": [[*ids, 1], ids]}) == key({"prompt": ids})  # a batch: the first prompt
    assert key({"prompt": ""}) is not None and key({}) is None


# --- placement -------------------------------------------------------------------------------


def test_without_load_every_sibling_lands_on_its_groups_engine_and_groups_spread() -> None:
    pool = engines()
    policy = PrefixAffinity(PLAIN, vnodes=160)
    home: dict[int, set[str]] = defaultdict(set)
    for group in range(GROUPS):
        for k in range(SIBLINGS):
            home[group].add(policy.order(pool, key_of(sibling(group, k)))[0].url)
    assert all(len(urls) == 1 for urls in home.values())
    per_engine = Counter(next(iter(urls)) for urls in home.values())
    assert set(per_engine) == {e.url for e in pool}
    print(f"\ngroups per engine: {sorted(per_engine.values())}")


@pytest.mark.parametrize("floor", [1, 8])
def test_held_requests_never_push_an_engine_past_the_bound_and_move_only_when_home_is_full(floor: int) -> None:
    """All 64 x 6 requests arrive while every earlier one is still in flight."""
    pool = engines()
    policy = PrefixAffinity(LoadBound(FACTOR, floor), vnodes=160)
    order = [(g, k) for k in range(SIBLINGS) for g in range(GROUPS)]
    random.Random(7).shuffle(order)
    homes = _homes(pool)
    moved = 0
    for group, k in order:
        key = key_of(sibling(group, k))
        bound = policy.bound(pool)
        ring_home = homes(key)
        chosen = policy.order(pool, key)[0]
        if chosen.url != ring_home.url:
            moved += 1
            # A sibling leaves its home only when home is at the bound.
            assert next(e for e in pool if e.url == ring_home.url).in_flight >= bound
        chosen.in_flight += 1
        assert max(e.in_flight for e in pool) <= bound
    total = GROUPS * SIBLINGS
    assert max(e.in_flight for e in pool) <= math.ceil(FACTOR * total / ENGINES)
    print(f"\nall held: loads {sorted(e.in_flight for e in pool)}, moved {moved}/{total}")


@pytest.mark.parametrize("factor", [1.25, 1.5, 2.0])
def test_realistic_concurrency_trades_togetherness_for_balance_by_the_factor(factor: float) -> None:
    """A sliding window of 32 requests in flight; siblings arrive in random order.

    The bound holds at every placement and a sibling leaves its group's engine only when
    that engine is at the bound; how often that happens is what the factor buys.
    """
    pool = engines()
    policy = PrefixAffinity(LoadBound(factor, floor=1), vnodes=160)
    tracker = AffinityTracker()
    order = [(g, k) for g in range(GROUPS) for k in range(SIBLINGS)]
    random.Random(11).shuffle(order)
    homes = _homes(pool)
    window: deque[Engine] = deque()
    outcomes: Counter[str] = Counter()
    for group, k in order:
        if len(window) == 32:
            window.popleft().in_flight -= 1
        key = key_of(sibling(group, k))
        bound = policy.bound(pool)
        home_url = homes(key).url
        chosen = policy.order(pool, key)[0]
        assert chosen.in_flight < bound
        if chosen.url != home_url:
            assert next(e for e in pool if e.url == home_url).in_flight >= bound
        chosen.in_flight += 1
        window.append(chosen)
        outcomes[tracker.observe(key, chosen.url)] += 1
    kept = outcomes["keep"] / (outcomes["keep"] + outcomes["move"])
    print(f"\nfactor {factor}, window 32: {dict(outcomes)}, siblings kept together {kept:.0%}")
    assert outcomes["new"] == GROUPS
    if factor >= 2.0:
        assert kept >= 0.95


def _burst(policy: PrefixAffinity, pool: tuple[Engine, ...], group: int, size: int) -> Counter[str]:
    """`size` siblings of one group arrive while every earlier one is still in flight."""
    placed: Counter[str] = Counter()
    for k in range(size):
        chosen = policy.order(pool, key_of(sibling(group, k)))[0]
        chosen.in_flight += 1
        placed[chosen.url] += 1
    return placed


def test_a_burst_of_siblings_up_to_the_floor_stays_on_its_engine() -> None:
    """4 siblings at once on 2 idle engines: the plain ring (bound ceil(1.25 * 4 / 2) = 3)
    sends the fourth away from the engine that will cache their prefix; with the floor
    the burst stays whole, up to `floor` siblings."""
    group = 9
    plain = _burst(PrefixAffinity(PLAIN, vnodes=160), engines(2), group, 4)
    assert sorted(plain.values()) == [1, 3]
    floored = _burst(PrefixAffinity(LoadBound(FACTOR, floor=4), vnodes=160), engines(2), group, 4)
    assert list(floored.values()) == [4]
    default = LoadBound()
    whole = _burst(PrefixAffinity(default, vnodes=160), engines(2), group, default.floor)
    assert list(whole.values()) == [default.floor]
    # One more than the floor on two engines: the factor's bound is still below the
    # floor, so the extra sibling is the first to spill.
    spilled = _burst(PrefixAffinity(LoadBound(FACTOR, floor=4), vnodes=160), engines(2), group, 5)
    assert sorted(spilled.values()) == [1, 4]


def test_above_the_floor_the_factor_bounds_every_engine() -> None:
    """40 siblings of one hot prefix held at once on 4 engines: no engine past
    max(floor, ceil(1.25 * 40 / 4)) = 13, whatever the floor below that."""
    for floor in (1, 8):
        pool = engines()
        _burst(PrefixAffinity(LoadBound(FACTOR, floor), vnodes=160), pool, 3, 40)
        assert max(e.in_flight for e in pool) == 13


def test_load_bound_limit() -> None:
    assert LoadBound(1.5, floor=1).limit(total=3, engines=2) == 3
    assert LoadBound(1.5, floor=8).limit(total=3, engines=2) == 8
    assert LoadBound(1.5, floor=8).limit(total=99, engines=2) == 75


@pytest.mark.parametrize(("factor", "floor"), [(0.9, 8), (1.5, 0)])
def test_a_load_bound_that_could_refuse_every_engine_is_refused(factor: float, floor: int) -> None:
    with pytest.raises(ValueError):
        LoadBound(factor, floor)


def test_unhealthy_home_sends_its_keys_to_the_next_engine_and_back() -> None:
    pool = engines()
    policy = PrefixAffinity(PLAIN, vnodes=160)
    key = key_of(sibling(5, 0))
    home, second = policy.order(pool, key)[:2]
    home.probe_ok = False
    assert policy.order(pool, key)[0] is second
    home.probe_ok = True
    assert policy.order(pool, key)[0] is home


def test_adding_an_engine_moves_only_the_keys_it_takes_over() -> None:
    old_policy, new_policy = PrefixAffinity(PLAIN, vnodes=160), PrefixAffinity(PLAIN, vnodes=160)
    before = engines(4)
    after = (
        *before,
        Engine(url="http://decode-4.svc:8000", role=Role.DECODE, breaker=CircuitBreaker(3, 10.0), probe_ok=True),
    )
    moved = 0
    for group in range(GROUPS):
        key = key_of(sibling(group, 0))
        old, new = old_policy.order(before, key)[0], new_policy.order(after, key)[0]
        if old is not new:
            moved += 1
            assert new.url == "http://decode-4.svc:8000"
    assert 0 < moved < GROUPS // 2


def test_least_loaded_and_round_robin() -> None:
    pool = engines(3)
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 2, 0, 1
    assert [e.url for e in LeastLoaded().order(pool, None)] == [pool[1].url, pool[2].url, pool[0].url]
    rr = RoundRobin()
    assert [rr.order(pool, None)[0].url for _ in range(4)] == [pool[0].url, pool[1].url, pool[2].url, pool[0].url]
    pool[1].probe_ok = False
    assert pool[1] not in rr.order(pool, None) and pool[1] not in LeastLoaded().order(pool, None)


def _homes(pool: tuple[Engine, ...]) -> Callable[[int], Engine]:
    """Where a key goes when nothing is busy: its home on the ring."""
    idle = tuple(Engine(url=e.url, role=e.role, breaker=e.breaker, probe_ok=True) for e in pool)
    policy = PrefixAffinity(PLAIN, vnodes=160)
    return lambda key: policy.order(idle, key)[0]


# --- through the router ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_router_sends_siblings_to_one_decode_and_one_prefill_engine() -> None:
    fakes = await FakeCluster.start(prefill=2, decode=ENGINES, chunks=2)
    router = await start_router(
        router_config_for(fakes, affinity_prefix_chars=PREFIX_CHARS, affinity_load_factor=FACTOR)
    )
    placed: dict[int, set[tuple[str, str]]] = defaultdict(set)
    try:
        async with aiohttp.ClientSession() as http:
            for k in range(3):
                for group in range(GROUPS):
                    body = {**sibling(group, k), "max_tokens": 2, "stream": k % 2 == 1}
                    async with http.post(router.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                        placed[group].add((resp.headers["X-PDConnect-Prefill"], resp.headers["X-PDConnect-Decode"]))
        assert all(len(pairs) == 1 for pairs in placed.values())
        assert {d for pairs in placed.values() for _, d in pairs} == set(fakes.decode_urls)
        metrics = router.router.metrics.registry
        assert (
            metrics.get_sample_value("pdconnect_router_affinity_total", {"role": "decode", "outcome": "keep"})
            == 2 * GROUPS
        )
        assert (
            metrics.get_sample_value("pdconnect_router_affinity_total", {"role": "decode", "outcome": "move"}) is None
        )
    finally:
        await router.close()
        await fakes.close()
