"""The peer notifier: a dead prefill engine delays nobody else, and no error ends delivery.

Real side-channel servers stand in for prefill engines; a "hung" peer is a zmq ROUTER
socket that takes messages and never answers (a stopped or wedged engine). Before this
module, one notifier thread sent everything in turn: a message to a hung engine held
every other engine's messages for the whole timeout, and a malformed address
(`ZMQError`) ended the thread silently.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
import zmq

from pdconnect.notifier import PeerNotifier
from pdconnect.protocol import Ack, Claim, Done, Handshake, Heartbeat, Message, Refusal, Release
from pdconnect.sidechannel import SideChannelServer
from pdconnect.testbed.keys import keyring
from tests.compat_records import OURS, handshake
from tests.waiting import wait_until

PREFILL, DECODE = keyring("prefill"), keyring("decode")
# Bounds on waiting for something that must happen; never a measurement.
WAIT = 20.0


class _Events:
    """Everything the notifier reported, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the notifier's threads report while the test reads
        self.log: list[tuple[str, str, Message, object]] = []
        self.unanswered: list[bool] = []  # each failure's flag, in order
        self.counts: Counter[str] = Counter()

    def count(self, name: str, amount: int) -> None:
        with self._lock:
            self.counts[name] += amount

    def on_reply(self, address: str, sent: Message, reply: Message) -> None:
        self._add(("reply", address, sent, reply))

    def on_failure(self, address: str, sent: Message, reason: str, unanswered: bool) -> None:
        self._add(("failure", address, sent, reason))
        self.unanswered.append(unanswered)

    def _add(self, event: tuple[str, str, Message, object]) -> None:
        with self._lock:
            self.log.append(event)

    def wait(self, condition: Callable[[], object], what: str) -> None:
        """`wait_until` `condition`, showing the events so far if it never holds."""
        wait_until(condition, what, WAIT, observe=self.seen)

    def seen(self) -> list[tuple[str, str, Message, object]]:
        """The events so far: what a failed wait reports."""
        with self._lock:
            return list(self.log)

    def of(self, kind: str, address: str) -> list[tuple[str, str, Message, object]]:
        return [e for e in self.seen() if e[0] == kind and e[1] == address]


