"""Side-channel faults: nothing a peer sends ends the serving thread, slips past the envelope or starves peers.

Each test sends one kind of stray or hostile traffic straight at a `SideChannelServer`
over zmq, checks how it was answered and counted, and then that the server still
answers an ordinary request (before the fix, a REQ socket's three frames killed the
thread and every later handshake and heartbeat timed out). The flood tests run a
flooder in another process while a real client's heartbeats must all be answered
within the deadline a decode engine gives them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.utils.monitor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.settings import ConnectorSettings
from pdconnect.envelope import encode_message, new_nonce, open_envelope
from pdconnect.keyring import Keyring
from pdconnect.protocol import PROTOCOL_VERSION, Ack, Claim, Done, Heartbeat, Message, Refusal, Release
from pdconnect.sidechannel import SideChannelClient, SideChannelError, SideChannelServer, is_loopback_host
from pdconnect.testbed.keys import SECRETS, keyring
from tests.waiting import wait_until

PREFILL, DECODE = keyring("prefill"), keyring("decode")
# Generous: a reply that does not come is a failure, never a timing measurement.
REPLY_WAIT_MS = 10_000
# What a decode engine gives a heartbeat before it counts it undelivered (its notifier's
# per-message deadline): the promise the flood tests hold the server to.
HEARTBEAT_DEADLINE_S = ConnectorSettings().handshake_timeout_seconds
# No budget limit: tests that count one refusal per message send more than a connection may.
UNLIMITED = {"refusal_burst": 1 << 30}


class _Recorder:
    """A handler that acknowledges every message and remembers what it was given."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def __call__(self, message: Message) -> Message:
        self.seen.append(message)
        return Ack(unknown=list(getattr(message, "request_ids", [])))


@contextlib.contextmanager
def _serving(keys: Keyring | None = PREFILL, **options) -> Iterator[tuple[SideChannelServer, _Recorder]]:
    handler = _Recorder()
    server = SideChannelServer("127.0.0.1", 0, handler, keys, **options, engine_id="prefill-0")
    try:
        yield server, handler
    finally:
        server.close()


@contextlib.contextmanager
def _raw(address: str, kind: int = zmq.DEALER) -> Iterator[zmq.Socket]:
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        yield socket
    finally:
        socket.close()


def _client_keys(server_keys: Keyring | None) -> Keyring | None:
    return DECODE if server_keys is not None else None


def _signed(message: Message, **options) -> bytes:
    return encode_message(message, "decode", DECODE, **options)


def _reply(socket: zmq.Socket, keys: Keyring | None = DECODE) -> Message:
    """The next reply on a raw socket (its last frame), decoded."""
    assert socket.poll(REPLY_WAIT_MS, zmq.POLLIN), "the server did not answer"
    return open_envelope(socket.recv_multipart()[-1], keys, "reply").message


def _still_serves(server: SideChannelServer, keys: Keyring | None = DECODE) -> None:
    client = SideChannelClient(server.address, "decode", keys, timeout=REPLY_WAIT_MS / 1000)
    try:
        assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["alive"])) == Ack(unknown=["alive"])
    finally:
        client.close()


# --- frames -----------------------------------------------------------------------


def test_a_req_socket_is_refused_and_the_server_keeps_serving():
    # A REQ socket sends [b"", data]: the ROUTER sees three frames. Before the fix this
    # unpacking error ended the serving thread and the next handshake timed out.
    with _serving() as (server, handler), _raw(server.address, zmq.REQ) as req:
        req.send(_signed(Heartbeat(to_engine="prefill-0", request_ids=["r"])))
        reply = _reply(req)
        assert isinstance(reply, Refusal) and "exactly one frame" in reply.reason
        _still_serves(server)
        assert handler.seen == [Heartbeat(to_engine="prefill-0", request_ids=["alive"])]
        assert server.counts()["refused_frames"] == 1


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b""],
        [b"", _signed(Heartbeat(to_engine="prefill-0", request_ids=[]))],  # a REQ envelope sent by hand
        [_signed(Heartbeat(to_engine="prefill-0", request_ids=[]))] * 2,
        [b"x"] * 10,
        [b""] * 10,
    ],
    ids=["two-empty", "req-like", "two-valid", "ten", "ten-empty"],
)
def test_every_wrong_frame_count_is_refused_and_counted(frames):
    with _serving() as (server, handler), _raw(server.address) as dealer:
        dealer.send_multipart(frames)
        reply = _reply(dealer)
        assert reply == Refusal(reason=f"expected exactly one frame per message, got {len(frames)}")
        _still_serves(server)
        assert server.counts()["refused_frames"] == 1 and len(handler.seen) == 1


