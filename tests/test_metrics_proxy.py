"""`pdconnect metrics-proxy` over real sockets, against a real aiohttp upstream.

The upstream stands where vLLM's API server does (a pod's 127.0.0.1:8000): it serves
/metrics as prometheus_client renders it, answers everything else the way an API would,
and records every request it gets, so each refusal can be shown never to reach it.
Expected bodies are the upstream's own bytes; expected statuses and counter values are
written out here. The CLI test runs the installed entry point in a subprocess.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from pdconnect.errors import ConfigError
from pdconnect.metricsproxy import ProxySettings, RunningProxy, parse_args, start_proxy

REPO = Path(__file__).resolve().parents[1]
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
LIMIT = 64 * 1024


def _exposition() -> CollectorRegistry:
    """A registry shaped like vLLM's: counters and a histogram with labels, odd label text."""
    registry = CollectorRegistry()
    tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry)
    tokens.labels('model "a"\\b\n').inc(5131)
    latency = Histogram("vllm:e2e_request_latency_seconds", "Latency.", ["model_name"], registry=registry)
    for value in (0.01, 0.3, 2.5):
        latency.labels("m").observe(value)
    return registry


@dataclass
class Upstream:
    """The engine side: what it was asked, and knobs for how it answers /metrics."""

    url: str = ""
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    registry: CollectorRegistry = field(default_factory=_exposition)
    status: int = 200
    size: int | None = None  # answer this many bytes instead of the metrics
    declare_size: bool = True  # with Content-Length; else chunked
    hold: asyncio.Event | None = None  # wait for it before answering
    trickle: bool = False  # send headers, then a byte every 50 ms, forever
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def metrics_bytes(self, accept: str) -> tuple[bytes, str]:
        if "application/openmetrics-text" in accept:
            return generate_openmetrics(self.registry), OPENMETRICS
        return generate_latest(self.registry), TEXT_FORMAT

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs, dict(request.headers)))
        self.arrived.set()
        if request.path != "/metrics":
            return web.json_response({"choices": [{"text": "an engine would have generated this"}]})
        if self.hold is not None:
            await self.hold.wait()
        if self.trickle:
            response = web.StreamResponse(headers={"Content-Type": TEXT_FORMAT})
            await response.prepare(request)
            while True:
                await response.write(b"#")
                await asyncio.sleep(0.05)
        if self.size is not None:
            body = b"x" * self.size
            if self.declare_size:
                return web.Response(body=body)
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for start in range(0, len(body), 4096):
                await response.write(body[start : start + 4096])
            await response.write_eof()
            return response
        body, content_type = self.metrics_bytes(request.headers.get("Accept", ""))
        headers = {"Content-Type": content_type}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        return web.Response(status=self.status, body=body, headers=headers)


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Upstream]:
    state = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", state.handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    state.url = f"http://{host}:{port}"
    yield state
    if state.hold is not None:
        state.hold.set()
    await runner.cleanup()


async def _proxy(upstream_url: str, **overrides: float) -> RunningProxy:
    settings = ProxySettings(
        upstream=upstream_url + "/metrics", host="127.0.0.1", port=0, timeout=2.0, max_bytes=LIMIT, max_concurrent=4
    )
    return await start_proxy(msgspec.structs.replace(settings, **overrides))


@pytest_asyncio.fixture
async def proxy(upstream: Upstream) -> AsyncIterator[RunningProxy]:
    running = await _proxy(upstream.url)
    yield running
    await running.close()


async def _get(url: str, method: str = "GET", **kwargs: object) -> tuple[int, dict[str, str], bytes]:
    # auto_decompress off: the test reads the bytes that travelled.
    async with (
        aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=("Accept-Encoding",)) as session,
        session.request(method, url, **kwargs) as response,  # type: ignore[arg-type]
    ):
        return response.status, dict(response.headers), await response.read()


