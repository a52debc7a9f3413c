"""The kv-aware index (`router.kvindex`) fed by a FAKE publisher: batches built and encoded
with vLLM's own event classes (so the wire format is vLLM's, checked here), decoded by
pdconnect's mirror structs; hybrid hits need every group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from pdconnect.router.kvindex import EngineKVIndex  # noqa: E402
from pdconnect.router.kvwire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch  # noqa: E402
from pdconnect.router.prompt import RoutingPrompt  # noqa: E402
from tests.router_events_support import publish_until_applied  # noqa: E402
from tests.vllm_kv_events import block_stored, encoded_batch, stored_blocks  # noqa: E402
from tests.waiting import wait_until_async  # noqa: E402

if TYPE_CHECKING:
    from connectors.geometry import GroupKind

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4


def _stored(blocks: range, group: int, kind: str, window: int | None = None) -> object:
    """vLLM's BlockStored for consecutive blocks of TOKENS (hashes = block number + group tag)."""
    return stored_blocks(blocks, TOKENS, block_size=BS, group=group, kind=kind, window=window, tag=f"g{group}")


def _publish(index: EngineKVIndex, *events: object) -> None:
    """What a FAKE publisher sends: vLLM's KVEventBatch encoded the way ZmqEventPublisher does."""
    index.apply(decode_batch(encoded_batch(events)))


