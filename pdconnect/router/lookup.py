"""What vLLM's own prefix-cache lookup would hit on an engine, replayed over the router's KV index.

The kv-aware index (`kvindex`) says which blocks of each KV cache group an engine holds.
Whether a request would *hit* them is vLLM's rule, not a simple prefix run: the engine
caps a hit at `prompt_len - 1` (the last token is always computed, for its logits), a
sliding-window group needs a run of `cdiv(window - 1, block) + 1[EAGLE]` cached blocks
that ends on the cache-hit alignment (the lcm of the groups' block sizes), and with
EAGLE/MTP a group "drops" the last matched block (`KVCacheManager.get_computed_blocks`,
`HybridKVCacheCoordinator.find_longest_cache_hit` and the single-type managers'
`find_longest_cache_hit`, vLLM 0.32). `lookup_hit` is that algorithm, step for step, over
"is block i of this group cached" instead of vLLM's block pool; a test runs it against
vLLM's real coordinator on random cache states.

Which groups exist and which take the EAGLE/MTP drop cannot be read from KV events (a
group that has published nothing is absent from the index, and the drop is a scheduler
setting), so they are configuration: `parse_groups("full:128:eagle,sliding:128:64:eagle")`.
vLLM flags every group for the drop under EAGLE (no group names the draft), and only the
group holding the drafter's trailing layers under MTP.

Scope, as pdconnect's connector: full-attention and sliding-window groups, no Mamba (so no
fine-grained partial hash hits), no decode context parallelism. Groups of one kind, block
size and window are looked up jointly, as vLLM does for groups of one spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pdconnect.errors import ConfigError
from pdconnect.router.kvindex import EngineKVIndex, chain_keys

__all__ = ["CacheGroup", "CacheGroups", "lookup_hit", "parse_groups", "predicted_hits"]

GroupKind = Literal["full", "sliding"]


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache spec of the engines: kind, block size, window (sliding only), EAGLE drop."""

    kind: GroupKind
    block_size: int
    window: int | None = None
    eagle: bool = False

    def __str__(self) -> str:
        window = f":{self.window}" if self.window is not None else ""
        return f"{self.kind}:{self.block_size}{window}{':eagle' if self.eagle else ''}"


@dataclass(frozen=True)
class CacheGroups:
    """The engines' KV cache specs, full attention first (the order vLLM looks them up in)."""

    groups: tuple[CacheGroup, ...]

    @property
    def alignment(self) -> int:
        """Cache hits land on this many tokens: one group's block, or the lcm of several."""
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        return math.gcd(*(g.block_size for g in self.groups))

    def full_attention_only(self) -> CacheGroups | None:
        """The same engines as a decider reading full attention alone would see them."""
        full = tuple(g for g in self.groups if g.kind == "full")
        return CacheGroups(full) if full else None

    def __str__(self) -> str:
        return ",".join(str(g) for g in self.groups)


def parse_groups(text: str) -> CacheGroups:
    """`full:128[:eagle],sliding:128:64[:eagle],...` -> CacheGroups; ConfigError names the bad part."""
    groups: list[CacheGroup] = []
    for part in (p.strip() for p in text.split(",")):
        fields = part.split(":")
        eagle = fields[-1] == "eagle"
        if eagle:
            fields.pop()
        try:
            if fields[0] == "full" and len(fields) == 2:
                group = CacheGroup("full", int(fields[1]), None, eagle)
            elif fields[0] == "sliding" and len(fields) == 3:
                group = CacheGroup("sliding", int(fields[1]), int(fields[2]), eagle)
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"KV cache group {part!r}: expected full:BLOCK or sliding:BLOCK:WINDOW, optionally :eagle"
            ) from None
        if group.block_size < 1 or (group.window is not None and group.window < 1):
            raise ConfigError(f"KV cache group {part!r}: block size and window must be positive")
        if any((g.kind, g.block_size, g.window) == (group.kind, group.block_size, group.window) for g in groups):
            raise ConfigError(f"KV cache group {part!r} is given twice (groups of one spec are one lookup)")
        groups.append(group)
    if not groups:
        raise ConfigError("no KV cache groups given")
    # vLLM sorts full attention first (a stable sort): its run bounds the others.
    return CacheGroups(tuple(sorted(groups, key=lambda g: g.kind != "full")))


Cached = Callable[[int], bool]  # is block i (at the group's block size) cached?


