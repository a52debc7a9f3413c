"""Two router replicas over the same engines keep the engines' bounds for the fleet and share breaker news.

Each router is a real `pdconnect router` process, told of its peer (`--replica-peers`,
the replica ports); the engines are FAKE (`pdconnect.testbed.fake_engine`, in this test's
event loop) so a stream can stay open while the next request is placed, and FAKE KV
event publishers (vLLM's own event classes on a PUB socket) speak for the decode engine's
cache. Requests alternate between the two routers; each is in flight at its engine before
the next is sent, so both routers route on settled counts.

Breaker notices are signed with the replicas' shared secret (`--replica-secret-file`):
notices posted to a real router's replica port unsigned, forged, stale or replayed
change nothing there and are counted; the same notice signed with the secret opens the
breaker.

`ReplicaSet`'s counting (DNS answers, failures, the fail-safe maximum) runs in-process
with a resolver the test controls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from pdconnect.errors import ConfigError
from pdconnect.router.breaker import CircuitBreaker
from pdconnect.router.config import DnsTarget
from pdconnect.router.engines import EngineRegistry
from pdconnect.router.options import parse_args
from pdconnect.router.replicas import BREAKER_PATH, NOTICE_MAX_AGE, NoticeSigner, ReplicaSet, read_replica_secret
from pdconnect.testbed.fake_engine import FakeCluster
from pdconnect.testbed.processes import free_port
from tests.router_support import RouterProcess, start_router_process
from tests.waiting import wait_until_async

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4, all cached by the decode engine
# 32 cached + 12 more: vLLM's lookup hits the 8 cached blocks, decode would prefill 12 itself.
PROMPT = [*TOKENS, *range(900, 912)]
UNCACHED = 12
SECRET = b"replicas-of-this-test-share-this-secret-0123456789"


@contextlib.asynccontextmanager
async def _fakes(decode: int) -> AsyncIterator[FakeCluster]:
    cluster = await FakeCluster.start(prefill=1, decode=decode, chunks=4)
    for engine in cluster.decode:
        # Every answer stays in flight, before its first byte, until the test ends: a local
        # prefill holds its share of the decode-first budget until then.
        engine.faults.delay = 120.0
    try:
        yield cluster
    finally:
        await cluster.close()


@contextlib.asynccontextmanager
async def _replicas(
    fakes: FakeCluster, *args: str, peers: bool = True, replica_urls: list[str] | None = None
) -> AsyncIterator[list[RouterProcess]]:
    """Two router processes before `fakes`, each told of both (unless `peers` is off: today's
    two routers), signing notices with `SECRET`; their replica ports' URLs go to `replica_urls`."""
    ports = [free_port(), free_port()]
    replica_ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in replica_ports]
    if replica_urls is not None:
        replica_urls.extend(urls)
    routers: list[RouterProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "replica-secret"
        secret.write_bytes(SECRET + b"\n")  # as a mounted Secret often ends
        try:
            for port, replica_port in zip(ports, replica_ports):
                extra = (
                    (
                        "--replica-peers",
                        *urls,
                        "--replica-port",
                        str(replica_port),
                        "--replica-secret-file",
                        str(secret),
                    )
                    if peers
                    else ()
                )
                routers.append(await start_router_process(fakes, *args, *extra, "--admin-open", port=port))
            yield routers
        finally:
            for router in routers:
                router.process.send_signal(signal.SIGTERM)
            for router in routers:
                try:
                    await asyncio.wait_for(router.process.wait(), timeout=10)
                except TimeoutError:
                    await router.kill()  # streams held by the stalled fakes outlast a polite stop


async def _place(fakes: FakeCluster, routers: list[RouterProcess], body: dict[str, Any], requests: int) -> None:
    """`requests` streams, alternating between the routers, each at a decode engine before the
    next is sent; all stay open (the fakes hold them) until every one is placed."""

    def at_decode(placed: int) -> bool:
        return sum(len(engine.seen) for engine in fakes.decode) == placed

    async def stream(http: aiohttp.ClientSession, url: str) -> None:
        async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for _ in resp.content:
                pass

    async with aiohttp.ClientSession() as http:
        held = []
        for i in range(requests):
            held.append(asyncio.create_task(stream(http, routers[i % 2].url)))
            await wait_until_async(
                functools.partial(at_decode, i + 1), f"request {i} to reach a decode engine", within=30
            )
        assert not any(task.done() for task in held), "a held stream ended early"
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


def _decode_requests(fakes: FakeCluster) -> list[int]:
    return [len(engine.seen) for engine in fakes.decode]


# --- the load bound --------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("peers", [True, False], ids=["replicas", "today"])
async def test_two_FAKE_engine_routers_put_no_more_than_the_fleet_load_bound_on_one_engine(peers: bool) -> None:
    """16 siblings (one affinity key) over 2 routers and 2 decode engines, all in flight at
    once. One router would hold the key's engine to max(floor 8, ceil(1.5 * 16 / 2)) = 12
    for the 16th; two routers that each keep the whole floor put 8 + 8 = 16 there."""
    async with _fakes(decode=2) as fakes, _replicas(fakes, "--policy", "prefix-affinity", peers=peers) as routers:
        await _place(fakes, routers, {"model": "fake-model", "prompt": "one long shared prefix", "max_tokens": 4}, 16)
        most = max(_decode_requests(fakes))
    if peers:
        assert most <= 12, f"one engine holds {most} of 16 siblings, over the fleet bound of 12"
    else:
        assert most == 16  # the flaw the replicas fix: each router kept its own floor of 8


# --- the decode-first budget -------------------------------------------------------------------


@contextlib.contextmanager
def _publisher() -> Iterator[tuple[str, zmq.Socket[Any]]]:
    context: zmq.Context[Any] = zmq.Context()
    socket = context.socket(zmq.PUB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", socket
    finally:
        socket.close(linger=0)
        context.destroy(linger=0)


def _cached_batch() -> bytes:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from pdconnect.kvdescribe import VERSION, DescribedGroup, EngineDescribed
    from tests.vllm_kv_events import stored_blocks

    stored = stored_blocks(range(8), TOKENS, block_size=BS, group=0, kind="full_attention", tag="g0")
    # The engine's connector describes its one group with its events (`connectors.describe`).
    described = EngineDescribed(VERSION, [DescribedGroup("full_attention", BS, None, False)], 0)
    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=0.0, events=[stored, described]))


