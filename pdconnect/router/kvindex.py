"""What each engine really caches, from vLLM's KV events: wire types and a per-group index.

vLLM engines started with `--kv-events-config` publish msgpack `KVEventBatch`es of
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` over ZMQ. The structs below mirror
that wire format (vllm/distributed/kv_events.py, 0.32; `pdconnect` never imports vLLM,
and a test decodes batches encoded with vLLM's own classes), tolerant of fields added
later.

Block hashes cannot be recomputed here (vLLM seeds them per process), so the index keys
blocks by *content*: a chain key per block = hash(parent's chain key, the block's token
ids), learned from the `token_ids` and `parent_block_hash` every store event carries, and
computed the same way for a request's tokens.

A store's `token_ids` cover its whole block range, but its `block_hashes` leave out the
blocks a group did not cache: a sliding-window group's blocks behind the window (null)
and those its lookup never consults (masked). Which positions the hashes stand for is
then unknown. It need not be: vLLM hashes a request's blocks once, for all groups of a
block size (the group is not mixed in), so a hash another group of the engine has keyed
names the same content. Such hashes are keyed through the other groups, at once or when
the other group's store arrives (a decode engine may publish a sliding-window run one
batch before the full-attention blocks); until then they wait, bounded, and a hash that
never resolves is dropped and counted.

Hybrid models: every KV cache group (full attention, sliding window, ...) is indexed on
its own, and a prefix of L tokens is a hit only if *every* group can serve it: a full
attention group needs all blocks before L, a sliding-window group only the blocks that
hold the last `window` tokens before L (what vLLM's own lookup checks). vLLM's per-group
events do not mix the group into the hash, so mixing the groups here would call a
prefix cached that one group has already evicted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineKVIndex",
    "GroupIndex",
    "KVEventBatch",
    "chain_keys",
    "decode_batch",
]

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_decoder: msgspec.msgpack.Decoder[KVEventBatch] = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published payload; msgspec.DecodeError/ValidationError names what is wrong."""
    return _decoder.decode(payload)