def _unanswered_then_served(dealer: zmq.Socket) -> None:
    """Replies come in order: if the next one answers this heartbeat, what came before got none."""
    dealer.send(_signed(Heartbeat(to_engine="prefill-0", request_ids=["after"])))
    assert _reply(dealer) == Ack(unknown=["after"])


def test_an_empty_frame_is_a_malformed_envelope_left_unanswered():
    # It names no request, so no client can be waiting for its refusal.
    with _serving() as (server, _), _raw(server.address) as dealer:
        dealer.send(b"")
        _unanswered_then_served(dealer)
        assert server.counts()["refused_malformed"] == 1


# --- size -------------------------------------------------------------------------


def test_an_oversized_message_is_cut_by_zmq_before_the_server_reads_it():
    # Before the fix any size was read into memory and decoded (a 51 MB message cost
    # 350 MB before any check). Now zmq drops the sender's connection at the limit: the
    # message never reaches the serving thread, and the sender can reconnect.
    with _serving(max_message_bytes=64 << 10) as (server, handler), _raw(server.address) as dealer:
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            dealer.send(_signed(Heartbeat(to_engine="prefill-0", request_ids=["x" * (1 << 20)])))
            assert monitor.poll(REPLY_WAIT_MS, zmq.POLLIN), "the server kept the connection"
            assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            dealer.disable_monitor()
            monitor.close()
        counts = server.counts()
        # Nothing was read or refused; the close itself is counted (once the server has seen it).
        assert handler.seen == [] and sum(v for k, v in counts.items() if k != "connections_closed") == 0
        # Just under the limit is served, on the connection zmq re-establishes.
        dealer.send(_signed(Heartbeat(to_engine="prefill-0", request_ids=["y" * (60 << 10)])))
        assert _reply(dealer) == Ack(unknown=["y" * (60 << 10)])
        _still_serves(server)


# --- authentication, replay, freshness ---------------------------------------------


def test_forged_and_tampered_messages_are_refused_without_reaching_the_handler():
    genuine = msgspec.msgpack.decode(_signed(Heartbeat(to_engine="prefill-0", request_ids=["lease"])))
    tampered_body = {**genuine, "body": msgspec.msgpack.encode(Heartbeat(to_engine="prefill-0", request_ids=["other"]))}
    forged = [
        encode_message(
            Heartbeat(to_engine="prefill-0", request_ids=["lease"]), "decode", keyring("decode", secret="g" * 32)
        ),
        encode_message(Heartbeat(to_engine="prefill-0", request_ids=["lease"]), "decode"),  # unsigned
        encode_message(
            Heartbeat(to_engine="prefill-0", request_ids=["lease"]), "router", keyring("router")
        ),  # the router's key
        msgspec.msgpack.encode(tampered_body),
        msgspec.msgpack.encode({**genuine, "sender": "router"}),
    ]
    with _serving() as (server, handler), _raw(server.address) as dealer:
        for data in forged[:2] + forged[3:]:
            dealer.send(data)
            reply = _reply(dealer)
            assert isinstance(reply, Refusal) and "authentication failed" in reply.reason
        dealer.send(forged[2])
        reply = _reply(dealer)
        assert isinstance(reply, Refusal) and "a router may not send Heartbeat" in reply.reason
        # An id of the wrong size is no id: refused as malformed, and nobody to answer.
        dealer.send(msgspec.msgpack.encode({**genuine, "nonce": b"\x00" * 3}))
        _unanswered_then_served(dealer)
        assert handler.seen == [Heartbeat(to_engine="prefill-0", request_ids=["after"])]
        counts = server.counts()
        assert counts["refused_unauthenticated"] == len(forged) - 1
        assert counts["refused_forbidden"] == 1 and counts["refused_malformed"] == 1
        _still_serves(server)


def test_a_captured_heartbeat_cannot_be_replayed_to_keep_a_lease_alive():
    # Before the fix the same bytes were accepted every time, so a recorded heartbeat
    # kept a lease alive forever.
    captured = _signed(Heartbeat(to_engine="prefill-0", request_ids=["lease"]))
    with _serving() as (server, handler), _raw(server.address) as dealer:
        replies = []
        for _ in range(3):
            dealer.send(captured)
            replies.append(_reply(dealer))
        assert replies[0] == Ack(unknown=["lease"])
        assert all(isinstance(r, Refusal) and "replayed" in r.reason for r in replies[1:])
        assert handler.seen == [Heartbeat(to_engine="prefill-0", request_ids=["lease"])]
        assert server.counts()["refused_replayed"] == 2
        _still_serves(server)