async def _applied_batches(router: RouterProcess) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{router.url}/metrics") as resp:
        return "pdconnect_router_kv_events_last_seq{" in await resp.text()


async def _publish_until_heard(socket: zmq.Socket[Any], routers: list[RouterProcess]) -> None:
    """Publish the decode engine's cache (numbered batches, as vLLM does) until every router applied one."""
    payload, seq = _cached_batch(), 0

    async def heard() -> bool:
        nonlocal seq
        if all([await _applied_batches(r) for r in routers]):
            return True
        socket.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        return False

    await wait_until_async(heard, "both routers to apply the decode engine's KV events", within=30)


@pytest.mark.asyncio
@pytest.mark.parametrize("peers", [True, False], ids=["replicas", "today"])
async def test_two_FAKE_engine_routers_spend_no_more_than_the_decode_first_budget(peers: bool, tmp_path: Path) -> None:
    """A budget of 48 local-prefill tokens on the one decode engine, requests that each make
    it prefill 12: the fleet may hold 4 on the local route at once, whichever router sent them.
    Two routers that each keep the whole budget put 8 there (96 tokens)."""
    async with _fakes(decode=1) as fakes:
        with _publisher() as (endpoint, socket):
            config = tmp_path / "router.json"
            config.write_text(json.dumps({"kv_events_endpoints": {fakes.decode_urls[0]: [endpoint]}}))
            args = (
                "--config",
                str(config),
                "--policy",
                "kv-aware",
                "--decode-first",
                "--kv-cache-groups",
                "full:4",
                "--decode-first-max-tokens-in-flight",
                "48",
            )
            async with _replicas(fakes, *args, peers=peers) as routers:
                await _publish_until_heard(socket, routers)
                await _place(fakes, routers, {"model": "fake-model", "prompt": PROMPT, "max_tokens": 4}, 8)
                local = [s for s in fakes.decode[0].seen if not (s.body.get("kv_transfer_params") or {})]
    if peers:
        assert len(local) * UNCACHED <= 48, f"{len(local)} local prefills of {UNCACHED} tokens: over the budget of 48"
        assert len(local) == 4  # the budget is used, not refused outright
    else:
        assert len(local) == 8  # the flaw the replicas fix: each router spent the whole budget


