"""Byte-range arithmetic: the `(local_addr, remote_addr, length)` ranges a pull moves, as numpy tables.

A `Range` is one contiguous copy from the peer's memory into ours; a `RangeTable` is
many of them backed by one (N, 3) int64 table, which the transports post as it is.
`merge_ranges` joins ranges adjacent on both sides into one, so a library sees fewer
descriptors ("merge", not "coalesce": that word names the decode side's sibling waits).
No transport is involved here; `pdconnect.kvlayout` computes ranges, `transport` checks
and moves them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

__all__ = ["Range", "RangeTable", "merge_range_groups", "merge_ranges", "merge_table", "range_table"]

# (local_addr, remote_addr, length): one contiguous copy from the peer into our memory.
Range = tuple[int, int, int]


class RangeTable(Sequence[Range]):
    """A read-only sequence of ranges backed by an (N, 3) int64 numpy table.

    What the layout arithmetic returns: the transports post the table as it is (NIXL
    takes numpy descriptor tables, Mooncake three lists made by one `tolist`), so a pull
    of thousands of ranges never builds thousands of tuples. Anyone else iterates it like
    a list of `(local_addr, remote_addr, length)` tuples; it compares equal to one.
    """

    __slots__ = ("table",)

    def __init__(self, table: Any) -> None:
        table.flags.writeable = False  # what was validated is what gets posted
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, index: int) -> Range: ...
    @overload
    def __getitem__(self, index: slice) -> list[Range]: ...

    def __getitem__(self, index: int | slice) -> Range | list[Range]:
        if isinstance(index, slice):
            return list(map(tuple, self.table[index].tolist()))
        local, remote, length = self.table[index].tolist()
        return local, remote, length

    def __iter__(self) -> Iterator[Range]:
        # Three column lists zipped: about twice as fast as a tuple per row of `tolist()`.
        return zip(*self.table.T.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RangeTable):
            other = list(other)
        return isinstance(other, (list, tuple)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as list; typeshed's is a method

    def __repr__(self) -> str:
        return f"RangeTable({list(self)!r})"

    @property
    def total_bytes(self) -> int:
        """The bytes these ranges move."""
        return int(self.table[:, 2].sum())


def range_table(ranges: Sequence[Range]) -> Any:
    """The (N, 3) int64 numpy table of `ranges` (the one it keeps, for a RangeTable).

    numpy is imported here, not at module import: only a process that moves bytes needs it
    (every transport library depends on it), a router never does.
    """
    if isinstance(ranges, RangeTable):
        return ranges.table
    import numpy as np

    # fromiter over the flattened tuples: half the time of np.array on a list of tuples.
    flat = np.fromiter(itertools.chain.from_iterable(ranges), dtype=np.int64)
    if len(flat) != 3 * len(ranges):
        raise ValueError(
            f"ranges must be (local_addr, remote_addr, length) triples; {len(ranges)} ranges hold {len(flat)} numbers"
        )
    return flat.reshape(-1, 3)


def merge_ranges(ranges: Iterable[Range]) -> RangeTable:
    """Merge ranges that are adjacent on BOTH sides, so the library sees fewer descriptors.

    Ranges are sorted by local address first (order inside one batch does not matter,
    and sorting lets e.g. the K plane of block b meet the K plane of block b+1).
    Overlapping destinations are a caller bug (two pulls racing for the same bytes)
    and raise ValueError.
    """
    return RangeTable(merge_table(range_table(ranges if isinstance(ranges, Sequence) else list(ranges))))


def merge_range_groups(groups: Iterable[Sequence[Range]]) -> RangeTable:
    """`merge_ranges` over several range sets at once (e.g. one per KV cache group).

    Joins `RangeTable`s by their tables, where `merge_ranges(list_a + list_b)` would turn
    every range into a tuple and back.
    """
    import numpy as np

    tables = [range_table(group) for group in groups]
    return RangeTable(merge_table(np.concatenate(tables) if tables else np.zeros((0, 3), dtype=np.int64)))


def merge_table(table: Any) -> Any:
    """`merge_ranges` on an (N, 3) int64 table, returning a new table (vectorized)."""
    import numpy as np

    positive = table[:, 2] > 0
    if not positive.all():
        table = table[positive]
    if len(table) < 2:
        return table.copy()
    # By local address alone: valid input has no two ranges starting at one address
    # (that is an overlap, refused below), and a stable radix sort of one int64 key is
    # several times faster than sorting whole rows.
    table = table[np.argsort(table[:, 0], kind="stable")]
    local, remote, length = table[:, 0], table[:, 1], table[:, 2]
    local_end = local[:-1] + length[:-1]
    overlaps = np.flatnonzero(local[1:] < local_end)
    if len(overlaps):
        i = int(overlaps[0])
        raise ValueError(
            f"destination ranges overlap: [{int(local[i]):#x}, +{int(length[i])}) and "
            f"[{int(local[i + 1]):#x}, +{int(length[i + 1])})"
        )
    joins = (local[1:] == local_end) & (remote[1:] == remote[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = table[starts].copy()
    merged[:, 2] = np.add.reduceat(length, starts)
    return merged