def test_a_lease_message_for_another_engine_is_refused_without_reaching_the_handler():
    """Issue 35: lease and request ids are unique per engine only, so a signed, fresh
    notice meant for engine prefill-1 must not act on prefill-0's lease of the same id."""
    elsewhere = [
        ("decode", DECODE, Heartbeat(to_engine="prefill-1", request_ids=["lease"])),
        ("decode", DECODE, Claim(to_engine="prefill-1", lease_id="lease", claimant="d/r", plan_digest="p")),
        ("decode", DECODE, Done(to_engine="prefill-1", request_ids=["lease"])),
        ("decode", DECODE, Release(to_engine="prefill-1", request_ids=["lease"], reason="aborted")),
        ("router", keyring("router"), Release(to_engine="prefill-1", request_ids=["r"], reason="client gone")),
        ("router", keyring("router"), Release(to_engine="", request_ids=["r"], reason="client gone")),
    ]
    with _serving(**UNLIMITED) as (server, handler), _raw(server.address) as dealer:
        for role, keys, message in elsewhere:
            dealer.send(encode_message(message, role, keys))
            reply = _reply(dealer)
            assert isinstance(reply, Refusal) and f"not engine {message.to_engine!r}" in reply.reason, message
        assert handler.seen == []
        assert server.counts()["refused_wrong_engine"] == len(elsewhere)
        here = Release(to_engine="prefill-0", request_ids=["r"], reason="client gone")
        dealer.send(encode_message(here, "router", keyring("router")))
        assert _reply(dealer) == Ack(unknown=["r"]) and handler.seen == [here]
        _still_serves(server)


def test_a_server_needs_the_id_of_the_engine_it_serves():
    with pytest.raises(SideChannelError, match="id of the engine"):
        SideChannelServer("127.0.0.1", 0, _Recorder(), PREFILL, engine_id="")


def test_stale_and_future_messages_are_refused_inside_the_skew_window_accepted():
    now = time.time()
    with _serving(max_age_seconds=30.0) as (server, handler), _raw(server.address) as dealer:
        for sent_at, accepted in ((now - 3600, False), (now + 3600, False), (now - 10, True), (now + 10, True)):
            dealer.send(_signed(Heartbeat(to_engine="prefill-0", request_ids=["lease"]), now=sent_at))
            reply = _reply(dealer)
            if accepted:
                assert reply == Ack(unknown=["lease"])
            else:
                assert isinstance(reply, Refusal) and "stale" in reply.reason
        assert len(handler.seen) == 2 and server.counts()["refused_stale"] == 2
        _still_serves(server)


# --- refusals say nothing local -----------------------------------------------------


def test_refusals_do_not_echo_local_values():
    def leaky(message: Message) -> Message:
        raise RuntimeError(f"cannot open /etc/pdconnect/{SECRETS['prefill']}")

    server = SideChannelServer("127.0.0.1", 0, leaky, PREFILL, engine_id="prefill-0")
    try:
        client = SideChannelClient(server.address, "decode", DECODE, timeout=REPLY_WAIT_MS / 1000)
        # Before the fix: "internal error: cannot open /etc/pdconnect/<secret>".
        with pytest.raises(SideChannelError) as info:
            client.request(Heartbeat(to_engine="prefill-0", request_ids=["r"]))
        client.close()
        assert str(info.value).endswith("refused Heartbeat: internal error")
        with _raw(server.address) as dealer:
            # Before the fix: "side-channel protocol version 7, expected 1".
            dealer.send(msgspec.msgpack.encode({"version": PROTOCOL_VERSION + 6, "body": b"", "nonce": new_nonce()}))
            reply = _reply(dealer)
        assert reply == Refusal(reason=f"unsupported side-channel protocol version {PROTOCOL_VERSION + 6}")
        assert server.counts()["handler_errors"] == 1 and server.counts()["refused_version"] == 1
    finally:
        server.close()


# --- random traffic (property-based) -------------------------------------------------


# Random msgpack-able values: envelopes and bodies with the right shape but any content.
_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.binary(max_size=64)
    | st.text(max_size=32),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
