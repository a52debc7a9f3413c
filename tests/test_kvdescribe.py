"""Engines describe their KV cache groups: the connector's description, its wire form, and what the router does with it.

The description is built by the connector from a real vLLM KVCacheManager's cache rules,
published the way vLLM publishes the connector's events (its own `KVEventBatch`), read
by the router's index, and used (or refused) by the real decider.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec
import pytest

pytest.importorskip("vllm")

from pdconnect.kvdescribe import VERSION, DescribedGroup, EngineDescribed, difference, invalid_reason
from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.kvwire import decode_batch
from pdconnect.router.lookup import described_groups, parse_groups
from pdconnect.router.prompt import RoutingPrompt
from tests.test_router_decider import D0, DESCRIBED, HELD, TOKENS, FakeFeed, _decider, _engine, _index
from tests.vllm_kv_events import encoded_batch

D1 = "http://d1:8000"
Group = tuple[Literal["full_attention", "sliding_window"], int, int | None, bool]


def _real_description(groups: tuple[Group, ...], retention: int | None = 0) -> Any:
    """What the connector (`connectors.describe`) says of a real vLLM manager built for `groups`."""
    from connectors.describe import describe
    from connectors.geometry import Geometry, GroupGeometry
    from connectors.vllm_adapter import CacheRules, build_kv_cache_manager

    geometry = Geometry(tuple(GroupGeometry(*g) for g in groups), retention_interval=retention)
    manager = build_kv_cache_manager(geometry, num_blocks=64, max_model_len=4096, enable_kv_cache_events=True)
    return describe(CacheRules.for_manager(manager))


MIMO: tuple[Group, ...] = (
    ("sliding_window", 64, 200, True),
    ("sliding_window", 64, 200, True),
    ("full_attention", 256, None, False),
)


def test_the_connector_describes_mimo_v2_with_mtp_as_the_decider_must_look_it_up() -> None:
    described = _real_description(MIMO)
    assert described.version == VERSION and described.retention_interval == 0
    assert [(g.kind, g.block_size, g.sliding_window, g.drop) for g in described.groups] == list(MIMO)
    # The groups the operator used to type in by hand.
    assert described_groups(described) == parse_groups("full:256,sliding:64:200:eagle")


def test_under_eagle_every_group_drops_and_dense_retention_is_said() -> None:
    described = _real_description((("full_attention", 32, None, True), ("sliding_window", 32, 70, True)), None)
    assert described.retention_interval is None
    assert described_groups(described) == parse_groups("full:32:eagle,sliding:32:70:eagle")


def test_the_description_rides_vllms_own_event_batch_to_the_index() -> None:
    from vllm.distributed.kv_events import BlockRemoved

    described = _real_description(MIMO)
    payload = encoded_batch([BlockRemoved(block_hashes=[b"x"], medium="GPU"), described])
    batch = decode_batch(payload)
    assert batch.events[1] == described
    index = EngineKVIndex()
    assert index.apply_payload(payload)
    assert index.described == described


def test_the_describer_repeats_only_when_due() -> None:
    from connectors.describe import Describer

    now = [100.0]
    describer = Describer(DESCRIBED, every=10.0, clock=lambda: now[0])
    assert describer.take() == [DESCRIBED]
    now[0] += 9.9
    assert describer.take() == []
    now[0] += 0.2
    assert describer.take() == [DESCRIBED]


def _bad(**change: Any) -> EngineDescribed:
    return msgspec.structs.replace(DESCRIBED, **change)


@pytest.mark.parametrize(
    ("described", "reason"),
    [
        (_bad(version=VERSION + 1), "describe_version"),
        (_bad(groups=[]), "describe_groups"),
        (_bad(groups=[DescribedGroup("full_attention", 4, None, False)] * 65), "describe_groups"),
        (_bad(groups=[DescribedGroup("mamba", 4, None, False)]), "describe_kind"),
        (_bad(groups=[DescribedGroup("full_attention", 0, None, False)]), "describe_block_size"),
        (_bad(groups=[DescribedGroup("full_attention", 4, 8, False)]), "describe_window"),
        (_bad(groups=[DescribedGroup("sliding_window", 4, None, False)]), "describe_window"),
        (_bad(groups=[DescribedGroup("sliding_window", 4, -1, False)]), "describe_window"),
        (_bad(retention_interval=-4), "describe_retention"),
    ],
)
def test_an_unsound_description_is_counted_logged_and_not_applied(
    described: EngineDescribed, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert invalid_reason(described) == reason
    counted: list[str] = []
    index = EngineKVIndex(count=counted.append, engine=D0)
    index.apply(decode_batch(encoded_batch([DESCRIBED])))
    with caplog.at_level(logging.WARNING, logger="pdconnect.router.kvindex"):
        index.apply(decode_batch(encoded_batch([described])))
    assert counted == [reason]
    assert index.described == DESCRIBED  # the sound one held before stays
    assert any(D0 in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_a_description_of_the_wrong_types_is_counted_and_the_rest_of_its_batch_applied() -> None:
    from vllm.distributed.kv_events import KVEventBatch

    from tests.test_router_decider import _stored

    counted: list[str] = []
    index = EngineKVIndex(count=counted.append)
    malformed = {"type": "EngineDescribed", "version": "one", "groups": 7, "retention_interval": None}
    batch = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[_stored(range(2), 0, "full_attention")]))
    raw = msgspec.msgpack.decode(batch)
    raw[1].append(malformed)
    assert index.apply_payload(msgspec.msgpack.encode(raw))
    assert counted == ["undecodable"] and index.described is None
    assert index.groups[0].by_hash  # the store beside it was applied


def test_difference_names_the_first_field_that_differs() -> None:
    other = _bad(groups=[DESCRIBED.groups[0], DescribedGroup("sliding_window", 4, 8, False)])
    assert difference(DESCRIBED, DESCRIBED) is None
    assert difference(DESCRIBED, other) == "groups[1].sliding_window: 4 != 8"
    assert difference(DESCRIBED, _bad(retention_interval=None)) == "retention_interval: 0 != None"
    assert difference(DESCRIBED, _bad(groups=DESCRIBED.groups[:1])) == "group count: 2 != 1"


# --- the decider ------------------------------------------------------------------------------


def test_an_engine_not_yet_described_goes_pd() -> None:
    decider = _decider(FakeFeed({D0: _index(*HELD, described=None)}), override=None)
    route = decider.decide(_engine(), RoutingPrompt(TOKENS), {})
    assert (route.local, route.reason) == (False, "undescribed")


def test_described_groups_alone_decide_as_the_typed_in_ones_did() -> None:
    decider = _decider(FakeFeed({D0: _index(*HELD)}), override=None)
    route = decider.decide(_engine(), RoutingPrompt(TOKENS), {})
    assert (route.local, route.reason, route.hit) == (True, "cached", 28)


def test_engines_that_disagree_go_pd_with_both_named_until_one_leaves(caplog: pytest.LogCaptureFixture) -> None:
    wider = _bad(groups=[DESCRIBED.groups[0], DescribedGroup("sliding_window", 4, 8, False)])
    feed = FakeFeed({D0: _index(*HELD), D1: _index(*HELD, described=wider)})
    decider = _decider(feed, override=None)
    assert decider.decide(_engine(D0), RoutingPrompt(TOKENS), {}).reason == "cached"
    with caplog.at_level(logging.WARNING, logger="pdconnect.router.decider"):
        for url in (D1, D0, D1):
            route = decider.decide(_engine(url), RoutingPrompt(TOKENS), {})
            assert (route.local, route.reason) == (False, "groups_disagree")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # once per pair and difference
    assert D0 in lines[0] and D1 in lines[0] and "groups[1].sliding_window" in lines[0]
    feed.indexes[D1] = None  # D1 left the pool (or its events went stale)
    assert decider.decide(_engine(D0), RoutingPrompt(TOKENS), {}).reason == "cached"


def test_an_override_the_engine_contradicts_sends_its_requests_pd(caplog: pytest.LogCaptureFixture) -> None:
    decider = _decider(FakeFeed({D0: _index(*HELD)}), override=parse_groups("full:4,sliding:4:8"))
    with caplog.at_level(logging.WARNING, logger="pdconnect.router.decider"):
        route = decider.decide(_engine(), RoutingPrompt(TOKENS), {})
    assert (route.local, route.reason) == (False, "groups_override")
    assert any(D0 in r.getMessage() and "sliding:4:8" in r.getMessage() for r in caplog.records)
    matching = _decider(FakeFeed({D0: _index(*HELD)}), override=parse_groups("sliding:4:4,full:4"))
    assert matching.decide(_engine(), RoutingPrompt(TOKENS), {}).reason == "cached"