async def _own_counters(proxy: RunningProxy) -> dict[tuple[str, str], float]:
    """(sample name, its one label's value) -> value, from the proxy's /proxy/metrics."""
    status, _, body = await _get(proxy.url + "/proxy/metrics")
    assert status == 200
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                (value,) = sample.labels.values()
                found[(sample.name, value)] = sample.value
    return found


async def _raw(proxy: RunningProxy, request: bytes) -> bytes:
    """Send raw bytes, read until the proxy closes (or 2 s of silence)."""
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    chunks = []
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 2.0):
            chunks.append(chunk)
    except TimeoutError:
        chunks.append(b"<still open>")
    writer.close()
    return b"".join(chunks)


# ------------------------------------------------------------------ relaying


@pytest.mark.asyncio
async def test_get_metrics_is_relayed_byte_for_byte_with_its_content_type(
    upstream: Upstream, proxy: RunningProxy
) -> None:
    status, headers, body = await _get(proxy.url + "/metrics")
    expected, content_type = upstream.metrics_bytes("")
    assert status == 200 and body == expected
    assert headers["Content-Type"] == content_type == TEXT_FORMAT
    [(method, path, _)] = upstream.requests
    assert (method, path) == ("GET", "/metrics")


@pytest.mark.asyncio
async def test_the_scrapers_format_and_compression_choices_travel_and_nothing_else(
    upstream: Upstream, proxy: RunningProxy
) -> None:
    status, headers, body = await _get(
        proxy.url + "/metrics?name[]=vllm:prompt_tokens",
        headers={
            "Accept": OPENMETRICS,
            "Accept-Encoding": "gzip",
            "Authorization": "Bearer scraper",
            "X-Forwarded-For": "10.9.9.9",
            "kv_transfer_params": "{}",
        },
    )
    expected, content_type = upstream.metrics_bytes(OPENMETRICS)
    assert status == 200
    assert headers["Content-Encoding"] == "gzip" and gzip.decompress(body) == expected
    assert headers["Content-Type"] == content_type == OPENMETRICS
    [(_, path, sent)] = upstream.requests
    assert path == "/metrics"  # the scraper's query stayed behind
    assert sent["Accept"] == OPENMETRICS and sent["Accept-Encoding"] == "gzip"
    assert not {"Authorization", "X-Forwarded-For", "kv_transfer_params"} & set(sent)


@pytest.mark.asyncio
async def test_without_accept_encoding_upstream_is_not_asked_to_compress(
    upstream: Upstream, proxy: RunningProxy
) -> None:
    status, headers, _ = await _get(proxy.url + "/metrics")
    assert status == 200 and "Content-Encoding" not in headers
    [(_, _, sent)] = upstream.requests
    assert "Accept-Encoding" not in sent


# ------------------------------------------------------------------ refusals


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "reason"),
    [
        ("POST", "/v1/completions", b'{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true}}', 400, "body"),
        ("POST", "/v1/completions", b"", 404, "not_found"),
        ("POST", "/metrics", b"", 405, "method"),
        ("HEAD", "/metrics", b"", 405, "method"),
        ("PUT", "/metrics", b"", 405, "method"),
        ("DELETE", "/metrics", b"", 405, "method"),
        ("GET", "/metrics", b"x", 400, "body"),
        ("GET", "/v1/models", b"", 404, "not_found"),
        ("GET", "/health", b"", 404, "not_found"),
        ("GET", "/", b"", 404, "not_found"),
        ("GET", "/metrics/", b"", 404, "not_found"),
        ("GET", "/metrics/../v1/models", b"", 404, "not_found"),
        ("GET", "/METRICS", b"", 404, "not_found"),
        ("POST", "/proxy/metrics", b"", 405, "method"),
    ],
)
async def test_anything_but_get_metrics_is_refused_and_never_reaches_upstream(
    upstream: Upstream, proxy: RunningProxy, method: str, path: str, body: bytes, status: int, reason: str
) -> None:
    length = f"Content-Length: {len(body)}\r\n".encode() if body or method in ("POST", "PUT") else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n".encode() + length
    answer = await _raw(proxy, head + b"\r\n" + body)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert upstream.requests == []
    counters = await _own_counters(proxy)
    assert counters[("pdconnect_metrics_proxy_refused_requests_total", reason)] == 1
    assert sum(v for (name, _), v in counters.items() if name.endswith("refused_requests_total")) == 1


