"""A store the KV index cannot place: counted, logged with the engine and the reason, and
the decider predicts P/D for the prompts reaching into it, and only for those.

The stores come from a real vLLM KVCacheManager (the sweep's prompt stream on a geometry
where the index meets a store it cannot place); the decider is the real one, over the
real index.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from connectors.kvsim import make_request
from pdconnect.router.decider import DeciderSettings, DecodeFirstDecider
from pdconnect.router.engines import Engine, EngineRegistry, Role
from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.prompt import RoutingPrompt
from tests.test_router_kvindex_sweep import SWEEP, _geometry, _groups_text, _prompts, _serve

URL = "http://d0:8000"


class _Indexes:
    """The feed's `index(url)`, over the one real index (no subscription needed here)."""

    def __init__(self, index: EngineKVIndex) -> None:
        self._index = index

    def index(self, url: str) -> EngineKVIndex | None:
        return self._index if url == URL else None


def test_an_unplaceable_FAKE_store_is_counted_logged_and_routes_only_its_prompts_to_pd(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sweep's prompt stream on DeepSeek-V4-like full attention 256 + sliding 64, window
    128, MTP, from a real manager; then one FAKE sparse sliding store whose listed hash the
    index already holds for other content (what a corrupt or mixed-up publisher would send:
    the real manager's stores all place since issue 32's sweep is exact). What the index
    says and the decider decides."""
    from connectors.describe import describe
    from connectors.vllm_adapter import CacheRules, build_kv_cache_manager
    from pdconnect.router.kvwire import decode_batch
    from tests.vllm_kv_events import block_stored, encoded_batch

    name = "fa256-swa64-w128-mtp"
    groups, retention = SWEEP[name]
    geometry = _geometry(groups, retention)
    manager = build_kv_cache_manager(geometry, num_blocks=6000, max_model_len=4096, enable_kv_cache_events=True)
    counted: list[str] = []
    index = EngineKVIndex(count=counted.append, engine=URL)
    # The engine's connector describes its groups (what the decider replays the lookup over).
    index.apply(decode_batch(encoded_batch([describe(CacheRules.for_manager(manager))])))
    caplog.set_level(logging.DEBUG, logger="pdconnect.router.kvindex")
    rng = random.Random(name)
    for i, (_, tokens) in enumerate(_prompts(rng, 128, 14)):
        _serve(manager, make_request(f"r{i}", tokens, geometry.hash_block_size), rng.choice((10_000, 96)), index)
    assert "unanchored" not in counted
    held: Any = next(iter(index.groups[1].by_hash))  # bytes or int, as the publisher sends hashes
    lost = [rng.randrange(30000, 31000) for _ in range(600)]
    fake = block_stored([held], None, lost[:512], block_size=64, group=1, kind="sliding_window", window=128)
    index.apply(decode_batch(encoded_batch([fake])))
    assert counted.count("unanchored") == 1
    lines = [r for r in caplog.records if r.name == "pdconnect.router.kvindex"]
    assert lines and lines[0].levelno == logging.WARNING
    assert URL in lines[0].getMessage() and "contradicts_index" in lines[0].getMessage()

    assert index.unplaced_in(RoutingPrompt(lost))
    assert index.unplaced_in(RoutingPrompt([*lost[:-1], 7]))  # a sibling cut inside it
    # An unrelated conversation served next is placed, and its prompts are not affected.
    other = [rng.randrange(1000, 30000) for _ in range(700)]
    _serve(manager, make_request("other", other, geometry.hash_block_size), 96, index)
    assert counted.count("unanchored") == 1
    assert not index.unplaced_in(RoutingPrompt(other))

    settings = DeciderSettings(_groups_text(groups), 1 << 16, 1.0, 1 << 20)  # any predicted hit is small enough
    decider = DecodeFirstDecider(settings, _Indexes(index), RouterMetrics(EngineRegistry(lambda: None, probed=False)))  # type: ignore[arg-type, return-value]
    engine = Engine(url=URL, role=Role.DECODE, breaker=None)  # type: ignore[arg-type]
    unknown = decider.decide(engine, RoutingPrompt(lost), {})
    assert (unknown.local, unknown.reason) == (False, "unplaced")
    known = decider.decide(engine, RoutingPrompt(other), {})
    _, real, _ = manager.get_computed_blocks(make_request("probe", other, geometry.hash_block_size))
    assert (known.local, known.reason, known.hit) == (True, "cached", real) and real > 0
