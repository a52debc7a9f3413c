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
    index = EngineKVIndex(max_pending=3)
    _publish(index, _stored(range(2, 4), 0, "full_attention"))  # blocks 0, 1 missed
    assert index.hit_tokens(TOKENS) == 0
    assert len(index.groups[0].pending) == 2 and index.groups[0].orphans == 0
    _publish(index, _stored(range(5, 7), 0, "full_attention"))  # more than max_pending wait
    assert len(index.groups[0].pending) == 3 and index.groups[0].orphans == 1
    assert index.hit_tokens(TOKENS) == 0


def _window_tail(blocks: range, group: int, window: int) -> object:
    """A sliding group's store as vLLM sends it: the token range of `blocks`, hashes only
    for the last `window` tokens' blocks (the rest null or masked), and vLLM's hashes are
    the request's, shared by every group of the block size (`b{i}`, no group tag)."""
    tail = range(max(blocks.start, blocks.stop - window // BS), blocks.stop)
    return kv_events.BlockStored(
        block_hashes=[f"b{i}".encode() for i in tail],
        parent_block_hash=f"b{blocks.start - 1}".encode() if blocks.start else None,
        token_ids=TOKENS[blocks.start * BS:blocks.stop * BS], block_size=BS, lora_id=None, medium="GPU",
        lora_name=None, group_idx=group, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window)


def _full(blocks: range, group: int = 0) -> object:
    return kv_events.BlockStored(
        block_hashes=[f"b{i}".encode() for i in blocks],
        parent_block_hash=f"b{blocks.start - 1}".encode() if blocks.start else None,
        token_ids=TOKENS[blocks.start * BS:blocks.stop * BS], block_size=BS, lora_id=None, medium="GPU",
        lora_name=None, group_idx=group, kv_cache_spec_kind="full_attention")


def test_window_tail_hashes_are_keyed_at_their_own_positions_through_the_full_group() -> None:
    # Before: the two tail hashes were paired with the range's first two blocks, so the
    # index called a 2-block prefix cached (wrong) and the 6-block one not (wrong).
    index = EngineKVIndex()
    _publish(index, _full(range(0, 6)), _window_tail(range(0, 6), 1, 2 * BS))
    assert index.hit_tokens(TOKENS[:6 * BS]) == 6 * BS
    assert index.hit_tokens(TOKENS[:2 * BS]) == 0  # block 0 and 1 of the sliding group are gone


def test_a_window_run_published_before_its_full_attention_blocks_waits_for_them() -> None:
    # A decode engine publishing a pulled window tail (replay slack) whose parent it never
    # stored, one batch before the full-attention blocks of the same prompt.
    index = EngineKVIndex()
    _publish(index, _window_tail(range(3, 5), 1, 2 * BS))
    assert index.hit_tokens(TOKENS) == 0 and len(index.groups[1].pending) == 2
    _publish(index, _full(range(0, 6)))
    assert index.groups[1].pending == {} and index.groups[1].orphans == 0
    assert index.hit_tokens(TOKENS[:5 * BS]) == 5 * BS
    assert index.hit_tokens(TOKENS[:6 * BS]) == 5 * BS  # block 5's window tail (4, 5) is not all there


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

    from pdconnect.router import load_config, start_router
    from pdconnect.testbed.fake_engine import FakeCluster

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


# --- against vLLM's own KV cache manager: what the events say vs what its lookup finds ------

def _real_manager(geometry: Any, num_blocks: int) -> Any:
    from connectors.vllm_adapter import build_kv_cache_manager
    return build_kv_cache_manager(geometry, num_blocks=num_blocks, max_model_len=4096, enable_kv_cache_events=True)


def _real_request(request_id: str, tokens: list[int], hash_block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256)
    return Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=get_request_block_hasher(hash_block_size, sha256))


def _serve_prompt(manager: Any, request: Any, chunk: int) -> None:
    """What the scheduler does for a prompt: look it up, allocate and compute it chunk by
    chunk (sliding-window blocks behind the window are freed as it goes), then free it."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    computed, first = hit, True
    while computed < request.num_tokens:
        step = min(chunk, request.num_tokens - computed)
        assert manager.allocate_slots(request, step, num_new_computed_tokens=hit if first else 0,
                                      new_computed_blocks=blocks if first else None) is not None
        computed, first = computed + step, False
        request.num_computed_tokens = computed
    manager.free(request)


@pytest.mark.parametrize("chunk", [10_000, 48], ids=["whole-prompt", "chunked-prefill"])
def test_the_index_finds_what_vllms_own_lookup_finds_on_a_hybrid_model(chunk: int) -> None:
    """Prompts served by a real vLLM KVCacheManager (full attention + sliding window, events
    on): for every later sibling, the index built from the published events alone must
    report the hit vLLM's own lookup gives. vLLM leaves the sliding group's out-of-window
    and masked blocks out of a store's hashes while its token range covers them all."""
    import random

    from connectors.geometry import Geometry, GroupGeometry

    bs = 16
    geometry = Geometry((GroupGeometry("full_attention", bs), GroupGeometry("sliding_window", bs, 32)))
    manager = _real_manager(geometry, num_blocks=400)
    index = EngineKVIndex()
    rng = random.Random(5)
    prefix = [rng.randrange(1000, 30000) for _ in range(300)]
    served = 0
    for i in range(12):
        shared = rng.choice([0, 40, 100, 160, 230, 300])
        tokens = prefix[:shared] + [rng.randrange(1000, 30000) for _ in range(rng.choice([5, 40, 90]))]
        probe = _real_request(f"probe{i}", tokens, bs)
        _, real_hit, _ = manager.get_computed_blocks(probe)
        # vLLM looks up at most num_tokens - 1 tokens (one must be computed for logits).
        assert index.hit_tokens(tokens[:len(tokens) - 1]) == real_hit, f"sibling {i} sharing {shared} tokens"
        served += real_hit > 0
        _serve_prompt(manager, _real_request(f"r{i}", tokens, bs), chunk)
        _publish(index, *manager.take_events())
    assert served >= 4  # the comparison covered real hits, not only misses
