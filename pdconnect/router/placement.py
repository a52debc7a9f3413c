"""Where a store's listed hashes stand in its block range, and where the range starts.

An engine's index (`kvindex`) keys a block by the content key of its token prefix; a
store's `token_ids` give its whole range's keys once the key the range continues from is
known, and its `block_hashes` say which blocks a group cached. Both can be partial, and
this module reads them the way vLLM wrote them:

A store's `block_hashes` leave out the blocks a group did not cache (vLLM's
`BlockPool.cache_full_blocks` skips them): a sliding-window group's blocks behind the
window (null, `remove_skipped_blocks`) and those its lookup never consults (masked,
`SlidingWindowManager.reachable_block_mask`). Which positions the listed hashes stand for
is then unknown. A listed hash another group of the engine has keyed (any block size: one
key space, see `kvindex`) whose key is the content key of a block of the range is
*anchored* there, content-verified; one listed by the group of the largest block size
(vLLM's scheduler block, the cache-hit alignment) ends an aligned *boundary*. The others
of a sliding-window store are placed by vLLM's rule (`run_blocks`): what it keeps of a
sliding group is a union of runs of `cdiv(window - 1, B)` blocks (one more in a group that
takes the EAGLE/MTP drop) ending at (one past) the aligned boundaries it retains, clipped
to the range; anchors pin the runs, the alignment places the gaps between them. Where two
readings fit (a run cut by the range's start, or by its end when the prompt goes on), the
first is taken and the other kept until a later store names the range's last block as
its parent (`confirm_continued`). Our decode connector publishes a slack run as a store
of its own, from the prompt's start, ending at the run. Whether a group takes the drop is
not published, so both shifts are tried. A store whose runs do not fit (anchors out of
order or off the runs, no alignment known: no full-attention block in or before its
range) is unplaceable, and `place` says why.

A store whose parent vLLM names by a hash no event lists (a block the window did not
cache, an empty store's last block, MTP's one-block lag) starts from a recent store's
range end, chosen by content: the one from which the range's chain reaches a key another
group listed among the store's hashes, or else any key a group holds (`start_key`).

The argument and its limits are in docs/router.md; `tests/test_router_kvindex_sweep.py`
checks the whole against vLLM's own manager.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdconnect.router.kvwire import BlockHash, BlockStored
from pdconnect.router.prompt import chain_keys

__all__ = ["PlacedGroup", "StorePlacement", "run_blocks"]

# Recent range ends an unknown parent is looked for among (a request's stores follow each
# other closely within an engine's event stream).
_TAILS_TRIED = 8


class PlacedGroup(Protocol):
    """One indexed KV cache group as placement reads and corrects it (`kvindex.GroupIndex`)."""

    @property
    def block_size(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def by_hash(self) -> Mapping[BlockHash, int]: ...
    @property
    def present(self) -> Mapping[int, int]: ...
    def add(self, block_hash: BlockHash, key: int) -> None: ...
    def remove(self, block_hashes: list[BlockHash]) -> None: ...


@dataclass
class _Tentative:
    """A sparse sliding-window store's other reading: (hash, content key) of each listed hash."""

    group: PlacedGroup
    placed: list[tuple[BlockHash, int]]


