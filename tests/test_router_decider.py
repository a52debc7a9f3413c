"""Decode-first routing (`router.lookup`, `router.decider`): the predicted hit is vLLM's own, every
KV group counts, decode's load bounds local prefills, and the flow skips the prefill leg.

The lookup is checked against vLLM's real coordinator (through `connectors.vllm_adapter`);
the decider reads a real `EngineKVIndex` fed with batches encoded by vLLM's own event
classes; the flow runs against FAKE engines whose KV events a FAKE publisher sends.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from pdconnect.errors import ConfigError
from pdconnect.kvdescribe import VERSION, DescribedGroup, EngineDescribed
from pdconnect.router.decider import DeciderSettings, DecodeFirstDecider, Route
from pdconnect.router.engines import Engine, Role
from pdconnect.router.kvindex import EngineKVIndex, GroupIndex
from pdconnect.router.kvwire import decode_batch
from pdconnect.router.lookup import CacheGroup, CacheGroups, parse_groups, predicted_hits
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.prompt import RoutingPrompt, block_keys
from tests.router_events_support import complete_through, publish_until_applied
from tests.vllm_kv_events import encoded_batch, stored_blocks

if TYPE_CHECKING:
    from connectors.geometry import GroupKind

kv_events = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4
GROUPS = parse_groups("full:4,sliding:4:4")  # a window of 4: one block of 4 tokens serves it


# --- the lookup is vLLM's -------------------------------------------------------------------

# Each group: (kind, block size, sliding window or None).
_GEOMETRIES: dict[str, list[tuple[GroupKind, int, int | None]]] = {
    "cpu-llama": [("full_attention", 128, None), ("sliding_window", 128, 64)],
    "mimo-like": [("full_attention", 256, None), ("sliding_window", 64, 128)],
    "window-over-alignment": [("full_attention", 128, None), ("sliding_window", 32, 320)],
    "two-windows": [("full_attention", 64, None), ("sliding_window", 64, 128), ("sliding_window", 32, 64)],
    "full-only": [("full_attention", 16, None)],
}
# Which groups take the EAGLE/MTP drop: none, all (EAGLE), one (MTP: the drafter's group).
_DROPS = {
    "no-spec": lambda gid: False,
    "eagle": lambda gid: True,
    "mtp-full": lambda gid: gid == 0,
    "mtp-sliding": lambda gid: gid == 1,
}


@pytest.mark.parametrize(
    ("name", "drop"),
    [
        (name, drop)
        for name in _GEOMETRIES
        for drop in _DROPS
        if not (drop == "mtp-sliding" and len(_GEOMETRIES[name]) < 2)
    ],
)
def test_the_predicted_hit_is_what_vllms_own_lookup_returns_on_random_cache_states(name: str, drop: str) -> None:
    from connectors.geometry import Geometry, GroupGeometry
    from connectors.vllm_adapter import CacheRules

    spec = _GEOMETRIES[name]
    flagged = _DROPS[drop]
    geometry = Geometry(
        tuple(GroupGeometry(kind, bs, window, eagle=flagged(gid)) for gid, (kind, bs, window) in enumerate(spec))
    )
    rules = CacheRules.for_geometry(geometry)
    groups = parse_groups(
        ",".join(
            (f"full:{bs}" if kind == "full_attention" else f"sliding:{bs}:{window}")
            + (":eagle" if flagged(gid) else "")
            for gid, (kind, bs, window) in enumerate(spec)
        )
    )
    rng = random.Random(f"{name}-{drop}")
    largest = max(bs for _, bs, _ in spec)
    hits = 0
    for _ in range(400):
        n = rng.randrange(1, 24 * largest)
        tokens = [rng.randrange(1, 50000) for _ in range(n)]
        density = 1 - rng.random() ** 3  # mostly dense: hits, and the gaps that cut them
        index = EngineKVIndex()
        cached: dict[int, set[int]] = {}
        grain = math.gcd(*(bs for _, bs, _ in spec))  # the engine's key space
        for gid, (_kind, bs, window) in enumerate(spec):
            keys = block_keys(tokens, bs, grain)
            cached[gid] = {i for i in range(len(keys)) if rng.random() < density}
            index.groups[gid] = GroupIndex(bs, window, present={keys[i]: 1 for i in cached[gid]})
        expected = rules.lookup_hit(cached, n, n)
        assert predicted_hits(groups, index, RoutingPrompt(tokens))[0] == expected, (n, cached)
        hits += expected > 0
    assert hits > 40  # the states exercise real hits, not just misses


def test_groups_are_parsed_full_attention_first_and_bad_ones_are_named() -> None:
    assert str(parse_groups("sliding:128:64:eagle, full:128:eagle")) == "full:128:eagle,sliding:128:64:eagle"
    for bad in ("", "full", "full:0", "sliding:128", "mamba:16", "full:128,full:128", "full:x"):
        with pytest.raises(ConfigError):
            parse_groups(bad)


# --- the decider over a real index ------------------------------------------------------------


def _stored(blocks: range, group: int, kind: str, window: int | None = None) -> Any:
    """vLLM's BlockStored for blocks of TOKENS. The hash names the block, not the group: vLLM
    hashes a request's blocks once for every group of a block size."""
    return stored_blocks(blocks, TOKENS, block_size=BS, group=group, kind=kind, window=window)


