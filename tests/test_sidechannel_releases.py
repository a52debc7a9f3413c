"""The router's releases: one kept connection per prefill engine, and none lost to a stalled one.

The router tells a prefill engine to free a request's blocks when its client went away
or decode failed. Before, every release opened a connection of its own and gave up
after `release_timeout`: a prefill engine stalled for longer (its process starved on
busy cores) never saw the connection's handshake, so the release was lost and the
blocks stayed held until the lease ran out. Here a real `SideChannelServer` in a child
process is stopped with SIGSTOP while releases are sent, and a raw zmq ROUTER counts the
connections the router opens.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import pytest
import zmq

from pdconnect.envelope import encode_message, open_envelope, request_id_of
from pdconnect.notifier import PeerNotifier
from pdconnect.protocol import Ack, Message, Release
from pdconnect.router.breaker import CircuitBreaker
from pdconnect.router.engines import EngineRegistry
from pdconnect.router.metrics import RouterMetrics
from pdconnect.router.releaser import PrefillReleaser
from pdconnect.sidechannel import SideChannelServer
from pdconnect.testbed.keys import keyring
from pdconnect.testbed.processes import freeze
from tests.waiting import wait_until

PREFILL, ROUTER = keyring("prefill"), keyring("router")
WAIT_S = 20.0  # bound on every wait; none is a performance claim
RELEASE_TIMEOUT_S = 0.5


def _metrics() -> RouterMetrics:
    return RouterMetrics(EngineRegistry(make_breaker=lambda: CircuitBreaker(3, 10.0), probed=False))


def _released(metrics: RouterMetrics, result: str) -> float:
    return metrics.registry.get_sample_value("pdconnect_router_prefill_releases_total", {"result": result}) or 0.0


def _plan(address: str, request_id: str, lease_seconds: float = 60.0) -> dict[str, Any]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return {
        "remote_engine_id": "prefill-0",
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": int(port),
        "compat_hash": "c",
        "num_prompt_tokens": 10,
        "lease_expires_at": time.time() + lease_seconds,
        "groups": [],
    }


# --- a stalled prefill engine -----------------------------------------------------------


def _serve(ready: Any, released: Synchronized[int]) -> None:
    def handler(message: Message) -> Message:
        assert isinstance(message, Release)
        with released.get_lock():
            released.value += len(message.request_ids)
        return Ack()

    server = SideChannelServer("127.0.0.1", 0, handler, PREFILL, engine_id="prefill-0")
    ready.put(server.address)
    while True:
        time.sleep(60)


@pytest.fixture
def stalled_prefill() -> Iterator[tuple[Any, str, Synchronized[int]]]:
    context = multiprocessing.get_context("spawn")
    ready, released = context.Queue(), context.Value("i", 0)
    process = context.Process(target=_serve, args=(ready, released), daemon=True)
    process.start()
    try:
        yield process, ready.get(timeout=60), released
    finally:
        assert process.pid is not None  # started above
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.join(WAIT_S)


def test_releases_sent_while_a_prefill_engine_is_stopped_reach_it_when_it_runs_again(stalled_prefill) -> None:
    process, address, released = stalled_prefill
    metrics = _metrics()
    releaser = PrefillReleaser(ROUTER, RELEASE_TIMEOUT_S, metrics)
    try:
        releaser.release(_plan(address, "warm"), "client gone")
        wait_until(lambda: released.value == 1, "the first release", WAIT_S)
        freeze(process.pid)
        for i in range(5):
            releaser.release(_plan(address, f"stopped-{i}"), "client gone")
        # Several release timeouts pass unanswered: before, each of these was lost by now.
        wait_until(lambda: _released(metrics, "retried") >= 2, "releases retried while stopped", WAIT_S)
        assert released.value == 1
        os.kill(process.pid, signal.SIGCONT)
        wait_until(lambda: released.value >= 6, "every release reached the engine once it ran again", WAIT_S)
        wait_until(lambda: _released(metrics, "ok") >= 6, "counted as ok", WAIT_S)
        assert _released(metrics, "dropped") == 0 and _released(metrics, "expired") == 0
    finally:
        releaser.close(wait=False)


# --- one connection per prefill engine ---------------------------------------------------


@contextlib.contextmanager
def _counting_prefill() -> Iterator[tuple[str, list[str], list[int]]]:
    """A stand-in prefill engine on a raw ROUTER that answers releases and counts the
    connections it accepts (what a `SideChannelServer` does not expose)."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED)
    released: list[str] = []
    accepted = [0]
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not stop.is_set():
            for socket, _ in poller.poll(50):
                if socket is monitor:
                    monitor.recv_multipart()
                    accepted[0] += 1
                    continue
                identity, data = router.recv_multipart()
                message = open_envelope(data, PREFILL, "request").message
                assert isinstance(message, Release)
                released.extend(message.request_ids)
                router.send_multipart(
                    [identity, encode_message(Ack(), "prefill", PREFILL, reply_to=request_id_of(data))]
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield router.getsockopt_string(zmq.LAST_ENDPOINT), released, accepted
    finally:
        stop.set()
        thread.join(5)
        router.disable_monitor()
        monitor.close()
        router.close()
        context.term()


def test_releases_to_one_prefill_engine_share_one_connection() -> None:
    """Before, each release opened (and closed) a connection of its own: 30 here."""
    metrics = _metrics()
    releaser = PrefillReleaser(ROUTER, RELEASE_TIMEOUT_S, metrics)
    with _counting_prefill() as (address, released, accepted):
        try:
            for i in range(30):
                releaser.release(_plan(address, f"r{i}"), "decode_failed")
                if i % 3 == 0:
                    time.sleep(0.01)  # some go out alone, some together
            wait_until(lambda: len(released) == 30, "all releases", WAIT_S)
        finally:
            releaser.close(wait=True)
        assert sorted(released) == sorted(f"r{i}" for i in range(30))
        assert accepted[0] == 1 and _released(metrics, "ok") == 30


def test_without_keys_no_release_leaves_this_machine() -> None:
    metrics = _metrics()
    releaser = PrefillReleaser(None, RELEASE_TIMEOUT_S, metrics)
    try:
        releaser.release(_plan("tcp://10.1.2.3:5700", "r"), "client gone")
        assert _released(metrics, "insecure") == 1
    finally:
        releaser.close(wait=False)


# --- bounded, and never past the lease ----------------------------------------------------


@contextlib.contextmanager
def _hung_peer() -> Iterator[str]:
    """An address that takes messages and never answers."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind("tcp://127.0.0.1:0")
    try:
        yield socket.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        socket.close()


def test_pending_releases_are_bounded_and_given_up_when_their_lease_is_over() -> None:
    counts: dict[str, int] = {}

    def count(name: str, amount: int) -> None:
        counts[name] = counts.get(name, 0) + amount

    notifier = PeerNotifier(
        sender="router",
        keys=ROUTER,
        timeout_seconds=RELEASE_TIMEOUT_S,
        heartbeat_seconds=3600.0,
        count=count,
        max_pending_releases=3,
    )
    with _hung_peer() as address:
        try:
            notifier.release(address, "prefill-0", [f"r{i}" for i in range(10)], "client gone", time.monotonic() + 2.0)
            assert counts.get("releases_dropped") == 7
            # Unanswered, retried until their deadline, then given up and counted.
            wait_until(lambda: counts.get("releases_expired") == 3, "expired", WAIT_S)
            assert counts.get("release_retries", 0) >= 3
            wait_until(lambda: notifier.pending_releases() == 0, "nothing left pending", WAIT_S)
        finally:
            notifier.close()
