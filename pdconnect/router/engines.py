"""The engines the router knows: who they are, where they came from, how loaded and healthy.

An engine is known through one or more sources (a static URL, a DNS name, the admin
API) and leaves when its last source drops it. Requests already sent to a removed
engine finish normally: they hold the `Engine` object, not a name.

A data-parallel server (`vllm serve --data-parallel-size N`) is N engines here, one per
rank: each rank is an engine core with a KV cache and a prefix cache of its own, so each
is a cache the policies choose between, with its own load and breaker, and a request sent
to it carries `X-data-parallel-rank` (vLLM's API server then skips its own balancer,
which rotates ranks by load and would split a prompt's siblings across caches). The ranks
of one server join and leave together; its `/health` is polled once for all of them.

Everything here runs on the event loop thread, so no locks; `engines(role)` returns
the same tuple object until membership changes, which lets policies cache per tuple.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pdconnect.router.breaker import CircuitBreaker

__all__ = ["DP_RANK_HEADER", "Engine", "EngineRegistry", "Role", "engine_name"]

logger = logging.getLogger("pdconnect.router.engines")

# vLLM's OpenAI server pins a request to this data-parallel rank (`_get_data_parallel_rank`).
DP_RANK_HEADER = "X-data-parallel-rank"


def engine_name(url: str, dp_rank: int | None) -> str:
    """How an engine is named where it is keyed: its URL, and `#dp<rank>` for a data-parallel rank."""
    return url if dp_rank is None else f"{url}#dp{dp_rank}"


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Engine:
    """One vLLM server, or one data-parallel rank of one (`dp_rank`; None: a server without
    data parallelism, sent no rank header). `in_flight` counts this router's open requests to it."""

    url: str
    role: Role
    breaker: CircuitBreaker
    dp_rank: int | None = None
    sources: set[str] = field(default_factory=set)
    # None until the first health poll answers (when polling is on).
    probe_ok: bool | None = None
    probe_failures: int = 0
    in_flight: int = 0
    failures: int = 0
    # Hears of this engine's breaker opening on its own failures (the registry's listeners).
    on_breaker_open: Callable[[Engine], None] = field(default=lambda engine: None, repr=False)

    @property
    def name(self) -> str:
        """The cache this engine stands for: its URL, `<url>#dp<rank>` for a data-parallel rank
        (what KV indexes, hash rings, metrics and logs key it by)."""
        return engine_name(self.url, self.dp_rank)

    @property
    def headers(self) -> dict[str, str]:
        """What every request sent to this engine adds to its headers (the rank pin)."""
        return {} if self.dp_rank is None else {DP_RANK_HEADER: str(self.dp_rank)}

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
                self.name,
                self.breaker.consecutive_failures,
            )
            self.on_breaker_open(self)


class EngineRegistry:
    """Engines by role, the ranks of a data-parallel server together under its URL
    (`dp_sizes[role]` ranks each; 1: no data parallelism). Listeners hear of every engine
    added and removed, rank by rank (the health monitor polls it, the KV events feed subscribes)."""

    def __init__(
        self,
        make_breaker: Callable[[], CircuitBreaker],
        probed: bool,
        dp_sizes: Mapping[Role, int] | None = None,
    ) -> None:
        self._make_breaker = make_breaker
        # Without active polling an engine is presumed up and only the breaker guards it.
        self._initial_probe: bool | None = None if probed else True
        self._dp_sizes = {role: (dp_sizes or {}).get(role, 1) for role in Role}
        self._by_url: dict[Role, dict[str, tuple[Engine, ...]]] = {role: {} for role in Role}
        self._snapshot: dict[Role, tuple[Engine, ...]] = dict.fromkeys(Role, ())
        self.on_added: list[Callable[[Engine], None]] = []
        self.on_removed: list[Callable[[Engine], None]] = []
        # Hear of every breaker that opened on this router's own failures (peer replicas are told).
        self.on_breaker_open: list[Callable[[Engine], None]] = []

    def engines(self, role: Role) -> tuple[Engine, ...]:
        return self._snapshot[role]

    def all_engines(self) -> list[Engine]:
        return [e for role in Role for e in self._snapshot[role]]

    def get(self, role: Role, url: str, dp_rank: int = 0) -> Engine | None:
        """The engine at `url` (of a data-parallel server: its rank `dp_rank`)."""
        ranks = self._by_url[role].get(url)
        return ranks[dp_rank] if ranks is not None and dp_rank < len(ranks) else None

    def ranks(self, role: Role, url: str) -> tuple[Engine, ...]:
        """Every engine of the server at `url`: one, or one per data-parallel rank."""
        return self._by_url[role].get(url, ())

    def add(self, role: Role, url: str, source: str) -> Engine:
        """Register the server at `url` (all its ranks) under `source`; returns its first engine."""
        ranks = self._by_url[role].get(url)
        if ranks is None:
            size = self._dp_sizes[role]
            ranks = tuple(
                Engine(
                    url=url,
                    role=role,
                    breaker=self._make_breaker(),
                    dp_rank=None if size == 1 else rank,
                    probe_ok=self._initial_probe,
                    on_breaker_open=self._breaker_opened,
                )
                for rank in range(size)
            )
            self._by_url[role][url] = ranks
            self._refresh(role)
            logger.info("added %s engine %s (%s)%s", role.value, url, source, f", {size} DP ranks" if size > 1 else "")
            for engine in ranks:
                for listener in self.on_added:
                    listener(engine)
        for engine in ranks:
            engine.sources.add(source)
        return ranks[0]

    def remove(self, role: Role, url: str, source: str | None = None) -> bool:
        """Drop one source of an engine (all of them when `source` is None).
        True if the engine left the registry."""
        ranks = self._by_url[role].get(url)
        if ranks is None:
            return False
        for engine in ranks:
            if source is None:
                engine.sources.clear()
            else:
                engine.sources.discard(source)
        if ranks[0].sources:
            return False
        del self._by_url[role][url]
        self._refresh(role)
        logger.info("removed %s engine %s", role.value, url)
        for engine in ranks:
            for listener in self.on_removed:
                listener(engine)
        return True

    def sync(self, role: Role, source: str, urls: Iterable[str]) -> None:
        """Make `source` list exactly `urls` (DNS re-resolution)."""
        wanted = set(urls)
        for url in wanted:
            self.add(role, url, source)
        for url, ranks in list(self._by_url[role].items()):
            if source in ranks[0].sources and url not in wanted:
                self.remove(role, url, source)

    def _breaker_opened(self, engine: Engine) -> None:
        for listener in self.on_breaker_open:
            listener(engine)

    def _refresh(self, role: Role) -> None:
        self._snapshot[role] = tuple(e for ranks in self._by_url[role].values() for e in ranks)