def _batch(*events: Any) -> bytes:
    return encoded_batch(events)


# What the engine's connector says of its groups (`connectors.describe`): GROUPS.
DESCRIBED = EngineDescribed(
    VERSION, [DescribedGroup("full_attention", BS, None, False), DescribedGroup("sliding_window", BS, 4, False)], 0
)


def _index(*events: Any, described: EngineDescribed | None = DESCRIBED) -> EngineKVIndex:
    index = EngineKVIndex()
    index.apply(decode_batch(_batch(*events, *([] if described is None else [described]))))
    return index


class FakeFeed:
    """Stands in for `KVEventsFeed`: engine url -> index (None: not fresh)."""

    def __init__(self, indexes: dict[str, EngineKVIndex | None]) -> None:
        self.indexes = indexes

    def index(self, url: str) -> EngineKVIndex | None:
        return self.indexes.get(url)


D0 = "http://d0:8000"
HELD = (_stored(range(8), 0, "full_attention"), _stored(range(6, 8), 1, "sliding_window", 4))
# Full attention holds the whole prompt; the sliding group only blocks it cached long ago.
WINDOW_GONE = (_stored(range(8), 0, "full_attention"), _stored(range(3), 1, "sliding_window", 4))


def _decider(
    feed: FakeFeed,
    max_uncached: int = 8,
    in_flight: int = 64,
    ratio: float = 1.0,
    override: CacheGroups | None = GROUPS,
) -> DecodeFirstDecider:
    from pdconnect.router.engines import EngineRegistry

    return DecodeFirstDecider(
        DeciderSettings(override, max_uncached, ratio, in_flight),
        feed,
        # No engine registers, so no breaker is ever made.
        RouterMetrics(EngineRegistry(lambda: None, probed=False)),  # type: ignore[arg-type, return-value]
    )


def _engine(url: str = D0) -> Engine:
    return Engine(url=url, role=Role.DECODE, breaker=None)  # type: ignore[arg-type]


def test_a_prompt_decode_holds_goes_local_with_vllms_cap_and_alignment() -> None:
    decider = _decider(FakeFeed({D0: _index(*HELD)}))
    route = decider.decide(_engine(), RoutingPrompt(TOKENS), {})
    # 32 tokens, all cached: vLLM still computes the last block (the hit stops at 31, aligned to 28).
    assert (route.local, route.reason, route.hit, route.prompt_tokens) == (True, "cached", 28, 32)
    assert decider.local_tokens_in_flight(D0) == 4
    route.prefilled()
    route.prefilled()  # released once only
    assert decider.local_tokens_in_flight(D0) == 0