def test_vllm_batches_decode_into_our_mirror_structs() -> None:
    payload = msgspec.msgpack.Encoder().encode(
        kv_events.KVEventBatch(
            ts=1.5,
            events=[
                _stored(range(2), 1, "sliding_window", 8),
                kv_events.BlockRemoved(block_hashes=[b"g1b0"], medium="GPU", group_idx=1),
                kv_events.AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
    )
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.group_idx == 1 and stored.block_size == BS
    assert stored.kv_cache_spec_kind == "sliding_window" and stored.kv_cache_spec_sliding_window == 8
    assert stored.token_ids == TOKENS[:8] and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"g1b0"]
    assert isinstance(cleared, AllBlocksCleared) and batch.ts == 1.5


def test_full_attention_hit_is_the_stored_prefix_and_follows_removals() -> None:
    index = EngineKVIndex()
    _publish(index, _stored(range(3), 0, "full_attention"), _stored(range(3, 6), 0, "full_attention"))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 6 * BS
    assert index.hit_tokens(RoutingPrompt(TOKENS[:4] + [0] * 28)) == BS  # diverges in the second block
    _publish(index, kv_events.BlockRemoved(block_hashes=[b"g0b2"], medium="GPU", group_idx=0))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 2 * BS
    _publish(index, kv_events.AllBlocksCleared())
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0


def test_hybrid_hit_needs_the_window_tail_of_the_sliding_group_too() -> None:
    # Full attention holds 6 blocks; the sliding group (window 8 tokens = 2 blocks) evicted
    # its early blocks and holds blocks 2..4 only.
    index = EngineKVIndex()
    _publish(index, _stored(range(6), 0, "full_attention"), _stored(range(5), 1, "sliding_window", 8))
    _publish(index, kv_events.BlockRemoved(block_hashes=[b"g1b0", b"g1b1"], medium="GPU", group_idx=1))
    # 5 blocks: the window tail (blocks 3, 4) is there although blocks 0 and 1 are gone.
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 5 * BS
    # Without block 3 no length has its window tail (5 and 4 blocks need block 3, shorter
    # ones need blocks 0 or 1): no hit, though the full group alone would say 6 blocks.
    _publish(index, kv_events.BlockRemoved(block_hashes=[b"g1b3"], medium="GPU", group_idx=1))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0


def test_a_store_whose_parent_was_never_seen_is_not_indexed() -> None:
    index = EngineKVIndex(max_pending=3)
    _publish(index, _stored(range(2, 4), 0, "full_attention"))  # blocks 0, 1 missed
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0
    assert len(index.groups[0].pending) == 2 and index.groups[0].orphans == 0
    _publish(index, _stored(range(5, 7), 0, "full_attention"))  # more than max_pending wait
    assert len(index.groups[0].pending) == 3 and index.groups[0].orphans == 1
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0


def _window_tail(blocks: range, group: int, window: int) -> object:
    """A sliding group's store as vLLM sends it: the token range of `blocks`, hashes only
    for the last `window` tokens' blocks (the rest null or masked), and vLLM's hashes are
    the request's, shared by every group of the block size (`b{i}`, no group tag)."""
    tail = range(max(blocks.start, blocks.stop - window // BS), blocks.stop)
    return stored_blocks(blocks, TOKENS, block_size=BS, group=group, kind="sliding_window", window=window, hashed=tail)


def _full(blocks: range, group: int = 0) -> object:
    return stored_blocks(blocks, TOKENS, block_size=BS, group=group, kind="full_attention")


def test_window_tail_hashes_are_keyed_at_their_own_positions_through_the_full_group() -> None:
    # Before: the two tail hashes were paired with the range's first two blocks, so the
    # index called a 2-block prefix cached (wrong) and the 6-block one not (wrong).
    index = EngineKVIndex()
    _publish(index, _full(range(6)), _window_tail(range(6), 1, 2 * BS))
    assert index.hit_tokens(RoutingPrompt(TOKENS[: 6 * BS])) == 6 * BS
    assert index.hit_tokens(RoutingPrompt(TOKENS[: 2 * BS])) == 0  # block 0 and 1 of the sliding group are gone


def test_a_window_run_published_before_its_full_attention_blocks_waits_for_them() -> None:
    # A decode engine publishing a pulled window tail (replay slack) whose parent it never
    # stored, one batch before the full-attention blocks of the same prompt.
    index = EngineKVIndex()
    _publish(index, _window_tail(range(3, 5), 1, 2 * BS))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0 and len(index.groups[1].pending) == 2
    _publish(index, _full(range(6)))
    assert index.groups[1].pending == {} and index.groups[1].orphans == 0
    assert index.hit_tokens(RoutingPrompt(TOKENS[: 5 * BS])) == 5 * BS
    assert index.hit_tokens(RoutingPrompt(TOKENS[: 6 * BS])) == 5 * BS  # block 5's window tail (4, 5) is not all there


# --- the kv-aware policy end to end: FAKE engines, a FAKE publisher with vLLM's classes ------


def _word_tokenizer(path: str) -> str:
    """A WordLevel tokenizer where word `w<i>` is token id i (what the engines would use)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)} | {"[UNK]": 200}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(path)
    return path


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt_kind", ["token-ids", "text-with-tokenizer"])
async def test_kv_aware_routes_to_the_engine_that_really_caches_the_prompt_and_to_affinity_before(
    prompt_kind: str, tmp_path: Any
) -> None:
    import asyncio

    import aiohttp
    import zmq

    from pdconnect.router import start_router
    from pdconnect.testbed.fake_engine import FakeCluster
    from tests.router_support import router_config_for

    fakes = await FakeCluster.start(prefill=1, decode=2)
    context = zmq.Context()
    publishers = {url: context.socket(zmq.PUB) for url in fakes.decode_urls}
    endpoints = {}
    for url, socket in publishers.items():
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        endpoints[url] = [f"tcp://127.0.0.1:{port}"]
    router = await start_router(
        router_config_for(
            fakes,
            policy="kv-aware",
            kv_events_endpoints=endpoints,
            **({"tokenizer": _word_tokenizer(str(tmp_path / "tokenizer.json"))} if prompt_kind != "token-ids" else {}),
        )
    )
    prompt: Any = TOKENS if prompt_kind == "token-ids" else " ".join(f"w{t}" for t in TOKENS)
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(15):

            async def decode_engine() -> str:
                async with http.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["X-PDConnect-Decode"]

            # No events yet: prefix affinity decides, and keeps deciding the same.
            by_affinity = await decode_engine()
            assert await decode_engine() == by_affinity
            # The other engine reports (through its FAKE publisher) that it holds the prompt.
            other = next(url for url in fakes.decode_urls if url != by_affinity)
            batch = msgspec.msgpack.Encoder().encode(
                kv_events.KVEventBatch(ts=0.0, events=[_stored(range(8), 0, "full_attention")])
            )
            await publish_until_applied(router, publishers[other], batch)
            assert await decode_engine() == other
    finally:
        await router.close()
        await fakes.close()
        context.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_sequence_gap_without_replay_drops_the_index_until_it_is_rebuilt() -> None:
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    counted: list[str] = []
    feed = KVEventsFeed(lambda url, dp_rank: None, counted.append)
    sub = _Subscription("http://fake-d0:8000", "tcp://fake-d0:5557", None)
    feed._subs[sub.name] = sub

    def frames(seq: int, *events: object) -> list[bytes]:
        batch = kv_events.KVEventBatch(ts=0.0, events=list(events))
        return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]

    try:
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) is None  # nothing heard: not fresh, affinity decides
        await feed._receive(sub, frames(0, _stored(range(4), 0, "full_attention")))
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 4 * BS
        # Batches 1 and 2 are lost (one of them may have removed blocks): the index cannot
        # be trusted, so it starts over from batch 3.
        await feed._receive(sub, frames(3, _stored(range(4, 6), 0, "full_attention")))
        assert counted.count("gap") == 1
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 0  # blocks 4, 5 alone are no prefix
        await feed._receive(sub, frames(4, _stored(range(2), 0, "full_attention")))
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 2 * BS
    finally:
        await feed.close()


# --- against vLLM's own KV cache manager: what the events say vs what its lookup finds ------


# name: (groups as (kind, block size, window), hash block size, prefix length, shares, tails)
_HYBRID_GEOMETRIES: dict[
    str, tuple[tuple[tuple[GroupKind, int, int | None], ...], int, int, tuple[int, ...], tuple[int, ...]]
] = {
    # Hybrid Llama-like: both groups of one block size.
    "fa16+swa16": (
        (("full_attention", 16, None), ("sliding_window", 16, 32)),
        16,
        300,
        (0, 40, 100, 160, 230, 300),
        (5, 40, 90),
    ),
    # MiMo-V2 / DeepSeek-V4-like: 256-token full attention, two 64-token sliding groups,
    # hashed at 64: the sliding stores list hashes no group of their own size ever keys.
    "fa256+2xswa64": (
        (("full_attention", 256, None), ("sliding_window", 64, 128), ("sliding_window", 64, 128)),
        64,
        1200,
        (0, 300, 600, 900, 1200),
        (5, 70, 300),
    ),
}


@pytest.mark.parametrize("geometry_name", list(_HYBRID_GEOMETRIES))
@pytest.mark.parametrize("chunk", [10_000, 48], ids=["whole-prompt", "chunked-prefill"])
def test_the_index_finds_what_vllms_own_lookup_finds_on_a_hybrid_model(chunk: int, geometry_name: str) -> None:
    """Prompts served by a real vLLM KVCacheManager (full attention + sliding window, events
    on): for every later sibling, the index built from the published events alone must
    report the hit vLLM's own lookup gives. vLLM leaves the sliding group's out-of-window
    and masked blocks out of a store's hashes while its token range covers them all."""
    import random

    from connectors.geometry import Geometry, GroupGeometry
    from connectors.kvsim import make_request
    from tests.kv_manager_steps import events_manager, serve_prompt

    groups, hash_block, prefix_len, shares, tails = _HYBRID_GEOMETRIES[geometry_name]
    geometry = Geometry(
        tuple(
            GroupGeometry(kind, size) if window is None else GroupGeometry(kind, size, window)
            for kind, size, window in groups
        )
    )
    manager = events_manager(geometry, num_blocks=800)
    index = EngineKVIndex()
    rng = random.Random(5)
    prefix = [rng.randrange(1000, 30000) for _ in range(prefix_len)]
    served = 0
    for i in range(14):
        shared = rng.choice(shares)
        tokens = prefix[:shared] + [rng.randrange(1000, 30000) for _ in range(rng.choice(tails))]
        probe = make_request(f"probe{i}", tokens, hash_block)
        _, real_hit, _ = manager.get_computed_blocks(probe)
        # vLLM looks up at most num_tokens - 1 tokens (one must be computed for logits).
        assert index.hit_tokens(RoutingPrompt(tokens[: len(tokens) - 1])) == real_hit, (
            f"sibling {i} sharing {shared} tokens"
        )
        served += real_hit > 0
        serve_prompt(manager, make_request(f"r{i}", tokens, hash_block), chunk)
        _publish(index, *manager.take_events())
    assert served >= 4  # the comparison covered real hits, not only misses


# MiMo-V2 with its MTP layer, as the engine's scheduler lays it out: two 64-token sliding
# groups (window 128; the MTP layer's group takes the drop, the other shares its spec) and
# 256-token full attention last, vLLM's default sparse retention. Prompts (prefix share,
# new tokens): siblings, cuts, an unrelated prompt and its extension, a resend.
_MIMO_MTP_PROMPTS = [(1200, 0), (1200, 64), (700, 0), (0, 600), (1264, 150), (1200, 0), (1000, 300), (0, 450)]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_index_predicts_a_mimo_mtp_engines_own_hit_after_p_d_loads(kind: str) -> None:
    """A P/D pair of real vLLM managers on MiMo-V2 + MTP geometry, our connector's loads and
    slack publishing included (`connectors.kvsim`): before each request, the index built
    from one engine's events alone must give that engine's own lookup's hit. A decode engine
    publishes the slack runs itself, a prefill engine's core its replay boundaries' runs;
    both list a sliding store's hashes sparsely, and MTP keeps the block after each boundary."""
    import random

    from connectors.geometry import Geometry, GroupGeometry
    from connectors.kvsim import PrefillDecodePair

    geometry = Geometry(
        (
            GroupGeometry("sliding_window", 64, 128, eagle=True),
            GroupGeometry("sliding_window", 64, 128),
            GroupGeometry("full_attention", 256),
        )
    )
    pair = PrefillDecodePair.create(geometry, 2000, kv_events=True)
    engine = pair.decode if kind == "decode" else pair.prefill
    index = EngineKVIndex()
    rng = random.Random(7)
    prefix = [rng.randrange(1000, 30000) for _ in range(1400)]
    hits = []
    for i, (shared, new) in enumerate(_MIMO_MTP_PROMPTS):
        tokens = prefix[:shared] + [rng.randrange(1000, 30000) for _ in range(new)]
        real = engine.lookup(engine.new_request(f"probe{i}", tokens))
        assert index.hit_tokens(RoutingPrompt(tokens), eagle_groups={0, 1}) == real, f"request {i}: {shared}+{new}"
        hits.append(real)
        pair.serve(f"r{i}", tokens)
        _publish(index, *engine.manager.take_events())
    assert sum(hit > 0 for hit in hits) >= 3, hits  # the comparison covered real hits


def _fine_store(group: int, hashes: list[str], size: int, kind: str, window: int | None = None) -> BlockStored:
    """One of our own stores over all of TOKENS (8 blocks of 4, 4 of 8)."""
    return BlockStored(
        block_hashes=[h.encode() for h in hashes],
        token_ids=TOKENS,
        block_size=size,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def _mixed_index(*sliding: BlockStored) -> tuple[EngineKVIndex, list[str]]:
    """Full attention in blocks of 16, hashed at 4 the way vLLM does: a 16-block's hash is
    its last 4-block's, so the full group lists the 4-level hashes h3 and h7 (blocks 3, 7
    end the 16-token boundaries); in the same batch (as vLLM publishes a step's stores), the
    `sliding` stores (window 8 over blocks of 4: cdiv(7, 4) = 2 blocks before a boundary),
    after it or before it."""
    from pdconnect.router.kvwire import KVEventBatch

    counted: list[str] = []
    index = EngineKVIndex(count=counted.append)
    full = _fine_store(0, ["h3", "h7"], 16, "full_attention")
    index.apply(KVEventBatch(0.0, [*sliding[:1], full, *sliding[1:]]))
    return index, counted


def test_a_sparse_sliding_store_is_placed_by_its_anchors_in_the_finest_key_space() -> None:
    # vLLM kept the runs ending at the 16-token boundaries (blocks 2, 3 and 6, 7), masked
    # the others; the sliding store comes first in its batch, as on MiMo-V2.
    index, counted = _mixed_index(_fine_store(1, ["h2", "h3", "h6", "h7"], 4, "sliding_window", 8))
    assert index.granularity == 4 and not counted
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 32  # blocks 6, 7 before the end
    assert index.hit_tokens(RoutingPrompt(TOKENS[:24])) == 16  # blocks 4, 5 are masked; 2, 3 serve 16 tokens
    assert index.hit_tokens(RoutingPrompt(TOKENS[:16] + [0] * 16)) == 16


def test_under_mtp_the_block_after_each_boundary_is_placed_after_its_anchor() -> None:
    # A drafting group keeps the block after each boundary too (2, 3, 4 and 6, 7), which
    # its lookup matches and drops back from.
    index, counted = _mixed_index(_fine_store(1, ["h2", "h3", "x4", "h6", "h7"], 4, "sliding_window", 8))
    assert not counted
    # 23 tokens looked up: full attention serves 16; the window's run 2, 3, 4 ends past 16
    # and drops back to it. Had x4 been put anywhere else, nothing would be served.
    assert index.hit_tokens(RoutingPrompt(TOKENS[:20] + [0] * 4), eagle_groups={1}) == 16


def test_a_published_slack_run_is_the_run_ending_at_its_range_end() -> None:
    # Our decode connector publishes a slack run as a store from the prompt's start whose
    # last blocks are the run: with its anchor (2, 3, 4 around 16) and without (6 alone).
    def slack(hashes: list[str], blocks: int) -> BlockStored:
        return BlockStored(
            block_hashes=[h.encode() for h in hashes],
            token_ids=TOKENS[: 4 * blocks],
            block_size=4,
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=8,
        )

    index, counted = _mixed_index(slack(["h2", "h3", "x4"], 5), slack(["x6"], 7))
    assert not counted
    assert index.hit_tokens(RoutingPrompt(TOKENS[:20] + [0] * 4), eagle_groups={1}) == 16
    assert b"x6" in index.groups[1].by_hash and not index.groups[1].pending


def test_a_block_removed_later_in_the_batch_of_its_waiting_store_stays_removed() -> None:
    # The sparse store is read after its batch, but a removal after it in the batch wins.
    from pdconnect.router.kvwire import KVEventBatch

    counted: list[str] = []
    index = EngineKVIndex(count=counted.append)
    sliding = _fine_store(1, ["h2", "h3", "h6", "h7"], 4, "sliding_window", 8)
    full = _fine_store(0, ["h3", "h7"], 16, "full_attention")
    index.apply(KVEventBatch(0.0, [sliding, full, BlockRemoved(block_hashes=[b"h6"], group_idx=1)]))
    assert not counted and sorted(index.groups[1].by_hash) == [b"h2", b"h3", b"h7"]


@pytest.mark.parametrize(
    "hashes",
    [["a", "b", "c", "d", "h3"], ["h7", "h3"], ["h3", "b", "c", "d", "e", "f"]],
    ids=["run-longer-than-its-room", "anchors-out-of-order", "tail-longer-than-the-range"],
)
def test_a_sparse_store_whose_runs_do_not_fit_keys_only_its_anchors(hashes: list[str]) -> None:
    index, counted = _mixed_index(_fine_store(1, hashes, 4, "sliding_window", 8))
    assert counted == ["unanchored"]
    sliding = index.groups[1]
    anchored = [h.encode() for h in hashes if h.startswith("h")]
    assert sorted(sliding.by_hash) == sorted(anchored)  # the rest waits, unplaced
    assert sorted(sliding.pending) == sorted(h.encode() for h in hashes if not h.startswith("h"))


def test_a_finer_group_appearing_later_starts_the_index_over() -> None:
    from pdconnect.router.kvwire import KVEventBatch

    index, counted = _mixed_index()
    assert index.granularity == 16 and index.hit_tokens(RoutingPrompt(TOKENS)) == 32
    index.apply(KVEventBatch(0.0, [_fine_store(1, ["h6", "h7"], 4, "sliding_window", 8)]))
    assert counted == ["granularity"] and index.granularity == 4
    assert list(index.groups) == [1]  # the full group's 16-level keys are gone with it


# --- untrusted events: every field of every event type, any engine ---------------------------


def _raw_event(tag: str, **fields: Any) -> dict[str, Any]:
    """An event as it travels (a msgpack map with vLLM's `type` tag), any field any value."""
    return {"type": tag, **fields}


def _raw_payload(*events: Any) -> bytes:
    return msgspec.msgpack.encode([0.0, list(events)])


def _stored_fields(blocks: range, group: int = 0, tokens: list[int] = TOKENS, tag: str = "g0") -> dict[str, Any]:
    first, last = blocks.start, blocks.stop
    return {
        "block_hashes": [f"{tag}b{i}".encode() for i in blocks],
        "parent_block_hash": f"{tag}b{first - 1}".encode() if first else None,
        "token_ids": tokens[first * BS : last * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": group,
        "kv_cache_spec_kind": "full_attention",
    }


def test_a_store_with_block_size_zero_is_dropped_and_later_lookups_still_answer() -> None:
    # Before: the zero-sized group made every later lookup divide by zero.
    index = EngineKVIndex()
    _publish(index, _stored(range(4), 0, "full_attention"))
    bad = kv_events.BlockStored(
        block_hashes=[b"x"],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=1,
    )
    _publish(index, bad)
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 4 * BS


# Values that break a field's type or range, for the fuzz below: the Struct definitions say
# which fields exist; every one gets every value.
_BAD_VALUES: list[Any] = [
    None,
    0,
    -1,
    1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    float("nan"),
    "",
    "x" * 1000,
    b"",
    b"\x00" * 200,
    [],
    [None],
    [1.5],
    ["a"],
    [-1],
    [2**40],
    [[1]],
    [b""],
    [b"h" * 100],
    {"a": 1},
    True,
    list(range(7)),
]
_OTHER = list(range(500, 532))  # another prompt's tokens: whatever happens to it, TOKENS' hit must hold


def _fuzz_cases() -> list[tuple[str, str, Any]]:
    cases = []
    for struct in (BlockStored, BlockRemoved):
        for name in struct.__struct_fields__:
            cases += [(struct.__name__, name, value) for value in _BAD_VALUES]
    return cases


@pytest.mark.asyncio
async def test_any_malformed_field_of_any_event_is_dropped_and_lookups_stay_right() -> None:
    """For every field of the event structs and every bad value: the event goes through the
    feed as an engine would send it, between valid batches; nothing raises, and the valid
    blocks still answer (the fuzzed event concerns another prompt's blocks)."""
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    failures = []
    for tag, name, value in _fuzz_cases():
        counted: list[str] = []
        feed = KVEventsFeed(lambda url, dp_rank: None, counted.append)
        sub = _Subscription("http://fake-d0:8000", "tcp://fake-d0:5557", None)
        feed._subs[sub.name] = sub
        valid = _raw_event("BlockStored", **_stored_fields(range(6)))
        other = _stored_fields(range(8), tokens=_OTHER, tag="o")
        if tag == "BlockStored":
            fuzzed = _raw_event(tag, **(other | {name: value}))
        else:
            fuzzed = _raw_event(tag, **({"block_hashes": [b"ob0"], "medium": "GPU", "group_idx": 0} | {name: value}))
        try:
            await feed._receive(sub, [b"", (0).to_bytes(8, "big"), _raw_payload(valid)])
            await feed._receive(sub, [b"", (1).to_bytes(8, "big"), _raw_payload(fuzzed, valid)])
            await feed._receive(
                sub,
                [b"", (2).to_bytes(8, "big"), _raw_payload(_raw_event("BlockStored", **_stored_fields(range(6, 8))))],
            )
            hit = feed.hit_tokens(sub.name, RoutingPrompt(TOKENS))
        except Exception as exc:  # noqa: BLE001 - collected: the assertion lists them all
            failures.append(f"{tag}.{name}={value!r:.40}: raised {exc!r:.80}")
            continue
        finally:
            await feed.close()
        # The valid store after the fuzzed event re-proves blocks 0..5 even if an unreadable
        # removal emptied the index. Only a well-formed store into a group never seen adds
        # a group every hit then needs (an engine's groups all publish): 0, never more.
        new_group = name == "group_idx" and type(value) is int and 0 < value < 256
        if hit != 8 * BS and not (new_group and hit == 0):
            failures.append(f"{tag}.{name}={value!r:.40}: hit {hit}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode(5),
        msgspec.msgpack.encode([1.0, 5]),
        msgspec.msgpack.encode(["t", [5, "x", None]]),
        b"\x92\xcb" + b"\x00" * 3,
        b"\x91" * 100_000 + b"\xc0",  # nesting deeper than any decoder recurses
        b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 100_000 + b"\xc0",
    ],
)
def test_a_batch_that_is_no_batch_is_refused_and_the_index_dropped(payload: bytes) -> None:
    index = EngineKVIndex()
    _publish(index, _stored(range(4), 0, "full_attention"))
    counted: list[str] = []
    index.count = counted.append
    applied = index.apply_payload(payload)
    assert index.hit_tokens(RoutingPrompt(TOKENS)) in (0, 4 * BS)
    assert not applied or counted  # either refused as a whole, or each bad event counted


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -4}, "block_size"),
        ({"block_size": 1 << 40}, "block_size"),
        ({"token_ids": list(range(6))}, "token_ids"),
        ({"token_ids": [-1] * 8}, "token_ids"),
        ({"token_ids": [5, 6, 7, -1, 8, 9, 10, 11]}, "token_ids"),  # any id, not only the first
        ({"token_ids": [5, 6, 7, 8, 9, 10, 11, 1 << 32]}, "token_ids"),  # MAX_TOKEN_ID is exclusive
        ({"block_hashes": [b"a", b"b", b"c"]}, "hashes"),
        ({"block_hashes": [b"a" * 65, b"b"]}, "hashes"),
        ({"block_hashes": [], "block_size": 0}, "block_size"),
        ({"group_idx": -1}, "group"),
        ({"group_idx": 10**6}, "group"),
        ({"kv_cache_spec_kind": "sliding_window"}, "window"),
        ({"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 0}, "window"),
        ({"lora_id": -3}, "lora"),
        ({"medium": "G" * 1000}, "medium"),
        ({"parent_block_hash": b""}, "parent"),
        ({"block_size": 8, "token_ids": TOKENS[:8], "block_hashes": [b"g0b0"]}, "group_mismatch"),
    ],
)
def test_an_invalid_store_is_counted_by_reason_and_changes_nothing(fields: dict[str, Any], reason: str) -> None:
    counted: list[str] = []
    index = EngineKVIndex(count=counted.append)
    _publish(index, _stored(range(4), 0, "full_attention"))
    base = _stored_fields(range(2), tokens=_OTHER, tag="o")
    assert index.apply_payload(_raw_payload(_raw_event("BlockStored", **(base | fields))))
    assert counted == [reason]
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 4 * BS and index.hit_tokens(RoutingPrompt(_OTHER)) == 0


def test_a_removal_with_malformed_hashes_still_removes_the_well_formed_ones() -> None:
    counted: list[str] = []
    index = EngineKVIndex(count=counted.append)
    _publish(index, _stored(range(6), 0, "full_attention"))
    assert index.apply_payload(_raw_payload(_raw_event("BlockRemoved", block_hashes=[1.5, b"g0b3", "x"], medium="GPU")))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 3 * BS and "undecodable" in counted
    # An unknown group: removed from every group, the side that never over-reports.
    assert index.apply_payload(_raw_payload(_raw_event("BlockRemoved", block_hashes=[b"g0b1"], group_idx=-5)))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == BS and "group" in counted


def test_an_engines_index_holds_at_most_max_blocks_and_evicts_the_oldest() -> None:
    counted: list[str] = []
    index = EngineKVIndex(max_blocks=4, count=counted.append)
    _publish(index, _stored(range(3), 0, "full_attention"))
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 3 * BS
    _publish(index, _stored(range(3, 6), 0, "full_attention"))  # 6 blocks: blocks 0 and 1 go
    assert len(index.groups[0].by_hash) == 4 and counted == ["index_full", "index_full"]
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 0  # the prefix lost its first blocks: no hit, never a false one
    other = EngineKVIndex(max_blocks=4)
    _publish(other, _stored(range(4), 0, "full_attention"))
    assert other.hit_tokens(RoutingPrompt(TOKENS)) == 4 * BS  # at the bound, nothing evicted


def test_the_block_bound_holds_for_all_groups_of_an_engine_together() -> None:
    counted: list[str] = []
    index = EngineKVIndex(max_blocks=4, count=counted.append)
    _publish(index, _stored(range(3), 0, "full_attention"), _stored(range(3), 1, "sliding_window", 8))
    # Group 1's second and third blocks each evict its own oldest: 3 + 1 held.
    assert [len(g.by_hash) for g in index.groups.values()] == [3, 1] and index.budget.held == 4
    assert counted == ["index_full", "index_full"]
    full = EngineKVIndex(max_blocks=2, count=counted.append)
    _publish(full, _stored(range(2), 0, "full_attention"), _stored(range(1), 1, "sliding_window", 8))
    assert len(full.groups[1].by_hash) == 0 and full.budget.held == 2  # refused: group 1 held nothing
    _publish(full, kv_events.AllBlocksCleared(), _stored(range(2), 0, "full_attention"))
    assert full.budget.held == 2 and full.hit_tokens(RoutingPrompt(TOKENS)) == 2 * BS


def test_subscriber_sockets_cap_message_size() -> None:
    import zmq

    from pdconnect.router.kvevents import KVEventsFeed

    feed = KVEventsFeed(lambda url, dp_rank: None, max_message_bytes=4096)
    try:
        for kind in (zmq.SUB, zmq.DEALER):
            socket = feed._socket(kind)
            hwm = socket.getsockopt(zmq.RCVHWM)
            assert socket.getsockopt(zmq.MAXMSGSIZE) == 4096 and isinstance(hwm, int) and hwm > 0
            socket.close(linger=0)
    finally:
        feed._context.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_frame_over_the_cap_never_reaches_the_index_and_the_feed_keeps_going() -> None:

    import zmq

    from pdconnect.router.kvevents import KVEventsFeed

    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    url = "http://fake-d0:8000"
    counted: list[str] = []
    feed = KVEventsFeed(lambda u, dp_rank: (f"tcp://127.0.0.1:{port}", None), counted.append, max_message_bytes=2048)
    long_tokens = list(range(4096))
    big = msgspec.msgpack.encode(
        kv_events.KVEventBatch(
            ts=0.0,
            events=[
                kv_events.BlockStored(
                    block_hashes=[f"L{i}".encode() for i in range(1024)],
                    parent_block_hash=None,
                    token_ids=long_tokens,
                    block_size=BS,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ],
        )
    )

    def small(blocks: int) -> bytes:
        return msgspec.msgpack.encode(
            kv_events.KVEventBatch(ts=0.0, events=[_stored(range(blocks), 0, "full_attention")])
        )

    assert len(big) > 2048 > len(small(6))
    try:
        feed.watch(url)
        seq = 0

        def hit() -> int | None:
            return feed.hit_tokens(url, RoutingPrompt(TOKENS))

        def heard(blocks: int) -> bool:  # publish until heard: a SUB (re)joins asynchronously
            nonlocal seq
            pub.send_multipart([b"", seq.to_bytes(8, "big"), small(blocks)])
            seq += 1
            return hit() == blocks * BS

        await wait_until_async(lambda: heard(4), "the feed to hear the publisher", 15, observe=hit)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), big])  # ZMQ drops the connection
        seq += 1
        await wait_until_async(lambda: heard(6), "the feed to go on after the SUB reconnects", 15, observe=hit)
        assert feed.hit_tokens(url, RoutingPrompt(long_tokens)) == 0
    finally:
        await feed.close()
        context.destroy(linger=0)


