"""vLLM's own KV event objects, built and encoded as an engine's publisher sends them, for the router's index tests.

The router's index must read what vLLM publishes, so these tests build events with vLLM's
classes (`vllm.distributed.kv_events`) rather than the router's mirror structs; this module
is the one place that spells out a store's fields and the batch's wire encoding.
Imports vLLM when called: a caller skips first where vLLM is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

__all__ = ["block_stored", "encoded_batch", "stored_blocks"]


def block_stored(
    hashes: list[bytes],
    parent: bytes | None,
    token_ids: list[int],
    *,
    block_size: int,
    group: int,
    kind: str,
    window: int | None = None,
) -> Any:
    """vLLM's BlockStored for blocks on the GPU without LoRA, in KV cache group `group`."""
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def stored_blocks(
    blocks: range,
    tokens: list[int],
    *,
    block_size: int,
    group: int,
    kind: str,
    window: int | None = None,
    hashed: range | None = None,
    tag: str = "",
) -> Any:
    """vLLM's BlockStored for consecutive `blocks` of `tokens`, block i hashed `{tag}b{i}`.

    `hashed`: the blocks whose hashes the store lists (all of `blocks` unless given), as a
    sliding group lists only those still in its window while its token range covers all.
    """
    return block_stored(
        [f"{tag}b{i}".encode() for i in (blocks if hashed is None else hashed)],
        f"{tag}b{blocks.start - 1}".encode() if blocks.start else None,
        tokens[blocks.start * block_size : blocks.stop * block_size],
        block_size=block_size,
        group=group,
        kind=kind,
        window=window,
    )


def encoded_batch(events: Iterable[Any]) -> bytes:
    """vLLM's KVEventBatch of `events` (timestamp 0), encoded as its ZmqEventPublisher sends it."""
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=list(events)))