def test_a_prompt_whose_window_blocks_are_gone_is_pd_although_full_attention_holds_it() -> None:
    """The case a full-attention-only decider gets wrong: it predicts 28 cached tokens, but
    vLLM's lookup needs the sliding group's block before the hit, and finds it only at 12."""
    route = _decider(FakeFeed({D0: _index(*WINDOW_GONE)})).decide(_engine(), RoutingPrompt(TOKENS), {})
    assert (route.local, route.reason, route.hit, route.full_attention_hit) == (False, "uncached", 12, 28)
    # ... and a sliding group that never published at all counts as holding nothing.
    alone = _decider(FakeFeed({D0: _index(_stored(range(8), 0, "full_attention"))})).decide(
        _engine(), RoutingPrompt(TOKENS), {}
    )
    assert (alone.local, alone.hit, alone.full_attention_hit) == (False, 0, 28)


def test_predicted_hits_take_the_eagle_drop_on_the_flagged_groups() -> None:
    index, eagle = _index(*HELD), parse_groups("full:4:eagle,sliding:4:4:eagle")
    assert predicted_hits(GROUPS, index, RoutingPrompt(TOKENS)) == (28, 28)
    assert predicted_hits(eagle, index, RoutingPrompt(TOKENS)) == (
        28,
        24,
    )  # look-ahead block 7 is there; alone, no margin
    # 31 tokens: EAGLE's lookup drops the last matched block, so the sliding group needs
    # blocks 5 and 6 (it holds 6 and 7) and nothing hits; full attention alone would say 24.
    assert predicted_hits(GROUPS, index, RoutingPrompt(TOKENS[:31])) == (28, 28)
    assert predicted_hits(eagle, index, RoutingPrompt(TOKENS[:31])) == (0, 24)
    assert predicted_hits(CacheGroups((CacheGroup("full", 4),)), index, RoutingPrompt(TOKENS[:1])) == (
        0,
        0,
    )  # one token: nothing


@pytest.mark.parametrize(
    ("tokens", "body", "feed", "reason"),
    [
        (None, {}, {D0: None}, "no_tokens"),
        (TOKENS, {}, {D0: None}, "no_events"),
        (TOKENS, {"prompt_logprobs": 1}, {D0: "held"}, "unpredictable"),
        (TOKENS, {"cache_salt": "tenant-a"}, {D0: "held"}, "unpredictable"),
    ],
)
def test_without_a_prediction_the_request_is_pd_and_says_why(
    tokens: list[int] | None, body: dict[str, Any], feed: dict[str, Any], reason: str
) -> None:
    indexes = {url: (_index(*HELD) if v == "held" else None) for url, v in feed.items()}
    route = _decider(FakeFeed(indexes)).decide(_engine(), None if tokens is None else RoutingPrompt(tokens), body)
    assert (route.local, route.reason) == (False, reason)


def test_thresholds_and_decodes_own_load_bound_local_prefills() -> None:
    feed = FakeFeed({D0: _index(_stored(range(5), 0, "full_attention"), _stored(range(3, 5), 1, "sliding_window", 4))})
    assert (
        _decider(feed, max_uncached=11).decide(_engine(), RoutingPrompt(TOKENS), {}).reason == "uncached"
    )  # 12 uncached
    assert _decider(feed, max_uncached=12, ratio=0.25).decide(_engine(), RoutingPrompt(TOKENS), {}).reason == "uncached"
    decider = _decider(feed, max_uncached=12, in_flight=24)
    first, second, third = (decider.decide(_engine(), RoutingPrompt(TOKENS), {}) for _ in range(3))
    assert [first.reason, second.reason, third.reason] == ["cached", "cached", "busy"]
    assert decider.local_tokens_in_flight(D0) == 24
    first.prefilled()
    assert decider.decide(_engine(), RoutingPrompt(TOKENS), {}).local


