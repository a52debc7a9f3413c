"""The router's HTTP face and `main`: its apps and handlers, lifecycle, CLI entry.

aiohttp serves clients (C parser, one event loop; uvloop when installed, as `main`
does). Engine calls on the request path go through `upstream.UpstreamPool`, a lean
HTTP/1.1 keep-alive client: aiohttp's client was about half of the router's CPU per
request. Health polls and `/v1/models` still use an aiohttp session (rare calls).

Every client connection has deadlines on what it sends: the wait for a request is
aiohttp's keep-alive timeout, each request's head must arrive within
`header_read_timeout` (`listener`), its body within `body_read_timeout`
(`body.read_body`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from hmac import compare_digest
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import Counter

from pdconnect.router.apikeys import ApiKeys
from pdconnect.router.breaker import CircuitBreaker
from pdconnect.router.chat_template import PromptTokenizer
from pdconnect.router.config import ConfigError, RouterConfig, engine_origin, pool_dns_targets
from pdconnect.router.decider import DeciderSettings, DecodeFirstDecider
from pdconnect.router.discovery import DnsDiscovery, Resolver, resolve_addresses
from pdconnect.router.engines import Engine, EngineRegistry, Role
from pdconnect.router.errors import (
    AdminUnauthorized,
    BadRequest,
    NoEngineAvailable,
    UnknownEngine,
)
from pdconnect.router.flow import PDFlow
from pdconnect.router.health import HealthMonitor
from pdconnect.router.kvevents import KVEventsFeed, events_endpoint, offset_port
from pdconnect.router.listener import serve_app
from pdconnect.router.logs import configure_logging
from pdconnect.router.lookup import parse_groups
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.options import parse_args
from pdconnect.router.policy import LoadBound, RoutingPolicy, make_policy
from pdconnect.router.pools import Pools, build_pools, pool_source
from pdconnect.router.releaser import PrefillReleaser
from pdconnect.router.replicas import NoticeSigner, ReplicaSet, read_replica_secret, replica_count
from pdconnect.router.request import Endpoint
from pdconnect.router.routes import add_route, answer_unrouted
from pdconnect.router.tracing import Tracing, TracingUnavailable, require_sdk, sample_ratio
from pdconnect.router.upstream import UpstreamPool
from pdconnect.serving import serve_until_signalled

__all__ = ["Router", "RunningRouter", "main", "start_router"]

logger = logging.getLogger("pdconnect.router")

# An engine's /v1/models answer, relayed: a model list (with every LoRA adapter) is small.
_MODELS_LIMIT = 16 * 1024 * 1024


class _ModelList(msgspec.Struct):
    """What the router reads of an engine's /v1/models: its entries, kept as they are."""

    data: list[dict[str, Any]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data), content_type="application/json")