# --- sequence numbers and replay answers ------------------------------------------------------


def _frames(seq: int, *events: object) -> list[bytes]:
    batch = kv_events.KVEventBatch(ts=0.0, events=list(events))
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]


def _replayed(seq: int, *events: object) -> list[bytes]:
    """A replay answer as vLLM's publisher sends it (the DEALER's view): empty, topic, seq, batch."""
    return [b"", *_frames(seq, *events)]


_REPLAY_END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


async def _replay_server(answers: list[list[bytes]]) -> tuple[str, Any, Any]:
    """A FAKE engine replay socket (ROUTER): to any request, sends `answers` in order."""
    import asyncio

    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            identity, _, _start = await router.recv_multipart()
            for frames in answers:
                await router.send_multipart([identity, *frames])

    task = asyncio.get_running_loop().create_task(serve())
    return f"tcp://127.0.0.1:{port}", task, context


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", ["starts-late", "garbage-frames", "garbage-payload"])
async def test_a_replay_that_cannot_fill_the_gap_drops_the_index(answer: str) -> None:
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    # Batch 0 stores blocks 0..5; batch 1 (lost) removes block 0; batch 2 stores nothing new.
    lost_removal = kv_events.BlockRemoved(block_hashes=[b"g0b0"], medium="GPU", group_idx=0)
    answers = {
        "starts-late": [_replayed(2, _stored(range(6, 8), 0, "full_attention")), _REPLAY_END],
        "garbage-frames": [[b"", b"", b"\x01\x02", b"zz"], _REPLAY_END],
        "garbage-payload": [[b"", b"", (1).to_bytes(8, "big"), b"\xc1garbage"], _REPLAY_END],
    }[answer]
    endpoint, server, context = await _replay_server(answers)
    counted: list[str] = []
    feed = KVEventsFeed(lambda url, dp_rank: None, counted.append)
    sub = _Subscription("http://fake-d0:8000", "tcp://fake-d0:5557", endpoint)
    feed._subs[sub.name] = sub
    try:
        await feed._receive(sub, _frames(0, _stored(range(6), 0, "full_attention")))
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 6 * BS
        del lost_removal  # never delivered: that is the point
        await feed._receive(sub, _frames(3, _stored(range(6, 8), 0, "full_attention")))
        # Before: a late-starting replay was applied on top of the old index, which kept
        # claiming block 0. The index may only hold what batches from the gap on proved.
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 0
        await feed._receive(sub, _frames(4, _stored(range(2), 0, "full_attention")))
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 2 * BS
    finally:
        server.cancel()
        await feed.close()
        context.destroy(linger=0)