def test_the_reported_hit_is_checked_against_the_prediction() -> None:
    decider = _decider(FakeFeed({D0: _index(*HELD)}))
    metrics = decider._metrics
    for reported in (28, 20, 30):
        check = decider.usage_check(Route(True, "cached", 32, 28))
        body = msgspec.json.encode(
            {"usage": {"prompt_tokens": 32, "prompt_tokens_details": {"cached_tokens": reported}}}
        )
        assert check.rewrite_body(body) == body  # the engine's own usage, unchanged
    assert {r: metrics.decode_local_hit_checks.labels(r).value for r in ("match", "over", "under")} == {
        "match": 1,
        "over": 1,
        "under": 1,
    }


def test_decode_first_needs_kv_aware_and_the_groups_only_as_an_override() -> None:
    from pdconnect.router import load_config

    base = {"decode": [D0], "decode_first": True}
    with pytest.raises(ConfigError, match="kv-aware"):
        load_config({**base, "kv_cache_groups": "full:4"})
    # The engines describe their groups: none need be typed in.
    assert load_config({**base, "policy": "kv-aware", "kv_events_port": 5557}).kv_cache_groups is None
    with pytest.raises(ConfigError, match="KV cache group"):
        load_config({**base, "policy": "kv-aware", "kv_events_port": 5557, "kv_cache_groups": "full"})
    load_config({**base, "policy": "kv-aware", "kv_events_port": 5557, "kv_cache_groups": "full:4"})


# --- the flow, against FAKE engines -----------------------------------------------------------


class _Publisher:
    """A FAKE engine's KV events publisher (ZMQ PUB, vLLM's frame layout)."""

    def __init__(self, context: Any) -> None:
        import zmq

        self.socket = context.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0

    async def publish(self, router: Any, *events: Any) -> None:
        """Until the router applied the batch: its SUB socket joins asynchronously."""
        # With the description its connector adds to an engine's first step's events.
        self.seq = await publish_until_applied(router, self.socket, _batch(*events, DESCRIBED), self.seq)


