"""The router's engine client (`router.upstream`) against a FAKE engine: keep-alive reuse,
streamed bodies, compressed answers inflated, a dropped connection reported, and the
whole router serving P/D requests on uvloop (the event loop `pdconnect router` runs on;
uvloop's transports differ from asyncio's in ways the default loop does not show)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
import uvloop

from pdconnect.router import start_router
from pdconnect.router.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from pdconnect.testbed.fake_engine import FakeCluster, FakeEngine
from tests.router_support import router_config_for
from tests.waiting import wait_until_async

HANG = 15.0


async def _exchange(pool: UpstreamPool, engine: FakeEngine, body: dict[str, Any]) -> tuple[int, bytes]:
    async with asyncio.timeout(HANG):
        resp = await pool.post(
            engine.url, "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        data = await resp.read()
        resp.release()
        return resp.status, data


def _run_on_both_loops(coro_factory: Any) -> None:
    asyncio.run(coro_factory())
    uvloop.run(coro_factory())


@pytest.mark.parametrize("gzip_answers", [False, True], ids=["identity", "gzip"])
def test_one_connection_carries_many_requests_and_compressed_answers_are_inflated(
    monkeypatch: pytest.MonkeyPatch, gzip_answers: bool
) -> None:
    async def scenario() -> None:
        opened: list[object] = []
        made = UpstreamResponse.connection_made

        def connection_made(self: UpstreamResponse, transport: asyncio.BaseTransport) -> None:
            opened.append(transport)
            made(self, transport)

        monkeypatch.setattr(UpstreamResponse, "connection_made", connection_made)
        engine = FakeEngine(chunks=3)
        engine.faults.gzip = gzip_answers
        await engine.start()
        pool = UpstreamPool(1.0, keepalive=30.0)
        try:
            for _ in range(3):
                status, data = await _exchange(pool, engine, {"prompt": "a b", "stream": True})
                assert status == 200 and data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == 4
                status, data = await _exchange(pool, engine, {"prompt": "a b"})
                assert status == 200 and json.loads(data)["choices"][0]["text"] == " t0 t1 t2"
            assert len(opened) == 1
        finally:
            pool.close()
            await engine.close()

    _run_on_both_loops(scenario)


def test_a_connection_dropped_mid_stream_is_an_upstream_error() -> None:
    async def scenario() -> None:
        engine = FakeEngine(chunks=8)
        engine.faults.drop_after_chunks = 2
        await engine.start()
        pool = UpstreamPool(1.0, keepalive=30.0)
        try:
            with pytest.raises(UpstreamError):
                await _exchange(pool, engine, {"prompt": "a b", "stream": True})
        finally:
            pool.close()
            await engine.close()

    _run_on_both_loops(scenario)


def test_router_serves_prefill_then_decode_on_uvloop() -> None:
    async def scenario() -> None:
        fakes = await FakeCluster.start(1, 1)
        router = await start_router(router_config_for(fakes))
        try:
            async with aiohttp.ClientSession() as http, asyncio.timeout(HANG):
                for stream in (False, True, False, True):
                    async with http.post(
                        router.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 4, "stream": stream}
                    ) as resp:
                        assert resp.status == 200 and "X-PDConnect-Fallback" not in resp.headers
                        await resp.read()
            assert [kind for kind, _ in fakes.prefill[0].served] == ["prefill"] * 4
            assert [kind for kind, _ in fakes.decode[0].served] == ["decode"] * 4
        finally:
            await router.close()
            await fakes.close()

    uvloop.run(scenario())


def test_a_pooled_connection_the_engine_closed_while_idle_is_not_reused() -> None:
    async def scenario() -> None:
        engine = FakeEngine(chunks=2)
        await engine.start()
        port = int(engine.url.rsplit(":", 1)[1])
        pool = UpstreamPool(1.0, keepalive=30.0)
        try:
            assert (await _exchange(pool, engine, {"prompt": "a b"}))[0] == 200
            await engine.close()  # the engine restarts: its side of the idle connection closes
            engine = FakeEngine(chunks=2)
            await engine.start(port=port)
            await wait_until_async(  # the close reaches the loop, as it would while idle
                lambda: not any(p._idle for p in pool._pools.values()), "the idle connection's close"
            )
            assert (await _exchange(pool, engine, {"prompt": "a b"}))[0] == 200
        finally:
            pool.close()
            await engine.close()

    _run_on_both_loops(scenario)


async def _closing_at_keepalive(idle_limit: float) -> tuple[asyncio.Server, str]:
    """A server that, like uvicorn at its keep-alive timeout, drops a connection idle for
    `idle_limit` seconds; a request arriving on it then gets no answer (the race, made
    certain: in real life the request and the close cross on the wire)."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if loop.time() - last > idle_limit:
                    break
                writer.write(answer)
                await writer.drain()
                last = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("keepalive", [0.2, 30.0], ids=["below-engine-keepalive", "above-engine-keepalive"])
