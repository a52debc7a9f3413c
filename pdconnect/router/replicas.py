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

A notice can take an engine out of every replica's rotation, so the replica port takes
only signed ones (`NoticeSigner`): HMAC-SHA256 over the notice's timestamp and body,
under a key derived from a secret all replicas share (`--replica-secret-env` /
`--replica-secret-file`; the deploy gives them the router role's side-channel secret,
which only router pods mount, under a domain string of its own). A notice without a
signature is refused with 401; one with a wrong signature, a timestamp more than
`NOTICE_MAX_AGE` seconds from the receiver's clock, or a signature already taken
(a replay) with 403, each counted by reason in `pdconnect_router_replica_notices`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdconnect.errors import ConfigError
from pdconnect.keyring import MIN_SECRET_BYTES
from pdconnect.router.config import DnsTarget
from pdconnect.router.discovery import Resolver, resolve_addresses, url_of
from pdconnect.router.engines import Engine, EngineRegistry, Role

__all__ = [
    "BREAKER_PATH",
    "NOTICE_MAX_AGE",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "BreakerNotice",
    "NoticeSigner",
    "ReplicaSet",
    "read_replica_secret",
]

logger = logging.getLogger("pdconnect.router.replicas")

BREAKER_PATH = "/replicas/breaker"
_NOTICE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
_NOTICE_LIMIT = 4096
TIMESTAMP_HEADER = "X-Pdconnect-Replica-Timestamp"
SIGNATURE_HEADER = "X-Pdconnect-Replica-Signature"
# How far a notice's timestamp may be from the receiver's clock (both ways: clocks skew).
# Every signature taken within it is remembered, so a notice cannot be replayed.
NOTICE_MAX_AGE = 30.0
_DERIVATION_DOMAIN = b"pdconnect router replica notices v1\x00"


def read_replica_secret(file: str | None, env: str | None) -> bytes:
    """The replicas' shared secret from a file or an environment variable, read once at start;
    ConfigError when it is missing or shorter than `keyring.MIN_SECRET_BYTES`."""
    if file is not None:
        try:
            secret = Path(file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the replica secret {file!r}: {exc}") from None
    else:
        secret = os.environ.get(env or "", "").encode().strip()
    if len(secret) < MIN_SECRET_BYTES:
        where = file if file is not None else f"${env}"
        raise ConfigError(
            f"the replica secret ({where}) is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return secret


class NoticeSigner:
    """Signs and checks breaker notices between replicas: HMAC-SHA256 over the timestamp and body."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        # A key of its own, derived under a domain string: the secret may be one used elsewhere.
        self._key = hashlib.sha256(_DERIVATION_DOMAIN + secret.strip()).digest()
        self._clock = clock
        self._taken: dict[str, float] = {}  # signature -> when it stops being fresh

    def _mac(self, timestamp: str, body: bytes) -> str:
        return hmac.new(self._key, timestamp.encode() + b"\n" + body, hashlib.sha256).hexdigest()

    def headers(self, body: bytes) -> dict[str, str]:
        timestamp = f"{self._clock():.3f}"
        return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: self._mac(timestamp, body)}

    def check(self, timestamp: str | None, signature: str | None, body: bytes) -> str | None:
        """None for a notice to act on, else why it is refused: "unsigned", "forged", "stale", "replayed"."""
        if not timestamp or not signature:
            return "unsigned"
        if not hmac.compare_digest(self._mac(timestamp, body), signature):
            return "forged"
        now = self._clock()
        try:
            sent = float(timestamp)
        except ValueError:
            return "forged"  # signed, so one of ours; but no time of ours either
        if not abs(now - sent) <= NOTICE_MAX_AGE:  # `not`: a NaN is stale too
            return "stale"
        self._taken = {sig: until for sig, until in self._taken.items() if until > now}
        if signature in self._taken:
            return "replayed"
        self._taken[signature] = sent + NOTICE_MAX_AGE
        return None


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
        *,
        signer: NoticeSigner,
    ) -> None:
        self._signer = signer
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
            "Breaker notices between router replicas, by result (sent, failed, rejected by the peer, received, "
            "applied, unknown_engine; refused here: unsigned, forged, stale, replayed)",
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
                headers={"Content-Type": "application/json", **self._signer.headers(notice)},
                timeout=_NOTICE_TIMEOUT,
            ) as resp:
                await resp.content.read(_NOTICE_LIMIT)
                result = "sent" if resp.status < 500 else "failed"
                if resp.status in (401, 403):
                    result = "rejected"  # the peer holds another secret (or another clock)
                    logger.warning(
                        "breaker notice to %s refused (%d): do the replicas share a secret?", peer, resp.status
                    )
        except (aiohttp.ClientError, TimeoutError, OSError):
            result = "failed"
        except Exception:  # a helper task: whatever else fails a notice is a failed notice
            logger.exception("breaker notice to %s failed", peer)
            result = "failed"
        self._notices.labels(result).inc()

    def build_app(self) -> web.Application:
        """The replica port's app: breaker notices from peers."""
        app = web.Application(client_max_size=_NOTICE_LIMIT)
        app.router.add_post(BREAKER_PATH, self._receive)
        return app

    async def _receive(self, request: web.Request) -> web.Response:
        self._notices.labels("received").inc()
        body = await request.read()
        refused = self._signer.check(request.headers.get(TIMESTAMP_HEADER), request.headers.get(SIGNATURE_HEADER), body)
        if refused is not None:
            self._notices.labels(refused).inc()
            logger.warning("breaker notice from %s refused: %s", request.remote, refused)
            return web.Response(status=401 if refused == "unsigned" else 403, text=f"notice refused: {refused}")
        try:
            notice: BreakerNotice = msgspec.json.decode(body, type=BreakerNotice)
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
