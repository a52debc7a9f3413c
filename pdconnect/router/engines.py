"""The engines the router knows: who they are, where they came from, how loaded and healthy.

An engine is known through one or more sources (a static URL, a DNS name, the admin
API) and leaves when its last source drops it. Requests already sent to a removed
engine finish normally: they hold the `Engine` object, not a name.

Everything here runs on the event loop thread, so no locks; `engines(role)` returns
the same tuple object until membership changes, which lets policies cache per tuple.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdconnect.router.breaker import CircuitBreaker

__all__ = ["Engine", "EngineRegistry", "Role"]

logger = logging.getLogger("pdconnect.router.engines")


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Engine:
    """One vLLM server. `in_flight` counts this router's open requests to it."""

    url: str
    role: Role
    breaker: CircuitBreaker
    sources: set[str] = field(default_factory=set)
    # None until the first health poll answers (when polling is on).
    probe_ok: bool | None = None
    probe_failures: int = 0
    in_flight: int = 0
    failures: int = 0

    @property
    def routable(self) -> bool:
        return self.probe_ok is True and self.breaker.allows()

    def record_probe(self, ok: bool, failures_to_down: int) -> None:
        if ok:
            self.probe_failures = 0
            self.probe_ok = True
            return
        self.probe_failures += 1
        if self.probe_ok is None or self.probe_failures >= failures_to_down:
            self.probe_ok = False

    def begin(self) -> None:
        self.in_flight += 1
        self.breaker.on_attempt()

    def end(self, ok: bool | None) -> None:
        """Close one attempt: True = engine worked, False = engine failed, None = no verdict
        (the client left first, or the engine refused a bad request)."""
        self.in_flight -= 1
        if ok:
            self.breaker.record_success()
        elif ok is False:
            self.blame()

    def blame(self) -> None:
        """Count one engine fault (at the end of an attempt, or later once it is clear that
        the request was not to blame)."""
        self.failures += 1
        if self.breaker.record_failure():
            logger.warning(
                "%s engine %s: circuit opened after %d failures",
                self.role.value,
                self.url,
                self.breaker.consecutive_failures,
            )


class EngineRegistry:
    """Engines by role. Listeners hear of every engine added (the health monitor polls it)."""

    def __init__(self, make_breaker: Callable[[], CircuitBreaker], probed: bool) -> None:
        self._make_breaker = make_breaker
        # Without active polling an engine is presumed up and only the breaker guards it.
        self._initial_probe: bool | None = None if probed else True
        self._by_url: dict[Role, dict[str, Engine]] = {role: {} for role in Role}
        self._snapshot: dict[Role, tuple[Engine, ...]] = dict.fromkeys(Role, ())
        self.on_added: list[Callable[[Engine], None]] = []
        self.on_removed: list[Callable[[Engine], None]] = []

    def engines(self, role: Role) -> tuple[Engine, ...]:
        return self._snapshot[role]

    def all_engines(self) -> list[Engine]:
        return [e for role in Role for e in self._snapshot[role]]

    def get(self, role: Role, url: str) -> Engine | None:
        return self._by_url[role].get(url)

    def add(self, role: Role, url: str, source: str) -> Engine:
        engine = self._by_url[role].get(url)
        if engine is None:
            engine = Engine(url=url, role=role, breaker=self._make_breaker(), probe_ok=self._initial_probe)
            self._by_url[role][url] = engine
            self._refresh(role)
            logger.info("added %s engine %s (%s)", role.value, url, source)
            for listener in self.on_added:
                listener(engine)
        engine.sources.add(source)
        return engine

    def remove(self, role: Role, url: str, source: str | None = None) -> bool:
        """Drop one source of an engine (all of them when `source` is None).
        True if the engine left the registry."""
        engine = self._by_url[role].get(url)
        if engine is None:
            return False
        if source is None:
            engine.sources.clear()
        else:
            engine.sources.discard(source)
        if engine.sources:
            return False
        del self._by_url[role][url]
        self._refresh(role)
        logger.info("removed %s engine %s", role.value, url)
        for listener in self.on_removed:
            listener(engine)
        return True

    def sync(self, role: Role, source: str, urls: Iterable[str]) -> None:
        """Make `source` list exactly `urls` (DNS re-resolution)."""
        wanted = set(urls)
        for url in wanted:
            self.add(role, url, source)
        for engine in list(self._by_url[role].values()):
            if source in engine.sources and engine.url not in wanted:
                self.remove(role, engine.url, source)

    def _refresh(self, role: Role) -> None:
        self._snapshot[role] = tuple(self._by_url[role].values())
