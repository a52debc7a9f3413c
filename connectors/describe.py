"""The engine's KV cache groups, described to the router as a KV event of the connector's own.

The router's decode-first decider must replay vLLM's lookup over this engine's groups,
and vLLM's own events do not say which groups take the EAGLE/MTP drop nor the retention
interval. The scheduler half builds `pdconnect.kvdescribe.EngineDescribed` from the live
engine's cache rules once they are bound, and `PDConnector.take_events` hands it to vLLM,
which publishes it in the step's `KVEventBatch` with its own events: on the first step,
then again every `REPEAT_SECONDS` (a router that subscribes later, or restarts, learns it
within that long of the engine's next step). It never changes while the engine lives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from connectors.vllm_adapter import CacheRules
from pdconnect.kvdescribe import REPEAT_SECONDS, VERSION, DescribedGroup, EngineDescribed

__all__ = ["Describer", "describe"]


def describe(rules: CacheRules) -> EngineDescribed:
    """What the router needs of this engine's groups, in vLLM's group order."""
    return EngineDescribed(
        version=VERSION,
        groups=[DescribedGroup(g.kind, g.block_size, g.sliding_window, g.eagle) for g in rules.groups],
        retention_interval=rules.retention_interval,
    )


class Describer:
    """Hands out the engine's description when it is due (first call, then every `every` s)."""

    def __init__(
        self, described: EngineDescribed, every: float = REPEAT_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._described = described
        self._every = every
        self._clock = clock
        self._due = float("-inf")

    def take(self) -> list[EngineDescribed]:
        now = self._clock()
        if now < self._due:
            return []
        self._due = now + self._every
        return [self._described]
