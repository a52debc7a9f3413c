"""vLLM's KV event wire format, mirrored as msgspec structs, and the checks an event passes before it is indexed.

vLLM engines started with `--kv-events-config` publish msgpack `KVEventBatch`es of
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` over ZMQ. The structs below mirror
that wire format (vllm/distributed/kv_events.py, 0.32; `pdconnect` never imports vLLM,
and a test decodes batches encoded with vLLM's own classes), tolerant of fields added
later. Events come from the network: `invalid_reason` names why one must not touch an
index (a bounded set of metric labels), and the bounds below say what a well-formed one
stays within.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from pdconnect.kvdescribe import EngineDescribed
from pdconnect.kvdescribe import invalid_reason as describe_reason

__all__ = [
    "DECODE_ERRORS",
    "MAX_GROUPS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EngineDescribed",
    "KVEvent",
    "KVEventBatch",
    "RawBatch",
    "decode_batch",
    "decode_event",
    "decode_raw_batch",
    "invalid_reason",
    "is_sliding",
    "valid_group",
    "valid_hash",
]

BlockHash = bytes | int

# What a well-formed event stays within. vLLM's block sizes are a few tokens to a few
# thousand (Mamba's can reach tens of thousands); hashes are 32-byte digests or 64-bit ints.
MAX_BLOCK_SIZE = 1 << 16
MAX_GROUPS = 256
MAX_WINDOW = 1 << 24
MAX_HASH_BYTES = 64
MAX_TOKEN_ID = 1 << 32  # exclusive
MAX_NAME_CHARS = 256  # medium, kind, LoRA name
# An array of C unsigned ints takes exactly the ids in [0, MAX_TOKEN_ID) where they are 32
# bits: filling one checks a store's whole prompt at C speed (`_tokens_in_range`).
_TOKEN_TYPECODE = "I" if array("I").itemsize * 8 == MAX_TOKEN_ID.bit_length() - 1 else None


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


# `EngineDescribed`: not vLLM's, our connector's (`pdconnect.kvdescribe`), in the same batches.
KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | EngineDescribed


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class RawBatch(msgspec.Struct, array_like=True):
    """A batch whose events are read one by one: one malformed event spoils only itself."""

    ts: Any
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


# What reading a payload may raise: msgspec's errors, and RecursionError for deep nesting.
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

_decoder: msgspec.msgpack.Decoder[KVEventBatch] = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder: msgspec.msgpack.Decoder[RawBatch] = msgspec.msgpack.Decoder(RawBatch)
_event_decoder: msgspec.msgpack.Decoder[KVEvent] = msgspec.msgpack.Decoder(KVEvent)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published payload; msgspec.DecodeError/ValidationError names what is wrong."""
    return _decoder.decode(payload)


def decode_raw_batch(payload: bytes) -> RawBatch:
    """One published payload whose events stay undecoded, to be read one by one (`decode_event`)."""
    return _raw_decoder.decode(payload)


def decode_event(item: msgspec.Raw) -> KVEvent:
    """One event of a `RawBatch`; raises one of `DECODE_ERRORS` when it is malformed."""
    return _event_decoder.decode(item)


def valid_hash(value: object) -> bool:
    """Whether `value` is a block hash an event may carry (a short digest or an int)."""
    if isinstance(value, bytes):
        return 0 < len(value) <= MAX_HASH_BYTES
    return isinstance(value, int) and not isinstance(value, bool)


def _valid_name(value: object) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= MAX_NAME_CHARS)


def valid_group(value: object) -> bool:
    """Whether `value` is a group index an event may carry (None: vLLM's single group)."""
    return value is None or (isinstance(value, int) and 0 <= value < MAX_GROUPS)


def invalid_reason(event: KVEvent) -> str | None:
    """Why `event` must not touch the index (a bounded set of metric labels), or None."""
    if isinstance(event, AllBlocksCleared):
        return None
    if isinstance(event, EngineDescribed):
        return describe_reason(event)
    if not valid_group(event.group_idx):
        return "group"
    if not _valid_name(event.medium):
        return "medium"
    if isinstance(event, BlockRemoved):
        return None  # its hashes are checked one by one (see EngineKVIndex._remove)
    size = event.block_size
    if not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
        return "block_size"
    tokens = event.token_ids
    if not tokens or len(tokens) % size or not _tokens_in_range(tokens):
        return "token_ids"
    if not 0 < len(event.block_hashes) <= len(tokens) // size or not all(map(valid_hash, event.block_hashes)):
        return "hashes"
    if event.parent_block_hash is not None and not valid_hash(event.parent_block_hash):
        return "parent"
    if not _valid_name(event.kv_cache_spec_kind):
        return "kind"
    if is_sliding(event):
        window = event.kv_cache_spec_sliding_window
        if window is None or not 0 < window <= MAX_WINDOW:
            return "window"
    if (event.lora_id is not None and event.lora_id < 0) or not _valid_name(event.lora_name):
        return "lora"
    return None


def _tokens_in_range(tokens: list[int]) -> bool:
    """Whether every token id is in [0, MAX_TOKEN_ID). A store carries its whole range's ids
    (a 128k-token prompt's, once per group): `min` and `max` over them were most of the
    cost of ingesting it (`make bench-fleet`)."""
    if _TOKEN_TYPECODE is None:
        return min(tokens) >= 0 and max(tokens) < MAX_TOKEN_ID
    try:
        array(_TOKEN_TYPECODE, tokens)
    except (OverflowError, TypeError):
        return False
    return True


def is_sliding(event: BlockStored) -> bool:
    """Whether the store's group may skip early blocks (a sliding-window kind)."""
    # Only sliding-window kinds may skip early blocks; any other kind (full, MLA,
    # unknown) is held to the whole prefix, the safe side.
    return (event.kv_cache_spec_kind or "").startswith("sliding_window")