def test_an_idle_connection_is_given_up_before_the_engine_closes_it(keepalive: float) -> None:
    async def scenario() -> None:
        server, url = await _closing_at_keepalive(idle_limit=0.5)
        pool = UpstreamPool(1.0, keepalive=keepalive)
        try:
            async with asyncio.timeout(HANG):
                resp = await pool.post(url, "/v1/completions", b"{}", {})
                assert resp.status == 200 and await resp.read() == b"{}"
                resp.release()
                await asyncio.sleep(0.7)  # idle past the server's limit
                if keepalive < 0.5:
                    resp = await pool.post(url, "/v1/completions", b"{}", {})
                    assert resp.status == 200 and await resp.read() == b"{}"
                    resp.release()
                else:  # a pool that keeps connections longer than the engine sends into the close
                    with pytest.raises(UpstreamError):
                        await pool.post(url, "/v1/completions", b"{}", {})
        finally:
            pool.close()
            server.close()

    _run_on_both_loops(scenario)


async def _dripping(first_after: float, gap: float, events: int, then_stall: bool) -> tuple[asyncio.Server, str]:
    """A server answering every request with a chunked stream: headers and the first event
    after `first_after` seconds, then `events` more, `gap` seconds apart, then the end (or
    silence, `then_stall`)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            await reader.readexactly(length)
            await asyncio.sleep(first_after)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"6\r\ndata:\n\r\n"
            )
            for _ in range(events):
                await asyncio.sleep(gap)
                writer.write(b"6\r\ndata:\n\r\n")
            if then_stall:
                await asyncio.sleep(HANG)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _drain(resp: UpstreamResponse, idle: float | None) -> int:
    received = 0
    while data := await resp.chunk(idle):
        received += data.count(b"data:")
    return received


def test_a_stream_outlives_its_idle_limit_while_bytes_keep_coming_and_a_stall_times_out() -> None:
    async def scenario() -> None:
        for stall in (False, True):
            server, url = await _dripping(first_after=0.0, gap=0.1, events=6, then_stall=stall)
            pool = UpstreamPool(1.0, keepalive=30.0)
            try:
                async with asyncio.timeout(HANG):
                    resp = await pool.post(url, "/v1/completions", b"{}", {})
                    if stall:  # 6 gaps under the limit, then silence longer than it
                        with pytest.raises(TimeoutError):
                            await _drain(resp, idle=0.35)
                        resp.close()
                    else:  # the whole stream takes longer than one idle limit
                        assert await _drain(resp, idle=0.35) == 7
                        resp.release()
            finally:
                pool.close()
                server.close()

    _run_on_both_loops(scenario)


def test_the_exchange_deadline_bounds_the_answer_until_cleared() -> None:
    async def scenario() -> None:
        server, url = await _dripping(first_after=0.0, gap=0.1, events=6, then_stall=False)
        slow, slow_url = await _dripping(first_after=HANG, gap=0.0, events=0, then_stall=False)
        pool = UpstreamPool(1.0, keepalive=30.0)
        try:
            async with asyncio.timeout(HANG):
                with pytest.raises(TimeoutError):  # no answer within the deadline
                    await pool.post(slow_url, "/v1/completions", b"{}", {}, timeout=0.2)
                resp = await pool.post(url, "/v1/completions", b"{}", {}, timeout=0.25)
                with pytest.raises(TimeoutError):  # the stream runs past the exchange's deadline
                    await _drain(resp, idle=None)
                resp.close()
                resp = await pool.post(url, "/v1/completions", b"{}", {}, timeout=0.25)
                first = await resp.chunk()
                resp.clear_deadline()  # the first bytes are here: only the idle limit holds now
                assert first.count(b"data:") + await _drain(resp, idle=0.35) == 7
                resp.release()
        finally:
            pool.close()
            server.close()
            slow.close()

    _run_on_both_loops(scenario)


def test_an_unread_stream_pauses_the_engine_connection_until_the_caller_reads() -> None:
    """A slow client must not make the router buffer an engine's whole stream: past the
    high-water mark the connection stops reading, and resumes once the caller takes it."""
    piece, pieces = b"x" * 65536, 64  # 4 MiB, well past the 1 MiB mark

    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(pieces):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = UpstreamPool(1.0, keepalive=30.0)
        try:
            async with asyncio.timeout(HANG):
                resp = await pool.post(
                    f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "/v1/completions", b"{}", {}
                )
                await wait_until_async(lambda: resp._paused, "the read mark (nobody reads)")
                assert len(await resp.read()) == len(piece) * pieces
                assert not resp._paused
                resp.release()
        finally:
            pool.close()
            server.close()

    _run_on_both_loops(scenario)


@pytest.mark.parametrize("framing", ["announced", "chunked"])
def test_a_body_over_the_callers_limit_raises_without_being_read_whole(framing: str) -> None:
    """An announced length over the limit fails before a body byte is read; a chunked
    body fails once it passes the limit, while the engine is still sending."""
    from pdconnect.router.upstream import AnswerTooLarge

    limit = 1 << 20
    sent: list[int] = []

    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            if framing == "announced":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
                await asyncio.sleep(HANG)  # the body never comes: only the header can tell
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            with contextlib.suppress(ConnectionError):
                for _ in range(1 << 12):  # 4 GiB if nobody stops it
                    writer.write(b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20)))
                    sent.append(1)
                    await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = UpstreamPool(1.0, keepalive=30.0)
        try:
            async with asyncio.timeout(HANG):
                resp = await pool.post(
                    f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "/v1/completions", b"{}", {}
                )
                with pytest.raises(AnswerTooLarge):
                    await resp.read(limit)
                resp.close()
        finally:
            pool.close()
            server.close()

    _run_on_both_loops(scenario)
    assert len(sent) < 64  # stopped within a few MiB, not 4 GiB
