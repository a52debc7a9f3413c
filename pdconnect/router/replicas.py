"""Router replicas over the same engines: each keeps its share of the fleet's bounds, and shares breaker news.

Each replica routes on what it alone knows: its own requests in flight, its own local
prefills, its own request outcomes. The bounds that matter are the engines' (how many
requests one decode engine holds, how many prompt tokens it prefills itself), so with N
replicas each one keeps to a 1/N share of each absolute bound (`share`): the decode-first
token budget per engine and the load floor of the bounded-load ring. No coordination on
the request path, and the shares add up to at most the bound however the requests
spread over the replicas (docs/router.md, "Several replicas", has the argument and what
stays per replica).

N is counted, never assumed low: the peers are the static `--replica-peers` and the
addresses of `--replicas-dns` (the routers' own headless Service, which lists starting
and terminating routers too), re-resolved every `interval`. A replica that cannot count
(no answer yet, a failed lookup, an answer without any router) uses `maximum`, the most
replicas the deployment runs; an answer above it is believed (more replicas: smaller
shares, the safe side). Without peers configured the count is 1: the bounds are the
whole bounds, as with one router.

Engine health needs no sharing: every replica polls every engine's `/health` itself. The
circuit breaker is fed by request outcomes, which each replica sees only of its own
requests: when one opens, the replica posts it to every peer (`/replicas/breaker` on the
peers' replica port), and a peer whose breaker for that engine is closed opens it too
(`CircuitBreaker.trip`), cooling down as if it had seen the failures. A lost notice costs
that peer its own `breaker_failures` failures, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdconnect.router.config import DnsTarget
from pdconnect.router.discovery import Resolver, resolve_addresses, url_of
from pdconnect.router.engines import Engine, EngineRegistry, Role

__all__ = ["BREAKER_PATH", "BreakerNotice", "ReplicaSet"]

logger = logging.getLogger("pdconnect.router.replicas")

BREAKER_PATH = "/replicas/breaker"
_NOTICE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
_NOTICE_LIMIT = 4096


class BreakerNotice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A replica's news that its breaker for one engine opened."""

    role: str
    url: str
    dp_rank: int | None = None


class ReplicaSet:
    """How many replicas share the engines (`count`), each one's share of a bound, and the
    breaker notices between them."""

    def __init__(
        self,
        peers: tuple[str, ...],
        target: DnsTarget | None,
        maximum: int,
        interval: float,
        registry: EngineRegistry,
        metrics: CollectorRegistry,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        self._static = tuple(dict.fromkeys(peers))
        self._target = target
        self._maximum = maximum
        self._interval = interval
        self._registry = registry
        self._resolver = resolver
        self._found: tuple[str, ...] | None = None  # the last DNS answer, as peer URLs; None: none usable
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._count_gauge = Gauge(
            "pdconnect_router_replicas",
            "Router replicas this one counts (each keeps 1/N of the engines' load floor and decode-first budget)",
            registry=metrics,
        )
        self._notices = Counter(
            "pdconnect_router_replica_notices",
            "Breaker notices between router replicas, by result (sent, failed, received, applied, unknown_engine)",
            ["result"],
            registry=metrics,
        )
        self._count_gauge.set(self.count)

    @property
    def configured(self) -> bool:
        return bool(self._static) or self._target is not None

    @property
    def peers(self) -> tuple[str, ...]:
        """Every replica's URL this one knows of (itself among them)."""
        return tuple(dict.fromkeys(self._static + (self._found or ())))

    @property
    def count(self) -> int:
        """The replicas sharing the engines: 1 without peers; `maximum` while DNS gives no usable answer."""
        if not self.configured:
            return 1
        if self._target is not None and not self._found:
            return max(self._maximum, len(self._static))
        return max(1, len(self.peers))

    def share(self, bound: int) -> int:
        """This replica's part of a fleet-wide `bound`: the parts of all replicas add up to at most `bound`."""
        return bound // self.count

    # --- counting ---------------------------------------------------------------------------

    async def refresh(self) -> None:
        target = self._target
        if target is None:
            return
        try:
            addresses = await self._resolver(target.host, target.port)
        except (OSError, UnicodeError) as exc:
            self._found = None
            logger.warning("cannot resolve the router replicas %s (%s): counting %d", target, exc, self.count)
        else:
            self._found = tuple(url_of(target.scheme, a, target.port) for a in addresses) or None
        self._count_gauge.set(self.count)

    async def run(self) -> None:
        """Count now and every `interval` seconds (cancel to stop); nothing ends the loop but cancel."""
        while True:
            try:
                await self.refresh()
            except Exception:  # counting must outlive any one bad answer: count the maximum
                self._found = None
                self._count_gauge.set(self.count)
                logger.exception("counting the router replicas failed; counting %d", self.count)
            await asyncio.sleep(self._interval)

    # --- breaker notices --------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession) -> None:
        """Post breaker notices through `session` from now on."""
        self._session = session

    def announce(self, engine: Engine) -> None:
        """Tell every peer that this replica's breaker for `engine` opened (fire and forget)."""
        if self._session is None or not self.peers:
            return
        notice = msgspec.json.encode(BreakerNotice(engine.role.value, engine.url, engine.dp_rank))
        for peer in self.peers:
            task = asyncio.get_running_loop().create_task(self._post(peer, notice))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _post(self, peer: str, notice: bytes) -> None:
        assert self._session is not None
        try:
            async with self._session.post(
                f"{peer}{BREAKER_PATH}",
                data=notice,
                headers={"Content-Type": "application/json"},
                timeout=_NOTICE_TIMEOUT,
            ) as resp:
                await resp.content.read(_NOTICE_LIMIT)
                ok = resp.status < 500
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        except Exception:  # a helper task: whatever else fails a notice is a failed notice
            logger.exception("breaker notice to %s failed", peer)
            ok = False
        self._notices.labels("sent" if ok else "failed").inc()

    def build_app(self) -> web.Application:
        """The replica port's app: breaker notices from peers."""
        app = web.Application(client_max_size=_NOTICE_LIMIT)
        app.router.add_post(BREAKER_PATH, self._receive)
        return app

    async def _receive(self, request: web.Request) -> web.Response:
        self._notices.labels("received").inc()
        try:
            notice: BreakerNotice = msgspec.json.decode(await request.read(), type=BreakerNotice)
            role = Role(notice.role)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return web.Response(status=400, text="a breaker notice is {role, url, dp_rank}")
        engine = self._registry.get(role, notice.url, notice.dp_rank or 0)
        if engine is None or engine.dp_rank != notice.dp_rank:
            self._notices.labels("unknown_engine").inc()
            return web.Response(status=404, text="no such engine here")
        if engine.breaker.trip():
            self._notices.labels("applied").inc()
            logger.warning("%s engine %s: circuit opened on a peer replica's notice", role.value, engine.name)
        return web.Response(status=204)

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)


def replica_count(replicas: ReplicaSet | None) -> Callable[[], int]:
    """What the bounds divide by: the set's live count, or 1 for a router without peers."""
    if replicas is None or not replicas.configured:
        return one_replica
    return lambda: replicas.count


def one_replica() -> int:
    """The replica count of a router without peers: it keeps the whole of every bound."""
    return 1