class Router:
    """One router: engine registry, health, discovery, the P/D flow and its metrics."""

    def __init__(self, config: RouterConfig, resolver: Resolver = resolve_addresses) -> None:
        self.config = config
        self.registry = EngineRegistry(
            make_breaker=lambda: CircuitBreaker(config.breaker_failures, config.breaker_cooldown),
            probed=config.health_interval > 0,
            dp_sizes={role: config.dp_size(role.value) for role in Role},
        )
        self.metrics = RouterMetrics(self.registry)
        # Here, not in RouterMetrics: the connection layer below the app counts it.
        self.header_timeouts = Counter(
            "pdconnect_router_header_timeouts",
            "Client connections closed because a request head did not arrive within header_read_timeout",
            registry=self.metrics.registry,
        )
        self._resolver = resolver
        self._side_channel_keys = config.resolve_side_channel_keys()
        self._admin_token = config.resolve_admin_token()
        # Loaded before anything listens: a path that holds no tokenizer is a ConfigError in `main`.
        self._tokenizer = self._load_tokenizer(config)
        if config.otlp_traces_endpoint:
            try:
                require_sdk()
                sample_ratio(config.otlp_traces_sample_ratio)  # a bad OTEL_TRACES_SAMPLER_ARG: refused here
            except TracingUnavailable as exc:
                raise ConfigError(str(exc)) from None
        self._flow: PDFlow | None = None
        self._session: aiohttp.ClientSession | None = None
        # Several replicas over the same engines: each keeps its share of the engines' bounds.
        self.replicas = (
            ReplicaSet(
                tuple(engine_origin(u) for u in config.replica_peers),
                config.replicas_target,
                config.max_replicas,
                config.dns_interval,
                self.registry,
                self.metrics.registry,
                resolver,
                signer=NoticeSigner(read_replica_secret(config.replica_secret_file, config.replica_secret_env)),
            )
            if config.replica_peers or config.replicas_dns
            else None
        )
        # Client keys' rates hold for the fleet too: each replica keeps its share.
        self._keys = ApiKeys.load(
            config.api_keys_file, config.api_keys_env, config.engine_api_key_env, replica_count(self.replicas)
        )

    @staticmethod
    def _load_tokenizer(config: RouterConfig) -> PromptTokenizer | None:
        """`--tokenizer`, for the kv-aware policy only (the others read no token ids)."""
        if config.policy != "kv-aware" or not config.tokenizer:
            return None
        tokenizer = PromptTokenizer.load(config.tokenizer)
        if tokenizer.template is None:
            logger.warning(
                "kv-aware: no usable chat template in %s; chat requests are placed by prefix affinity", config.tokenizer
            )
        return tokenizer

    @property
    def admin_enabled(self) -> bool:
        return self._admin_token is not None or self.config.admin_open

    def build_app(self) -> web.Application:
        """The client-facing app; it carries the admin routes unless they have a port of their own."""
        # Bodies are read by `body.read_body` under the router's own limit; this bound is
        # for aiohttp's own readers only (admin bodies).
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.cleanup_ctx.append(self._lifecycle)
        add_route(app, "POST", Endpoint.COMPLETIONS.value, self._completions)
        add_route(app, "POST", Endpoint.CHAT.value, self._chat)
        add_route(app, "POST", Endpoint.RESPONSES.value, self._responses)
        add_route(app, "GET", "/v1/models", self._models)
        add_route(app, "GET", "/health", self._health)
        if self.config.metrics_port is None:
            add_route(app, "GET", "/metrics", self._metrics)
        if self.admin_enabled and self.config.admin_port is None:
            self._add_admin_routes(app)
        answer_unrouted(app)
        return app

    def build_admin_app(self) -> web.Application | None:
        """The admin-only app for `admin_port`, or None when admin is off or shares the main port."""
        if not self.admin_enabled or self.config.admin_port is None:
            return None
        app = web.Application(client_max_size=64 * 1024)
        self._add_admin_routes(app)
        answer_unrouted(app)
        return app

    def build_metrics_app(self) -> web.Application | None:
        """The /metrics-only app for `metrics_port`, or None when /metrics shares the client port."""
        if self.config.metrics_port is None:
            return None
        app = web.Application(client_max_size=1024)
        app.router.add_get("/metrics", self._metrics)
        return app

    def _add_admin_routes(self, app: web.Application) -> None:
        add_route(app, "GET", "/admin/engines", self._list_engines)
        add_route(app, "POST", "/admin/engines", self._add_engine)
        add_route(app, "DELETE", "/admin/engines", self._remove_engine)

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        config = self.config
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=config.upstream_keepalive, ttl_dns_cache=max(1, int(config.dns_interval))
        )
        # Engines are asked for identity encoding; one that compresses anyway (or a hop
        # between) is inflated here, so clients never get bytes their headers do not describe.
        # No cookie jar: engines set no cookies, and filtering one costs every request.
        session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=True,
            cookie_jar=aiohttp.DummyCookieJar(),
            headers={"Accept-Encoding": "identity"},
        )
        self._session = session
        releaser = PrefillReleaser(self._side_channel_keys, config.release_timeout, self.metrics)
        upstream = UpstreamPool(config.connect_timeout, config.upstream_keepalive)
        feed = self._kv_events_feed() if config.policy == "kv-aware" else None
        load = LoadBound(config.affinity_load_factor, config.affinity_min_load, replica_count(self.replicas))
        tracing = (
            Tracing(config.otlp_traces_endpoint, ratio=sample_ratio(config.otlp_traces_sample_ratio))
            if config.otlp_traces_endpoint
            else None
        )
        pools = self._pools(lambda: make_policy(config.policy, load, config.affinity_vnodes, feed))
        self._flow = PDFlow(
            config,
            self.registry,
            upstream,
            self.metrics,
            releaser,
            make_policy(config.policy, load, config.affinity_vnodes, feed),
            make_policy(config.policy, load, config.affinity_vnodes, feed),
            self._decider(feed),
            self._tokenizer,
            tracing,
            pools,
            self._keys,
        )
        tasks: list[asyncio.Task[None]] = []
        if self.replicas is not None:
            self.replicas.start(session)
            self.registry.on_breaker_open.append(self.replicas.announce)
            await self.replicas.refresh()
            tasks.append(asyncio.create_task(self.replicas.run()))
        monitor = None
        if config.health_interval > 0:
            monitor = HealthMonitor(
                self.registry,
                session,
                config.health_interval,
                config.health_timeout,
                config.health_failures,
                on_error=self.metrics.health_errors.inc,
            )
            self.registry.on_added.append(monitor.poll_soon)
        for url in config.prefill_urls:
            self.registry.add(Role.PREFILL, url, "static")
        for url in config.decode_urls:
            self.registry.add(Role.DECODE, url, "static")
        for pool in config.pools:
            for role, urls in ((Role.PREFILL, pool.prefill), (Role.DECODE, pool.decode)):
                for url in urls:
                    self.registry.add(role, url.rstrip("/"), pool_source(pool.name))
        for role in Role:
            for target in config.dns_targets(role.value, pools=True):
                discovery = DnsDiscovery(
                    self.registry,
                    role,
                    target,
                    config.dns_interval,
                    self._resolver,
                    on_failure=self.metrics.dns_failures.inc,
                )
                await discovery.refresh()
                tasks.append(asyncio.create_task(discovery.run()))
        if monitor is not None:
            await monitor.poll(self.registry.all_engines())
            tasks.append(asyncio.create_task(monitor.run()))
        logger.info(
            "router ready: %d prefill, %d decode engines, policy %s",
            len(self.registry.engines(Role.PREFILL)),
            len(self.registry.engines(Role.DECODE)),
            config.policy,
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if monitor is not None:
                await monitor.close()
            if self.replicas is not None:
                await self.replicas.close()
            await session.close()
            upstream.close()
            if feed is not None:
                await feed.close()
            releaser.close(wait=True)
            if tracing is not None:
                await asyncio.to_thread(tracing.close)  # exports what is buffered (blocking)

    def _pools(self, make: Callable[[], RoutingPolicy]) -> Pools:
        """The model pools (`pools.py`), each with policies of its own (one pool without `pools`)."""
        config = self.config
        named = [(pool, [f"dns:{target}" for target in pool_dns_targets(pool)]) for pool in config.pools]
        top_dns = [f"dns:{target}" for role in Role for target in config.dns_targets(role.value)]
        return build_pools(self.registry, config.models, named, top_dns, make)

    def _decider(self, feed: KVEventsFeed | None) -> DecodeFirstDecider | None:
        config = self.config
        if not config.decode_first or feed is None:
            return None  # RouterConfig refuses decode_first without kv-aware
        settings = DeciderSettings(
            # An override the engines' own descriptions are checked against (None: theirs alone).
            groups=None if config.kv_cache_groups is None else parse_groups(config.kv_cache_groups),
            max_uncached_tokens=config.decode_first_max_uncached_tokens,
            max_uncached_ratio=config.decode_first_max_uncached_ratio,
            max_local_tokens_in_flight=config.decode_first_max_tokens_in_flight,
        )
        share = self.replicas.share if self.replicas is not None else (lambda bound: bound)
        return DecodeFirstDecider(settings, feed, self.metrics, share)

    def _kv_events_feed(self) -> KVEventsFeed:
        """Subscribe to every engine's KV events as it joins; drop it as it leaves."""
        config = self.config

        def endpoints(url: str, dp_rank: int | None) -> tuple[str, str | None] | None:
            # A data-parallel rank publishes on the ports offset by its rank, as vLLM binds them.
            rank = dp_rank or 0
            explicit = config.kv_events_endpoints.get(url)
            if explicit:
                return offset_port(explicit[0], rank), offset_port(explicit[1], rank) if len(explicit) > 1 else None
            if config.kv_events_port is None:
                return None
            replay = config.kv_events_replay_port
            return (
                events_endpoint(url, config.kv_events_port + rank),
                events_endpoint(url, replay + rank) if replay is not None else None,
            )

        counter, invalid = self.metrics.kv_events, self.metrics.kv_events_invalid
        feed = KVEventsFeed(
            endpoints,
            lambda result: counter.labels(result).inc(),
            lambda reason: invalid.labels(reason).inc(),
            max_blocks=config.kv_index_max_blocks,
            max_message_bytes=config.kv_events_max_message_bytes,
        )
        self.registry.on_added.append(lambda engine: feed.watch(engine.url, engine.dp_rank))
        self.registry.on_removed.append(lambda engine: feed.forget(engine.name))
        self.metrics.track_kv_events(feed.applied_sequences)
        return feed

    # --- inference --------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        assert self._flow is not None
        return await self._flow.handle(request, Endpoint.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        assert self._flow is not None
        return await self._flow.handle(request, Endpoint.CHAT)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        assert self._flow is not None
        return await self._flow.handle(request, Endpoint.RESPONSES)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """The models of every engine server (prefill and decode, each data-parallel server
        once), merged by id: a pool whose engines serve different models or LoRA adapters
        lists them all. Asked concurrently within the health timeout; an engine that does
        not answer, answers 5xx or over the size limit is left out. When no engine lists
        anything, the first engine's refusal (e.g. 401 without its API key) is relayed."""
        assert self._session is not None
        # Engines started with --api-key want the client's key here too (or the engines' own
        # key, when the router checks client keys: `apikeys`).
        headers = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else None
        if self._keys is not None:
            self._keys.identify(request.headers)
            if self._keys.engine_authorization is not None:
                headers = {"Authorization": self._keys.engine_authorization}
        servers = list(dict.fromkeys(engine.url for engine in self.registry.all_engines() if engine.routable))
        answers = await asyncio.gather(*(self._models_of(url, headers) for url in servers))
        listed: dict[str, Any] = {}
        refusal: web.Response | None = None
        for answer in answers:
            if isinstance(answer, list):
                for model in answer:
                    listed.setdefault(model["id"], model)
            elif answer is not None and refusal is None:
                refusal = answer
        if listed:
            return _json({"object": "list", "data": list(listed.values())})
        if refusal is not None:
            return refusal
        raise NoEngineAvailable(Role.DECODE.value)

    async def _models_of(self, url: str, headers: dict[str, str] | None) -> list[dict[str, Any]] | web.Response | None:
        """One server's model entries; its own answer when it refused (4xx); None when it
        could not answer."""
        assert self._session is not None
        try:
            async with self._session.get(
                f"{url}/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)
            ) as resp:
                body = await _read_within(resp, _MODELS_LIMIT)
                if body is None:
                    self.metrics.oversized_answers.labels("models").inc()
                    return None
                if resp.status >= 500:
                    return None
                if resp.status >= 400:
                    content_type = resp.headers.get("Content-Type", "application/json")
                    return web.Response(status=resp.status, body=body, headers={"Content-Type": content_type})
        except (aiohttp.ClientError, TimeoutError):
            return None
        try:
            data: list[dict[str, Any]] = msgspec.json.decode(body, type=_ModelList).data
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("%s answered /v1/models with something else than a model list", url)
            return None
        return [model for model in data if isinstance(model.get("id"), str)]

    # --- operations -------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        """200 while some decode engine can serve (decode-only fallback needs nothing else)."""
        counts = {
            role.value: {
                "routable": sum(e.routable for e in self.registry.engines(role)),
                "registered": len(self.registry.engines(role)),
            }
            for role in Role
        }
        ok = counts["decode"]["routable"] > 0
        return _json({"status": "ok" if ok else "unavailable", **counts}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    def _check_admin(self, request: web.Request) -> None:
        if self._admin_token is None:
            return
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        # Constant time: how long a wrong token takes to refuse says nothing about the right one.
        if not compare_digest(given, f"Bearer {self._admin_token}".encode()):
            raise AdminUnauthorized("admin endpoints need 'Authorization: Bearer <token>'")

    async def _list_engines(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        return _json([_describe(e) for e in self.registry.all_engines()])

    async def _engine_ref(self, request: web.Request) -> tuple[Role, str]:
        self._check_admin(request)
        try:
            body = msgspec.json.decode(await request.read())
            role, url = Role(body["role"]), str(body["url"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            raise BadRequest('body must be {"role": "prefill"|"decode", "url": "http://host:port"}') from None
        try:
            return role, engine_origin(url)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None

    async def _add_engine(self, request: web.Request) -> web.Response:
        role, url = await self._engine_ref(request)
        return _json(_describe(self.registry.add(role, url, "admin")), status=201)

    async def _remove_engine(self, request: web.Request) -> web.Response:
        role, url = await self._engine_ref(request)
        if not self.registry.remove(role, url):
            raise UnknownEngine(f"no {role.value} engine {url}")
        return _json({"removed": url, "role": role.value})


async def _read_within(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None once it is over `limit` bytes (the rest is not read)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _describe(engine: Engine) -> dict[str, Any]:
    return {
        "role": engine.role.value,
        "url": engine.url,
        "dp_rank": engine.dp_rank,
        "sources": sorted(engine.sources),
        "routable": engine.routable,
        "health_poll_ok": engine.probe_ok,
        "breaker": engine.breaker.state.value,
        "in_flight": engine.in_flight,
        "failures": engine.failures,
    }


@dataclass
class RunningRouter:
    """A router serving on this event loop (tests, benchmarks, embedding)."""

    router: Router
    runner: web.AppRunner
    url: str
    admin_runner: web.AppRunner | None = None
    admin_url: str | None = None
    metrics_runner: web.AppRunner | None = None
    metrics_url: str | None = None
    replica_runner: web.AppRunner | None = None

    async def close(self) -> None:
        """Drain: stop accepting, let requests in flight finish (up to `drain_timeout`), then stop.

        aiohttp closes the listeners and idle connections first, waits for running
        handlers up to the runner's shutdown timeout, and only then cancels the rest
        (whose prefill holds are released on the client-gone path) and runs the app's
        cleanup, which closes the engine sessions.
        """
        for side in (self.admin_runner, self.metrics_runner, self.replica_runner):
            if side is not None:
                await side.cleanup()
        await self.runner.cleanup()


async def start_router(config: RouterConfig, resolver: Resolver = resolve_addresses) -> RunningRouter:
    """Serve `config` on config.host:config.port (port 0 picks a free one) until `close()`;
    the admin app too, on admin_host:admin_port, when it has a port of its own."""
    router = Router(config, resolver)
    head = (config.header_read_timeout, router.header_timeouts.inc, config.client_keepalive, config.drain_timeout)
    runner, url = await serve_app(router.build_app(), config.host, config.port, *head)
    running = RunningRouter(router=router, runner=runner, url=url)
    admin = router.build_admin_app()
    if admin is not None and config.admin_port is not None:
        running.admin_runner, running.admin_url = await serve_app(admin, config.admin_host, config.admin_port, *head)
    metrics = router.build_metrics_app()
    if metrics is not None and config.metrics_port is not None:
        host = config.metrics_host or config.host
        running.metrics_runner, running.metrics_url = await serve_app(metrics, host, config.metrics_port, *head)
    if router.replicas is not None and config.replica_port is not None:
        replica_app = router.replicas.build_app()
        running.replica_runner, _ = await serve_app(replica_app, config.host, config.replica_port, *head)
    return running


# Objects the collector lets pile up before it looks at the youngest ones (Python's default: 700).
_YOUNG_GENERATION = 10_000


def _started(running: RunningRouter) -> None:
    # Everything built so far (modules, the app, the config) lives as long as the process:
    # out of the collector's sight, a full collection scans what requests left behind, not
    # ~50k start-up objects (a 10-25 ms stall of every request in flight, every few seconds
    # under load, measured on 2 shared cores).
    gc.freeze()
    # A young generation larger than what requests in flight hold at once: at the default
    # 700 every few requests' live objects started a collection that found them alive and
    # promoted them (the collector was ~2 % of the router's CPU under bench-router's load);
    # above that working set a collection runs only once reference cycles pile up
    # (collections 1623 -> 11, their time 0.38 -> 0.08 s over the same run).
    gc.set_threshold(_YOUNG_GENERATION, *gc.get_threshold()[1:])
    sides = [
        f"{name} on {url}" for name, url in (("admin", running.admin_url), ("metrics", running.metrics_url)) if url
    ]
    logger.info("listening on %s%s", running.url, "".join(f", {side}" for side in sides))


def _run_until_signalled(config: RouterConfig) -> Coroutine[Any, Any, None]:
    return serve_until_signalled(lambda: start_router(config), _started)


def main(argv: list[str]) -> int:
    """`pdconnect router ...`: serve until SIGINT/SIGTERM."""
    try:
        config = parse_args(argv)
        Router(config)  # refuses a missing secret or token before anything listens
    except ConfigError as exc:
        print(f"pdconnect router: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_run_until_signalled(config))
    else:
        uvloop.run(_run_until_signalled(config))
    return 0
