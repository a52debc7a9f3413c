"""Sweep: the router's predicted hit equals a real vLLM KVCacheManager's hit, for every geometry.

Each case is one geometry a user can run (windows below one block, equal to it, between
and across several cache-hit alignments; mixed block sizes per group; EAGLE/MTP drop on
and off; `prefix_cache_retention_interval` sparse, dense and set) and a seeded stream of
prompt families (siblings, cuts, divergence inside the last window, multi-turn
extensions, resends). Before each prompt is served, the decider's prediction
(`lookup.predicted_hits` over the engine's groups as `parse_groups` reads them, on the
index built from the manager's published KV events alone) must equal what vLLM's own
`get_computed_blocks` reports for it, exactly. No fakes: the manager, its block pool and
its events are vLLM's (0.32 here, 0.33 in the compat suite).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.kvwire import decode_batch
from pdconnect.router.lookup import CacheGroup, CacheGroups, parse_groups, predicted_hits
from pdconnect.router.prompt import RoutingPrompt
from tests.vllm_kv_events import encoded_batch

# One geometry: groups as (kind, block size, window or None, eagle), retention interval
# (0: vLLM's default sparse retention; None: dense; >0: one tail per that many tokens).
Group = tuple[str, int, int | None, bool]
SWEEP: dict[str, tuple[tuple[Group, ...], int | None]] = {}


def _add(name: str, groups: tuple[Group, ...], retention: int | None = 0) -> None:
    SWEEP[name] = (groups, retention)


for _b in (16, 64):
    for _w in (_b // 2, _b, _b + 1, 2 * _b, 3 * _b + 7):  # below a block, one, one past, several
        _add(f"swa{_b}-w{_w}", (("full", _b, None, False), ("sliding", _b, _w, False)))
        _add(f"swa{_b}-w{_w}-eagle", (("full", _b, None, True), ("sliding", _b, _w, True)))
for _fa, _sw in ((64, 16), (128, 32), (256, 64)):  # full attention's block is the alignment
    for _w in (_sw // 2, _sw, 2 * _sw, _fa - 8, _fa, 200, 2 * _fa + _sw // 2):
        _add(f"fa{_fa}-swa{_sw}-w{_w}", (("full", _fa, None, False), ("sliding", _sw, _w, False)))
        _add(f"fa{_fa}-swa{_sw}-w{_w}-mtp", (("full", _fa, None, False), ("sliding", _sw, _w, True)))
# Windows just below and above multiples of the full-attention block, with the drop (MTP on
# the sliding group, EAGLE on both): a run of cdiv(w - 1, B) + 1 blocks spans one alignment
# segment more or less, and near the prompt's start it is clipped (issue 32's w544 case).
for _fa, _sw, _ws in ((256, 64, (255, 257, 511, 513, 543, 545, 769)), (128, 32, (127, 129, 255, 257, 385))):
    for _w in _ws:
        _add(f"fa{_fa}-swa{_sw}-w{_w}-mtp", (("full", _fa, None, False), ("sliding", _sw, _w, True)))
        _add(f"fa{_fa}-swa{_sw}-w{_w}-eagle", (("full", _fa, None, True), ("sliding", _sw, _w, True)))
# MiMo-V2 shape with MTP: two sliding groups of one spec (the MTP one drops), full last.
for _w in (128, 192, 200, 256):
    _add(f"mimo-w{_w}-mtp", (("sliding", 64, _w, True), ("sliding", 64, _w, True), ("full", 256, None, False)))
    _add(f"mimo-w{_w}", (("sliding", 64, _w, False), ("sliding", 64, _w, False), ("full", 256, None, False)))
# Several specs: sliding groups of two block sizes, and an alignment none of them has.
_add("fa64+swa16-w40+swa32-w100", (("full", 64, None, False), ("sliding", 16, 40, False), ("sliding", 32, 100, False)))
_add("fa32+swa48-w100", (("full", 32, None, False), ("sliding", 48, 100, False)))
_add("swa-only-32-w70", (("sliding", 32, 70, False),))
_add("full-only-32-eagle", (("full", 32, None, True),))
# Retention: dense (None) and a positive interval, on the shapes above.
for _name in ("fa256-swa64-w200", "fa128-swa32-w32-mtp", "mimo-w200-mtp", "swa16-w17"):
    _add(f"{_name}-dense", SWEEP[_name][0], None)
    _add(f"{_name}-every2", SWEEP[_name][0], 2 * max(b for _, b, _, _ in SWEEP[_name][0]))


# Geometries the index mispredicts (issue 32): each must fail until fixed.
KNOWN_WRONG: set[str] = set()


def _groups_text(groups: tuple[Group, ...]) -> CacheGroups:
    """The groups as the decider is configured with them (one entry per spec)."""
    specs = dict.fromkeys(
        str(CacheGroup("full" if kind == "full" else "sliding", size, window, eagle))
        for kind, size, window, eagle in groups
    )
    return parse_groups(",".join(specs))


def _geometry(groups: tuple[Group, ...], retention: int | None) -> Any:
    from connectors.geometry import Geometry, GroupGeometry

    return Geometry(
        tuple(
            GroupGeometry("full_attention" if kind == "full" else "sliding_window", size, window, eagle)
            for kind, size, window, eagle in groups
        ),
        retention_interval=retention,
    )


def _serve(manager: Any, request: Any, chunk: int, index: EngineKVIndex) -> None:
    """The scheduler's work for a prompt (`serve_prompt`); each step's KV events reach the
    index as one batch, as vLLM's publisher sends them."""
    from tests.kv_manager_steps import serve_prompt

    serve_prompt(manager, request, chunk, between_steps=lambda: _publish(index, manager.take_events()))
    _publish(index, manager.take_events())


