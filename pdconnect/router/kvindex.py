"""What each engine really caches, from vLLM's KV events: wire types, a per-group index, vLLM's hit rule.

vLLM engines started with `--kv-events-config` publish msgpack `KVEventBatch`es of
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` over ZMQ. The structs below mirror
that wire format (vllm/distributed/kv_events.py, 0.32; `pdconnect` never imports vLLM,
and a test decodes batches encoded with vLLM's own classes), tolerant of fields added
later.

Block hashes cannot be recomputed here (vLLM seeds them per process), so the index keys
blocks by *content*, in one key space per engine at its finest granularity g (the gcd of
its groups' block sizes, vLLM's `hash_block_size`): g-level chain keys
(`chain_keys(tokens, g)`, each = hash(previous key, g token ids)) name token prefixes, and
a block of B tokens ending at token t is keyed by the g-level key of the prefix [0, t)
(`block_keys`). vLLM does the same with its hashes (`BlockHashListWithBlockSize`, vLLM
0.32 and 0.33: a B-block's hash *is* the `hash_block_size` hash of its last sub-block), so
one hash has one key whichever group lists it, and a B-store's `parent_block_hash`
resolves to the g-level key its range's chain continues from. Keys are learned from the
`token_ids` and `parent_block_hash` every store carries and computed the same way for a
request's tokens. Should a group of a finer block size appear later, every key changes:
the index starts over (counted `granularity`); a batch's own stores are read first, so an
engine's first batch, which stores every group, sets g once.

A store's `token_ids` cover its whole block range, but its `block_hashes` leave out the
blocks a group did not cache (vLLM's `BlockPool.cache_full_blocks` skips them): a
sliding-window group's blocks behind the window (null, `remove_skipped_blocks`) and those
its lookup never consults (masked, `SlidingWindowManager.reachable_block_mask`). Which
positions the listed hashes stand for is then unknown. A listed hash another group of the
engine has keyed (any block size: see above) whose key is the content key of a block of
the range is *anchored* there, content-verified; one listed by the group of the largest
block size (vLLM's scheduler block, the cache-hit alignment) ends an aligned *boundary*.
The others of a sliding-window store are placed by vLLM's rule (`_run_blocks`): what it
keeps of a sliding group are runs of `cdiv(window - 1, B)` blocks ending at an aligned
boundary, plus, in a group that takes the EAGLE/MTP drop, the block after it (its lookup
peeks at it and drops back); under vLLM's default sparse retention only at the boundaries
a prompt can be replayed from. Our decode connector publishes a slack run as a store of
its own, from the prompt's start, ending at the run. Whether a group takes the drop is not
published, so both shifts are tried and must agree, every anchor landing on its block. A
sparse sliding store is read after the rest of its batch (vLLM publishes a step's groups in
group order: MiMo-V2 numbers full attention last), so its anchors are known. A store
whose runs do not fit (a run longer than the room before its anchor, anchors out of
order) keeps its unanchored hashes unplaced (counted `unanchored`). A store whose parent
is unknown (vLLM names a block the window did not cache, whose hash no event lists)
cannot be keyed: its hashes are keyed through the other groups when their stores arrive;
until then they wait, bounded, and a hash that never resolves is dropped and counted.
The argument and its limits are in docs/router.md.

Hybrid models: every KV cache group (full attention, sliding window, ...) is indexed on
its own, and a prefix is a hit only if *every* group can serve it. `longest_hit` is vLLM's
rule for that (`HybridKVCacheCoordinator`: the lcm alignment, a sliding group's window
run, the EAGLE/MTP drop), the one copy both the kv-aware policy (`hit_tokens`, over the
groups the engine has published) and the decode-local decider (`lookup.predicted_hits`,
over the configured groups) use. vLLM's per-group events do not mix the group into the
hash, so mixing the groups here would call a prefix cached that one group has already
evicted.

Untrusted input: every event is checked (`invalid_reason`) before it touches the index; an
invalid one is dropped and counted by reason, never raised, and never affects another
engine (each engine has its own index). A removal that cannot be read at all empties the
index (what it names may be gone); one whose hashes are partly malformed removes the
well-formed ones, since a malformed hash was never accepted in a store. An engine's index
holds at most `max_blocks` blocks over all its groups; a store beyond that evicts the
oldest block of its own group (counted `index_full`). A block costs about 260 bytes
(32-byte hashes; measured with tracemalloc), so the default 524,288 blocks bound an
engine's index near 136 MB.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineKVIndex",
    "GroupIndex",
    "KVEventBatch",
    "LookupGroup",
    "block_keys",
    "chain_keys",
    "decode_batch",
    "invalid_reason",
    "longest_hit",
    "prompt_keys",
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
DEFAULT_MAX_BLOCKS = 1 << 19


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


class _RawBatch(msgspec.Struct, array_like=True):
    """A batch whose events are read one by one: one malformed event spoils only itself."""

    ts: Any
    events: list[msgspec.Raw]
    data_parallel_rank: Any = None


# What reading a payload may raise: msgspec's errors, and RecursionError for deep nesting.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

_decoder: msgspec.msgpack.Decoder[KVEventBatch] = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder: msgspec.msgpack.Decoder[_RawBatch] = msgspec.msgpack.Decoder(_RawBatch)
_event_decoder: msgspec.msgpack.Decoder[KVEvent] = msgspec.msgpack.Decoder(KVEvent)


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


def block_keys(tokens: Sequence[int], block_size: int, granularity: int) -> list[int]:
    """The content key of every full `block_size` block of `tokens` in the key space of
    `granularity` (which divides `block_size`): the g-level chain key of its last sub-block."""
    ratio = block_size // granularity
    return chain_keys(tokens, granularity)[ratio - 1 :: ratio]


def prompt_keys(tokens: Sequence[int], granularities: Iterable[int]) -> dict[int, list[int]]:
    """Every chain key of `tokens` at each granularity (`EngineKVIndex.granularity`): the
    `keys` argument of `hit_tokens`, complete. A pure function, for a worker thread (a
    128k-token prompt costs milliseconds)."""
    return {size: chain_keys(tokens, size) for size in set(granularities)}


def _valid_hash(value: object) -> bool:
    if isinstance(value, bytes):
        return 0 < len(value) <= MAX_HASH_BYTES
    return isinstance(value, int) and not isinstance(value, bool)


def _valid_name(value: object) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= MAX_NAME_CHARS)


def _valid_group(value: object) -> bool:
    return value is None or (isinstance(value, int) and 0 <= value < MAX_GROUPS)


def invalid_reason(event: KVEvent) -> str | None:
    """Why `event` must not touch the index (a bounded set of metric labels), or None."""
    if isinstance(event, AllBlocksCleared):
        return None
    if not _valid_group(event.group_idx):
        return "group"
    if not _valid_name(event.medium):
        return "medium"
    if isinstance(event, BlockRemoved):
        return None  # its hashes are checked one by one (see EngineKVIndex._remove)
    size = event.block_size
    if not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
        return "block_size"
    tokens = event.token_ids
    if not tokens or len(tokens) % size or min(tokens) < 0 or max(tokens) >= MAX_TOKEN_ID:
        return "token_ids"
    if not 0 < len(event.block_hashes) <= len(tokens) // size or not all(map(_valid_hash, event.block_hashes)):
        return "hashes"
    if event.parent_block_hash is not None and not _valid_hash(event.parent_block_hash):
        return "parent"
    if not _valid_name(event.kv_cache_spec_kind):
        return "kind"
    if _is_sliding(event):
        window = event.kv_cache_spec_sliding_window
        if window is None or not 0 < window <= MAX_WINDOW:
            return "window"
    if (event.lora_id is not None and event.lora_id < 0) or not _valid_name(event.lora_name):
        return "lora"
    return None


def _is_sliding(event: BlockStored) -> bool:
    # Only sliding-window kinds may skip early blocks; any other kind (full, MLA,
    # unknown) is held to the whole prefix, the safe side.
    return (event.kv_cache_spec_kind or "").startswith("sliding_window")


def _no_count(reason: str) -> None:
    return None


@dataclass
class BlockBudget:
    """How many blocks one engine's groups hold together, and the most they may."""

    limit: int = DEFAULT_MAX_BLOCKS
    held: int = 0


