"""The kv-aware index (`router.kvindex`) fed by a FAKE publisher: batches built and encoded
with vLLM's own event classes (so the wire format is vLLM's, checked here), decoded by
pdconnect's mirror structs; hybrid hits need every group."""

from __future__ import annotations

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