@pytest.mark.asyncio
async def test_live_copies_of_replayed_batches_are_skipped_not_taken_for_a_restart() -> None:
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    replay = [
        _replayed(1, _stored(range(4, 5), 0, "full_attention")),
        _replayed(2, _stored(range(5, 6), 0, "full_attention")),
        _replayed(3, _stored(range(6, 7), 0, "full_attention")),
        _REPLAY_END,
    ]
    endpoint, server, context = await _replay_server(replay)
    counted: list[str] = []
    feed = KVEventsFeed(lambda url, dp_rank: None, counted.append)
    sub = _Subscription("http://fake-d0:8000", "tcp://fake-d0:5557", endpoint)
    feed._subs[sub.name] = sub
    try:
        await feed._receive(sub, _frames(0, _stored(range(4), 0, "full_attention")))
        await feed._receive(sub, _frames(2, _stored(range(5, 6), 0, "full_attention")))  # 1 lost: replayed 1..3
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 7 * BS
        await feed._receive(sub, _frames(3, _stored(range(6, 7), 0, "full_attention")))  # the live copy of 3
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 7 * BS and "restart" not in counted
        await feed._receive(sub, _frames(0, kv_events.AllBlocksCleared()))  # a real restart: numbering from 0
        assert "restart" in counted and feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 0
    finally:
        server.cancel()
        await feed.close()
        context.destroy(linger=0)


