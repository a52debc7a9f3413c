"""The engines' KV cache groups as configured, and the hits the decode-local decider predicts from them.

The kv-aware index (`kvindex`) says which blocks of each KV cache group an engine holds,
and `kvindex.longest_hit` is vLLM's own lookup rule over them (the cache-hit alignment, a
sliding-window group's run, the EAGLE/MTP drop; tested against vLLM's real coordinator),
the one the kv-aware policy uses too. `predicted_hits` asks it what the engine would
report for the whole prompt (at most `prompt_len - 1` tokens: the last one is always
computed), over the *configured* groups rather than those the index has seen: a group
that has published nothing is absent from the index, yet vLLM still needs its blocks,
and the drop is a scheduler setting no event carries. So they are configuration:
`parse_groups("full:128:eagle,sliding:128:64:eagle")`. vLLM flags every group for the
drop under EAGLE (no group names the draft), and only the group holding the drafter's
trailing layers under MTP.

Scope, as pdconnect's connector: full-attention and sliding-window groups, no Mamba (so no
fine-grained partial hash hits), no decode context parallelism. Groups of one kind, block
size and window are looked up jointly, as vLLM does for groups of one spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pdconnect.errors import ConfigError
from pdconnect.router.kvindex import EngineKVIndex, longest_hit

__all__ = ["CacheGroup", "CacheGroups", "parse_groups", "predicted_hits"]

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


def predicted_hits(
    groups: CacheGroups, index: EngineKVIndex, tokens: Sequence[int], keys: dict[int, list[int]] | None = None
) -> tuple[int, int]:
    """(the hit vLLM would report on the engine for the prompt `tokens`, the hit a
    full-attention-only reading predicts): `kvindex.longest_hit` over the configured groups,
    each read from the index groups of its spec (one that has published nothing holds
    nothing), capped at `len(tokens) - 1`. `keys`: see `longest_hit` (one dict per request)."""
    keys = {} if keys is None else keys
    specs = [index.lookup_group(g.block_size, g.window, g.eagle) for g in groups.groups]
    hit = longest_hit(specs, tokens, keys, len(tokens) - 1)
    full = [spec for spec in specs if spec.sliding_window is None]
    if not full or len(full) == len(specs):
        return hit, hit
    return hit, longest_hit(full, tokens, keys, len(tokens) - 1)