def chain_keys(tokens: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """The content key of every full block of `tokens` (a block's key covers its whole prefix)."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


@dataclass
class GroupIndex:
    """One KV cache group of one engine. Invariant: `present` holds exactly the content keys
    of blocks stored and not yet removed (a key can be stored under several engine hashes,
    e.g. two LoRA adapters, so it is counted)."""

    block_size: int
    sliding_window: int | None = None
    by_hash: dict[BlockHash, int] = field(default_factory=dict)
    present: dict[int, int] = field(default_factory=dict)
    # Stored hashes whose content key is not known yet (see the module docstring), oldest first.
    pending: dict[BlockHash, None] = field(default_factory=dict)
    orphans: int = 0  # stored hashes dropped without a content key (events missed)

    def add(self, block_hash: BlockHash, key: int) -> None:
        self.pending.pop(block_hash, None)
        if block_hash in self.by_hash:
            return
        self.by_hash[block_hash] = key
        self.present[key] = self.present.get(key, 0) + 1

    def remove(self, block_hashes: list[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.pending.pop(block_hash, None)
            key = self.by_hash.pop(block_hash, None)
            if key is None:
                continue
            left = self.present[key] - 1
            if left:
                self.present[key] = left
            else:
                del self.present[key]

    def wait_for_key(self, block_hash: BlockHash, limit: int) -> None:
        if block_hash in self.by_hash:
            return
        self.pending[block_hash] = None
        while len(self.pending) > limit:
            del self.pending[next(iter(self.pending))]
            self.orphans += 1

    def serves(self, keys: list[int], tokens: int) -> bool:
        """Can this group serve the first `tokens` tokens (a multiple of block_size)?"""
        end = tokens // self.block_size
        start = 0
        if self.sliding_window is not None:
            start = max(0, (tokens - self.sliding_window) // self.block_size)
        return all(key in self.present for key in keys[start:end])


@dataclass
class EngineKVIndex:
    """Every group of one engine, fed by its event batches."""

    groups: dict[int, GroupIndex] = field(default_factory=dict)
    # Hashes waiting for a content key, per group: enough for a few long prompts' runs.
    max_pending: int = 4096

    def apply(self, batch: KVEventBatch) -> None:
        keyed: list[tuple[int, BlockHash, int]] = []  # (block size, hash, key) this batch taught
        for event in batch.events:
            if isinstance(event, BlockStored):
                group = self.groups.get(event.group_idx or 0)
                if group is None or group.block_size != event.block_size:
                    # Only sliding-window kinds may skip early blocks; any other kind
                    # (full, MLA, unknown) is held to the whole prefix, the safe side.
                    sliding = (event.kv_cache_spec_kind or "").startswith("sliding_window")
                    window = event.kv_cache_spec_sliding_window if sliding else None
                    group = self.groups[event.group_idx or 0] = GroupIndex(event.block_size, window)
                self._store(group, event, keyed)
            elif isinstance(event, BlockRemoved):
                group = self.groups.get(event.group_idx or 0)
                if group is not None:
                    group.remove(event.block_hashes)
            else:
                self.groups.clear()
        if keyed and any(group.pending for group in self.groups.values()):
            self._resolve_pending(keyed)

    def _key_of(self, block_size: int, block_hash: BlockHash) -> int | None:
        """The content key any group of this block size has for `block_hash`."""
        for group in self.groups.values():
            if group.block_size == block_size and (key := group.by_hash.get(block_hash)) is not None:
                return key
        return None

    def _store(self, group: GroupIndex, event: BlockStored, keyed: list[tuple[int, BlockHash, int]]) -> None:
        """Index one store; hashes whose position is unknown wait for another group's key.
        The hashes it learns a content key for are appended to `keyed`."""
        size = group.block_size
        parent = 0 if event.parent_block_hash is None else self._key_of(size, event.parent_block_hash)
        if parent is not None and len(event.block_hashes) == len(event.token_ids) // size:
            # Every block of the range is listed: positions, hence content keys, are known.
            for block_hash, key in zip(event.block_hashes, chain_keys(event.token_ids, size, parent)):
                group.add(block_hash, key)
                keyed.append((size, block_hash, key))
            return
        for block_hash in event.block_hashes:
            known = self._key_of(size, block_hash)
            if known is None:
                group.wait_for_key(block_hash, self.max_pending)
            else:
                group.add(block_hash, known)

    def _resolve_pending(self, keyed: list[tuple[int, BlockHash, int]]) -> None:
        """Give waiting hashes the keys this batch taught: only those can newly resolve
        (a key known before was handed out when the hash arrived), so the cost follows
        the batch, not the number waiting."""
        for group in self.groups.values():
            if not group.pending:
                continue
            for size, block_hash, key in keyed:
                if size == group.block_size and block_hash in group.pending:
                    group.add(block_hash, key)

    def hit_tokens(self, tokens: Sequence[int], keys: dict[int, list[int]] | None = None) -> int:
        """The longest prefix of `tokens` every group can serve (0 before any event).
        `keys` caches chain keys by block size across engines (one request, many engines)."""
        if not self.groups:
            return 0
        step = math.lcm(*(g.block_size for g in self.groups.values()))
        if keys is None:
            keys = {}
        for size in {g.block_size for g in self.groups.values()}:
            if size not in keys:
                keys[size] = chain_keys(tokens, size)
        # Full-attention groups bound the hit from above: their hit is a prefix run.
        limit = len(tokens) // step * step
        for group in self.groups.values():
            if group.sliding_window is None:
                run = 0
                for key in keys[group.block_size]:
                    if key not in group.present:
                        break
                    run += 1
                limit = min(limit, run * group.block_size // step * step)
        for length in range(limit, 0, -step):
            if all(g.serves(keys[g.block_size], length) for g in self.groups.values()):
                return length
        return 0
