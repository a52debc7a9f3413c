"""`pdconnect metrics-proxy`: an engine's /metrics on a port of its own, and nothing else there.

vLLM serves /metrics only on its API port, and a NetworkPolicy cannot filter by path:
letting Prometheus in on that port lets it call the API as well (completions, with
`kv_transfer_params`). This proxy runs beside each engine (deploy/base/prefill.yaml,
decode.yaml: a native sidecar) on a port that serves metrics only, and that port is all
the monitoring namespace may open (deploy/README.md, "What monitoring can reach").

What it answers, all of it:

- `GET /metrics`: one GET of the fixed upstream URL, whatever the request's path, query
  or headers said (only `Accept` and `Accept-Encoding` travel: they choose the exposition
  format and its compression). A 200 of at most `max_bytes` that arrives within `timeout`
  is relayed byte for byte, with its `Content-Type` and `Content-Encoding`; anything else
  is a one-line reason and 503 (upstream unreachable, or `max_concurrent` scrapes already
  waiting), 504 (no whole answer in time) or 502 (another status, too large, cut off),
  counted by cause. The body is buffered, not streamed, so a scraper never gets half.
- `GET /proxy/metrics`: the proxy's own counters (those causes, and refused requests).
- Anything else is refused before any upstream call: 404 for another path, 405 for
  another method (HEAD included), 400 with the connection closed for any request that
  carries a body. Request heads are bounded (line, field and header count).

What it does not bound: the time a client takes to send a head (aiohttp has no such
deadline; the router adds one, pdconnect.router.listener). Only the monitoring namespace may
connect, and what a slow client holds is a socket of this proxy, not the engine.
No vLLM and no torch: it runs from the router image.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from pdconnect.errors import ConfigError
from pdconnect.serving import serve_http, serve_until_signalled

__all__ = ["REFUSALS", "RESULTS", "MetricsProxy", "ProxySettings", "RunningProxy", "main", "parse_args", "start_proxy"]

logger = logging.getLogger("pdconnect.metricsproxy")

# Label `result` of pdconnect_metrics_proxy_scrapes_total: every GET /metrics ends with one.
RESULTS = (
    "ok",  # relayed
    "unreachable",  # no connection to upstream (engine starting, stopped, crashed): 503
    "timeout",  # no whole answer within `timeout`: 504
    "bad_status",  # upstream answered, but not 200 (redirects are not followed): 502
    "too_large",  # more than `max_bytes` (declared or received): 502
    "broken",  # the connection broke or the answer was malformed: 502
    "busy",  # `max_concurrent` scrapes already waiting on upstream: 503
)
# Label `reason` of pdconnect_metrics_proxy_refused_requests_total.
REFUSALS = ("not_found", "method", "body")

# The scraper's request headers that reach upstream; nothing else of the request does.
_FORWARDED = ("Accept", "Accept-Encoding")
# The upstream answer's headers that reach the scraper, besides the body.
_RELAYED = ("Content-Type", "Content-Encoding")

# Request-head limits: a scrape is a request line and a handful of short headers
# (Prometheus: Accept, Accept-Encoding, User-Agent, a timeout header, maybe Authorization).
_MAX_LINE = 2048
_MAX_FIELD = 4096
_MAX_HEADERS = 32
# Longer than a 15-60 s scrape interval, so a scraper's kept-alive connection is reused.
_KEEPALIVE = 75.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxySettings(msgspec.Struct, frozen=True):
    """What `pdconnect metrics-proxy` was told; `parse_args` builds and validates it."""

    upstream: str
    host: str = "0.0.0.0"
    port: int = 9400
    # Below the scraper's own timeout (the ServiceMonitor's scrapeTimeout, 10 s), so the
    # scraper sees this proxy's 504 and reason instead of giving up first.
    timeout: float = 8.0
    max_bytes: int = 16 * 1024 * 1024
    max_concurrent: int = 4
    log_level: str = "info"


class _UpstreamFailed(Exception):
    """Why a scrape was not relayed: the `result` label, the status answered, a reason."""

    def __init__(self, result: str, status: int, reason: str) -> None:
        super().__init__(reason)
        self.result = result
        self.status = status


class MetricsProxy:
    """One proxy: its upstream client, its counters, and the app that serves them."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.scrapes = Counter(
            "pdconnect_metrics_proxy_scrapes",
            "GET /metrics requests, by result (ok, or why upstream's answer was not relayed)",
            ["result"],
            registry=self.registry,
        )
        self.refused = Counter(
            "pdconnect_metrics_proxy_refused_requests",
            "Requests refused without calling upstream: another path, another method, a body",
            ["reason"],
            registry=self.registry,
        )
        # Every series exists from the start, so rate() and alerts see the first failure.
        for result in RESULTS:
            self.scrapes.labels(result)
        for reason in REFUSALS:
            self.refused.labels(reason)
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._failing: str | None = None  # the last failure's result, until a scrape succeeds

    def build_app(self) -> web.Application:
        # client_max_size: no handler reads a body; a request with one is refused unread.
        app = web.Application(client_max_size=1024, middlewares=[self._strict])
        app.cleanup_ctx.append(self._client)
        app.router.add_get("/metrics", self._relay, allow_head=False)
        app.router.add_get("/proxy/metrics", self._own_metrics, allow_head=False)
        return app

    async def _client(self, app: web.Application) -> AsyncIterator[None]:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout),
            connector=aiohttp.TCPConnector(limit=self.settings.max_concurrent),
            # The bytes as upstream sent them: no inflating, no cookies, no proxy variables,
            # and no Accept-Encoding of aiohttp's own (only the scraper's travels).
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            skip_auto_headers=("Accept-Encoding",),
        )
        try:
            yield
        finally:
            await self._session.close()

    @web.middleware
    async def _strict(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            self.refused.labels("body").inc()
            response = _text(400, "requests to the metrics proxy carry no body")
            response.force_close()  # rather than read and drain what the client sends
            return response
        try:
            return await handler(request)
        except web.HTTPNotFound:
            self.refused.labels("not_found").inc()
            raise
        except web.HTTPMethodNotAllowed:
            self.refused.labels("method").inc()
            raise

    async def _own_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _relay(self, request: web.Request) -> web.Response:
        if self._in_flight >= self.settings.max_concurrent:
            return self._failed(_UpstreamFailed("busy", 503, f"{self._in_flight} scrapes already waiting on upstream"))
        self._in_flight += 1
        try:
            headers, body = await self._fetch({h: request.headers[h] for h in _FORWARDED if h in request.headers})
        except _UpstreamFailed as failure:
            return self._failed(failure)
        finally:
            self._in_flight -= 1
        self.scrapes.labels("ok").inc()
        if self._failing is not None:
            logger.info("upstream %s answers again", self.settings.upstream)
            self._failing = None
        return web.Response(body=body, headers=headers)

    async def _fetch(self, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
        assert self._session is not None, "the app's cleanup context opens the session"
        limit, upstream = self.settings.max_bytes, self.settings.upstream
        try:
            async with self._session.get(upstream, headers=headers, allow_redirects=False) as response:
                if response.status != 200:
                    raise _UpstreamFailed("bad_status", 502, f"upstream answered {response.status}")
                declared = response.content_length
                if declared is not None and declared > limit:
                    raise _UpstreamFailed("too_large", 502, f"upstream declares {declared} bytes, over {limit}")
                body = bytearray()
                async for chunk in response.content.iter_any():
                    body += chunk
                    if len(body) > limit:
                        raise _UpstreamFailed("too_large", 502, f"upstream sent over {limit} bytes")
                relayed = {h: response.headers[h] for h in _RELAYED if h in response.headers}
                return relayed, bytes(body)
        except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors too
            raise _UpstreamFailed("timeout", 504, f"no whole answer within {self.settings.timeout} s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise _UpstreamFailed("unreachable", 503, f"cannot connect: {exc.os_error}") from exc
        except aiohttp.ClientError as exc:
            raise _UpstreamFailed("broken", 502, f"{type(exc).__name__}: {exc}") from exc

    def _failed(self, failure: _UpstreamFailed) -> web.Response:
        self.scrapes.labels(failure.result).inc()
        # Logged when the cause changes, not per scrape: an engine starts for up to 30 min.
        if failure.result != self._failing:
            logger.warning("upstream %s: %s (%s)", self.settings.upstream, failure, failure.result)
            self._failing = failure.result
        return _text(failure.status, f"metrics proxy: upstream {self.settings.upstream}: {failure}")


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n")


@dataclass
class RunningProxy:
    """A proxy serving on this event loop until `close()` (tests, `main`)."""

    proxy: MetricsProxy
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_proxy(settings: ProxySettings) -> RunningProxy:
    """Serve `settings` on host:port (port 0 picks a free one)."""
    proxy = MetricsProxy(settings)
    runner, url = await serve_http(
        proxy.build_app(),
        settings.host,
        settings.port,
        _KEEPALIVE,
        max_line_size=_MAX_LINE,
        max_field_size=_MAX_FIELD,
        max_headers=_MAX_HEADERS,
    )
    return RunningProxy(proxy=proxy, runner=runner, url=url)


def _listen_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen must be host:port, got {text!r}")
    return host.strip("[]"), int(port)


def _upstream_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.fragment:
        raise ConfigError(f"--upstream must be an http(s) URL without credentials, got {text!r}")
    return text


def parse_args(argv: list[str]) -> ProxySettings:
    """argv -> ProxySettings; ConfigError names a bad value (argparse exits on unknown flags)."""
    defaults = ProxySettings(upstream="")
    parser = argparse.ArgumentParser(
        prog="pdconnect metrics-proxy",
        description="Serve GET /metrics from one fixed upstream URL (and the proxy's own at /proxy/metrics); "
        "refuse everything else.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--listen", default=f"{defaults.host}:{defaults.port}", help="host:port to serve on")
    # SUPPRESS: a required flag has no default to show.
    parser.add_argument(
        "--upstream",
        required=True,
        default=argparse.SUPPRESS,
        help="the URL scraped, e.g. http://127.0.0.1:8000/metrics",
    )
    parser.add_argument("--timeout", type=float, default=defaults.timeout, help="seconds for upstream's whole answer")
    parser.add_argument("--max-bytes", type=int, default=defaults.max_bytes, help="largest answer relayed")
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=defaults.max_concurrent,
        help="scrapes waiting on upstream at once; more are answered 503",
    )
    parser.add_argument(
        "--log-level",
        default=defaults.log_level,
        choices=("debug", "info", "warning", "error"),
        help="what the proxy logs",
    )
    args = parser.parse_args(argv)
    host, port = _listen_address(args.listen)
    if not args.timeout > 0 or args.max_bytes < 1 or args.max_concurrent < 1:
        raise ConfigError("--timeout, --max-bytes and --max-concurrent must be positive")
    return ProxySettings(
        upstream=_upstream_url(args.upstream),
        host=host,
        port=port,
        timeout=args.timeout,
        max_bytes=args.max_bytes,
        max_concurrent=args.max_concurrent,
        log_level=args.log_level,
    )


def main(argv: list[str]) -> int:
    """`pdconnect metrics-proxy ...`: serve until SIGINT/SIGTERM."""
    try:
        settings = parse_args(argv)
    except ConfigError as exc:
        print(f"pdconnect metrics-proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(
        serve_until_signalled(
            lambda: start_proxy(settings),
            lambda running: logger.info("listening on %s, relaying %s", running.url, settings.upstream),
        )
    )
    return 0
