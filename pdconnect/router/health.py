"""Whether an engine answers: its `/health` polled, the signal beside the circuit breaker.

Two independent signals decide whether an engine may get traffic (`Engine.routable`):
- active: `/health` polled every `health_interval`; `health_failures` failed polls in a
  row mark the engine down, one good poll marks it up. Until its first poll answers,
  a new engine is not routable (a pod that is still loading its model must not get
  traffic just because DNS already lists it).
- passive: `breaker.CircuitBreaker` over request outcomes, which catches engines
  whose `/health` says fine while their completions fail.

The monitor never stops on its own: an unexpected error in a round or a probe is
logged, counted (`on_error`) and taken as a failed poll, and polling goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

import aiohttp

from pdconnect.router.engines import Engine, EngineRegistry

__all__ = ["HealthMonitor"]

logger = logging.getLogger("pdconnect.router.health")

# Read of a /health answer's body: vLLM's is empty; only the status counts.
_BODY_LIMIT = 64 * 1024


class HealthMonitor:
    """Polls every registered engine's `/health`; polls a newly added engine at once."""

    def __init__(
        self,
        registry: EngineRegistry,
        session: aiohttp.ClientSession,
        interval: float,
        timeout: float,
        failures_to_down: int,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._registry = registry
        self._on_error = on_error
        self._session = session
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._failures_to_down = failures_to_down
        self._pending: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Poll forever (cancel to stop); an error ends one round, never the loop."""
        while True:
            try:
                await self.poll(self._registry.all_engines())
            except Exception:  # logged and counted; the next round may succeed
                self._on_error()
                logger.exception("health round failed; polling goes on")
            await asyncio.sleep(self._interval)

    def poll_soon(self, engine: Engine) -> None:
        if engine.dp_rank:
            return  # a data-parallel server's rank 0 was added with it: its poll answers for every rank
        task = asyncio.get_running_loop().create_task(self._probe(self._registry.ranks(engine.role, engine.url)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def poll(self, engines: Iterable[Engine]) -> None:
        """One `/health` per server: the ranks of a data-parallel one share its API server."""
        servers: dict[tuple[str, str], list[Engine]] = {}
        for engine in engines:
            servers.setdefault((engine.role.value, engine.url), []).append(engine)
        await asyncio.gather(*(self._probe(ranks) for ranks in servers.values()))

    async def _probe(self, ranks: Sequence[Engine]) -> None:
        if not ranks:
            return  # removed before its first poll
        engine = ranks[0]
        try:
            async with self._session.get(f"{engine.url}/health", timeout=self._timeout) as resp:
                ok = resp.status == 200
                await resp.content.read(_BODY_LIMIT)  # the status decides; a body is not kept
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        except Exception:  # whatever else fails a probe is a failed probe
            self._on_error()
            logger.exception("health probe of %s failed", engine.url)
            ok = False
        was = engine.probe_ok
        for rank in ranks:
            rank.record_probe(ok, self._failures_to_down)
        if was is not engine.probe_ok:
            logger.info("%s engine %s is %s", engine.role.value, engine.url, "up" if engine.probe_ok else "down")

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
