"""A model's KV cache geometry as an operator describes it: groups, block sizes, windows, EAGLE.

Plain data with no vLLM import, so commands can validate their input before paying for
vLLM's import; `connectors.vllm_adapter` turns it into vLLM's own objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["Geometry", "GroupGeometry", "GroupKind", "UnsupportedLayout", "consecutive_runs"]

GroupKind = Literal["full_attention", "sliding_window"]


class UnsupportedLayout(ValueError):
    """A KV cache group or geometry that pdconnect cannot serve (e.g. Mamba, bad sizes)."""


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group: its kind, block size, window (sliding only) and flags."""

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    eagle: bool = False
    prefix_cacheable: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise UnsupportedLayout(f"block size must be positive, got {self.block_size}")
        if self.kind == "sliding_window":
            if self.sliding_window is None or self.sliding_window <= 0:
                raise UnsupportedLayout(f"sliding window must be positive, got {self.sliding_window}")
        elif self.sliding_window is not None:
            raise UnsupportedLayout("a full-attention group has no sliding window")


@dataclass(frozen=True)
class Geometry:
    """A model's KV cache groups plus the retention policy, as vLLM would configure them.

    `scheduler_block_size` and `hash_block_size` follow vLLM's definitions (lcm and gcd
    of the group block sizes); the cache-hit alignment is read back from the coordinator
    vLLM builds for the geometry.
    """

    groups: tuple[GroupGeometry, ...]
    retention_interval: int | None = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise UnsupportedLayout("a geometry needs at least one KV cache group")

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        cacheable = [g.block_size for g in self.groups if g.prefix_cacheable] or [self.scheduler_block_size]
        return math.gcd(*cacheable)

    @property
    def use_eagle(self) -> bool:
        return any(g.eagle for g in self.groups)


def consecutive_runs(indices: Iterable[int]) -> list[range]:
    """Sorted block indices as runs of consecutive ones: [3, 4, 5, 9] -> [range(3, 6), range(9, 10)]."""
    runs: list[range] = []
    for index in indices:
        if runs and runs[-1].stop == index:
            runs[-1] = range(runs[-1].start, index + 1)
        else:
            runs.append(range(index, index + 1))
    return runs
