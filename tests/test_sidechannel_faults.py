"""Side-channel faults: nothing a peer sends ends the prefill engine's serving thread or slips past the envelope.

Each test sends one kind of stray or hostile traffic straight at a `SideChannelServer`
over zmq, checks how it was answered and counted, and then that the server still
answers an ordinary request (before the fix, a REQ socket's three frames killed the
thread and every later handshake and heartbeat timed out).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.utils.monitor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdconnect.envelope import decode_message, encode_message
from pdconnect.protocol import PROTOCOL_VERSION, Ack, Heartbeat, Message, Refusal
from pdconnect.sidechannel import SideChannelClient, SideChannelError, SideChannelServer, is_loopback_host

SECRET = b"side-channel-test-secret"
# Generous: a reply that does not come is a failure, never a timing measurement.
REPLY_WAIT_MS = 10_000


class _Recorder:
    """A handler that acknowledges every message and remembers what it was given."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def __call__(self, message: Message) -> Message:
        self.seen.append(message)
        return Ack(unknown=list(getattr(message, "request_ids", [])))


@contextlib.contextmanager
def _serving(secret: bytes | None = SECRET, **options) -> Iterator[tuple[SideChannelServer, _Recorder]]:
    handler = _Recorder()
    server = SideChannelServer("127.0.0.1", 0, handler, secret, **options)
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


def _reply(socket: zmq.Socket, secret: bytes | None = SECRET) -> Message:
    """The next reply on a raw socket (its last frame), decoded."""
    assert socket.poll(REPLY_WAIT_MS, zmq.POLLIN), "the server did not answer"
    return decode_message(socket.recv_multipart()[-1], secret)


def _still_serves(server: SideChannelServer, secret: bytes | None = SECRET) -> None:
    client = SideChannelClient(server.address, secret, timeout=REPLY_WAIT_MS / 1000)
    try:
        assert client.request(Heartbeat(request_ids=["alive"])) == Ack(unknown=["alive"])
    finally:
        client.close()


# --- frames -----------------------------------------------------------------------


def test_a_req_socket_is_refused_and_the_server_keeps_serving():
    # A REQ socket sends [b"", data]: the ROUTER sees three frames. Before the fix this
    # unpacking error ended the serving thread and the next handshake timed out.
    with _serving() as (server, handler), _raw(server.address, zmq.REQ) as req:
        req.send(encode_message(Heartbeat(request_ids=["r"]), SECRET))
        reply = _reply(req)
        assert isinstance(reply, Refusal) and "exactly one frame" in reply.reason
        _still_serves(server)
        assert handler.seen == [Heartbeat(request_ids=["alive"])]
        assert server.counts()["refused_frames"] == 1


@pytest.mark.parametrize("frames", [
    [b"", b""],
    [b"", encode_message(Ack(), SECRET)],  # a REQ envelope sent by hand
    [encode_message(Ack(), SECRET)] * 2,
    [b"x"] * 10,
    [b""] * 10,
], ids=["two-empty", "req-like", "two-valid", "ten", "ten-empty"])
def test_every_wrong_frame_count_is_refused_and_counted(frames):
    with _serving() as (server, handler), _raw(server.address) as dealer:
        dealer.send_multipart(frames)
        reply = _reply(dealer)
        assert reply == Refusal(reason=f"expected exactly one frame per message, got {len(frames)}")
        _still_serves(server)
        assert server.counts()["refused_frames"] == 1 and len(handler.seen) == 1


def test_an_empty_frame_is_a_malformed_envelope():
    with _serving() as (server, _), _raw(server.address) as dealer:
        dealer.send(b"")
        reply = _reply(dealer)
        assert isinstance(reply, Refusal) and "malformed side-channel envelope" in reply.reason
        _still_serves(server)
        assert server.counts()["refused_malformed"] == 1


# --- size -------------------------------------------------------------------------


def test_an_oversized_message_is_cut_by_zmq_before_the_server_reads_it():
    # Before the fix any size was read into memory and decoded (a 51 MB message cost
    # 350 MB before any check). Now zmq drops the sender's connection at the limit: the
    # message never reaches the serving thread, and the sender can reconnect.
    with _serving(max_message_bytes=64 << 10) as (server, handler), _raw(server.address) as dealer:
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            dealer.send(encode_message(Heartbeat(request_ids=["x" * (1 << 20)]), SECRET))
            assert monitor.poll(REPLY_WAIT_MS, zmq.POLLIN), "the server kept the connection"
            assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            dealer.disable_monitor()
            monitor.close()
        assert handler.seen == [] and sum(server.counts().values()) == 0
        # Just under the limit is served, on the connection zmq re-establishes.
        dealer.send(encode_message(Heartbeat(request_ids=["y" * (60 << 10)]), SECRET))
        assert _reply(dealer) == Ack(unknown=["y" * (60 << 10)])
        _still_serves(server)


# --- authentication, replay, freshness ---------------------------------------------