def _decode_first_config(fakes: Any, publishers: dict[str, _Publisher]) -> Any:
    """The router config of the decode-first tests: kv-aware over the publishers, decode-first on."""
    from tests.router_support import router_config_for

    return router_config_for(
        fakes,
        policy="kv-aware",
        kv_events_endpoints={u: [p.endpoint] for u, p in publishers.items()},
        decode_first=True,
        kv_cache_groups=str(GROUPS),
        decode_first_max_uncached_tokens=8,
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_decode_first_skips_the_prefill_leg_and_pd_keeps_it(stream: bool) -> None:
    import aiohttp
    import zmq

    from pdconnect.router import start_router
    from pdconnect.testbed.fake_engine import FakeCluster

    fakes = await FakeCluster.start(prefill=1, decode=2)
    context = zmq.Context()
    publishers = {url: _Publisher(context) for url in fakes.decode_urls}
    router = await start_router(_decode_first_config(fakes, publishers))
    body: dict[str, Any] = {"model": "fake-model", "prompt": TOKENS, "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    prefill = fakes.prefill[0]
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(15):

            async def send() -> dict[str, str]:
                async with http.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
                    return dict(resp.headers)

            # No events: nothing predicted, P/D as before.
            headers = await send()
            assert headers["X-PDConnect-Route"] == "pd; reason=no_events"
            assert len(prefill.seen) == 1
            # One decode engine holds the prompt's full-attention blocks but not its window:
            # still P/D (a full-attention-only reading would call it cached).
            holder = fakes.decode_urls[1]
            await publishers[holder].publish(router, *WINDOW_GONE)
            headers = await send()
            assert headers["X-PDConnect-Route"].startswith("pd; reason=uncached; prompt=32; hit=12;")
            assert len(prefill.seen) == 2
            # Now it holds the window too: decode-first on that engine, no prefill leg, no plan.
            await publishers[holder].publish(router, _stored(range(6, 8), 1, "sliding_window", 4))
            headers = await send()
            assert (
                headers["X-PDConnect-Route"] == "decode-first; reason=cached; prompt=32; hit=28; full_attention_hit=28"
            )
            assert headers["X-PDConnect-Decode"] == holder and headers["X-PDConnect-Prefill"] == "none"
            assert "X-PDConnect-Fallback" not in headers
            assert len(prefill.seen) == 2
            decoded = fakes.engine(holder).seen[-1].body
            assert "kv_transfer_params" not in decoded
        metrics = router.router.metrics.registry
        assert (
            metrics.get_sample_value(
                "pdconnect_router_decode_routes_total", {"route": "decode-first", "reason": "cached"}
            )
            == 1
        )
        assert (
            metrics.get_sample_value("pdconnect_router_decode_routes_total", {"route": "pd", "reason": "uncached"}) == 1
        )
        assert (
            metrics.get_sample_value(
                "pdconnect_router_decode_routes_full_attention_only_total", {"route": "decode-first"}
            )
            == 2
        )
        # The FAKE decode engine reports no cached tokens for a local prefill: counted as over-predicted.
        assert metrics.get_sample_value("pdconnect_router_decode_local_hit_checks_total", {"result": "over"}) == 1
        assert (
            metrics.get_sample_value("pdconnect_router_requests_total", {"endpoint": "completions", "outcome": "ok"})
            == 3
        )
        assert router.router._flow._decider.local_tokens_in_flight(holder) == 0  # type: ignore[union-attr]
    finally:
        await router.close()
        await fakes.close()
        context.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_failed_local_attempt_is_retried_pd_on_the_next_engine() -> None:
    import zmq

    from pdconnect.router import start_router
    from pdconnect.testbed.fake_engine import FakeCluster

    fakes = await FakeCluster.start(prefill=1, decode=2)
    context = zmq.Context()
    publishers = {url: _Publisher(context) for url in fakes.decode_urls}
    router = await start_router(_decode_first_config(fakes, publishers))
    holder, other = fakes.decode_urls[1], fakes.decode_urls[0]
    try:
        await publishers[holder].publish(router, *HELD)
        fakes.engine(holder).faults.fail_next = 1
        headers = await complete_through(router, TOKENS)
        assert headers["X-PDConnect-Route"].startswith("pd; reason=decode_retry")
        assert headers["X-PDConnect-Decode"] == other
        assert len(fakes.prefill[0].seen) == 1  # the engine that lacks the prompt got it P/D
        assert fakes.engine(other).seen[-1].body["kv_transfer_params"]["do_remote_prefill"] is True
        assert router.router._flow._decider.local_tokens_in_flight(holder) == 0  # type: ignore[union-attr]
    finally:
        await router.close()
        await fakes.close()
        context.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_long_prompts_chain_keys_are_computed_once_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain keys of a long prompt (the lookup's part that scales with it) are computed
    once per request, in a worker thread, and shared by the policy's scoring of every decode
    engine and the decider's prediction; the loop only looks them up."""
    import threading

    import zmq

    from pdconnect.router import prompt as routing_prompt
    from pdconnect.router import start_router
    from pdconnect.testbed.fake_engine import FakeCluster

    calls: list[tuple[bool, int, int]] = []  # (on the loop's thread, tokens, block size)
    chain_keys = routing_prompt.chain_keys

    def spy(tokens: Any, block_size: int, parent: int = 0) -> list[int]:
        calls.append((threading.current_thread() is threading.main_thread(), len(tokens), block_size))
        return chain_keys(tokens, block_size, parent)

    fakes = await FakeCluster.start(prefill=1, decode=2)
    context = zmq.Context()
    publishers = {url: _Publisher(context) for url in fakes.decode_urls}
    router = await start_router(_decode_first_config(fakes, publishers))
    prompt = TOKENS + [7] * (1 << 14)  # its body is far over the size tokenized inline
    try:
        for publisher in publishers.values():  # both engines fresh: the policy scores both
            await publisher.publish(router, *HELD)
        monkeypatch.setattr(routing_prompt, "chain_keys", spy)
        route = (await complete_through(router, prompt))["X-PDConnect-Route"]
        assert route.startswith(f"pd; reason=uncached; prompt={len(prompt)}; hit=32;")  # the decider read the keys
        assert calls == [(False, len(prompt), BS)]  # one block size, once, off the loop
    finally:
        await router.close()
        await fakes.close()
        context.destroy(linger=0)