@contextlib.contextmanager
def _prefill(handler: Callable[[Message], Message] | None = None) -> Iterator[SideChannelServer]:
    server = SideChannelServer("127.0.0.1", 0, handler or (lambda m: Ack()), PREFILL, engine_id="prefill-0")
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def _hung_peer() -> Iterator[tuple[str, zmq.Socket]]:
    """An address that accepts messages and never answers them."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind("tcp://127.0.0.1:0")
    try:
        yield socket.getsockopt_string(zmq.LAST_ENDPOINT), socket
    finally:
        socket.close()


@contextlib.contextmanager
def _notifier(events: _Events, **options) -> Iterator[PeerNotifier]:
    settings = {"sender": "decode", "keys": DECODE, "timeout_seconds": 60.0, "heartbeat_seconds": 3600.0, **options}
    notifier = PeerNotifier(count=events.count, on_reply=events.on_reply, on_failure=events.on_failure, **settings)
    try:
        yield notifier
    finally:
        notifier.close()


def _notifier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pdconnect-notifier")]


def test_a_hung_prefill_engine_does_not_delay_another_engines_messages():
    events = _Events()
    with _hung_peer() as (hung, hung_socket), _prefill() as live, _notifier(events) as notifier:
        notifier.send(hung, Done(to_engine="prefill-0", request_ids=["to-hung-1"]))
        notifier.send(hung, Done(to_engine="prefill-0", request_ids=["to-hung-2"]))
        # The hung engine has the first message: its worker now waits out a 60 s timeout.
        assert hung_socket.poll(WAIT * 1000, zmq.POLLIN)
        notifier.send(live.address, Done(to_engine="prefill-0", request_ids=["to-live"]))
        events.wait(
            lambda: events.of("reply", live.address), "the live engine to reply while the hung one holds its message"
        )
        # The live engine was answered while both messages to the hung one are pending
        # (sent one at a time, it would have waited for their timeouts first).
        assert events.of("failure", hung) == [] and events.of("reply", hung) == []
        assert events.of("reply", live.address) == [
            ("reply", live.address, Done(to_engine="prefill-0", request_ids=["to-live"]), Ack())
        ]


def test_messages_queued_behind_a_hung_engine_all_fail_and_the_queue_drains():
    events = _Events()
    with _hung_peer() as (hung, _), _notifier(events, timeout_seconds=0.3) as notifier:
        sent = [Release(to_engine="prefill-0", request_ids=[f"r{i}"], reason="client gone") for i in range(5)]
        for message in sent:
            notifier.send(hung, message)
        events.wait(
            lambda: len(events.of("failure", hung)) == len(sent), "every message queued behind the hung engine to fail"
        )
        assert [e[2] for e in events.of("failure", hung)] == sent  # in order, each reported once
        assert events.counts["notification_failures"] == len(sent)
        # The peer never answered any of them: each may be sent again (a claim is).
        assert events.unanswered == [True] * len(sent)


def test_a_malformed_address_fails_that_message_only():
    events = _Events()
    bad = "tcp://no such host:0"
    with _prefill() as live, _notifier(events) as notifier:
        for _ in range(2):  # the worker for the bad address survives its own failure
            notifier.send(bad, Done(to_engine="prefill-0", request_ids=["r"]))
        notifier.send(live.address, Done(to_engine="prefill-0", request_ids=["ok"]))
        events.wait(
            lambda: len(events.of("failure", bad)) == 2 and events.of("reply", live.address),
            "both messages to the bad address to fail and the live engine to reply",
        )
        assert all("Invalid argument" in e[3] for e in events.of("failure", bad))
        assert events.counts["notification_failures"] == 2 and events.counts["notifier_errors"] == 0
        assert events.unanswered == [False, False]  # resending would fail the same way


def test_a_refusal_is_a_failure_with_the_peers_reason():
    events = _Events()
    with (
        _prefill() as live,
        _notifier(events, keys=keyring("decode", secret="not-the-decode-secret-" + "x" * 20)) as notifier,
    ):
        notifier.send(live.address, Done(to_engine="prefill-0", request_ids=["r"]))
        events.wait(lambda: events.of("failure", live.address), "the refusal of a message signed with the wrong key")
        assert "authentication failed" in events.of("failure", live.address)[0][3]
        assert events.unanswered == [False]  # the peer decided: no resend


def test_a_refused_handshake_is_its_answer_and_a_refused_claim_a_failure():
    """A handshake's refusal carries the prefill engine's compat record, which is what the
    decode engine asked for: it goes to on_reply. Other refusals stay failures."""

    def refuse(message: Message) -> Message:
        if isinstance(message, Handshake):
            return Refusal(reason="incompatible engines: dtype differ", compat=OURS)
        return Refusal(reason="lease is claimed by another decode request")

    events = _Events()
    with _prefill(refuse) as live, _notifier(events) as notifier:
        asked = msgspec.structs.replace(OURS, dtype="bfloat16")
        notifier.send(live.address, handshake("decode-0", asked))
        notifier.send(live.address, Claim(to_engine="prefill-0", lease_id="l", claimant="c", plan_digest="d"))
        events.wait(lambda: events.of("reply", live.address) and events.of("failure", live.address), "both answers")
        ((_, _, sent, reply),) = events.of("reply", live.address)
        assert isinstance(sent, Handshake) and reply == Refusal(
            reason="incompatible engines: dtype differ", compat=OURS
        )
        ((_, _, claim, reason),) = events.of("failure", live.address)
        assert isinstance(claim, Claim) and "lease is claimed by another decode request" in str(reason)


def test_callback_and_counter_errors_do_not_end_delivery():
    events = _Events()
    calls: Counter[str] = Counter()

    def on_reply(address: str, sent: Message, reply: Message) -> None:
        calls["reply"] += 1
        events.on_reply(address, sent, reply)
        raise RuntimeError("reply callback bug")

    def on_failure(address: str, sent: Message, reason: str, unanswered: bool) -> None:
        calls["failure"] += 1
        events.on_failure(address, sent, reason, unanswered)
        raise RuntimeError("failure callback bug")

    def count(name: str, amount: int) -> None:
        events.count(name, amount)
        if name == "notification_failures":
            raise RuntimeError("counter bug")

    bad = "tcp://no such host:0"
    with _prefill() as live:
        notifier = PeerNotifier(
            sender="decode",
            keys=DECODE,
            timeout_seconds=60.0,
            heartbeat_seconds=3600.0,
            count=count,
            on_reply=on_reply,
            on_failure=on_failure,
        )
        try:
            for round_ in range(2):
                notifier.send(bad, Done(to_engine="prefill-0", request_ids=[f"bad{round_}"]))
                notifier.send(live.address, Done(to_engine="prefill-0", request_ids=[f"ok{round_}"]))
            events.wait(
                lambda: calls["reply"] == 2 and calls["failure"] == 2,
                "two replies and two failures, each callback raising",
            )
            wait_until(
                lambda: events.counts["notifier_callback_errors"] == 4,
                "the four callback errors to be counted",
                WAIT,
                observe=lambda: dict(events.counts),
            )
        finally:
            notifier.close()
    assert events.counts["notifier_errors"] == 0


def test_heartbeats_carry_every_watched_id_and_unknown_ids_reach_on_reply():
    held = {"lease-a"}
    received: list[Message] = []

    def prefill(message: Message) -> Message:
        received.append(message)
        return Ack(unknown=[i for i in getattr(message, "request_ids", []) if i not in held])

    events = _Events()
    with _prefill(prefill) as live, _prefill() as other, _notifier(events, heartbeat_seconds=0.05) as notifier:
        for request_id in ("lease-b", "lease-a"):
            notifier.watch(live.address, "prefill-0", request_id)
        notifier.watch(other.address, "prefill-0", "lease-c")
        events.wait(
            lambda: events.of("reply", live.address) and events.of("reply", other.address),
            "a heartbeat reply from each engine",
        )
        first = events.of("reply", live.address)[0]
        assert first[2:] == (
            Heartbeat(to_engine="prefill-0", request_ids=["lease-a", "lease-b"]),
            Ack(unknown=["lease-b"]),
        )
        assert events.of("reply", other.address)[0][2] == Heartbeat(to_engine="prefill-0", request_ids=["lease-c"])
        # Unwatched ids drop out of the next heartbeats; an address with none gets none.
        notifier.unwatch(live.address, "prefill-0", "lease-b")
        notifier.unwatch(other.address, "prefill-0", "lease-c")
        seen = len(events.of("reply", live.address))
        events.wait(
            lambda: len(events.of("reply", live.address)) >= seen + 2, "two more heartbeat replies from the live engine"
        )
        assert events.of("reply", live.address)[-1][2] == Heartbeat(to_engine="prefill-0", request_ids=["lease-a"])
        replies_to_other = len(events.of("reply", other.address))
    assert all(isinstance(m, Heartbeat) for m in received)
    # At most one heartbeat to `other` was already queued when its last id was unwatched.
    assert len(events.of("reply", other.address)) <= replies_to_other + 1


def test_notices_name_their_engine_and_ids_for_another_engine_at_the_address_are_refused():
    """Batches are per engine: ids watched or released for an engine that does not serve
    the address (a plan naming the wrong one) go out in their own message, which that
    server refuses, and never ride along with the ids it does hold."""
    received: list[Message] = []

    def prefill(message: Message) -> Message:
        received.append(message)
        return Ack()

    events = _Events()
    with _prefill(prefill) as live, _notifier(events, heartbeat_seconds=0.05) as notifier:
        notifier.watch(live.address, "prefill-0", "lease-a")
        notifier.watch(live.address, "prefill-1", "lease-b")
        notifier.release(live.address, "prefill-0", ["r1"], "client gone", time.monotonic() + WAIT)
        notifier.release(live.address, "prefill-1", ["r2"], "client gone", time.monotonic() + WAIT)
        sent = lambda kind: [e[2] for e in events.of(kind, live.address)]  # noqa: E731
        events.wait(
            lambda: len(sent("reply")) >= 2 and len(sent("failure")) >= 2, "two replies and two refusals of the notices"
        )
        assert Heartbeat(to_engine="prefill-0", request_ids=["lease-a"]) in sent("reply")
        assert Release(to_engine="prefill-0", request_ids=["r1"], reason="client gone") in sent("reply")
        assert Heartbeat(to_engine="prefill-1", request_ids=["lease-b"]) in sent("failure")
        assert Release(to_engine="prefill-1", request_ids=["r2"], reason="client gone") in sent("failure")
        assert all("not engine 'prefill-1'" in e[3] for e in events.of("failure", live.address))
    assert {m.to_engine for m in received if isinstance(m, (Heartbeat, Release))} == {"prefill-0"}


def test_close_does_not_wait_out_a_hung_engine():
    events = _Events()
    with _hung_peer() as (hung, hung_socket):
        before = set(_notifier_threads())
        with _notifier(events) as notifier:
            notifier.send(hung, Done(to_engine="prefill-0", request_ids=["r"]))
            assert hung_socket.poll(WAIT * 1000, zmq.POLLIN)  # the worker is mid-request (60 s timeout)
        # close() returned: its worker ended, without reporting the abandoned request.
        assert [t for t in _notifier_threads() if t not in before] == []
        assert events.log == [] and events.counts == Counter()


def test_an_idle_peer_worker_ends_and_comes_back_when_needed():
    events = _Events()
    with _prefill() as live, _notifier(events, idle_seconds=0.1) as notifier:
        before = set(_notifier_threads())
        notifier.send(live.address, Done(to_engine="prefill-0", request_ids=["first"]))
        events.wait(lambda: len(events.of("reply", live.address)) == 1, "the first reply")
        wait_until(
            lambda: [t for t in _notifier_threads() if t not in before] == [],
            "the notifier's threads to end",
            WAIT,
            observe=lambda: [t.name for t in _notifier_threads() if t not in before],
        )
        notifier.send(live.address, Done(to_engine="prefill-0", request_ids=["second"]))
        events.wait(lambda: len(events.of("reply", live.address)) == 2, "the second reply, from a new worker")


def test_addresses_beyond_max_peers_share_one_overflow_worker():
    # Addresses come from kv_transfer_params, which a client can craft: a flood of
    # distinct ones must not start a thread each.
    events = _Events()
    with (
        _hung_peer() as (hung, hung_socket),
        _prefill() as live,
        _prefill() as other,
        _notifier(events, max_peers=1) as notifier,
    ):
        before = set(_notifier_threads())
        notifier.send(hung, Done(to_engine="prefill-0", request_ids=["to-hung"]))
        assert hung_socket.poll(WAIT * 1000, zmq.POLLIN)
        for address in (live.address, other.address, live.address):
            notifier.send(address, Done(to_engine="prefill-0", request_ids=["r"]))
        events.wait(
            lambda: len(events.of("reply", live.address)) == 2 and events.of("reply", other.address),
            "two replies from the live engine and one from the other",
        )
        assert len([t for t in _notifier_threads() if t not in before]) == 2  # hung's worker + overflow
        assert events.counts["notifier_overflow"] == 3 and events.of("failure", hung) == []
