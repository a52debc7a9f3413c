"""Side-channel connection limits: no host, and no crowd of hosts, holds more connections than allowed.

A real `SideChannelServer` on loopback TCP and real clients: zmq DEALER sockets (the
side channel's own client, and bare ones) and plain TCP sockets that never start a
handshake. Linux routes all of 127.0.0.0/8 to the loopback interface, so clients bound
to 127.0.0.2, 127.0.0.3, ... are different source hosts to the server. Before the
limits, a ROUTER socket took every connection: each extra client here was answered, and
a thousand idle TCP connections held a thousand descriptors.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
from collections.abc import Iterator

import pytest
import zmq

from connectors.settings import ConfigError, ConnectorSettings
from pdconnect.admission import ConnectionTable
from pdconnect.envelope import encode_message
from pdconnect.protocol import Ack, Heartbeat, Message
from pdconnect.sidechannel import NoAnswer, SideChannelClient, SideChannelError, SideChannelServer
from tests.waiting import wait_until

# Generous: an answer that does not come is a failure, never a timing measurement.
ANSWER_WITHIN_S = 10.0
# How long an extra client keeps trying to send: it is cut on each attempt meanwhile.
REFUSED_AFTER_S = 1.0


def _ack(message: Message) -> Message:
    return Ack(unknown=list(getattr(message, "request_ids", [])))


@contextlib.contextmanager
def _serving(per_host: int, total: int) -> Iterator[SideChannelServer]:
    server = SideChannelServer(
        "127.0.0.1", 0, _ack, max_connections=total, max_connections_per_host=per_host, engine_id="prefill-0"
    )
    try:
        yield server
    finally:
        server.close()


def _from(host: str, server: SideChannelServer, timeout: float = ANSWER_WITHIN_S) -> SideChannelClient:
    """A side-channel client whose connections leave from `host` (zmq's `source;endpoint` form)."""
    return SideChannelClient(f"tcp://{host}:0;127.0.0.1:{server.port}", "decode", None, timeout)


def _beat(client: SideChannelClient, tag: str, timeout: float | None = None) -> Message:
    return client.request(Heartbeat(to_engine="prefill-0", request_ids=[tag]), timeout=timeout)


def _refused(client: SideChannelClient) -> bool:
    """True if the client could not get a request through within `REFUSED_AFTER_S`."""
    try:
        _beat(client, "extra", REFUSED_AFTER_S)
    except NoAnswer as exc:
        return "not sent" in str(exc)
    return False


def _newcomer_refused(host: str, server: SideChannelServer) -> bool:
    """True if a new client from `host` is refused (`_refused`)."""
    client = _from(host, server)
    try:
        return _refused(client)
    finally:
        client.close()


def _close(clients: list[SideChannelClient]) -> None:
    for client in clients:
        client.close()


def test_connections_beyond_a_hosts_limit_are_refused_and_closing_frees_them() -> None:
    with _serving(per_host=4, total=64) as server:
        held = [_from("127.0.0.2", server) for _ in range(4)]
        extras = [_from("127.0.0.2", server) for _ in range(3)]
        newcomers: list[SideChannelClient] = []
        try:
            assert [_beat(c, f"held-{i}") for i, c in enumerate(held)] == [Ack(unknown=[f"held-{i}"]) for i in range(4)]
            assert [_refused(c) for c in extras] == [True, True, True]
            counts = server.counts()
            assert counts["connections_over_host_limit"] >= 3 and counts["connections_over_limit"] == 0
            assert counts["received"] == 4 and counts["serve_errors"] == 0
            # The held connections were never disturbed.
            assert [_beat(c, f"again-{i}") for i, c in enumerate(held)] == [
                Ack(unknown=[f"again-{i}"]) for i in range(4)
            ]
            # Two leave and the extras give up: two newcomers get in, one after the other, and a third does not.
            _close(held[:2] + extras)
            newcomers = [_from("127.0.0.2", server) for _ in range(2)]
            assert [_beat(c, f"in-{i}") for i, c in enumerate(newcomers)] == [
                Ack(unknown=["in-0"]),
                Ack(unknown=["in-1"]),
            ]
            assert _newcomer_refused("127.0.0.2", server)
        finally:
            _close(held + extras + newcomers)


def test_the_total_limit_holds_across_hosts_and_frees_as_connections_close() -> None:
    with _serving(per_host=3, total=5) as server:
        first = [_from("127.0.0.2", server) for _ in range(3)]
        second = [_from("127.0.0.3", server) for _ in range(2)]
        late = _from("127.0.0.4", server)
        try:
            for i, client in enumerate(first + second):
                assert _beat(client, f"held-{i}") == Ack(unknown=[f"held-{i}"])
            assert _refused(late)
            counts = server.counts()
            # The total limit kept it out: the listening socket is shut at the cap (it is cut
            # only if it got in before the door shut), and no host limit was reached.
            assert counts["connections_over_host_limit"] == 0
            _close(first[:1])
            assert _beat(late, "late") == Ack(unknown=["late"])
            # Full again: a new host is refused, the ones holding connections still answered.
            assert _newcomer_refused("127.0.0.5", server)
            assert [_beat(c, "still") for c in first[1:] + second] == [Ack(unknown=["still"])] * 4
        finally:
            _close([*first, *second, late])


def _idle_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """Plain TCP connections from `host` that never send zmq's greeting."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN_S, source_address=(host, 0))
        sockets.append(sock)
    return sockets


def _closed_by_server(sockets: list[socket.socket], expected: int) -> int:
    """How many of `sockets` the server closed (end of stream or reset), once `expected` of
    them are (waiting up to `ANSWER_WITHIN_S`)."""
    open_ = {sock.fileno(): sock for sock in sockets}
    closed = 0
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            selector.register(sock, selectors.EVENT_READ)

        def enough_closed() -> bool:
            nonlocal closed
            for key, _ in selector.select(timeout=0.1):
                sock = open_[key.fd]
                try:
                    ended = sock.recv(4096) == b""  # zmq's greeting comes first: read past it
                except (ConnectionResetError, BrokenPipeError):
                    ended = True
                if ended:
                    selector.unregister(sock)
                    closed += 1
            return closed >= expected

        wait_until(
            enough_closed, f"the server to close {expected} connections", ANSWER_WITHIN_S, observe=lambda: closed
        )
    return closed


def test_a_connection_flood_from_one_host_is_cut_while_other_hosts_are_answered() -> None:
    """A flooding host has 30 zmq clients that keep reconnecting and opens 300 TCP
    connections that never handshake; meanwhile three clients on another host open their
    connections and send 20 heartbeats each. Every heartbeat is answered, a new client
    from the flooding host is refused, and the server closes all but 8 of the flood's
    TCP connections (before the limits, it held all 300 until zmq's 30 s handshake timer)."""
    per_host = 8
    with _serving(per_host=per_host, total=256) as server:
        context = zmq.Context()
        flooders = []
        for _ in range(30):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.2:0;127.0.0.1:{server.port}")
            flooders.append(dealer)
        idle = _idle_connections("127.0.0.2", server.port, 300)
        others = [_from("127.0.0.3", server) for _ in range(3)]
        try:
            assert _newcomer_refused("127.0.0.2", server)
            answered = [_beat(c, f"{n}-{i}") for i in range(20) for n, c in enumerate(others)]
            assert answered == [Ack(unknown=[f"{n}-{i}"]) for i in range(20) for n in range(3)]
            assert _closed_by_server(idle, 300 - per_host) >= 300 - per_host
            counts = server.counts()
            assert counts["connections_over_host_limit"] >= 300 - per_host
            assert counts["received"] == 60 and counts["serve_errors"] == 0
        finally:
            _close(others)
            for sock in idle:
                sock.close()
            for dealer in flooders:
                dealer.close()
            context.term()


def test_no_connection_beyond_the_limit_carries_a_message() -> None:
    """Bare zmq clients that queue a valid heartbeat before connecting (no `IMMEDIATE`)
    would deliver it on any handshake that succeeds: none may, while the host is full."""
    with _serving(per_host=2, total=64) as server:
        held = [_from("127.0.0.2", server) for _ in range(2)]
        context = zmq.Context()
        extras = []
        try:
            assert [_beat(c, "held") for c in held] == [Ack(unknown=["held"])] * 2
            for _ in range(10):
                dealer = context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://127.0.0.2:0;127.0.0.1:{server.port}")
                dealer.send(encode_message(Heartbeat(to_engine="prefill-0", request_ids=["extra"]), "decode", None))
                extras.append(dealer)
            # Each extra is cut every time it reconnects (every 100 ms).
            wait_until(
                lambda: server.counts()["connections_over_host_limit"] >= 50,
                "50 cuts of the extra connections",
                ANSWER_WITHIN_S,
                observe=server.counts,
            )
            counts = server.counts()
            assert counts["received"] == 2 and not any(dealer.poll(0) for dealer in extras)
        finally:
            _close(held)
            for dealer in extras:
                dealer.close()
            context.term()


def test_a_host_whose_idle_connections_close_gets_its_slots_back() -> None:
    with _serving(per_host=2, total=64) as server:
        idle = _idle_connections("127.0.0.2", server.port, 2)
        client = _from("127.0.0.2", server)
        try:
            assert _refused(client)
            for sock in idle:
                sock.close()
            assert _beat(client, "in") == Ack(unknown=["in"])
        finally:
            client.close()


# --- the table and its settings -------------------------------------------------------


def test_the_table_counts_per_host_and_in_all_and_forgets_closed_connections() -> None:
    table = ConnectionTable(max_connections=3, max_per_host=2)
    assert [table.add(10, "a"), table.add(11, "a"), table.add(12, "a")] == [None, None, "host"]
    assert [table.add(13, "b"), table.add(14, "c")] == [None, "total"]
    assert len(table) == 3 and not table.holds("c")
    table.remove(12)  # refused: nothing was counted
    assert len(table) == 3
    table.remove(10)
    assert table.add(14, "c") is None and table.holds("c")
    table.remove(11)
    assert not table.holds("a")
    # A descriptor number reused before its close was seen counts once, for its new host.
    assert table.add(13, "d") is None and not table.holds("b") and len(table) == 2


@pytest.mark.parametrize(("per_host", "total"), [(0, 10), (11, 10), (-1, -1)])
def test_limits_must_be_positive_and_the_host_limit_within_the_total(per_host: int, total: int) -> None:
    with pytest.raises(SideChannelError, match="max_connections_per_host"):
        SideChannelServer(
            "127.0.0.1", 0, _ack, max_connections=total, max_connections_per_host=per_host, engine_id="prefill-0"
        )
    with pytest.raises(ConfigError, match="side_channel_max_connections"):
        ConnectorSettings.from_extra_config(
            {"side_channel_max_connections": total, "side_channel_max_connections_per_host": per_host}
        )


def test_the_limits_are_read_from_the_connector_config() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"side_channel_max_connections": 100, "side_channel_max_connections_per_host": 7}
    )
    assert (settings.side_channel_max_connections, settings.side_channel_max_connections_per_host) == (100, 7)