_envelope_like = st.fixed_dictionaries(
    {"version": st.sampled_from([PROTOCOL_VERSION]) | st.integers(-5, 5)},
    optional={
        "body": st.binary(max_size=128) | _msgpack_values.map(msgspec.msgpack.encode),
        "sender": st.sampled_from(["prefill", "decode", "router", "boss"]) | _msgpack_values,
        "direction": st.sampled_from(["request", "reply"]) | _msgpack_values,
        "signature": st.binary(max_size=80),
        "key_id": st.binary(max_size=12),
        "nonce": st.binary(min_size=14, max_size=18),
        "reply_to": st.binary(max_size=40),
        "sent_at": st.floats(),
        "type": st.text(max_size=10),
    },
).map(msgspec.msgpack.encode)
_frames = st.lists(
    st.binary(max_size=256) | _envelope_like | _msgpack_values.map(msgspec.msgpack.encode), min_size=1, max_size=12
)


# Counters of rounds and connections, not of messages: a loaded machine may count a late
# round in the middle of a message count.
_NOT_MESSAGES = frozenset(
    ("late_rounds", "connections_closed", "connections_over_host_limit", "connections_over_limit")
)


def _messages(counts: dict[str, int]) -> int:
    return sum(value for name, value in counts.items() if name not in _NOT_MESSAGES)


def _counted(server: SideChannelServer, total: int) -> dict[str, int]:
    """The counters once they account for `total` messages (each is counted exactly once)."""
    wait_until(
        lambda: _messages(server.counts()) >= total,
        f"the server to count {total} messages",
        REPLY_WAIT_MS / 1000,
        observe=server.counts,
        poll_s=0.001,  # once per message of a thousand-example property
    )
    counts = server.counts()
    assert _messages(counts) == total, counts
    return counts


