"""What each engine really caches: one index per engine and KV cache group, fed by vLLM's KV events.

The events arrive as `kvwire` structs (vLLM's wire format, checked by `invalid_reason`
before they touch an index); `kvevents` subscribes to them.

Block hashes cannot be recomputed here (vLLM seeds them per process), so the index keys
blocks by *content*, in one key space per engine at its finest granularity g (the gcd of
its groups' block sizes, vLLM's `hash_block_size`): g-level chain keys
(`prompt.chain_keys(tokens, g)`, each = hash(previous key, g token ids)) name token prefixes, and
a block of B tokens ending at token t is keyed by the g-level key of the prefix [0, t)
(`block_keys`). vLLM does the same with its hashes (`BlockHashListWithBlockSize`, vLLM
0.32 and 0.33: a B-block's hash *is* the `hash_block_size` hash of its last sub-block), so
one hash has one key whichever group lists it, and a B-store's `parent_block_hash`
resolves to the g-level key its range's chain continues from. Keys are learned from the
`token_ids` and `parent_block_hash` every store carries and computed the same way for a
request's tokens. Should a group of a finer block size appear later, every key changes:
the index starts over (counted `granularity`); a batch's own stores are read first, so an
engine's first batch, which stores every group, sets g once.

A store's `token_ids` cover its whole block range, but its `block_hashes` may leave out
blocks a group did not cache, and its parent may be a hash no event lists: `placement`
tells where its listed hashes stand in the range and where the range starts, by vLLM's
rules. A sparse sliding store is read after the rest of its batch (vLLM publishes a step's
groups in group order: MiMo-V2 numbers full attention last), so its anchors are known. A
store that cannot be placed keeps its unanchored hashes unplaced: counted `unanchored`,
logged with the engine and the reason, and its range's keys marked so that the decider
predicts P/D for the prompts reaching into it (`unplaced_in`), and only those. A store
listing no hash (a sliding group keeping none of its range) is valid: it still sets the
group's block size, and its range's end is one a later store may continue from. A store
whose range's start is unknown has its hashes keyed through the other groups when their
stores arrive; until then they wait, bounded, and a hash that never resolves is dropped
and counted. The argument and its limits are in docs/router.md;
`tests/test_router_kvindex_sweep.py` checks the whole against vLLM's own manager.

Hybrid models: every KV cache group (full attention, sliding window, ...) is indexed on
its own, and a prefix is a hit only if *every* group can serve it: `hit_tokens` asks
vLLM's rule for that (`lookup.longest_hit`) over the groups the engine has published.

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

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import msgspec

from pdconnect.router.kvwire import (
    DECODE_ERRORS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineDescribed,
    KVEvent,
    KVEventBatch,
    decode_batch,
    decode_event,
    decode_raw_batch,
    invalid_reason,
    is_sliding,
    valid_group,
    valid_hash,
)
from pdconnect.router.lookup import LookupGroup, longest_hit
from pdconnect.router.placement import StorePlacement
from pdconnect.router.prompt import RoutingPrompt, chain_keys

__all__ = ["DEFAULT_MAX_BLOCKS", "EngineKVIndex", "GroupIndex"]

logger = logging.getLogger("pdconnect.router.kvindex")

DEFAULT_MAX_BLOCKS = 1 << 19


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
    `removal_unreadable`, `index_full`, `orphan`, `unanchored`, `granularity`, `dp_rank`)."""

    groups: dict[int, GroupIndex] = field(default_factory=dict)
    # Hashes waiting for a content key, per group: enough for a few long prompts' runs.
    max_pending: int = 4096
    max_blocks: int = DEFAULT_MAX_BLOCKS  # over all groups
    count: Callable[[str], None] = _no_count
    budget: BlockBudget = field(init=False)
    engine: str = ""  # the engine's name, for log lines
    # The data-parallel rank whose engine core this index mirrors (None: no data parallelism).
    dp_rank: int | None = None
    # The KV cache groups the engine's connector last described (None: not yet).
    described: EngineDescribed | None = None
    # Block keys of the ranges of stores that could not be placed, at most this many (oldest dropped).
    max_unplaced: int = 1 << 16
    # The key space's granularity set by the stores read (0: none yet; see `granularity`).
    _grain: int = field(default=0, init=False)
    _unplaced: OrderedDict[int, None] = field(default_factory=OrderedDict, init=False)
    _warned: set[str] = field(default_factory=set, init=False)
    _placement: StorePlacement = field(init=False)

    def __post_init__(self) -> None:
        self.budget = BlockBudget(self.max_blocks)
        self._placement = StorePlacement(self.groups, self.max_pending)

    @property
    def granularity(self) -> int:
        """The token granularity of this engine's content keys (the gcd of its groups' block
        sizes; 0 before any group): lookups read `keys[granularity]`."""
        return math.gcd(self._grain, *(g.block_size for g in self.groups.values()))

    def apply_payload(self, payload: bytes) -> bool:
        """Apply one published payload, event by event; False when it is no batch at all
        (then nothing was applied and the caller must distrust the index: removals may be lost).
        A batch of another data-parallel rank than this index's (`dp_rank`) is dropped, counted
        `dp_rank`: its blocks live in another engine core's cache."""
        try:
            batch = decode_batch(payload)
        except DECODE_ERRORS:
            batch = None
        if batch is not None:
            if self._own_rank(batch.data_parallel_rank):
                self.apply(batch)
            return True
        try:
            raw = decode_raw_batch(payload)
        except DECODE_ERRORS:
            return False
        if not self._own_rank(raw.data_parallel_rank):
            return True
        events: list[KVEvent] = []
        for item in raw.events:
            try:
                events.append(decode_event(item))
            except DECODE_ERRORS:
                self.count("undecodable")
                self._unreadable(item, events)
        self.apply(KVEventBatch(ts=0.0, events=events))
        return True

    def _own_rank(self, rank: object) -> bool:
        """Whether a batch published as data-parallel rank `rank` is this index's to apply.
        vLLM stamps every batch with its engine core's rank (0 without data parallelism)."""
        if rank is None or rank == (self.dp_rank or 0):
            return True
        self.count("dp_rank")
        if "dp_rank" not in self._warned:
            self._warned.add("dp_rank")
            logger.warning(
                "KV index of engine %s (DP rank %s): a batch of DP rank %r dropped; are the KV events "
                "ports offset by rank, as vLLM binds them?",
                self.engine or "?",
                self.dp_rank,
                rank,
            )
        return False

    def _unreadable(self, item: msgspec.Raw, events: list[KVEvent]) -> None:
        """An event our structs cannot read: a store is safely skipped; a removal is applied
        as far as it can be read (the index keeps nothing it cannot vouch for)."""
        try:
            value = msgspec.msgpack.decode(item)
        except (*DECODE_ERRORS, TypeError, ValueError):
            return  # not even a map: no kind we could name
        if not isinstance(value, dict) or value.get("type") not in ("BlockRemoved", "AllBlocksCleared"):
            return  # a store (skipping it under-reports) or a kind we do not model
        hashes, group = value.get("block_hashes"), value.get("group_idx")
        if value["type"] == "BlockRemoved" and isinstance(hashes, list):
            events.append(BlockRemoved(hashes, None, group if valid_group(group) else -1))
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
                    waiting.removed.update(h for h in event.block_hashes if valid_hash(h))
                continue
            if isinstance(event, AllBlocksCleared):
                self._forget()
                deferred.clear()
                continue
            if isinstance(event, EngineDescribed):
                self._described(event)
                continue
            reason = _store_reason(event)
            if reason is not None:
                self.count(reason)
                continue
            self._placement.confirm_continued(event)
            group = self._group_for(event)
            if group is not None and not event.block_hashes:
                self._placement.note_empty(
                    event, self._grain
                )  # caches nothing, but its range end is a key a later store continues from
                continue
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

    def _described(self, event: EngineDescribed) -> None:
        """The engine's connector describing its KV cache groups (`pdconnect.kvdescribe`):
        kept when sound; otherwise counted by reason and logged (once per reason), and the
        description held before, if any, stays."""
        reason = invalid_reason(event)
        if reason is None:
            self.described = event
            return
        self.count(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning(
                "KV index of engine %s: its connector's description of its KV cache groups is refused (%s)",
                self.engine or "?",
                reason,
            )

    def _is_sparse_sliding(self, group: GroupIndex, event: BlockStored) -> bool:
        blocks = len(event.token_ids) // group.block_size
        return group.sliding_window is not None and len(event.block_hashes) < blocks

    def _set_granularity(self, batch: KVEventBatch) -> None:
        """Make the key space fine enough for every store of `batch`, before any is read; a
        finer one invalidates every key held, so the index starts over (counted)."""
        current = self.granularity
        # A block size the key space already divides cannot refine it: only the others need
        # the (whole-range) validity check here, which `apply` repeats for every store.
        stores = [
            e
            for e in batch.events
            if isinstance(e, BlockStored) and (not current or e.block_size % current) and self._may_store(e)
        ]
        grain = math.gcd(current, *(e.block_size for e in stores))
        if grain == current:
            return
        if self.groups:
            self.count("granularity")
            self._forget()
        self._grain = grain

    def _may_store(self, event: BlockStored) -> bool:
        """Whether `apply` may index `event` (valid, and no `group_mismatch`)."""
        if _store_reason(event) is not None:
            return False
        group = self.groups.get(event.group_idx or 0)
        return group is None or group.block_size == event.block_size

    def _group_for(self, event: BlockStored) -> GroupIndex | None:
        """The store's group, created by its first store; None (counted) for a store that
        contradicts the group's block size or kind: an engine keeps its layout for life."""
        gid = event.group_idx or 0
        window = event.kv_cache_spec_sliding_window if is_sliding(event) else None
        group = self.groups.get(gid)
        if group is None:
            group = self.groups[gid] = GroupIndex(event.block_size, window, self.budget)
        elif group.block_size != event.block_size or group.sliding_window != window:
            self.count("group_mismatch")
            return None
        return group

    def _remove(self, event: BlockRemoved) -> None:
        hashes = [h for h in event.block_hashes if valid_hash(h)]
        if len(hashes) < len(event.block_hashes):
            self.count("hashes")  # malformed hashes were never accepted in a store: nothing to do
        if valid_group(event.group_idx):
            group = self.groups.get(event.group_idx or 0)
            targets = [] if group is None else [group]
        else:
            self.count("group")  # which group is unknown: remove from all, the safe side
            targets = list(self.groups.values())
        for group in targets:
            group.remove(hashes)

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
        placement = self._placement
        parent = placement.start_key(event, grain)
        placed: list[tuple[BlockHash, int] | None]
        if parent is None:
            placed = [None] * len(hashes)
        else:
            ratio = size // grain
            own = chain_keys(event.token_ids, grain, parent)[ratio - 1 :: ratio]  # the range's block keys
            placement.note_end(own[-1])
            unplaceable = None
            # Every block of the range listed: positions, hence content keys, are known.
            if len(hashes) == len(own):
                placed = list(zip(hashes, own))
            else:
                placed, unplaceable = placement.place(group, event, own)
            if unplaceable is not None:
                self._unplaceable(event, own, unplaceable)
        for block_hash, slot in zip(hashes, placed):
            if block_hash in removed:
                continue
            if slot is not None:
                group.add(block_hash, slot[1])
                keyed.append(slot)
            elif (known := placement.key_of(block_hash)) is not None:
                group.add(block_hash, known)
            else:
                group.wait_for_key(block_hash, self.max_pending)
        for _ in range(group.evicted - evicted):
            self.count("index_full")
        for _ in range(group.orphans - orphans):
            self.count("orphan")

    def _forget(self) -> None:
        """Drop everything held (a restart of the engine's cache or of the key space)."""
        self.groups.clear()
        self.budget = BlockBudget(self.max_blocks)
        self._unplaced.clear()
        self._placement.clear()

    def _unplaceable(self, event: BlockStored, own: list[int], reason: str) -> None:
        """A store whose listed hashes cannot all be placed: counted (`unanchored`), logged
        with the engine and the reason (a warning the first time per reason, then debug),
        and its range's block keys marked, so that the decider predicts P/D for the prompts
        that reach into it (`unplaced_in`) and only for those. The marks are conservative:
        they outlive the blocks (dropped oldest first past `max_unplaced`, or on a restart)."""
        self.count("unanchored")
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        logger.log(
            level,
            "KV index of engine %s: cannot place a store of %d hashes over %d blocks of group %s (%s): %s; "
            "prompts reaching into them are predicted P/D",
            self.engine or "?",
            len(event.block_hashes),
            len(own),
            event.group_idx or 0,
            event.kv_cache_spec_kind,
            reason,
        )
        unplaced = self._unplaced
        for key in own:
            unplaced[key] = None
            unplaced.move_to_end(key)
        while len(unplaced) > self.max_unplaced:
            unplaced.popitem(last=False)

    def unplaced_in(self, prompt: RoutingPrompt) -> bool:
        """Whether the prompt reaches into the range of a store this index could not place:
        then what the engine holds for it is unknown, and no hit can be predicted."""
        if not self._unplaced or not self.groups:
            return False
        grain = self.granularity
        keys = prompt.keys_upto(grain, len(prompt.tokens) // grain)
        return not self._unplaced.keys().isdisjoint(keys)

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

    def hit_tokens(self, prompt: RoutingPrompt, *, eagle_groups: Collection[int] = ()) -> int:
        """The longest prefix of the prompt every group can serve (0 before any event): vLLM's
        lookup (`longest_hit`) over this engine's groups, with at most all its tokens. The
        prompt's chain keys are shared across engines and lookups (see `longest_hit`).

        `eagle_groups`: the engine runs EAGLE/MTP drafting and these group ids get vLLM's
        last-block drop. The prompt is then the whole prompt, and the answer is vLLM's for it
        exactly: it looks up all tokens but the last and lets a dropping group peek one block
        further.
        """
        # vLLM looks groups of one spec up together, full attention first (a stable sort).
        ordered = sorted(self.groups.items(), key=lambda item: (item[1].sliding_window is not None, item[0]))
        specs = dict.fromkeys((g.block_size, g.sliding_window) for _, g in ordered)
        eagle = {(g.block_size, g.sliding_window) for gid, g in ordered if gid in eagle_groups}
        grain = self.granularity
        groups = [self.lookup_group(size, window, (size, window) in eagle, grain) for size, window in specs]
        max_length = len(prompt.tokens) - 1 if eagle_groups else len(prompt.tokens)
        return longest_hit(groups, prompt, max_length)

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


def _store_reason(event: BlockStored) -> str | None:
    """`invalid_reason` for a store, except that one listing no hash is valid: vLLM publishes
    it for a sliding-window group that keeps none of the range (behind the window, or masked),
    and it still tells the group's block size, hence the engine's key granularity. Missing
    it, a first step whose sliding store is empty sets a coarser key space, and the group's
    first real store starts the index over (issue 32's sweep)."""
    if event.block_hashes:
        return invalid_reason(event)
    return invalid_reason(msgspec.structs.replace(event, block_hashes=[0]))


@dataclass
class _Deferred:
    """A sparse sliding-window store waiting for the end of its batch, and the hashes removed meanwhile."""

    group: GroupIndex
    event: BlockStored
    removed: set[BlockHash] = field(default_factory=set)