def _full_attention_hit(cached: Cached, block_size: int, max_length: int, drop: bool, alignment: int) -> int:
    # FullAttentionManager.find_longest_cache_hit, phase 1 (no fine-grained hits without Mamba).
    run = 0
    while run < max_length // block_size and cached(run):
        run += 1
    hit = run * block_size
    if drop and hit > 0:
        hit -= min(alignment, block_size)
    return hit - hit % alignment


def _sliding_window_hit(
    cached: Cached, block_size: int, window: int, max_length: int, drop: bool, alignment: int
) -> int:
    # SlidingWindowManager.find_longest_cache_hit: right to left, a run of `need` blocks
    # whose right end sits on the alignment (one block past it under EAGLE, then popped).
    need = -(-(window - 1) // block_size) + (1 if drop else 0)
    run, found, length = 0, False, 0
    for i in range(max_length // block_size - 1, -1, -1):
        if cached(i):
            if run == 0 and block_size != alignment:
                post_pop = i if drop else i + 1
                if post_pop * block_size % alignment:
                    continue
            run += 1
            if run >= need:
                found, length = True, i + run
                break
        else:
            run = 0
    if not found:
        length = run  # the leading run from block 0 is a hit even if shorter than the window
        while block_size != alignment and length * block_size % alignment:
            length -= 1
    if drop and length:
        length -= 1
        while block_size != alignment and length * block_size % alignment:
            length -= 1
    return length * block_size


def _group_hit(group: CacheGroup, cached: Cached, max_length: int, drop: bool, alignment: int) -> int:
    if group.kind == "full":
        return _full_attention_hit(cached, group.block_size, max_length, drop, alignment)
    assert group.window is not None
    return _sliding_window_hit(cached, group.block_size, group.window, max_length, drop, alignment)


def lookup_hit(groups: CacheGroups, cached: Sequence[Cached], num_tokens: int) -> int:
    """The prompt tokens vLLM's lookup reports as computed for a request of `num_tokens`
    tokens, given per group (in `groups.groups` order) which of its blocks are cached."""
    max_hit = num_tokens - 1  # get_computed_blocks: the last token is always recomputed
    if max_hit <= 0:
        return 0
    specs = groups.groups
    if len(specs) == 1:  # UnitaryKVCacheCoordinator: no look-ahead margin
        group = specs[0]
        return _group_hit(group, cached[0], max_hit, group.eagle, group.block_size)
    # HybridKVCacheCoordinator.find_longest_cache_hit: a fixed point over the groups.
    alignment = groups.alignment
    hashed = num_tokens // groups.hash_block_size * groups.hash_block_size
    simple = len(specs) == 2 and specs[0].kind == "full"
    full_hits: dict[int, int] = {}  # full attention is downward-closed: looked up once
    eagle_verified: set[int] = set()
    hit_length = max_hit
    while True:
        current = hit_length
        for idx, group in enumerate(specs):
            if group.kind == "full" and idx in full_hits:
                current = min(current, full_hits[idx])
                continue
            drop = group.eagle and idx not in eagle_verified
            max_length = min(current + group.block_size, hashed) if drop else current
            new = _group_hit(group, cached[idx], max_length, drop, alignment)
            if drop:
                eagle_verified.add(idx)
            elif new < current:
                eagle_verified.clear()
            current = new
            if group.kind == "full":
                full_hits[idx] = new
        if current >= hit_length:
            break
        hit_length = current
        if simple:
            break
    return hit_length


def _cached_in(index: EngineKVIndex, group: CacheGroup, keys: list[int]) -> Cached:
    """Block i of `group` is cached when every index group of its spec holds its content key."""
    window = group.window if group.kind == "sliding" else None
    members = [g for g in index.groups.values() if g.block_size == group.block_size and g.sliding_window == window]
    if not members:
        return lambda i: False  # nothing of this group ever published (or all evicted)
    return lambda i: i < len(keys) and all(keys[i] in g.present for g in members)


def predicted_hits(groups: CacheGroups, index: EngineKVIndex, tokens: Sequence[int]) -> tuple[int, int]:
    """(the hit vLLM would report on the engine, the hit a full-attention-only reading predicts)."""
    keys = {size: chain_keys(tokens, size) for size in {g.block_size for g in groups.groups}}
    cached = [_cached_in(index, g, keys[g.block_size]) for g in groups.groups]
    hit = lookup_hit(groups, cached, len(tokens))
    full = groups.full_attention_only()
    if full is None:
        return hit, hit
    full_cached = [c for g, c in zip(groups.groups, cached) if g.kind == "full"]
    return hit, lookup_hit(full, full_cached, len(tokens))