@dataclass
class StorePlacement:
    """The placement state of one engine's index: the ends of recent stores' ranges, the
    keys learned for parent hashes no store lists, and the other reading of stores placed
    as a prompt's last chunk; each bounded by `max_pending`, oldest dropped. `groups` is
    the index's own mapping of its groups (read, never replaced)."""

    groups: Mapping[int, PlacedGroup]
    max_pending: int
    # Content keys at the ends of recent stores' ranges, newest last, and the keys learned
    # for parent hashes no store lists (see `start_key`).
    _tails: OrderedDict[int, None] = field(default_factory=OrderedDict, init=False)
    _learned: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict, init=False)
    # Sparse stores placed as a prompt's last chunk, by their last listed hash, with the
    # reading that holds if a later store continues from that hash (`confirm_continued`).
    _tentative: OrderedDict[BlockHash, _Tentative] = field(default_factory=OrderedDict, init=False)

    def clear(self) -> None:
        """Forget everything (the index starts over)."""
        self._tentative.clear()
        self._tails.clear()
        self._learned.clear()

    def key_of(self, block_hash: BlockHash) -> int | None:
        """The content key any group of the engine has for `block_hash` (one key space)."""
        for group in self.groups.values():
            if (key := group.by_hash.get(block_hash)) is not None:
                return key
        return None

    def place(
        self, group: PlacedGroup, event: BlockStored, own: list[int]
    ) -> tuple[list[tuple[BlockHash, int] | None], str | None]:
        """(hash, content key) for each listed hash of a sparse store whose range's block
        keys are `own`, None where its position is unknown: anchors, and for a sliding-window
        group the runs vLLM keeps around them (see the module docstring), with None, or the
        reason the store cannot be placed (the anchors alone are placed then). Linear in the range."""
        hashes, parent = event.block_hashes, event.parent_block_hash
        position = {key: p for p, key in enumerate(own)}
        anchors: dict[int, int] = {}  # index in hashes -> block of the range
        foreign = False  # a known hash of other content: the store contradicts the index
        for i, block_hash in enumerate(hashes):
            key, p = self.key_of(block_hash), None
            if key is not None and (p := position.get(key)) is not None:
                anchors[i] = p
            foreign |= key is not None and p is None
        placed: list[tuple[BlockHash, int] | None] = [None] * len(hashes)
        for i, p in anchors.items():
            placed[i] = (hashes[i], own[p])
        window = group.sliding_window
        if window is None or foreign:
            if len(anchors) < len(hashes):
                return placed, "contradicts_index" if foreign else "sparse_full_attention"
            return placed, None
        # Tokens per cache-hit-aligned boundary: the lcm of the groups' block sizes (vLLM's
        # scheduler block). Only the groups of that block size end a block on each boundary.
        alignment = math.lcm(*(g.block_size for g in self.groups.values()))
        per_segment = alignment // group.block_size
        aligned = [g for g in self.groups.values() if g.block_size == alignment]
        # Blocks of the range ending a cache-hit-aligned boundary the aligned group holds.
        keyed = [p for p, key in enumerate(own) if any(key in g.present for g in aligned)]
        if parent is None or any(parent in g.by_hash for g in aligned):
            phase = per_segment - 1  # the range starts on a boundary
        elif keyed:
            phase = keyed[0] % per_segment
        else:
            return placed, "alignment_unknown"
        if any(p % per_segment != phase for p in keyed):
            return placed, "contradicts_index"
        readings = run_blocks(len(hashes), anchors, keyed, phase, len(own), group.block_size, window, alignment)
        if readings is None:
            return placed, "runs_do_not_fit"
        blocks, continued = readings
        if continued is not None:  # confirmed if a store continues from the range's last block
            self._tentative[hashes[-1]] = _Tentative(group, [(h, own[p]) for h, p in zip(hashes, continued)])
            while len(self._tentative) > self.max_pending:
                self._tentative.popitem(last=False)
        return [(block_hash, own[p]) for block_hash, p in zip(hashes, blocks)], None

    def confirm_continued(self, event: BlockStored) -> None:
        """A store whose parent is the last listed hash of a store placed as a prompt's last
        chunk: that hash is the range's last block, so the prompt went on, and the store's
        other reading (its last run cut by the range's end) is vLLM's: re-keyed."""
        if not self._tentative or not event.parent_block_hash:
            return
        tentative = self._tentative.pop(event.parent_block_hash, None)
        if tentative is None or not any(g is tentative.group for g in self.groups.values()):
            return
        group = tentative.group
        held = [h for h, _ in tentative.placed if h in group.by_hash]
        group.remove(held)
        for block_hash, key in tentative.placed:
            if block_hash in held:
                group.add(block_hash, key)

    def start_key(self, event: BlockStored, grain: int) -> int | None:
        """The content key the store's range continues from (0: the prompt's start), None
        when unknown, in the engine's key space of granularity `grain`. vLLM names the block
        before the range as the parent even when no group listed it (a sliding-window block
        behind the window or masked, whose store listed nothing, MTP's one-block lag): then
        the key is found by content, as the end of a recent store's range from which the
        range's chain reaches a key another group listed among the store's own hashes, and
        learned for that hash."""
        parent = event.parent_block_hash
        if parent is None:
            return 0
        key = self.key_of(parent)
        if key is None:
            key = self._learned.get(parent)
        if key is not None or not self._tails:
            return key
        anchors = {k for h in event.block_hashes if (k := self.key_of(h)) is not None}
        presents = [g.present for g in self.groups.values()]
        for tail in itertools.islice(reversed(self._tails), _TAILS_TRIED):
            keys = chain_keys(event.token_ids, grain, tail)
            # Without a listed hash another group keyed, any key a group holds (a block of
            # the same step's full-attention store) verifies the start by content.
            if not anchors.isdisjoint(keys) if anchors else any(k in p for k in keys for p in presents):
                self._learned[parent] = tail
                while len(self._learned) > self.max_pending:
                    self._learned.popitem(last=False)
                return tail
        return None

    def note_empty(self, event: BlockStored, grain: int) -> None:
        """Remember where a store listing no hash ends; when its start is unknown, where it
        would end after each recent range end (a candidate: only a later store whose chain
        through it reaches a listed key confirms it, see `start_key`)."""
        parent = self.start_key(event, grain)
        starts = [parent] if parent is not None else list(itertools.islice(reversed(self._tails), _TAILS_TRIED))
        for start in reversed(starts):  # the likeliest start ends up newest
            self.note_end(chain_keys(event.token_ids, grain, start)[-1])

    def note_end(self, key: int) -> None:
        """A store's range ends at content key `key`: a later store may continue from it."""
        tails = self._tails
        tails[key] = None
        tails.move_to_end(key)
        while len(tails) > _TAILS_TRIED:
            tails.popitem(last=False)


