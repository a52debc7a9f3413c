"""A side-channel server that stalls: what its clients' requests become.

A prefill engine on busy cores can stop running for seconds (its side-channel thread
starved of the GIL by the engine's busy loop, or the whole process of the CPU). Seen in
the fault suite: decode's heartbeats went unanswered for 30 s and the lease expired,
because each timed-out request closed its connection and the next one opened a new
connection that needed the stalled engine's handshake before it carried anything.

Here the server runs in a child process that the test stops with SIGSTOP: a real stall
of a real `SideChannelServer`, not a simulated one.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import pytest

from pdconnect.protocol import Ack, Heartbeat, Message
from pdconnect.sidechannel import LATE_ROUND_SECONDS, NoAnswer, SideChannelClient, SideChannelServer
from pdconnect.testbed.keys import keyring
from pdconnect.testbed.processes import freeze
from tests.waiting import wait_until

PREFILL, DECODE = keyring("prefill"), keyring("decode")
WAIT_S = 10.0  # bound on every wait for the child process; none is a performance claim


def _serve(port: int, ready: Any, handled: Synchronized[int]) -> None:
    """The child: a server answering each heartbeat with its own ids (so every answer
    names what it answers), counting what it handled."""

    def handler(message: Message) -> Message:
        with handled.get_lock():
            handled.value += 1
        assert isinstance(message, Heartbeat)
        return Ack(unknown=list(message.request_ids))

    server = SideChannelServer("127.0.0.1", port, handler, PREFILL, engine_id="prefill-0")
    ready.put(server.port)
    while True:
        time.sleep(60)


@dataclass
class Child:
    process: Any
    port: int
    handled: Synchronized[int]

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def wait_handled(self, count: int) -> int:
        wait_until(
            lambda: self.handled.value >= count,
            f"the child to handle {count} messages",
            WAIT_S,
            observe=lambda: self.handled.value,
        )
        return int(self.handled.value)


def _start(port: int = 0) -> Child:
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    handled = context.Value("i", 0)
    process = context.Process(target=_serve, args=(port, ready, handled), daemon=True)
    process.start()
    return Child(process, ready.get(timeout=60), handled)


def _stop(child: Child) -> None:
    os.kill(child.process.pid, signal.SIGCONT)
    child.process.kill()
    child.process.join(WAIT_S)


@pytest.fixture
def child() -> Iterator[Child]:
    started = _start()
    try:
        yield started
    finally:
        _stop(started)


def test_requests_sent_to_a_stopped_server_all_reach_it_when_it_runs_again(child: Child) -> None:
    client = SideChannelClient(child.address, "decode", DECODE, timeout=0.5)
    try:
        assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["before"])) == Ack(unknown=["before"])
        freeze(child.process.pid)
        for beat in range(3):
            with pytest.raises(NoAnswer, match="no answer"):
                client.request(Heartbeat(to_engine="prefill-0", request_ids=[f"stopped-{beat}"]))
        os.kill(child.process.pid, signal.SIGCONT)
        # Every heartbeat sent while it was stopped is handled (each would extend a lease).
        # Before, only the first was: the others went out on new connections that were
        # closed, unsent, before the stopped server could take them.
        assert child.wait_handled(4) == 4
        # Its late answers wait in the client's socket; the next request gets its own.
        assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["after"]), timeout=WAIT_S) == Ack(
            unknown=["after"]
        )
    finally:
        client.close()


def test_a_late_answer_is_never_taken_for_the_answer_to_a_later_request() -> None:
    def slow_first(message: Message) -> Message:
        assert isinstance(message, Heartbeat)
        if message.request_ids == ["slow"]:
            time.sleep(1.0)
        return Ack(unknown=list(message.request_ids))

    server = SideChannelServer("127.0.0.1", 0, slow_first, PREFILL, engine_id="prefill-0")
    client = SideChannelClient(server.address, "decode", DECODE, timeout=0.3)
    try:
        with pytest.raises(NoAnswer):
            client.request(Heartbeat(to_engine="prefill-0", request_ids=["slow"]))
        # The answer to "slow" arrives first, on the same connection, and is dropped.
        assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["next"]), timeout=WAIT_S) == Ack(
            unknown=["next"]
        )
    finally:
        client.close()
        server.close()


def hold_the_interpreter(seconds: float) -> None:
    """Sleep in C without releasing the interpreter lock: no other thread of this
    process runs Python meanwhile (what a library call that keeps the lock does)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1_000_000))


def test_a_serving_thread_kept_from_running_is_counted_late() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda message: Ack(), PREFILL, engine_id="prefill-0")
    try:
        started = server.drained_at  # set again by every round that found nothing waiting
        wait_until(lambda: server.drained_at > started, "the serving thread to run its rounds", WAIT_S)
        before = server.counts()["late_rounds"]
        hold_the_interpreter(LATE_ROUND_SECONDS + 0.5)
        wait_until(
            lambda: server.counts()["late_rounds"] > before, "a late round counted", WAIT_S, observe=server.counts
        )
    finally:
        server.close()


def test_a_request_that_could_not_be_sent_is_never_delivered_later() -> None:
    """Nothing waits for a server that is not there: a claim or heartbeat that failed as
    "not sent" must not reach a prefill engine that starts on that port afterwards."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = SideChannelClient(f"tcp://127.0.0.1:{port}", "decode", DECODE, timeout=0.3)
    try:
        with pytest.raises(NoAnswer, match="not sent"):
            client.request(Heartbeat(to_engine="prefill-0", request_ids=["early"]))
        late = _start(port)
        try:
            assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["now"]), timeout=WAIT_S) == Ack(
                unknown=["now"]
            )
            time.sleep(0.5)  # room for a queued "early" to arrive, were one queued
            assert late.handled.value == 1
        finally:
            _stop(late)
    finally:
        client.close()