@dataclass
class GroupIndex:
    """One KV cache group of one engine. Invariants: `present` holds exactly the content keys
    of blocks stored and not yet removed or evicted (a key can be stored under several engine
    hashes, e.g. two LoRA adapters, so it is counted); `by_hash` is oldest stored first, and
    its length is this group's share of `budget.held`, which never exceeds `budget.limit`."""

    block_size: int
    sliding_window: int | None = None
    budget: BlockBudget = field(default_factory=BlockBudget)
    by_hash: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    present: dict[int, int] = field(default_factory=dict)
    # Stored hashes whose content key is not known yet (see the module docstring), oldest first.
    pending: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    orphans: int = 0  # stored hashes dropped without a content key (events missed)
    evicted: int = 0  # blocks dropped (or refused, the group holding none) to stay in budget

    def add(self, block_hash: BlockHash, key: int) -> None:
        self.pending.pop(block_hash, None)
        if block_hash in self.by_hash:
            return
        if self.budget.held >= self.budget.limit:
            self.evicted += 1
            if not self.by_hash:
                return  # the other groups hold the budget: this block goes unindexed
            self._release(self.by_hash.popitem(last=False)[1])
        self.by_hash[block_hash] = key
        self.budget.held += 1
        self.present[key] = self.present.get(key, 0) + 1

    def remove(self, block_hashes: list[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.pending.pop(block_hash, None)
            key = self.by_hash.pop(block_hash, None)
            if key is not None:
                self._release(key)

    def _release(self, key: int) -> None:
        self.budget.held -= 1
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
            self.pending.popitem(last=False)
            self.orphans += 1


@dataclass
class EngineKVIndex:
    """Every group of one engine, fed by its event batches. `count(reason)` hears of every
    event, hash or block dropped (`invalid_reason`'s labels, `undecodable`, `group_mismatch`,
    `removal_unreadable`, `index_full`, `orphan`, `unanchored`, `granularity`)."""

    groups: dict[int, GroupIndex] = field(default_factory=dict)
    # Hashes waiting for a content key, per group: enough for a few long prompts' runs.
    max_pending: int = 4096
    max_blocks: int = DEFAULT_MAX_BLOCKS  # over all groups
    count: Callable[[str], None] = _no_count
    budget: BlockBudget = field(init=False)
    # The key space's granularity set by the stores read (0: none yet; see `granularity`).
    _grain: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.budget = BlockBudget(self.max_blocks)

    @property
    def granularity(self) -> int:
        """The token granularity of this engine's content keys (the gcd of its groups' block
        sizes; 0 before any group): lookups read `keys[granularity]`."""
        return math.gcd(self._grain, *(g.block_size for g in self.groups.values()))

    def apply_payload(self, payload: bytes) -> bool:
        """Apply one published payload, event by event; False when it is no batch at all
        (then nothing was applied and the caller must distrust the index: removals may be lost)."""
        try:
            self.apply(_decoder.decode(payload))
            return True
        except _DECODE_ERRORS:
            pass
        try:
            raw = _raw_decoder.decode(payload)
        except _DECODE_ERRORS:
            return False
        events: list[KVEvent] = []
        for item in raw.events:
            try:
                events.append(_event_decoder.decode(item))
            except _DECODE_ERRORS:
                self.count("undecodable")
                self._unreadable(item, events)
        self.apply(KVEventBatch(ts=0.0, events=events))
        return True

    def _unreadable(self, item: msgspec.Raw, events: list[KVEvent]) -> None:
        """An event our structs cannot read: a store is safely skipped; a removal is applied
        as far as it can be read (the index keeps nothing it cannot vouch for)."""
        try:
            value = msgspec.msgpack.decode(item)
        except (*_DECODE_ERRORS, TypeError, ValueError):
            return  # not even a map: no kind we could name
        if not isinstance(value, dict) or value.get("type") not in ("BlockRemoved", "AllBlocksCleared"):
            return  # a store (skipping it under-reports) or a kind we do not model
        hashes, group = value.get("block_hashes"), value.get("group_idx")
        if value["type"] == "BlockRemoved" and isinstance(hashes, list):
            events.append(BlockRemoved(hashes, None, group if _valid_group(group) else -1))
        else:
            self.count("removal_unreadable")
            events.append(AllBlocksCleared())

    def apply(self, batch: KVEventBatch) -> None:
        self._set_granularity(batch)
        keyed: list[tuple[BlockHash, int]] = []  # (hash, key) this batch taught
        # Sparse sliding-window stores wait for the batch's other stores: vLLM publishes a
        # step's groups in group order, and the anchors a sliding store is placed by may be
        # listed by a full-attention group after it (MiMo-V2 numbers that group last).
        deferred: list[_Deferred] = []
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                self._remove(event)
                for waiting in deferred:
                    waiting.removed.update(h for h in event.block_hashes if _valid_hash(h))
                continue
            if isinstance(event, AllBlocksCleared):
                self.groups.clear()
                self.budget = BlockBudget(self.max_blocks)
                deferred.clear()
                continue
            reason = invalid_reason(event)
            if reason is not None:
                self.count(reason)
                continue
            group = self._group_for(event)
            if group is None:
                continue
            if self._is_sparse_sliding(group, event):
                deferred.append(_Deferred(group, event))
            else:
                self._store(group, event, keyed)
        for waiting in deferred:
            if any(g is waiting.group for g in self.groups.values()):  # not cleared since
                self._store(waiting.group, waiting.event, keyed, waiting.removed)
        if keyed and any(group.pending for group in self.groups.values()):
            self._resolve_pending(keyed)

    def _is_sparse_sliding(self, group: GroupIndex, event: BlockStored) -> bool:
        blocks = len(event.token_ids) // group.block_size
        return group.sliding_window is not None and len(event.block_hashes) < blocks

    def _set_granularity(self, batch: KVEventBatch) -> None:
        """Make the key space fine enough for every store of `batch`, before any is read; a
        finer one invalidates every key held, so the index starts over (counted)."""
        current = self.granularity
        stores = [e for e in batch.events if isinstance(e, BlockStored) and self._may_store(e)]
        grain = math.gcd(current, *(e.block_size for e in stores))
        if grain == current:
            return
        if self.groups:
            self.count("granularity")
            self.groups.clear()
            self.budget = BlockBudget(self.max_blocks)
        self._grain = grain

    def _may_store(self, event: BlockStored) -> bool:
        """Whether `apply` may index `event` (valid, and no `group_mismatch`)."""
        if invalid_reason(event) is not None:
            return False
        group = self.groups.get(event.group_idx or 0)
        return group is None or group.block_size == event.block_size

    def _group_for(self, event: BlockStored) -> GroupIndex | None:
        """The store's group, created by its first store; None (counted) for a store that
        contradicts the group's block size or kind: an engine keeps its layout for life."""
        gid = event.group_idx or 0
        window = event.kv_cache_spec_sliding_window if _is_sliding(event) else None
        group = self.groups.get(gid)
        if group is None:
            group = self.groups[gid] = GroupIndex(event.block_size, window, self.budget)
        elif group.block_size != event.block_size or group.sliding_window != window:
            self.count("group_mismatch")
            return None
        return group

    def _remove(self, event: BlockRemoved) -> None:
        hashes = [h for h in event.block_hashes if _valid_hash(h)]
        if len(hashes) < len(event.block_hashes):
            self.count("hashes")  # malformed hashes were never accepted in a store: nothing to do
        if _valid_group(event.group_idx):
            group = self.groups.get(event.group_idx or 0)
            targets = [] if group is None else [group]
        else:
            self.count("group")  # which group is unknown: remove from all, the safe side
            targets = list(self.groups.values())
        for group in targets:
            group.remove(hashes)

    def _key_of(self, block_hash: BlockHash) -> int | None:
        """The content key any group of this engine has for `block_hash` (one key space)."""
        for group in self.groups.values():
            if (key := group.by_hash.get(block_hash)) is not None:
                return key
        return None

    def _store(
        self,
        group: GroupIndex,
        event: BlockStored,
        keyed: list[tuple[BlockHash, int]],
        removed: Collection[BlockHash] = (),
    ) -> None:
        """Index one store; hashes whose position is unknown wait for another group's key.
        The hashes it learns a content key for are appended to `keyed`; those in `removed`
        (removed later in the batch, the store having waited for it) are left out."""
        size, grain = group.block_size, self._grain
        evicted, orphans = group.evicted, group.orphans
        hashes = event.block_hashes
        parent = 0 if event.parent_block_hash is None else self._key_of(event.parent_block_hash)
        placed: list[tuple[BlockHash, int] | None]
        if parent is None:
            placed = [None] * len(hashes)
        else:
            ratio = size // grain
            own = chain_keys(event.token_ids, grain, parent)[ratio - 1 :: ratio]  # the range's block keys
            if len(hashes) == len(own):
                # Every block of the range is listed: positions, hence content keys, are known.
                placed = list(zip(hashes, own))
            else:
                placed = self._place(group, hashes, own, event.parent_block_hash)
        for block_hash, slot in zip(hashes, placed):
            if block_hash in removed:
                continue
            if slot is not None:
                group.add(block_hash, slot[1])
                keyed.append(slot)
            elif (known := self._key_of(block_hash)) is not None:
                group.add(block_hash, known)
            else:
                group.wait_for_key(block_hash, self.max_pending)
        for _ in range(group.evicted - evicted):
            self.count("index_full")
        for _ in range(group.orphans - orphans):
            self.count("orphan")

    def _place(
        self, group: GroupIndex, hashes: list[BlockHash], own: list[int], parent: BlockHash | None
    ) -> list[tuple[BlockHash, int] | None]:
        """(hash, content key) for each listed hash of a sparse store whose range's block
        keys are `own`, None where its position is unknown: anchors, and for a sliding-window
        group the runs vLLM keeps around them (see the module docstring). Linear in the range."""
        position = {key: p for p, key in enumerate(own)}
        anchors: dict[int, int] = {}  # index in hashes -> block of the range
        boundaries: list[int] = []  # blocks of the range that end a cache-hit-aligned boundary
        alignment = self._alignment()
        aligned = [g for g in self.groups.values() if g.block_size == alignment]
        foreign = False  # a known hash of other content: the store contradicts the index
        for i, block_hash in enumerate(hashes):
            key, p = self._key_of(block_hash), None
            if key is not None and (p := position.get(key)) is not None:
                anchors[i] = p
                if any(block_hash in g.by_hash for g in aligned):
                    boundaries.append(p)
            foreign |= key is not None and p is None
        placed: list[tuple[BlockHash, int] | None] = [None] * len(hashes)
        for i, p in anchors.items():
            placed[i] = (hashes[i], own[p])
        if group.sliding_window is None or foreign:
            if len(anchors) < len(hashes):
                self.count("unanchored")
            return placed
        if parent is not None and any(parent in g.by_hash for g in aligned):
            boundaries.insert(0, -1)  # the range starts right after a boundary
        blocks = _run_blocks(hashes, anchors, boundaries, len(own), group, alignment)
        if blocks is None:
            self.count("unanchored")
            return placed
        return [(block_hash, own[p]) for block_hash, p in zip(hashes, blocks)]

    def _alignment(self) -> int:
        """Tokens per cache-hit-aligned boundary: the lcm of the groups' block sizes (vLLM's
        scheduler block). Only the groups of that block size end a block on each boundary."""
        return math.lcm(*(g.block_size for g in self.groups.values()))

    def _resolve_pending(self, keyed: list[tuple[BlockHash, int]]) -> None:
        """Give waiting hashes the keys this batch taught: only those can newly resolve
        (a key known before was handed out when the hash arrived), so the cost follows
        the batch, not the number waiting."""
        for group in self.groups.values():
            if not group.pending:
                continue
            evicted = group.evicted
            for block_hash, key in keyed:
                if block_hash in group.pending:
                    group.add(block_hash, key)
            for _ in range(group.evicted - evicted):
                self.count("index_full")

    def hit_tokens(
        self, tokens: Sequence[int], keys: dict[int, list[int]] | None = None, *, eagle_groups: Collection[int] = ()
    ) -> int:
        """The longest prefix of `tokens` every group can serve (0 before any event): vLLM's
        lookup (`longest_hit`) over this engine's groups, with at most len(tokens) tokens.

        `keys` caches chain keys by granularity across engines and lookups (one request, many
        engines; see `longest_hit`).

        `eagle_groups`: the engine runs EAGLE/MTP drafting and these group ids get vLLM's
        last-block drop. `tokens` is then the whole prompt, and the answer is vLLM's for it
        exactly: it looks up len(tokens) - 1 tokens and lets a dropping group peek one block
        further.
        """
        # vLLM looks groups of one spec up together, full attention first (a stable sort).
        ordered = sorted(self.groups.items(), key=lambda item: (item[1].sliding_window is not None, item[0]))
        specs = dict.fromkeys((g.block_size, g.sliding_window) for _, g in ordered)
        eagle = {(g.block_size, g.sliding_window) for gid, g in ordered if gid in eagle_groups}
        grain = self.granularity
        groups = [self.lookup_group(size, window, (size, window) in eagle, grain) for size, window in specs]
        max_length = len(tokens) - 1 if eagle_groups else len(tokens)
        return longest_hit(groups, tokens, {} if keys is None else keys, max_length)

    def lookup_group(
        self, block_size: int, sliding_window: int | None, eagle: bool, granularity: int | None = None
    ) -> LookupGroup:
        """This engine's groups of one KV cache spec (`sliding_window` None: full attention),
        looked up together; none when the engine has published nothing of that spec.
        `granularity`: `self.granularity`, when the caller has it at hand."""
        members = tuple(
            g for g in self.groups.values() if g.block_size == block_size and g.sliding_window == sliding_window
        )
        grain = self.granularity if granularity is None else granularity
        return LookupGroup(block_size, sliding_window, eagle, members, grain if members else block_size)


@dataclass
class _Deferred:
    """A sparse sliding-window store waiting for the end of its batch, and the hashes removed meanwhile."""

    group: GroupIndex
    event: BlockStored
    removed: set[BlockHash] = field(default_factory=set)


def _run_blocks(
    hashes: Sequence[BlockHash],
    anchors: dict[int, int],
    boundaries: Sequence[int],
    length: int,
    group: GroupIndex,
    alignment: int,
) -> list[int] | None:
    """The block of the range each listed hash of a sparse sliding-window store stands for,
    by vLLM's rule (`SlidingWindowManager.reachable_block_mask`), or None when it cannot be
    told.

    vLLM keeps, around each cache-hit-aligned boundary a prompt can be replayed from, the
    `cdiv(window - 1, B)` blocks before it, plus with EAGLE/MTP (shift 1) the block after
    it that its lookup peeks at; nulls (blocks behind the window when the range was
    cached) precede them. Our decode connector publishes a slack run as a store of its own
    that ends at the run's last block. So for either shift the listed hashes are the runs
    around the boundaries anchored in the range (`boundaries`: blocks that end one, -1 for
    the block before the range), exactly, or their last ones, or followed by a run
    ending at the range's end. Whether the group takes the drop is not published: both
    shifts are tried, the first rule above that fits best wins, and every hash another
    group anchored (`anchors`) must land on its own block. Two shifts that fit equally
    well but disagree leave the store unplaced.
    """
    assert group.sliding_window is not None
    size = group.block_size
    per_segment = alignment // size
    base = -(-(group.sliding_window - 1) // size)
    found: dict[int, set[tuple[int, ...]]] = {}  # rank (lower is better) -> placements
    count = len(hashes)
    for shift in (0, 1):
        if base + shift >= per_segment:
            expected = list(range(length))  # vLLM keeps every block: nulls first
        else:
            expected = sorted({p for b in boundaries for p in range(b - base + 1, b + shift + 1) if 0 <= p < length})
        if count == len(expected):
            rank, blocks = 0, expected
        elif count < len(expected):
            rank, blocks = 1, expected[len(expected) - count :]
        else:
            extra = count - len(expected)
            rank, blocks = 2, [*expected, *range(length - extra, length)]
            if length - extra < 0 or (expected and blocks[len(expected)] <= expected[-1]):
                continue
        if all(blocks[i] == p for i, p in anchors.items()):
            found.setdefault(rank, set()).add(tuple(blocks))
    if not found:
        return None
    best = found[min(found)]
    return list(next(iter(best))) if len(best) == 1 else None


# --- vLLM's hit rule ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupGroup:
    """One KV cache spec as vLLM's coordinator looks it up: a block is cached when every
    index group of the spec holds its content key (with none, no block is), and `eagle`
    says whether the spec takes vLLM's EAGLE/MTP last-block drop. `granularity`: the
    members' key space (their engine's `granularity`, a divisor of `block_size`)."""

    block_size: int
    sliding_window: int | None  # None: full attention (and any kind not known to skip blocks)
    eagle: bool
    members: tuple[GroupIndex, ...]
    granularity: int


def longest_hit(
    groups: Sequence[LookupGroup], tokens: Sequence[int], keys: dict[int, list[int]], max_length: int
) -> int:
    """The prompt tokens vLLM's `find_longest_cache_hit` reports as computed for the prompt
    `tokens`, looking up at most `max_length` of them (the engine asks len(tokens) - 1: the
    last token is always computed, for its logits), `groups` in vLLM's order (full attention
    first). The one copy of vLLM's rule here, step for step (vLLM 0.32; tests compare it
    with vLLM's real coordinator on random cache states):
    - one group (`UnitaryKVCacheCoordinator`): its own finder, aligned to its block;
    - several (`HybridKVCacheCoordinator`): hits land on the lcm of the block sizes, and
      the groups lower the candidate in turn until none does (a full group with a sliding
      one: one round); a dropping group may peek one block past the candidate (within
      the blocks the request's hashes cover) and is re-checked after another group lowers it;
    - full attention: the leading run of cached blocks, less one block under the drop;
    - sliding window w, block b: the highest end whose `cdiv(w - 1, b)` blocks before it
      (one more under the drop) are cached and which is aligned after the drop; without
      one, the aligned leading run.

    `keys[g]` is always a prefix of `chain_keys(tokens, g)` for a granularity g (a group
    of block size b reads every (b/g)-th key: `block_keys`), extended only as far as a
    lookup reaches: pass one dict for every engine of a request (or `prompt_keys`' result,
    computed off the event loop) and each key is computed once per request. Cost:
    linear in the blocks up to the full-attention hit (the whole prompt for a model
    without full attention); each block is looked up at most once per group and lookup.
    """
    if max_length <= 0 or not groups:
        return 0
    if len(groups) == 1:  # no look-ahead margin, no alignment beyond the group's block
        group = groups[0]
        return _Finder(group, tokens, keys, group.block_size).hit(max_length, group.eagle)
    sizes = [g.block_size for g in groups]
    align, hash_block = math.lcm(*sizes), math.gcd(*sizes)
    hashed = len(tokens) // hash_block * hash_block  # what the request's block hashes cover
    finders = [_Finder(g, tokens, keys, align) for g in groups]
    simple = len(groups) == 2 and groups[0].sliding_window is None
    full_hits: dict[int, int] = {}  # full attention is downward-closed: looked up once
    verified: set[int] = set()  # dropping groups whose drop holds at the current candidate
    hit_length = max_length
    while True:
        current = hit_length
        for position, (group, finder) in enumerate(zip(groups, finders)):
            full = group.sliding_window is None
            if full and position in full_hits:
                current = min(current, full_hits[position])
                continue
            drop = group.eagle and position not in verified
            found = finder.hit(min(current + group.block_size, hashed) if drop else current, drop)
            if drop:
                verified.add(position)
            elif found < current:
                verified.clear()
            current = found
            if full:
                full_hits[position] = found
            if not current:
                return 0  # no group finds more than the candidate, even peeking one block ahead
        if current >= hit_length:
            break
        hit_length = current
        if simple:
            break
    return hit_length


class _Finder:
    """One group's finder (vLLM's single-type managers' `find_longest_cache_hit`) for one
    lookup, over "is block i cached". A sliding group's scan goes down from the candidate
    end and jumps below each missing block, and remembers the run it verified, so across
    the coordinator's rounds each block is looked up at most once."""

    def __init__(self, group: LookupGroup, tokens: Sequence[int], keys: dict[int, list[int]], align: int) -> None:
        self._group = group
        self._tokens = tokens
        self._keys = keys
        self._size = group.block_size
        self._grain = group.granularity
        self._ratio = group.block_size // group.granularity
        self._own: list[int] = []  # this group's block keys derived so far (ratio > 1)
        self._step = align // group.block_size  # blocks per alignment unit
        presents = self._presents = [m.present for m in group.members]
        self._contains: Callable[[int], bool] = (
            presents[0].__contains__ if len(presents) == 1 else lambda key: all(key in p for p in presents)
        )
        self._lo = self._hi = 0  # blocks [lo, hi) verified cached

    def hit(self, max_length: int, drop: bool) -> int:
        """The tokens this group serves with at most `max_length`, `drop`: EAGLE/MTP's drop."""
        if not self._group.members:
            return 0  # nothing of this spec published (or all of it evicted)
        if self._group.sliding_window is None:
            return self._full_attention(max_length, drop)
        return self._sliding_window(self._group.sliding_window, max_length, drop)

    def _full_attention(self, max_length: int, drop: bool) -> int:
        size = self._size
        hit = self._extending_run(min(max_length // size, len(self._tokens) // size)) * size
        if drop and hit:
            hit -= size
        return hit - hit % (self._step * size)

    def _extending_run(self, blocks: int) -> int:
        """The leading run of cached blocks, at most `blocks`, computing chain keys only as
        far as the run goes (in doubling chunks): a miss costs a block's key, not the prompt's.
        Member by member (the joint run is the shortest), each at C speed."""
        run = blocks
        for present in self._presents:
            run = self._run_in(present.__contains__, run)
        return run

    def _run_in(self, contains: Callable[[int], bool], blocks: int) -> int:
        run, want = 0, 64
        while True:
            known = self._block_keys(min(blocks, want))
            available = min(blocks, len(known))
            run += sum(1 for _ in itertools.takewhile(contains, itertools.islice(known, run, available)))
            if run < available or run >= blocks:
                return run
            want *= 2

    def _sliding_window(self, window: int, max_length: int, drop: bool) -> int:
        size, step, d = self._size, self._step, int(drop)
        need = max(1, -(-(window - 1) // size) + d)  # vLLM: cdiv(w - 1, b), one more under the drop
        keys = self._block_keys(max_length // size)
        top = min(max_length // size, len(keys))
        contains = self._contains

        def candidate(at_most: int) -> int:  # the highest end <= at_most that is aligned after the drop
            return (at_most - d) // step * step + d if at_most >= d else -1

        end = candidate(top)
        while end >= need:
            start, i = end - need, end - 1
            lo, hi = self._lo, self._hi
            while i >= start:
                if lo <= i < hi:
                    i = lo - 1
                elif contains(keys[i]):
                    i -= 1
                else:
                    break
            if i < start:  # no block missing in [start, end)
                if end >= lo and start <= hi:
                    self._lo, self._hi = min(start, lo), max(end, hi)
                else:
                    self._lo, self._hi = start, end
                return (end - d) * size
            end = candidate(i)  # every end above block i has i in its window
        # No whole window: vLLM keeps the leading run its scan counted, aligned, then drops.
        stop, run = min(top, need + step), 0
        while run < stop:
            if self._lo <= run < self._hi:
                run = self._hi
            elif contains(keys[run]):
                run += 1
            else:
                break
        blocks = max(candidate(min(run, stop)), 0) // step * step
        if d and blocks:
            blocks = (blocks - 1) // step * step
        return blocks * size

    def _block_keys(self, blocks: int) -> list[int]:
        """This group's block keys (`block_keys`), at least `blocks` of them (fewer if the
        prompt is shorter); with ratio 1, the shared `keys[granularity]` itself."""
        ratio = self._ratio
        fine = _keys_upto(self._tokens, self._keys, self._grain, blocks * ratio)
        if ratio == 1:
            return fine
        own = self._own
        if len(own) < blocks:
            own.extend(itertools.islice(fine, (len(own) + 1) * ratio - 1, blocks * ratio, ratio))
        return own


def _keys_upto(tokens: Sequence[int], keys: dict[int, list[int]], block_size: int, blocks: int) -> list[int]:
    """`keys[block_size]`, extended to at least `blocks` keys (fewer if the prompt is shorter)."""
    known = keys.setdefault(block_size, [])
    if len(known) < blocks:
        start = len(known) * block_size
        known.extend(chain_keys(tokens[start : blocks * block_size], block_size, known[-1] if known else 0))
    return known