@pytest.mark.asyncio
async def test_a_request_with_a_body_is_answered_and_the_connection_closed(
    upstream: Upstream, proxy: RunningProxy
) -> None:
    """Chunked too; and whatever was pipelined behind it is not served."""
    answer = await _raw(
        proxy,
        b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\nGET /metrics HTTP/1.1\r\nHost: e\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.count(b"HTTP/1.1 ") == 1 and not answer.endswith(b"<still open>")
    assert upstream.requests == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "head"),
    [
        ("long field", b"GET /metrics HTTP/1.1\r\nHost: e\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"),
        (
            "many headers",
            b"GET /metrics HTTP/1.1\r\nHost: e\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(40)) + b"\r\n",
        ),
        ("long request line", b"GET /metrics?" + b"q" * 3000 + b" HTTP/1.1\r\nHost: e\r\n\r\n"),
    ],
)
async def test_oversized_request_heads_are_refused(
    upstream: Upstream, proxy: RunningProxy, name: str, head: bytes
) -> None:
    answer = await _raw(proxy, head)
    assert re.match(rb"HTTP/1\.[01] 400 ", answer), (name, answer[:200])
    assert upstream.requests == []


# ------------------------------------------------------------------ bounded upstream


async def _scrape_fails(proxy: RunningProxy, status: int, result: str) -> bytes:
    got, _, body = await _get(proxy.url + "/metrics")
    assert got == status, body
    counters = await _own_counters(proxy)
    assert counters[("pdconnect_metrics_proxy_scrapes_total", result)] == 1
    assert counters[("pdconnect_metrics_proxy_scrapes_total", "ok")] == 0
    return body


@pytest.mark.asyncio
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_an_answer_over_the_limit_is_a_502_not_a_truncated_relay(
    upstream: Upstream, proxy: RunningProxy, declared: bool
) -> None:
    upstream.size, upstream.declare_size = LIMIT + 1, declared
    body = await _scrape_fails(proxy, 502, "too_large")
    assert b"over 65536" in body and b"x" not in body.split(b":")[-1]


@pytest.mark.asyncio
async def test_an_answer_of_exactly_the_limit_is_relayed(upstream: Upstream, proxy: RunningProxy) -> None:
    upstream.size, upstream.declare_size = LIMIT, False
    status, _, body = await _get(proxy.url + "/metrics")
    assert status == 200 and body == b"x" * LIMIT


@pytest.mark.asyncio
async def test_an_upstream_that_never_answers_is_a_504(upstream: Upstream) -> None:
    upstream.hold = asyncio.Event()
    running = await _proxy(upstream.url, timeout=0.3)
    try:
        body = await _scrape_fails(running, 504, "timeout")
        assert b"within 0.3 s" in body
    finally:
        await running.close()


@pytest.mark.asyncio
async def test_an_upstream_that_trickles_its_answer_is_a_504(upstream: Upstream) -> None:
    """The timeout bounds the whole answer, not the gap between bytes."""
    upstream.trickle = True
    running = await _proxy(upstream.url, timeout=0.3)
    try:
        await _scrape_fails(running, 504, "timeout")
    finally:
        await running.close()


@pytest.mark.asyncio
async def test_an_upstream_error_status_is_a_502_and_not_relayed(upstream: Upstream, proxy: RunningProxy) -> None:
    upstream.status = 500
    body = await _scrape_fails(proxy, 502, "bad_status")
    assert b"answered 500" in body and b"vllm:prompt_tokens" not in body


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_an_upstream_that_is_down_is_a_503_and_counted() -> None:
    running = await _proxy(f"http://127.0.0.1:{_closed_port()}")
    try:
        body = await _scrape_fails(running, 503, "unreachable")
        assert b"cannot connect" in body
    finally:
        await running.close()


