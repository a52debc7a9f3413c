"""vLLM's cache-hit rule over indexed KV cache groups, and the hits the decode-first decider predicts with it.

The kv-aware index (`kvindex`) says which blocks of each KV cache group an engine holds;
`longest_hit` here is vLLM's own lookup rule over them (the cache-hit alignment, a
sliding-window group's run, the EAGLE/MTP drop; tested against vLLM's real coordinator),
the one copy both the kv-aware policy (`EngineKVIndex.hit_tokens`, over the groups the
engine has published) and the decode-first decider (`predicted_hits`, over the groups the
engine describes) use (`placement.run_blocks` is its counterpart for what a sliding-window
group keeps, the index's way to place a sparse store). vLLM's per-group events do not mix the
group into the hash, so mixing the groups here would call a prefix cached that one group
has already evicted.

`predicted_hits` asks what the engine would report for the whole prompt (at most
`prompt_len - 1` tokens: the last one is always computed), over the groups the engine's
connector describes (`described_groups` of a `pdconnect.kvdescribe.EngineDescribed`)
rather than those the index has seen: a group that has published nothing is absent from
the index, yet vLLM still needs its blocks, and the drop is a scheduler setting vLLM's own
events do not carry. `parse_groups("full:128:eagle,sliding:128:64:eagle")` reads the same
groups typed in (`--kv-cache-groups`, an override checked against the description).
vLLM flags every group for the drop under EAGLE (no group names the draft), and only the
group holding the drafter's trailing layers under MTP.

Scope, as pdconnect's connector: full-attention and sliding-window groups, no Mamba (so no
fine-grained partial hash hits), no decode context parallelism. Groups of one kind, block
size and window are looked up jointly, as vLLM does for groups of one spec.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pdconnect.errors import ConfigError
from pdconnect.kvdescribe import EngineDescribed
from pdconnect.router.prompt import RoutingPrompt

__all__ = [
    "CacheGroup",
    "CacheGroups",
    "LookupGroup",
    "described_groups",
    "longest_hit",
    "parse_groups",
    "predicted_hits",
]

GroupKind = Literal["full", "sliding"]


# What the rule reads of the index (`kvindex`, which builds on this module, not the other way round).
class CachedGroup(Protocol):
    """One indexed KV cache group: its spec and the content keys of the blocks it holds."""

    block_size: int
    sliding_window: int | None
    present: dict[int, int]


class GroupSource(Protocol):
    """An engine's index, as `predicted_hits` reads it (`EngineKVIndex`)."""

    def lookup_group(self, block_size: int, sliding_window: int | None, eagle: bool) -> LookupGroup: ...


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


def described_groups(event: EngineDescribed) -> CacheGroups:
    """The lookup's groups (one per spec, full attention first) for a sound description;
    a spec takes the drop when any of its groups does (vLLM looks a spec's groups up together)."""
    specs: dict[tuple[str, int, int | None], bool] = {}
    for group in event.groups:
        kind = "full" if group.kind == "full_attention" else "sliding"
        key = (kind, group.block_size, group.sliding_window)
        specs[key] = specs.get(key, False) or group.drop
    groups = [
        CacheGroup("full" if kind == "full" else "sliding", size, window, drop)
        for (kind, size, window), drop in specs.items()
    ]
    return CacheGroups(tuple(sorted(groups, key=lambda g: g.kind != "full")))


def predicted_hits(groups: CacheGroups, index: GroupSource, prompt: RoutingPrompt) -> tuple[int, int]:
    """(the hit vLLM would report on the engine for the prompt, the hit a full-attention-only
    reading predicts): `longest_hit` over the configured groups, each read from the index
    groups of its spec (one that has published nothing holds nothing), capped at
    `len(prompt.tokens) - 1`."""
    specs = [index.lookup_group(g.block_size, g.window, g.eagle) for g in groups.groups]
    most = len(prompt.tokens) - 1
    hit = longest_hit(specs, prompt, most)
    full = [spec for spec in specs if spec.sliding_window is None]
    if not full or len(full) == len(specs):
        return hit, hit
    return hit, longest_hit(full, prompt, most)


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
    members: tuple[CachedGroup, ...]
    granularity: int


def longest_hit(groups: Sequence[LookupGroup], prompt: RoutingPrompt, max_length: int) -> int:
    """The prompt tokens vLLM's `find_longest_cache_hit` reports as computed for `prompt`,
    looking up at most `max_length` of them (the engine asks len(tokens) - 1: the
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

    The prompt's chain keys at a granularity g are extended only as far as a lookup
    reaches (a group of block size b reads every (b/g)-th key: `block_keys`): pass one
    `RoutingPrompt` for every engine of a request (filled off the event loop for a long
    prompt: `RoutingPrompt.fill`) and each key is computed once per request. Cost:
    linear in the blocks up to the full-attention hit (the whole prompt for a model
    without full attention); each block is looked up at most once per group and lookup.
    """
    tokens = prompt.tokens
    if max_length <= 0 or not groups:
        return 0
    if len(groups) == 1:  # no look-ahead margin, no alignment beyond the group's block
        group = groups[0]
        return _Finder(group, prompt, group.block_size).hit(max_length, group.eagle)
    sizes = [g.block_size for g in groups]
    align, hash_block = math.lcm(*sizes), math.gcd(*sizes)
    hashed = len(tokens) // hash_block * hash_block  # what the request's block hashes cover
    finders = [_Finder(g, prompt, align) for g in groups]
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

    def __init__(self, group: LookupGroup, prompt: RoutingPrompt, align: int) -> None:
        self._group = group
        self._prompt = prompt
        self._tokens = prompt.tokens
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
        prompt is shorter); with ratio 1, the prompt's shared keys at the granularity itself."""
        ratio = self._ratio
        fine = self._prompt.keys_upto(self._grain, blocks * ratio)
        if ratio == 1:
            return fine
        own = self._own
        if len(own) < blocks:
            own.extend(itertools.islice(fine, (len(own) + 1) * ratio - 1, blocks * ratio, ratio))
        return own