def _publish(index: EngineKVIndex, events: list[Any]) -> None:
    """One step's events, encoded as vLLM's ZmqEventPublisher sends them."""
    index.apply(decode_batch(encoded_batch(events)))


def _prompts(rng: random.Random, window: int, count: int) -> list[tuple[str, list[int]]]:
    """A seeded stream of prompt families, each built from what came before it."""

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    history = [fresh(rng.randrange(300, 1500))]
    out = [("first", history[0])]
    while len(out) < count:
        base = rng.choice(history)
        family = rng.choice(("sibling", "cut", "cut-in-window", "diverge-in-window", "turn", "resend", "fresh"))
        if family == "sibling":
            tokens = base[: rng.randrange(0, len(base))] + fresh(rng.randrange(1, 400))
        elif family == "cut":
            tokens = base[: rng.randrange(1, len(base))]
        elif family == "cut-in-window":
            tokens = base[: max(1, len(base) - rng.randrange(1, window + 1))]
        elif family == "diverge-in-window":
            at = max(0, len(base) - rng.randrange(1, window + 1))
            tokens = [*base[:at], rng.randrange(30000, 31000), *base[at + 1 :]]
        elif family == "turn":
            tokens = base + fresh(rng.randrange(20, 500))
        elif family == "resend":
            tokens = list(base)
        else:
            tokens = fresh(rng.randrange(50, 1500))
        tokens = tokens[:3000]
        if len(tokens) < 2:
            continue
        history.append(tokens)
        out.append((family, tokens))
    return out


def _retention_supported() -> bool:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return "prefix_cache_retention_interval" in {f.name for f in dataclasses.fields(KVCacheConfig)}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="issue 32")) if n in KNOWN_WRONG else n
        for n in SWEEP
    ],
)
def test_the_predicted_hit_is_vllms_hit_for_every_geometry(name: str) -> None:
    from connectors.kvsim import make_request
    from tests.kv_manager_steps import events_manager

    groups, retention = SWEEP[name]
    if retention != 0 and not _retention_supported():
        pytest.skip("this vLLM has no prefix_cache_retention_interval: only its default retention exists")
    geometry = _geometry(groups, retention)
    manager = events_manager(geometry, num_blocks=6000)
    configured = _groups_text(groups)
    index = EngineKVIndex()
    rng = random.Random(name)
    window = max((w for _, _, w, _ in groups if w is not None), default=256)
    mismatches, hits = [], 0
    # Wide windows need more prompts before whole windows repeat (real hits to compare).
    for i, (family, tokens) in enumerate(_prompts(rng, window, max(14, window // 8))):
        _, real, _ = manager.get_computed_blocks(make_request(f"probe{i}", tokens, geometry.hash_block_size))
        predicted, _ = predicted_hits(configured, index, RoutingPrompt(tokens))
        if predicted != real:
            mismatches.append(f"#{i} {family} len {len(tokens)}: predicted {predicted}, vLLM {real}")
        hits += real > 0
        _serve(manager, make_request(f"r{i}", tokens, geometry.hash_block_size), rng.choice((10_000, 96)), index)
    assert not mismatches, "\n".join(mismatches)
    assert hits >= 3  # the comparison covered real hits, not only misses
