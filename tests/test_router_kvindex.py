"""The kv-aware index (`router.kvindex`) fed by a FAKE publisher: batches built and encoded
with vLLM's own event classes (so the wire format is vLLM's, checked here), decoded by
pdconnect's mirror structs; hybrid hits need every group."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events")

from pdconnect.router.kvindex import (  # noqa: E402
    AllBlocksCleared, BlockRemoved, BlockStored, EngineKVIndex, decode_batch,
)

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4


def _stored(blocks: range, group: int, kind: str, window: int | None = None) -> object:
    """vLLM's BlockStored for consecutive blocks of TOKENS (hashes = block number + group tag)."""
    first, last = blocks.start, blocks.stop
    return kv_events.BlockStored(
        block_hashes=[f"g{group}b{i}".encode() for i in blocks],
        parent_block_hash=f"g{group}b{first - 1}".encode() if first else None,
        token_ids=TOKENS[first * BS:last * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None,
        group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def _publish(index: EngineKVIndex, *events: object) -> None:
    """What a FAKE publisher sends: vLLM's KVEventBatch encoded the way ZmqEventPublisher does."""
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=0.0, events=list(events)))
    index.apply(decode_batch(payload))


def test_vllm_batches_decode_into_our_mirror_structs() -> None:
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.5, events=[
        _stored(range(0, 2), 1, "sliding_window", 8),
        kv_events.BlockRemoved(block_hashes=[b"g1b0"], medium="GPU", group_idx=1),
        kv_events.AllBlocksCleared()], data_parallel_rank=0))
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.group_idx == 1 and stored.block_size == BS
    assert stored.kv_cache_spec_kind == "sliding_window" and stored.kv_cache_spec_sliding_window == 8
    assert stored.token_ids == TOKENS[:8] and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"g1b0"]
    assert isinstance(cleared, AllBlocksCleared) and batch.ts == 1.5


def test_full_attention_hit_is_the_stored_prefix_and_follows_removals() -> None:
    index = EngineKVIndex()
    _publish(index, _stored(range(0, 3), 0, "full_attention"), _stored(range(3, 6), 0, "full_attention"))
    assert index.hit_tokens(TOKENS) == 6 * BS
    assert index.hit_tokens(TOKENS[:4] + [0] * 28) == BS  # diverges in the second block
    _publish(index, kv_events.BlockRemoved(block_hashes=[b"g0b2"], medium="GPU", group_idx=0))
    assert index.hit_tokens(TOKENS) == 2 * BS
    _publish(index, kv_events.AllBlocksCleared())
    assert index.hit_tokens(TOKENS) == 0


def test_hybrid_hit_needs_the_window_tail_of_the_sliding_group_too() -> None:
    # Full attention holds 6 blocks; the sliding group (window 8 tokens = 2 blocks) evicted
    # its early blocks and holds blocks 2..4 only.
    index = EngineKVIndex()
    _publish(index, _stored(range(0, 6), 0, "full_attention"), _stored(range(0, 5), 1, "sliding_window", 8))
    _publish(index, kv_events.BlockRemoved(block_hashes=[b"g1b0", b"g1b1"], medium="GPU", group_idx=1))
    # 5 blocks: the window tail (blocks 3, 4) is there although blocks 0 and 1 are gone.
    assert index.hit_tokens(TOKENS) == 5 * BS
    # Without block 3 no length has its window tail (5 and 4 blocks need block 3, shorter
    # ones need blocks 0 or 1): no hit, though the full group alone would say 6 blocks.
    _publish(index, kv_events.BlockRemoved(block_hashes=[b"g1b3"], medium="GPU", group_idx=1))
    assert index.hit_tokens(TOKENS) == 0


def test_a_store_whose_parent_was_never_seen_is_not_indexed() -> None:
    index = EngineKVIndex()
    _publish(index, _stored(range(2, 4), 0, "full_attention"))  # blocks 0, 1 missed
    assert index.hit_tokens(TOKENS) == 0
    assert index.groups[0].orphans == 1


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
        prompt_kind: str, tmp_path: Any) -> None:
    import asyncio

    import aiohttp
    import zmq

    from pdconnect.bench.fake_engine import FakeCluster
    from pdconnect.router import load_config, start_router

    fakes = await FakeCluster.start(prefill=1, decode=2)
    context = zmq.Context()
    publishers = {url: context.socket(zmq.PUB) for url in fakes.decode_urls}
    endpoints = {}
    for url, socket in publishers.items():
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        endpoints[url] = [f"tcp://127.0.0.1:{port}"]
    router = await start_router(load_config({
        "host": "127.0.0.1", "port": 0, "prefill": fakes.prefill_urls, "decode": fakes.decode_urls,
        "policy": "kv-aware", "kv_events_endpoints": endpoints,
        **({"tokenizer": _word_tokenizer(str(tmp_path / "tokenizer.json"))} if prompt_kind != "token-ids" else {})}))
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
            batch = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(
                ts=0.0, events=[_stored(range(0, 8), 0, "full_attention")]))
            applied = router.router.metrics.kv_events.labels("ok")
            seq = 0
            while applied._value.get() == 0:  # SUB joins asynchronously: publish until heard
                publishers[other].send_multipart([b"", seq.to_bytes(8, "big"), batch])
                seq += 1
                await asyncio.sleep(0.02)
            assert await decode_engine() == other
    finally:
        await router.close()
        await fakes.close()
        context.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_sequence_gap_without_replay_drops_the_index_until_it_is_rebuilt() -> None:
    from pdconnect.router.kvevents import KVEventsFeed, _Subscription

    counted: list[str] = []
    feed = KVEventsFeed(lambda url: None, counted.append)
    sub = _Subscription("http://fake-d0:8000", "tcp://fake-d0:5557", None)
    feed._subs[sub.url] = sub

    def frames(seq: int, *events: object) -> list[bytes]:
        batch = kv_events.KVEventBatch(ts=0.0, events=list(events))
        return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]
    try:
        assert feed.hit_tokens(sub.url, TOKENS) is None  # nothing heard: not fresh, affinity decides
        await feed._receive(sub, frames(0, _stored(range(0, 4), 0, "full_attention")))
        assert feed.hit_tokens(sub.url, TOKENS) == 4 * BS
        # Batches 1 and 2 are lost (one of them may have removed blocks): the index cannot
        # be trusted, so it starts over from batch 3.
        await feed._receive(sub, frames(3, _stored(range(4, 6), 0, "full_attention")))
        assert counted.count("gap") == 1
        assert feed.hit_tokens(sub.url, TOKENS) == 0  # blocks 4, 5 alone are no prefix
        await feed._receive(sub, frames(4, _stored(range(0, 2), 0, "full_attention")))
        assert feed.hit_tokens(sub.url, TOKENS) == 2 * BS
    finally:
        await feed.close()