@pytest.mark.asyncio
async def test_scrapes_beyond_max_concurrent_are_refused_while_upstream_is_slow(upstream: Upstream) -> None:
    upstream.hold = asyncio.Event()
    running = await _proxy(upstream.url, max_concurrent=1)
    try:
        first = asyncio.create_task(_get(running.url + "/metrics"))
        await upstream.arrived.wait()
        status, _, body = await _get(running.url + "/metrics")
        assert status == 503 and b"already waiting" in body
        upstream.hold.set()
        assert (await first)[0] == 200
        counters = await _own_counters(running)
        assert counters[("pdconnect_metrics_proxy_scrapes_total", "busy")] == 1
        assert counters[("pdconnect_metrics_proxy_scrapes_total", "ok")] == 1
        assert len(upstream.requests) == 1
    finally:
        await running.close()


@pytest.mark.asyncio
async def test_every_result_series_exists_before_anything_happened(proxy: RunningProxy) -> None:
    counters = await _own_counters(proxy)
    assert {v for (n, v) in counters if n == "pdconnect_metrics_proxy_scrapes_total"} == {
        "ok",
        "unreachable",
        "timeout",
        "bad_status",
        "too_large",
        "broken",
        "busy",
    }
    assert {v for (n, v) in counters if n == "pdconnect_metrics_proxy_refused_requests_total"} == {
        "not_found",
        "method",
        "body",
    }
    assert set(counters.values()) == {0.0}


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize(
    "argv",
    [
        ["--upstream", "ftp://127.0.0.1/metrics"],
        ["--upstream", "http://user:pw@127.0.0.1:8000/metrics"],
        ["--upstream", "http://127.0.0.1:8000/metrics", "--listen", "9400"],
        ["--upstream", "http://127.0.0.1:8000/metrics", "--listen", "0.0.0.0:99999"],
        ["--upstream", "http://127.0.0.1:8000/metrics", "--timeout", "0"],
        ["--upstream", "http://127.0.0.1:8000/metrics", "--max-concurrent", "0"],
    ],
)
def test_bad_arguments_are_refused_by_name(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_args(argv)


def test_arguments_as_the_manifests_give_them() -> None:
    settings = parse_args(["--listen=0.0.0.0:9400", "--upstream=http://127.0.0.1:8000/metrics", "--timeout=8"])
    assert (settings.host, settings.port, settings.upstream, settings.timeout) == (
        "0.0.0.0",
        9400,
        "http://127.0.0.1:8000/metrics",
        8.0,
    )
    assert parse_args(["--listen=[::]:9400", "--upstream=http://[::1]:8000/metrics"]).host == "::"


@pytest.mark.asyncio
async def test_the_pdconnect_command_serves_until_sigterm_and_loads_no_vllm(upstream: Upstream) -> None:
    """The real entry point, as the sidecar runs it; it must not import vLLM or torch (the
    router image has neither)."""
    code = (
        "import sys; sys.argv = ['pdconnect'] + sys.argv[1:]\n"
        "import pdconnect.cli as cli\n"
        "rc = 1\n"
        "try:\n    rc = cli.main()\n"
        "finally:\n"
        "    heavy = sorted(m for m in ('torch', 'vllm', 'connectors', 'transformers') if m in sys.modules)\n"
        "    print('heavy modules:', heavy, file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "metrics-proxy",
        "--listen=127.0.0.1:0",
        f"--upstream={upstream.url}/metrics",
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stderr is not None
    try:
        line = b""
        while b"listening on" not in line:
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert line, "the proxy exited before listening"
        url = re.search(rb"listening on (http://\S+),", line)
        assert url is not None, line
        status, _, body = await _get(url.group(1).decode() + "/metrics")
        assert status == 200 and body == upstream.metrics_bytes("")[0]
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 30)
        assert await proc.wait() == 0, rest
        assert b"heavy modules: []" in rest, rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
