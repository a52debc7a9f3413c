"""An engine's KV cache groups as its connector describes them to the router, in vLLM's KV event stream.

The router's decode-first decider replays vLLM's lookup over the engine's KV cache groups
(`pdconnect.router.lookup`). vLLM's `BlockStored` events carry each group's kind, block
size and window, but not which groups take the EAGLE/MTP last-block drop (a scheduler
setting), nor the retention interval, and a group that has stored nothing is not seen at
all. The connector, inside the engine, knows them all (`CacheRules`), so it says them:
`EngineDescribed` is a KV event of its own that the connector's `take_events` hands vLLM
(vLLM publishes the connector's events in the same batches as its own, on the same
socket), on the engine's first step and again every `REPEAT_SECONDS` while the engine
steps, so a router that subscribes later learns it too.

The wire form follows vLLM's events (msgspec maps tagged by class name) so the
router reads it with the rest of the batch (`pdconnect.router.kvwire`). It is untrusted
input there: `invalid_reason` bounds and checks every field (`lookup.described_groups`
reads a sound one), and a description that fails is counted and logged by the router,
never applied, never raised. `VERSION` changes with
any change of meaning; a router refuses a version it does not know.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MAX_GROUPS",
    "REPEAT_SECONDS",
    "VERSION",
    "DescribedGroup",
    "EngineDescribed",
    "difference",
    "invalid_reason",
]

VERSION = 1
MAX_GROUPS = 64  # far above any model served today (DeepSeek-V4: a handful)
MAX_BLOCK_SIZE = 1 << 16
MAX_WINDOW = 1 << 31
REPEAT_SECONDS = 1.0  # one small message a second while the engine steps: a new router learns it fast


class DescribedGroup(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One KV cache group: `kind`, tokens per block, window (sliding only), whether its
    lookup takes vLLM's EAGLE/MTP last-block drop."""

    kind: str
    block_size: int
    sliding_window: int | None
    drop: bool


class EngineDescribed(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """What an engine's connector says about its KV cache: its groups in vLLM's group order,
    and `prefix_cache_retention_interval` (None: dense; 0: vLLM's default sparse retention)."""

    version: int
    groups: list[DescribedGroup]
    retention_interval: int | None


def invalid_reason(event: EngineDescribed) -> str | None:
    """Why the router must not use `event` (a metric label), or None when it is sound."""
    if event.version != VERSION:
        return "describe_version"
    if not 0 < len(event.groups) <= MAX_GROUPS:
        return "describe_groups"
    for group in event.groups:
        if group.kind not in ("full_attention", "sliding_window"):
            return "describe_kind"
        if not 0 < group.block_size <= MAX_BLOCK_SIZE:
            return "describe_block_size"
        sliding = group.kind == "sliding_window"
        window = group.sliding_window
        if sliding != (window is not None) or (window is not None and not 0 < window <= MAX_WINDOW):
            return "describe_window"
    retention = event.retention_interval
    if retention is not None and not 0 <= retention <= MAX_WINDOW:
        return "describe_retention"
    return None


def difference(a: EngineDescribed, b: EngineDescribed) -> str | None:
    """The first field in which two descriptions differ, as `field: a != b`, or None."""
    if len(a.groups) != len(b.groups):
        return f"group count: {len(a.groups)} != {len(b.groups)}"
    for i, (x, y) in enumerate(zip(a.groups, b.groups)):
        for name in DescribedGroup.__struct_fields__:
            if getattr(x, name) != getattr(y, name):
                return f"groups[{i}].{name}: {getattr(x, name)!r} != {getattr(y, name)!r}"
    if a.retention_interval != b.retention_interval:
        return f"retention_interval: {a.retention_interval!r} != {b.retention_interval!r}"
    return None