# --- breaker news ----------------------------------------------------------------------------


async def _breaker(router: RouterProcess, url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{router.url}/admin/engines") as resp:
        engines = await resp.json()
    return next(e["breaker"] for e in engines if e["role"] == "decode" and e["url"] == url)


@pytest.mark.asyncio
async def test_a_breaker_one_FAKE_engine_router_opens_opens_on_its_peer() -> None:
    """The decode engine drops every completion (its /health would say fine): the router
    that sees 2 failures opens its breaker and tells its peer, which never sent it anything."""
    async with _fakes(decode=1) as fakes:
        fakes.decode[0].faults.delay = 0.0
        fakes.decode[0].faults.drop_before_answer = True  # the engine's fault (a 5xx may be the request's)
        async with _replicas(fakes, "--breaker-failures", "2", "--breaker-cooldown", "60") as (seeing, other):
            decode = fakes.decode_urls[0]
            async with aiohttp.ClientSession() as http:
                for _ in range(2):
                    async with http.post(
                        f"{seeing.url}/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 2}
                    ) as resp:
                        assert resp.status >= 500
            assert await _breaker(seeing, decode) == "open"
            await wait_until_async(
                lambda: _breaker_is(other, decode, "open"),
                "the peer replica to open its breaker for the failing engine",
                within=10,
            )


async def _breaker_is(router: RouterProcess, url: str, state: str) -> bool:
    return await _breaker(router, url) == state


async def _notice_results(router: RouterProcess) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{router.url}/metrics") as resp:
        text = await resp.text()
    prefix = 'pdconnect_router_replica_notices_total{result="'
    return {
        line[len(prefix) :].partition('"')[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


@pytest.mark.asyncio
async def test_a_FAKE_engine_router_acts_only_on_breaker_notices_signed_with_the_replicas_secret() -> None:
    """Posted to a real router's replica port: a notice unsigned (401), signed with another
    secret, signed long ago, or replayed (403) leaves its breaker closed and is counted; the
    same notice signed with the replicas' secret opens it."""
    replica_urls: list[str] = []
    async with _fakes(decode=1) as fakes, _replicas(fakes, replica_urls=replica_urls) as (router, _):
        decode = fakes.decode_urls[0]
        body = json.dumps({"role": "decode", "url": decode, "dp_rank": None}).encode()
        ours, theirs = NoticeSigner(SECRET), NoticeSigner(b"not-the-replicas-secret-but-as-long-as-one")
        long_ago = NoticeSigner(SECRET, clock=lambda: time.time() - 2 * NOTICE_MAX_AGE)
        genuine = ours.headers(body)
        attempts: list[tuple[dict[str, str], int]] = [
            ({}, 401),
            (theirs.headers(body), 403),
            ({**genuine, "X-Pdconnect-Replica-Timestamp": f"{time.time() + 1:.3f}"}, 403),  # not what was signed
            (long_ago.headers(body), 403),
            (genuine, 204),
            (genuine, 403),  # the genuine one again: a replay
        ]
        opened = False
        async with aiohttp.ClientSession() as http:
            for headers, status in attempts:
                async with http.post(f"{replica_urls[0]}{BREAKER_PATH}", data=body, headers=headers) as resp:
                    assert resp.status == status, (headers, await resp.text())
                opened = opened or status == 204
                assert await _breaker(router, decode) == ("open" if opened else "closed"), headers
        results = await _notice_results(router)
        assert {k: results.get(k) for k in ("unsigned", "forged", "stale", "replayed", "applied")} == {
            "unsigned": 1.0,
            "forged": 2.0,
            "stale": 1.0,
            "replayed": 1.0,
            "applied": 1.0,
        }, results


def test_replicas_without_a_shared_secret_or_with_a_short_one_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--replica-secret-file or --replica-secret-env"):
        parse_args(["--decode", "http://d:8000", "--replica-peers", "http://r0:8090", "http://r1:8090"])
    short = tmp_path / "secret"
    short.write_bytes(b"a-password\n")
    with pytest.raises(ConfigError, match="at least 32"):
        read_replica_secret(str(short), None)


# --- counting the replicas ---------------------------------------------------------------------


class _Dns:
    """A resolver whose answer the test sets: a list of addresses, or an error."""

    def __init__(self) -> None:
        self.answer: list[str] | OSError = OSError("no answer yet")

    async def __call__(self, host: str, port: int) -> list[str]:
        if isinstance(self.answer, OSError):
            raise self.answer
        return self.answer


def _set(dns: _Dns, maximum: int = 3) -> ReplicaSet:
    registry = EngineRegistry(lambda: CircuitBreaker(3, 10.0), probed=False)
    target = DnsTarget("routers.ns.svc", 8081)
    return ReplicaSet((), target, maximum, 10.0, registry, CollectorRegistry(), dns, signer=NoticeSigner(SECRET))


@pytest.mark.asyncio
async def test_a_replica_counts_its_peers_from_dns_and_the_maximum_when_it_cannot() -> None:
    dns = _Dns()
    replicas = _set(dns, maximum=3)
    assert (replicas.count, replicas.share(512)) == (3, 170)  # before any answer: the maximum
    dns.answer = ["10.0.0.1", "10.0.0.2"]
    await replicas.refresh()
    assert (replicas.count, replicas.share(512), replicas.share(8)) == (2, 256, 4)
    assert replicas.peers == ("http://10.0.0.1:8081", "http://10.0.0.2:8081")
    dns.answer = OSError("SERVFAIL")
    await replicas.refresh()
    assert replicas.count == 3  # a failed lookup: back to the maximum, never the last (maybe low) count
    dns.answer = []
    await replicas.refresh()
    assert replicas.count == 3  # an answer without even itself is no count
    dns.answer = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    await replicas.refresh()
    assert (replicas.count, replicas.share(512)) == (4, 128)  # more than the maximum: believed


@pytest.mark.asyncio
async def test_a_router_without_peers_keeps_the_whole_bounds() -> None:
    registry = EngineRegistry(lambda: CircuitBreaker(3, 10.0), probed=False)
    replicas = ReplicaSet((), None, 4, 10.0, registry, CollectorRegistry(), signer=NoticeSigner(SECRET))
    assert (replicas.count, replicas.share(512)) == (1, 512)


def test_a_peer_trips_a_closed_breaker_and_leaves_a_cooling_or_trying_one_alone() -> None:
    now = [100.0]
    breaker = CircuitBreaker(3, 10.0, clock=lambda: now[0])
    assert breaker.trip() and not breaker.allows()  # closed -> open, as if it had seen the failures
    assert not breaker.trip()  # already open: its cooldown is not restarted
    now[0] += 10.0
    assert breaker.allows()
    breaker.on_attempt()  # the trial goes out
    assert not breaker.trip()  # a trial in flight is left to decide
    breaker.record_success()
    assert breaker.allows() and breaker.opens == 1


# --- client keys' rates ------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("peers", [True, False], ids=["replicas", "today"])
async def test_two_FAKE_engine_routers_admit_no_more_than_a_keys_request_rate(peers: bool, tmp_path: Path) -> None:
    """A key of 6 requests a minute, 12 requests alternating between two routers within the
    minute: the fleet admits at most 6 (each router 3), whichever router a request reaches.
    Two routers that each keep the whole rate admit 12."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "team", "key": "sk-team-0123456789", "requests_per_minute": 6}]}))
    fakes = await FakeCluster.start(prefill=1, decode=1)
    statuses: list[int] = []
    try:
        async with (
            _replicas(fakes, "--api-keys-file", str(keys), peers=peers) as routers,
            aiohttp.ClientSession(headers={"Authorization": "Bearer sk-team-0123456789"}) as http,
        ):
            for i in range(12):
                body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
                async with http.post(f"{routers[i % 2].url}/v1/completions", json=body) as resp:
                    statuses.append(resp.status)
                    if resp.status == 429:
                        assert int(resp.headers["Retry-After"]) >= 1
    finally:
        await fakes.close()
    assert set(statuses) <= {200, 429}, statuses
    if peers:
        assert statuses.count(200) == 6, statuses
    else:
        assert statuses.count(200) == 12, statuses  # the flaw: each router kept the whole rate