# --- the lookup: vLLM's semantics, linear cost -------------------------------------------------


def _reference_hit(index: EngineKVIndex, tokens: list[int]) -> int:
    """The previous lookup, kept as the slow reference: walk down from the full-attention
    limit and re-check every group at every aligned length (quadratic), with vLLM's window
    rule (the max(1, ceil((w - 1) / b)) blocks before the end)."""
    import math

    from pdconnect.router.prompt import block_keys

    groups = list(index.groups.values())
    if not groups:
        return 0
    step = math.lcm(*(g.block_size for g in groups))
    grain = math.gcd(*(g.block_size for g in groups))
    keys = {g.block_size: block_keys(tokens, g.block_size, grain) for g in groups}

    def serves(g: Any, length: int) -> bool:
        end = length // g.block_size
        start = 0
        if g.sliding_window is not None:
            start = max(0, end - max(1, -(-(g.sliding_window - 1) // g.block_size)))
        return all(key in g.present for key in keys[g.block_size][start:end])

    for length in range(len(tokens) // step * step, 0, -step):
        if all(serves(g, length) for g in groups):
            return length
    return 0


# name -> groups as (block size, sliding window or None)
_LOOKUP_GEOMETRIES = {
    "fa16+swa16w128": ((16, None), (16, 128)),
    "fa64+fa64+swa256w512 (MiMo-V2-like sizes)": ((64, None), (64, None), (256, 512)),
    "fa256+swa64w128+swa64w200": ((256, None), (64, 128), (64, 200)),
    "fa16+swa16w100 (window not a block multiple)": ((16, None), (16, 100)),
    "fa16+swa16w129 (window one past a multiple)": ((16, None), (16, 129)),
    "swa16w48+swa32w100 (no full attention)": ((16, 48), (32, 100)),
}


def _random_index(
    rng: Any, geometry: tuple[tuple[int, int | None], ...], tokens: list[int]
) -> tuple[EngineKVIndex, dict[int, set[int]]]:
    """An index whose groups hold random blocks of `tokens` (runs, holes, evicted heads), and
    the same content as logical block indices per group."""
    import math

    from pdconnect.router.kvindex import GroupIndex
    from pdconnect.router.prompt import block_keys

    index, cached = EngineKVIndex(), {}
    grain = math.gcd(*(size for size, _ in geometry))  # the engine's key space
    for gid, (size, window) in enumerate(geometry):
        keys = block_keys(tokens, size, grain)
        shape = rng.random()
        if shape < 0.3:  # a prefix, then holes
            held = set(range(rng.randrange(len(keys) + 1)))
        else:
            density = rng.choice([0.5, 0.8, 0.95, 1.0])
            held = {i for i in range(len(keys)) if rng.random() < density}
        group = index.groups[gid] = GroupIndex(size, window)
        group.present = {keys[i]: 1 for i in held}
        cached[gid] = held
    return index, cached


@pytest.mark.parametrize("name", list(_LOOKUP_GEOMETRIES))
def test_the_lookup_equals_the_slow_reference_on_random_indexes(name: str) -> None:
    import random

    rng = random.Random(hash(name) & 0xFFFF)
    geometry = _LOOKUP_GEOMETRIES[name]
    for case in range(600):
        tokens = [rng.randrange(1, 50000) for _ in range(rng.randrange(1, 1600))]
        index, _ = _random_index(rng, geometry, tokens)
        assert index.hit_tokens(RoutingPrompt(tokens)) == _reference_hit(index, tokens), f"case {case}"


@pytest.mark.parametrize("name", list(_LOOKUP_GEOMETRIES))
def test_the_lookup_equals_vllms_own_coordinator_on_random_indexes(name: str) -> None:
    """vLLM's real `find_longest_cache_hit` (the hybrid coordinator, through the adapter's
    probe) against the index on the same cached blocks: equal on every case."""
    import random

    from connectors.geometry import Geometry, GroupGeometry
    from connectors.vllm_adapter import CacheRules

    geometry = _LOOKUP_GEOMETRIES[name]
    rules = CacheRules.for_geometry(
        Geometry(
            tuple(
                GroupGeometry("full_attention", size)
                if window is None
                else GroupGeometry("sliding_window", size, window)
                for size, window in geometry
            )
        )
    )
    rng = random.Random(hash(name) & 0xFFFF)
    hits = 0
    for case in range(300):
        tokens = [rng.randrange(1, 50000) for _ in range(rng.randrange(2, 1600))]
        index, cached = _random_index(rng, geometry, tokens)
        real = rules.lookup_hit(cached, len(tokens), len(tokens))
        # vLLM looks up at most num_tokens - 1 tokens (one must be computed for logits).
        assert index.hit_tokens(RoutingPrompt(tokens[:-1])) == real, f"case {case}"
        hits += real > 0
    assert hits >= 30  # the comparison covered real hits, not only misses


def test_a_window_one_past_a_block_multiple_needs_one_block_less_as_in_vllm() -> None:
    # Window 17, block 16: the next token attends to 16 before it, one block. Before, the
    # index asked for two and reported no hit where vLLM hits.
    from connectors.geometry import Geometry, GroupGeometry
    from connectors.vllm_adapter import CacheRules
    from pdconnect.router.kvindex import GroupIndex
    from pdconnect.router.prompt import chain_keys

    rules = CacheRules.for_geometry(
        Geometry((GroupGeometry("full_attention", 16), GroupGeometry("sliding_window", 16, 17)))
    )
    tokens = list(range(1000, 1065))
    cached = {0: {0, 1, 2, 3}, 1: {3}}
    index = EngineKVIndex()
    for gid, window in ((0, None), (1, 17)):
        keys = chain_keys(tokens, 16)
        index.groups[gid] = GroupIndex(16, window, present={keys[i]: 1 for i in cached[gid]})
    real = rules.lookup_hit(cached, len(tokens), len(tokens))
    assert real == 64 and index.hit_tokens(RoutingPrompt(tokens[:-1])) == real


class _CountingDict(dict[Any, Any]):
    """A group's `present`, counting the lookups made in it."""

    lookups = 0

    def __contains__(self, key: object) -> bool:
        _CountingDict.lookups += 1
        return super().__contains__(key)


@pytest.mark.parametrize("blocks", [256, 4096])
def test_a_lookup_looks_each_block_up_at_most_once_per_group(blocks: int) -> None:
    # Full attention holds the whole prompt, the sliding group only its first half: every
    # length above the half fails the window. Before, each of those lengths re-checked all
    # full-attention blocks below it: blocks^2 / 8 lookups.
    from pdconnect.router.kvindex import GroupIndex
    from pdconnect.router.prompt import chain_keys

    tokens = list(range(blocks * 16))
    keys = chain_keys(tokens, 16)
    index = EngineKVIndex()
    index.groups[0] = GroupIndex(16, present=_CountingDict(dict.fromkeys(keys, 1)))
    index.groups[1] = GroupIndex(16, 128, present=_CountingDict(dict.fromkeys(keys[: blocks // 2], 1)))
    _CountingDict.lookups = 0
    assert index.hit_tokens(RoutingPrompt(tokens)) == blocks // 2 * 16
    assert _CountingDict.lookups <= 2 * blocks


@pytest.mark.asyncio
async def test_keys_computed_off_the_loop_give_every_engine_the_same_hit() -> None:
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    feed = KVEventsFeed(lambda url, dp_rank: None)
    subs = [_Subscription(f"http://fake-d{i}:8000", f"tcp://fake-d{i}:5557", None) for i in range(2)]
    for sub in subs:
        feed._subs[sub.name] = sub
    try:
        await feed._receive(subs[0], _frames(0, _stored(range(6), 0, "full_attention")))
        await feed._receive(subs[1], _frames(0, _stored(range(3), 0, "full_attention")))
        prompt = RoutingPrompt(TOKENS)
        await feed.fill_keys(prompt)
        assert set(prompt.keys) == {BS} and len(prompt.keys[BS]) == len(TOKENS) // BS
        assert [feed.hit_tokens(s.name, prompt) for s in subs] == [6 * BS, 3 * BS]
        assert [feed.hit_tokens(s.name, RoutingPrompt(TOKENS)) for s in subs] == [6 * BS, 3 * BS]
    finally:
        await feed.close()


# name -> groups as (block size, sliding window or None, EAGLE group)
_EAGLE_GEOMETRIES = {
    "fa16e+swa16w128e": ((16, None, True), (16, 128, True)),
    "fa64e+swa64w128e": ((64, None, True), (64, 128, True)),
    "fa256e+swa64w128e+swa64w200e": ((256, None, True), (64, 128, True), (64, 200, True)),
    "fa16e+swa16w100 (EAGLE on full attention only)": ((16, None, True), (16, 100, False)),
    "fa16+swa16w129e (EAGLE on the window only)": ((16, None, False), (16, 129, True)),
    "fa128e+swa32w320e": ((128, None, True), (32, 320, True)),
}


@pytest.mark.parametrize("name", list(_EAGLE_GEOMETRIES))
def test_the_eagle_lookup_equals_vllms_own_coordinator_on_random_indexes(name: str) -> None:
    """With `eagle_groups`, vLLM's last-block drop: the index gives what vLLM's real
    coordinator (EAGLE groups flagged) finds for the whole prompt, case by case."""
    import random

    from connectors.geometry import Geometry, GroupGeometry
    from connectors.vllm_adapter import CacheRules

    geometry = _EAGLE_GEOMETRIES[name]
    rules = CacheRules.for_geometry(
        Geometry(
            tuple(
                GroupGeometry("full_attention", size, eagle=eagle)
                if window is None
                else GroupGeometry("sliding_window", size, window, eagle=eagle)
                for size, window, eagle in geometry
            )
        )
    )
    eagle_groups = {gid for gid, (_, _, eagle) in enumerate(geometry) if eagle}
    rng = random.Random(hash(name) & 0xFFFF)
    hits = 0
    for case in range(300):
        tokens = [rng.randrange(1, 50000) for _ in range(rng.randrange(2, 1600))]
        index, cached = _random_index(rng, tuple((size, window) for size, window, _ in geometry), tokens)
        real = rules.lookup_hit(cached, len(tokens), len(tokens))
        assert index.hit_tokens(RoutingPrompt(tokens), eagle_groups=eagle_groups) == real, f"case {case}"
        hits += real > 0
    assert hits >= 30  # the comparison covered real hits, not only misses


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\x00" * 8],
        [b"", b"\x00\x01", b"x"],
        [b"", (-5).to_bytes(8, "big", signed=True), b"x"],
        [b"", b"\x00" * 9, b"x"],
        [b"a", b"b", b"c", b"d"],
        [],
    ],
    ids=["two-frames", "short-seq", "negative-seq", "long-seq", "four-frames", "empty"],
)
async def test_frames_of_the_wrong_shape_are_counted_and_change_nothing(frames: list[bytes]) -> None:
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    counted: list[str] = []
    invalid: list[str] = []
    feed = KVEventsFeed(lambda url, dp_rank: None, counted.append, invalid.append)
    sub = _Subscription("http://fake-d0:8000", "tcp://fake-d0:5557", None)
    feed._subs[sub.name] = sub
    try:
        await feed._receive(sub, _frames(0, _stored(range(4), 0, "full_attention")))
        await feed._receive(sub, frames)
        assert invalid == ["frame"] and sub.last_seq == 0
        await feed._receive(sub, _frames(1, _stored(range(4, 6), 0, "full_attention")))
        assert feed.hit_tokens(sub.name, RoutingPrompt(TOKENS)) == 6 * BS and "gap" not in counted
    finally:
        await feed.close()


def test_an_empty_sliding_store_sets_the_key_granularity_so_later_stores_keep_the_index() -> None:
    """vLLM publishes a store listing no hash for a sliding-window group that keeps none of
    the range (window below its block, sparse retention). It is valid, and its block size
    sets the engine's key space: otherwise the group's first real store, finer, starts the
    index over and the full-attention blocks already held are lost."""
    counted: list[str] = []
    index = EngineKVIndex(count=counted.append)
    empty = block_stored([], None, TOKENS[:8], block_size=2, group=1, kind="sliding_window", window=3)
    _publish(index, _stored(range(2), 0, "full_attention"), empty)
    assert index.granularity == 2
    _publish(
        index,
        # The block ending on the full group's block 1 (vLLM: the same hash, g0b1).
        block_stored([b"g0b1"], None, TOKENS[:8], block_size=2, group=1, kind="sliding_window", window=3),
    )
    assert counted == []
    assert index.hit_tokens(RoutingPrompt(TOKENS)) == 2 * BS