class _Tracebacks(logging.Handler):
    """Every record logged with an exception attached, from any pdconnect logger."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        if record.exc_info:
            self.records.append(record)


@pytest.fixture
def tracebacks() -> Iterator[_Tracebacks]:
    handler = _Tracebacks()
    logger = logging.getLogger("pdconnect")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("keys", [PREFILL, None], ids=["keys", "no-keys"])
def test_random_traffic_is_refused_message_by_message_and_never_kills_the_server(keys, tracebacks):
    with _serving(keys, **UNLIMITED) as (server, handler), _raw(server.address) as dealer:
        sent = [0]

        @settings(
            max_examples=1000,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(frames=_frames)
        def one_message(frames: list[bytes]) -> None:
            dealer.send_multipart(frames)
            sent[0] += 1
            _counted(server, sent[0])
            # Whatever was answered is a refusal: nothing random passes as a valid message.
            while dealer.poll(0, zmq.POLLIN):
                assert isinstance(_reply(dealer, _client_keys(keys)), Refusal)

        one_message()
        assert handler.seen == [] and tracebacks.records == []
        counts = server.counts()
        assert counts["serve_errors"] == 0 and counts["handler_errors"] == 0 and counts["received"] == 0
        _still_serves(server, _client_keys(keys))


def _shapes() -> dict[str, bytes]:
    """One envelope of every malformed shape, each with a readable id where it can have one."""
    genuine = msgspec.msgpack.decode(_signed(Heartbeat(to_engine="prefill-0", request_ids=["lease"])))
    valid = msgspec.msgpack.encode(genuine)
    shapes = {
        f"reply_to-{size}": msgspec.msgpack.encode({**genuine, "reply_to": b"r" * size})
        for size in (0, 15, 17, 65_535, 65_536, 65_537, 1 << 20)
    }
    for field, value in (
        ("version", "3"),
        ("version", 2**64 - 1),
        ("sender", 7),
        ("sender", "boss"),
        ("direction", "sideways"),
        ("body", "text"),
        ("body", b"\xc1"),
        ("sent_at", "now"),
        ("key_id", b"k" * 7),
        ("key_id", b"k" * 1000),
        ("signature", b"s" * 63),
        ("signature", b"s" * 100_000),
        ("nonce", b"n" * 100_000),
        ("nonce", 5),
    ):
        shapes[f"{field}-{str(value)[:12]}"] = msgspec.msgpack.encode({**genuine, field: value})
    for cut in (1, 2, 10, len(valid) // 2, len(valid) - 1):
        shapes[f"truncated-{cut}"] = valid[:cut]
    shapes["random"] = os.urandom(512)
    shapes["nested"] = b"\x91" * 100_000 + b"\xc0"  # a list in a list in a list ...
    shapes["not-a-map"] = msgspec.msgpack.encode([1, 2, 3])
    return shapes


SHAPES = _shapes()


@pytest.mark.parametrize("keys", [PREFILL, None], ids=["keys", "no-keys"])
def test_every_malformed_shape_is_one_counted_refusal_and_no_traceback(keys, tracebacks):
    """Before the fix, a `reply_to` of 64 KiB or more raised inside the MAC's struct packing:
    a traceback and a 10 ms sleep per message, counted as a serving-loop error."""
    with _serving(keys, **UNLIMITED) as (server, handler), _raw(server.address) as dealer:
        for total, (name, data) in enumerate(SHAPES.items(), start=1):
            dealer.send(data)
            counts = _counted(server, total)
            assert counts["serve_errors"] == 0 and counts["received"] == 0, name
        while dealer.poll(100, zmq.POLLIN):
            assert isinstance(_reply(dealer, _client_keys(keys)), Refusal)
        assert tracebacks.records == [] and handler.seen == []
        _still_serves(server, _client_keys(keys))


def _flood(address: str, connections: int, stop: multiprocessing.synchronize.Event) -> None:
    """Another process: malformed envelopes on many connections, as fast as it can, never reading."""
    context = zmq.Context()
    sockets = []
    for _ in range(connections):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.connect(address)
        sockets.append(socket)
    junk = list(SHAPES.values())
    sent = 0
    while not stop.is_set():
        for socket in sockets:
            with contextlib.suppress(zmq.Again):
                socket.send(junk[sent % len(junk)], zmq.NOBLOCK)
            sent += 1
    for socket in sockets:
        socket.close()
    context.term()


@pytest.mark.parametrize("keys", [PREFILL, None], ids=["keys", "no-keys"])
def test_a_flood_of_malformed_envelopes_does_not_starve_a_live_client(keys, tracebacks):
    """A flooder on 16 connections while a decode engine heartbeats: every heartbeat is
    answered within the deadline its notifier gives it, the flood is counted (refused, then
    dropped unread past each connection's budget), and the log gets a line per reason
    per period, not one per message. Before the fix, each flooded envelope with a long
    `reply_to` logged a traceback and slept 10 ms in the serving loop (59 of them in half a
    second of one such flood, measured on the old code), and nothing bounded a connection's
    share of the serving thread but zmq's turn-taking."""
    with _serving(keys) as (server, handler):
        stop = multiprocessing.get_context("spawn").Event()
        flooder = multiprocessing.get_context("spawn").Process(target=_flood, args=(server.address, 16, stop))
        flooder.start()
        client = SideChannelClient(server.address, "decode", _client_keys(keys), timeout=HEARTBEAT_DEADLINE_S)
        try:
            wait_until(
                lambda: _messages(server.counts()) >= 1000,
                "the flood to be on (1000 messages counted)",
                REPLY_WAIT_MS / 1000,
                observe=server.counts,
            )
            answered = [client.request(Heartbeat(to_engine="prefill-0", request_ids=[f"beat-{i}"])) for i in range(20)]
        finally:
            client.close()
            stop.set()
            flooder.join(timeout=30)
        assert answered == [Ack(unknown=[f"beat-{i}"]) for i in range(20)]
        counts = server.counts()
        refused = sum(v for k, v in counts.items() if k.startswith("refused_"))
        assert refused > 0 and counts["dropped_over_budget"] > 0 and counts["serve_errors"] == 0
        assert counts["received"] == 20 and len(handler.seen) == 20
        assert tracebacks.records == []
        # Each refusal reason and the drops log at most once per period (the test runs a few).
        assert tracebacks.lines < 50, tracebacks.lines


# --- binding -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("*", False),
        ("10.0.0.7", False),
        ("prefill-0.pd.svc", False),
        ("eth0", False),
    ],
)
def test_loopback_hosts_are_recognised(host, loopback):
    assert is_loopback_host(host) is loopback


def test_a_reachable_bind_without_keys_refuses_to_start_unless_opted_out():
    # Before the fix this bound 0.0.0.0 silently, unauthenticated.
    with pytest.raises(SideChannelError, match="without keys") as info:
        SideChannelServer("0.0.0.0", 0, _Recorder(), engine_id="prefill-0")
    assert "allow_insecure_side_channel" in str(info.value)
    with pytest.raises(SideChannelError, match="answers as prefill"):
        SideChannelServer("127.0.0.1", 0, _Recorder(), DECODE, engine_id="prefill-0")
    for keys, allow_insecure in ((PREFILL, False), (None, True)):
        server = SideChannelServer(
            "0.0.0.0", 0, _Recorder(), keys, allow_insecure=allow_insecure, engine_id="prefill-0"
        )
        try:
            # Served on every interface, so also on loopback.
            client = SideChannelClient(
                f"tcp://127.0.0.1:{server.port}", "decode", _client_keys(keys), timeout=REPLY_WAIT_MS / 1000
            )
            assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["a"])) == Ack(unknown=["a"])
            client.close()
        finally:
            server.close()
