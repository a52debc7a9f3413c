"""The router's HTTP face and `main`: routes, error-to-status mapping, lifecycle, CLI entry.

aiohttp serves and calls: one event loop, one HTTP stack, C parsers on both sides, and
a client with a keep-alive pool per engine. A proxy's added latency is mostly its client
(two upstream calls per request here); measured on this machine, a 16-chunk streamed
request costs the aiohttp client 0.28 ms of CPU and httpx's 1.3 ms. uvicorn+starlette
would serve about as fast but would still need aiohttp as the client, so one stack it
is. uvloop is used when installed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from pdconnect.router.config import ConfigError, RouterConfig, parse_args
from pdconnect.router.discovery import DnsDiscovery, Resolver, resolve_addresses
from pdconnect.router.engines import Engine, EngineRegistry, Role
from pdconnect.router.errors import (
    AdminUnauthorized, BadRequest, DecodeFailed, DecodeTimeout, EngineRejected, NoEngineAvailable,
    PrefillFailed, RouterError, UnknownEngine,
)
from pdconnect.router.flow import Endpoint, PDFlow, PrefillReleaser
from pdconnect.router.health import CircuitBreaker, HealthMonitor
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.policy import LeastLoaded, make_policy

__all__ = ["Router", "RunningRouter", "start_router", "main"]

logger = logging.getLogger("pdconnect.router")

# The one place where a cause becomes an HTTP status.
_STATUS: dict[type[RouterError], int] = {
    BadRequest: 400,
    AdminUnauthorized: 401,
    UnknownEngine: 404,
    PrefillFailed: 502,
    DecodeFailed: 502,
    NoEngineAvailable: 503,
    DecodeTimeout: 504,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(exc: RouterError) -> web.Response:
    if isinstance(exc, EngineRejected):
        return web.Response(status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type})
    status = _STATUS.get(type(exc), 500)
    body = {"error": {"message": str(exc), "type": type(exc).__name__, "code": status}}
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")


def _guarded(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except RouterError as exc:
            return error_response(exc)
    return guarded


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data), content_type="application/json")


class Router:
    """One router: engine registry, health, discovery, the P/D flow and its metrics."""

    def __init__(self, config: RouterConfig, resolver: Resolver = resolve_addresses) -> None:
        self.config = config
        self.registry = EngineRegistry(
            make_breaker=lambda: CircuitBreaker(config.breaker_failures, config.breaker_cooldown),
            probed=config.health_interval > 0,
        )
        self.metrics = RouterMetrics(self.registry)
        self._resolver = resolver
        self._secret = config.resolve_secret()
        self._admin_token = config.resolve_admin_token()
        self._flow: PDFlow | None = None
        self._session: aiohttp.ClientSession | None = None

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_post(Endpoint.COMPLETIONS.value, _guarded(self._completions))
        app.router.add_post(Endpoint.CHAT.value, _guarded(self._chat))
        app.router.add_get("/v1/models", _guarded(self._models))
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        if self._admin_token is not None or self.config.admin_open:
            app.router.add_get("/admin/engines", _guarded(self._list_engines))
            app.router.add_post("/admin/engines", _guarded(self._add_engine))
            app.router.add_delete("/admin/engines", _guarded(self._remove_engine))
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        config = self.config
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=max(1, int(config.dns_interval)))
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self._session = session
        releaser = PrefillReleaser(self._secret, config.release_timeout, self.metrics)
        self._flow = PDFlow(config, self.registry, session, self.metrics, releaser,
                            make_policy(config.policy, config.affinity_load_factor, config.affinity_vnodes),
                            make_policy(config.policy, config.affinity_load_factor, config.affinity_vnodes))
        tasks: list[asyncio.Task[None]] = []
        monitor = None
        if config.health_interval > 0:
            monitor = HealthMonitor(self.registry, session, config.health_interval, config.health_timeout,
                                    config.health_failures)
            self.registry.on_added.append(monitor.poll_soon)
        for url in config.prefill_urls:
            self.registry.add(Role.PREFILL, url, "static")
        for url in config.decode_urls:
            self.registry.add(Role.DECODE, url, "static")
        for role in Role:
            for target in config.dns_targets(role.value):
                discovery = DnsDiscovery(self.registry, role, target, config.dns_interval, self._resolver,
                                         on_failure=self.metrics.dns_failures.inc)
                await discovery.refresh()
                tasks.append(asyncio.create_task(discovery.run()))
        if monitor is not None:
            await monitor.poll(self.registry.all_engines())
            tasks.append(asyncio.create_task(monitor.run()))
        logger.info("router ready: %d prefill, %d decode engines, policy %s",
                    len(self.registry.engines(Role.PREFILL)), len(self.registry.engines(Role.DECODE)),
                    config.policy)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if monitor is not None:
                await monitor.close()
            await session.close()
            releaser.close(wait=True)

    # --- inference --------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        assert self._flow is not None
        return await self._flow.handle(request, Endpoint.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        assert self._flow is not None
        return await self._flow.handle(request, Endpoint.CHAT)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """The model list of a healthy decode engine (every engine serves the same model)."""
        assert self._session is not None
        for engine in LeastLoaded().order(self.registry.engines(Role.DECODE), None):
            try:
                async with self._session.get(f"{engine.url}/v1/models",
                                             timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as resp:
                    body = await resp.read()
                    if resp.status < 500:
                        return web.Response(status=resp.status, body=body,
                                            headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
            except (aiohttp.ClientError, TimeoutError):
                continue
        raise NoEngineAvailable(Role.DECODE.value)

    # --- operations -------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        """200 while some decode engine can serve (decode-only fallback needs nothing else)."""
        counts = {role.value: {"routable": sum(e.routable for e in self.registry.engines(role)),
                               "registered": len(self.registry.engines(role))} for role in Role}
        ok = counts["decode"]["routable"] > 0
        return _json({"status": "ok" if ok else "unavailable", **counts}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    def _check_admin(self, request: web.Request) -> None:
        if self._admin_token is not None and request.headers.get("Authorization") != f"Bearer {self._admin_token}":
            raise AdminUnauthorized("admin endpoints need 'Authorization: Bearer <token>'")

    async def _list_engines(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        return _json([_describe(e) for e in self.registry.all_engines()])

    async def _engine_ref(self, request: web.Request) -> tuple[Role, str]:
        self._check_admin(request)
        try:
            body = msgspec.json.decode(await request.read())
            role, url = Role(body["role"]), str(body["url"]).rstrip("/")
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            raise BadRequest('body must be {"role": "prefill"|"decode", "url": "http://host:port"}') from None
        if not url.startswith(("http://", "https://")):
            raise BadRequest(f"engine URL must start with http:// or https://, got {url!r}")
        return role, url

    async def _add_engine(self, request: web.Request) -> web.Response:
        role, url = await self._engine_ref(request)
        return _json(_describe(self.registry.add(role, url, "admin")), status=201)

    async def _remove_engine(self, request: web.Request) -> web.Response:
        role, url = await self._engine_ref(request)
        if not self.registry.remove(role, url):
            raise UnknownEngine(f"no {role.value} engine {url}")
        return _json({"removed": url, "role": role.value})


def _describe(engine: Engine) -> dict[str, Any]:
    return {"role": engine.role.value, "url": engine.url, "sources": sorted(engine.sources),
            "routable": engine.routable, "health_poll_ok": engine.probe_ok,
            "breaker": engine.breaker.state.value, "in_flight": engine.in_flight, "failures": engine.failures}


@dataclass
class RunningRouter:
    """A router serving on this event loop (tests, benchmarks, embedding)."""

    router: Router
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_router(config: RouterConfig, resolver: Resolver = resolve_addresses) -> RunningRouter:
    """Serve `config` on config.host:config.port (port 0 picks a free one) until `close()`."""
    router = Router(config, resolver)
    runner = web.AppRunner(router.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    return RunningRouter(router=router, runner=runner, url=f"http://{host}:{port}")


def main(argv: list[str]) -> int:
    """`pdconnect router ...`: serve until SIGINT/SIGTERM."""
    try:
        config = parse_args(argv)
        router = Router(config)
    except ConfigError as exc:
        print(f"pdconnect router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        pass
    else:
        uvloop.install()
    web.run_app(router.build_app(), host=config.host, port=config.port, handler_cancellation=True,
                access_log=None, print=lambda _: logger.info("listening on %s:%d", config.host, config.port))
    return 0