def test_forged_and_tampered_messages_are_refused_without_reaching_the_handler():
    genuine = msgspec.msgpack.decode(encode_message(Heartbeat(request_ids=["lease"]), SECRET))
    tampered_body = {**genuine, "body": msgspec.msgpack.encode(Heartbeat(request_ids=["other"]))}
    forged = [
        encode_message(Heartbeat(request_ids=["lease"]), b"guessed"),
        encode_message(Heartbeat(request_ids=["lease"])),  # unsigned
        msgspec.msgpack.encode(tampered_body),
        msgspec.msgpack.encode({**genuine, "nonce": b"\x00" * 3}),
    ]
    with _serving() as (server, handler), _raw(server.address) as dealer:
        for data in forged:
            dealer.send(data)
            reply = _reply(dealer)
            assert isinstance(reply, Refusal) and "authentication failed" in reply.reason
        assert handler.seen == []
        assert server.counts()["refused_unauthenticated"] == len(forged)
        _still_serves(server)


def test_a_captured_heartbeat_cannot_be_replayed_to_keep_a_lease_alive():
    # Before the fix the same bytes were accepted every time, so a recorded heartbeat
    # kept a lease alive forever.
    captured = encode_message(Heartbeat(request_ids=["lease"]), SECRET)
    with _serving() as (server, handler), _raw(server.address) as dealer:
        replies = []
        for _ in range(3):
            dealer.send(captured)
            replies.append(_reply(dealer))
        assert replies[0] == Ack(unknown=["lease"])
        assert all(isinstance(r, Refusal) and "replayed" in r.reason for r in replies[1:])
        assert handler.seen == [Heartbeat(request_ids=["lease"])]
        assert server.counts()["refused_replayed"] == 2
        _still_serves(server)


def test_stale_and_future_messages_are_refused_inside_the_skew_window_accepted():
    now = time.time()
    with _serving(max_age_seconds=30.0) as (server, handler), _raw(server.address) as dealer:
        for sent_at, accepted in ((now - 3600, False), (now + 3600, False), (now - 10, True), (now + 10, True)):
            dealer.send(encode_message(Heartbeat(request_ids=["lease"]), SECRET, now=sent_at))
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
        raise RuntimeError(f"cannot open /etc/pdconnect/{SECRET.decode()}")

    server = SideChannelServer("127.0.0.1", 0, leaky, SECRET)
    try:
        client = SideChannelClient(server.address, SECRET, timeout=REPLY_WAIT_MS / 1000)
        # Before the fix: "internal error: cannot open /etc/pdconnect/<secret>".
        with pytest.raises(SideChannelError) as info:
            client.request(Heartbeat(request_ids=["r"]))
        client.close()
        assert str(info.value).endswith("refused Heartbeat: internal error")
        with _raw(server.address) as dealer:
            # Before the fix: "side-channel protocol version 7, expected 1".
            dealer.send(msgspec.msgpack.encode({"version": PROTOCOL_VERSION + 6, "body": b""}))
            reply = _reply(dealer)
        assert reply == Refusal(reason=f"unsupported side-channel protocol version {PROTOCOL_VERSION + 6}")
        assert server.counts()["handler_errors"] == 1 and server.counts()["refused_version"] == 1
    finally:
        server.close()


# --- random traffic (property-based) -------------------------------------------------


# Random msgpack-able values: envelopes and bodies with the right shape but any content.
_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.binary(max_size=64)
    | st.text(max_size=32),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
_envelope_like = st.fixed_dictionaries(
    {"version": st.sampled_from([PROTOCOL_VERSION]) | st.integers(-5, 5)},
    optional={"body": st.binary(max_size=128) | _msgpack_values.map(msgspec.msgpack.encode),
              "mac": st.binary(max_size=40), "nonce": st.binary(max_size=20), "sent_at": st.floats(),
              "type": st.text(max_size=10)},
).map(msgspec.msgpack.encode)
_frames = st.lists(st.binary(max_size=256) | _envelope_like | _msgpack_values.map(msgspec.msgpack.encode),
                   min_size=1, max_size=12)


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
def test_random_traffic_is_refused_message_by_message_and_never_kills_the_server(secret):
    with _serving(secret) as (server, handler), _raw(server.address) as dealer:
        @settings(max_examples=1000, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(frames=_frames)
        def one_message(frames: list[bytes]) -> None:
            dealer.send_multipart(frames)
            # One reply per message, in order: nothing random passes as a valid message.
            assert isinstance(_reply(dealer, secret), Refusal)

        one_message()
        assert handler.seen == []
        counts = server.counts()
        assert counts["serve_errors"] == 0 and counts["handler_errors"] == 0
        assert sum(counts.values()) >= 1000
        _still_serves(server, secret)


# --- binding -----------------------------------------------------------------------


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("*", False), ("10.0.0.7", False),
    ("prefill-0.pd.svc", False), ("eth0", False),
])
def test_loopback_hosts_are_recognised(host, loopback):
    assert is_loopback_host(host) is loopback


def test_a_reachable_bind_without_a_secret_refuses_to_start_unless_opted_out():
    # Before the fix this bound 0.0.0.0 silently, unauthenticated.
    with pytest.raises(SideChannelError, match="without a secret") as info:
        SideChannelServer("0.0.0.0", 0, _Recorder())
    assert "allow_insecure_side_channel" in str(info.value)
    for secret, allow_insecure in ((SECRET, False), (None, True)):
        server = SideChannelServer("0.0.0.0", 0, _Recorder(), secret, allow_insecure=allow_insecure)
        try:
            # Served on every interface, so also on loopback.
            client = SideChannelClient(f"tcp://127.0.0.1:{server.port}", secret, timeout=REPLY_WAIT_MS / 1000)
            assert client.request(Heartbeat(request_ids=["a"])) == Ack(unknown=["a"])
            client.close()
        finally:
            server.close()