def run_blocks(
    count: int,
    anchors: dict[int, int],
    keyed: Collection[int],
    phase: int,
    length: int,
    block_size: int,
    sliding_window: int,
    alignment: int,
) -> tuple[list[int], list[int] | None] | None:
    """The block of the range each of the `count` listed hashes of a sparse sliding-window
    store stands for, by vLLM's rule (`SlidingWindowManager.reachable_block_mask`), or None
    when it cannot be told.

    vLLM keeps, for each boundary b it retains (every cache-hit-aligned one when dense, one
    per retention interval, the one or two a prompt can be replayed from, a shared-prefix
    junction: which of them is unknown here), the run of `need` = `cdiv(window - 1, B)`
    (+1 under the EAGLE/MTP drop, shift 1) blocks ending `shift` blocks past b, clipped to
    the range. What a store lists is the union of such runs: intervals of the range, each
    starting where a run starts (or at the range's start) and ending where a run ends (or at
    the range's end). Every run holds its boundary block (need > shift), whose hash the
    aligned group lists too: the hashes another group anchored (`anchors`: index in the
    list -> block) pin the intervals, and between two anchors at most one gap (a middle
    interval without an anchor would lack its boundary), whose place the run ends and
    starts fix. A hash no group anchored never sits on a block whose key the aligned group
    holds (`keyed`: it would be that block's hash). `phase`: the range's blocks b with
    b = phase (mod alignment / B) end an aligned boundary (-1: the block before the range).
    Whether the group takes the drop is not published: both shifts are tried.

    Where several readings fit, the likeliest is returned (`_likeliest`), with the likeliest
    whose last run the range's end cut short (None if that is the one returned): a store
    of a prompt computed in several chunks, which only its continuation tells apart (the
    next chunk's store names the range's last block as its parent: `confirm_continued`).
    """
    per_segment = alignment // block_size
    base = -(-(sliding_window - 1) // block_size)
    order = sorted(anchors.items())
    if any(q - p < j - i for (i, p), (j, q) in itertools.pairwise(order)):
        return None  # anchors out of order: no reading places them
    keyed_set = set(keyed)
    # (preference, placement) of each shift's likeliest reading, and of its likeliest one
    # whose last run reaches past the range (a prompt computed in further chunks).
    readings: list[tuple[tuple[int, bool, Sequence[int]], tuple[int, ...]]] = []
    continued: list[tuple[tuple[int, bool, Sequence[int]], tuple[int, ...]]] = []
    for shift in (0, 1):
        need = base + shift

        def is_end(y: int, shift: int = shift) -> bool:
            return y == length or (y - phase - 1 - shift) % per_segment == 0

        def is_start(x: int) -> bool:
            return x == 0 or (x + base - phase - 1) % per_segment == 0

        # The listed hashes between consecutive anchors (None: the range's edges).
        edges: list[tuple[int | None, int | None, int]] = []
        previous_index, previous_block = -1, None
        for i, p in order:
            edges.append((previous_block, p, i - previous_index - 1))
            previous_index, previous_block = i, p
        edges.append((previous_block, None, count - previous_index - 1))
        chosen: list[int] = []
        for left, right, k in edges:
            options = [o for o in _segment_options(left, right, k, length, is_start, is_end) if keyed_set.isdisjoint(o)]
            if not options:
                break
            tail = [] if right is None else [right]
            ranked = sorted(((_likeliest([*chosen, *o, *tail], length, need), o) for o in options), reverse=True)
            if right is None:
                clipped = [(key, o) for key, o in ranked if key[1] is False]
                if clipped and clipped[0][1] is not ranked[0][1]:
                    continued.append((clipped[0][0], (*chosen, *clipped[0][1])))
            chosen.extend(ranked[0][1])
            chosen.extend(tail)
        else:
            readings.append((_likeliest(chosen, length, need), tuple(chosen)))
    if not readings:
        return None
    best = max(readings)[1]
    later = max(continued)[1] if continued else None
    return list(best), (None if later is None or later == best else list(later))


def _likeliest(blocks: Sequence[int], length: int, need: int) -> tuple[int, bool, Sequence[int]]:
    """The preference between readings that fit: fewer runs; then none cut short by the
    range's end (a run shorter than `need` blocks, not at the range's start, ending on the
    range's last block: the prompt went on, which a later store's parent would show); then
    later blocks (vLLM's replay runs lie at the prompt's end)."""
    gaps = sum(1 for a, b in itertools.pairwise(blocks) if b != a + 1)
    start = len(blocks) - 1
    while start > 0 and blocks[start - 1] == blocks[start] - 1:
        start -= 1
    cut = bool(blocks) and blocks[-1] == length - 1 and blocks[start] > 0 and len(blocks) - start < need
    return -gaps, not cut, blocks[::-1]


def _segment_options(
    left: int | None,
    right: int | None,
    k: int,
    length: int,
    is_start: Callable[[int], bool],
    is_end: Callable[[int], bool],
) -> list[list[int]]:
    """Where `k` listed hashes between the anchors at blocks `left` and `right` (None: the
    range's start, end) can sit: contiguous, or split by one gap whose sides are a run's
    end and a run's start (`run_blocks`)."""
    if k == 0:  # the anchors' own intervals meet, or end and start around a gap
        ends = left is None or right == left + 1 or is_end(left + 1)
        starts = right is None or right == (-1 if left is None else left) + 1 or is_start(right)
        return [[]] if ends and starts else []
    lo = 0 if left is None else left + 1
    hi = length if right is None else right
    if hi - lo < k:
        return []
    options: list[list[int]] = []
    if left is not None and right is not None:
        if hi - lo == k:
            return [list(range(lo, hi))]
        for a in range(k + 1):
            y, x = lo + a, hi - (k - a)
            if y < x and is_end(y) and is_start(x):
                options.append([*range(lo, y), *range(x, hi)])
        return options
    if left is None and right is not None:
        if is_start(hi - k):
            options.append(list(range(hi - k, hi)))
        for a in range(1, k + 1):
            x = hi - (k - a)
            if a < x and is_end(a) and is_start(x):
                options.append([*range(a), *range(x, hi)])
        return options
    if left is not None and right is None:
        if is_end(lo + k):
            options.append(list(range(lo, lo + k)))
        for a in range(k):
            y, x = lo + a, hi - (k - a)
            if y < x and is_end(y) and is_start(x):
                options.append([*range(lo, y), *range(x, hi)])
        return options
    # No anchor at all: one interval, or one at each edge.
    options.extend(list(range(x, x + k)) for x in range(length - k + 1) if is_start(x) and is_end(x + k))
    for a in range(1, k):
        x = length - (k - a)
        if a < x and is_end(a) and is_start(x):
            options.append([*range(a), *range(x, length)])
    return options
