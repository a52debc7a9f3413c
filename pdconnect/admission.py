"""Connection limits for the side-channel server: how many connections one host, and all hosts, may hold.

zmq's ROUTER socket accepts every TCP connection and hands none of them to the
application, so on its own nothing bounds how many a peer opens: each holds a file
descriptor, and each that completes its handshake a session, pipes and buffers. This
module bounds them with the two hooks zmq offers, both served by the side-channel
server's own thread (`ConnectionGate.serve`):

- a socket monitor reports every accepted connection (with its file descriptor) and
  every closed one. `ConnectionTable` counts the open ones per source address; one
  beyond `max_per_host` for its host, or beyond `max_connections` in all, is cut at
  once (`shutdown` on the descriptor: zmq sees the peer gone and closes it), before it
  has sent anything, so connections that never even start a handshake are bounded too;
- ZAP (zmq's authentication hook, RFC 27): every handshake waits for the gate's answer,
  and the gate answers only once it has read the monitor past that connection's accept,
  so no connection carries a message before it has been counted. A handshake is
  refused if its host holds no counted connection (a cut connection is dead whatever
  it is told: its socket is shut down).

A flood from one host therefore takes at most `max_per_host` connections, and other
hosts keep theirs and can open new ones until `max_connections` are held. A refused
peer is refused again each time it reconnects (a zmq client retries every 100 ms), so
the counts of refusals measure attempts, not peers.

Cutting is not enough at the total cap: zmq's I/O thread accepts every connection that
arrives, whatever the gate has judged, so a burst of a few hundred connections held
descriptors up to the process's limit before the gate had read their accepts (the
server could not open a file at the moment of its first cut in 8 of 10 runs of
tests/test_sidechannel_descriptors.py). So the listening socket is this module's
(`Door`, handed to zmq with `ZMQ_USE_FD`), and the gate shuts it while `max_connections`
are held: the kernel then drops new connection attempts before any descriptor exists,
connections already admitted carry on, and the door opens again when one of them ends.
Where the cap comes from the descriptor limit, the door is also shut, within
`DESCRIPTOR_HEADROOM` of the cap, whenever accepts wait to be judged.
(zmq's own `unbind` would close every connection accepted on the endpoint.) Beyond the
cap, at most the listen backlog (`LISTEN_BACKLOG`) plus what zmq accepts while the gate
catches up is ever open: `DESCRIPTOR_HEADROOM` is kept for that. A peer that knocks on a
shut door retries at TCP's pace (after 1 s, then 3 s, ...), not zmq's 100 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import resource
import socket
import struct
import sys
from collections import deque
from collections.abc import Iterator
from typing import Literal

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["ConnectionGate", "ConnectionTable", "Door", "Refused", "descriptor_cap"]

logger = logging.getLogger("pdconnect.sidechannel")

# Which limit cut a connection: its host's, or the server's total.
Refused = Literal["host", "total"]

# The endpoint libzmq sends ZAP requests to, in the context of the socket being handshaken.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# Any non-empty domain makes libzmq ask ZAP for the NULL mechanism (no CURVE keys here).
ZAP_DOMAIN = b"pdconnect"
_MONITOR_ENDPOINT = "inproc://pdconnect-sidechannel-monitor"
# Events one `serve()` handles before the server reads its next message, so a storm of
# connections cannot keep the serving thread from answering the peers it has admitted.
EVENTS_PER_ROUND = 64
# Handshakes that wait for the monitor to catch up; beyond this (a storm of connections
# faster than this thread judges them) the oldest are refused, and their peers retry.
WAITING_HANDSHAKES = 1024


# Descriptors kept free beyond the connections: zmq's own (its I/O thread, signalers,
# inproc pipes), the files and sockets the process opens, and the connections accepted
# and not yet cut (at most about a round's worth). A cap closer to the limit lets a flood
# exhaust the process: zmq's accept then fails in a loop and nothing else can open a file.
DESCRIPTOR_HEADROOM = 64


# Connections the kernel completes and holds for zmq to accept (listen(2)'s backlog): all
# of them are accepted even after the door shuts, so it is small; a burst beyond it waits
# for TCP's retry (zmq's own default is 100).
LISTEN_BACKLOG = 16

# Linux's socket options for a classic BPF filter on a socket (asm-generic/socket.h).
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27
# One BPF instruction, `ret #0`: keep no byte of any packet. On a listening TCP socket
# that drops every connection attempt (SYN) and handshake completion before the kernel
# makes a socket for it; established connections have sockets of their own.
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)


def descriptor_cap(requested: int) -> int:
    """`requested` connections, or fewer if the process's descriptor limit (RLIMIT_NOFILE,
    soft) leaves less room beside the descriptors open now and `DESCRIPTOR_HEADROOM`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: count none, the headroom still holds
        open_now = 0
    return max(1, min(requested, soft - open_now - DESCRIPTOR_HEADROOM))


def host_key(address: str) -> str:
    """One spelling per source host: an IPv4-mapped IPv6 address counts as its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class ConnectionTable:
    """Open connections by file descriptor, counted per host; used by one thread only.

    Invariants: at most `max_per_host` counted connections per host and `max_connections`
    in all; a connection is counted from `add` (unless it was refused there) until
    `remove` of its descriptor.
    """

    def __init__(self, max_connections: int, max_per_host: int) -> None:
        if not 0 < max_per_host <= max_connections:
            raise ValueError(
                f"need 0 < max_connections_per_host <= max_connections, got {max_per_host} and {max_connections}"
            )
        self._max, self._max_per_host = max_connections, max_per_host
        self._hosts: dict[int, str] = {}  # descriptor -> host, counted connections only
        self._per_host: dict[str, int] = {}

    def add(self, fd: int, host: str) -> Refused | None:
        """Count a new connection; the limit it would break instead (it is then not counted)."""
        self.remove(fd)  # a descriptor is reused only once its connection was closed
        if self._per_host.get(host, 0) >= self._max_per_host:
            return "host"
        if len(self._hosts) >= self._max:
            return "total"
        self._hosts[fd] = host
        self._per_host[host] = self._per_host.get(host, 0) + 1
        return None

    def remove(self, fd: int) -> None:
        host = self._hosts.pop(fd, None)
        if host is None:  # refused, or never seen: nothing was counted
            return
        left = self._per_host[host] - 1
        if left:
            self._per_host[host] = left
        else:
            del self._per_host[host]

    def holds(self, host: str) -> bool:
        """Whether `host` has a counted connection."""
        return host in self._per_host

    def __len__(self) -> int:
        return len(self._hosts)


@contextlib.contextmanager
def _borrowed(fd: int, port: int) -> Iterator[socket.socket | None]:
    """A duplicate of `fd` if it still is a TCP connection accepted on `port`, else None.

    The monitor reports a descriptor number, and by the time it is read that connection
    may be closed and the number reused by anything this process opens: only a
    connection to our own port (which only our listener accepts) is ours to count or cut.
    """
    try:
        borrowed = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed already, or no longer a socket
        yield None
        return
    with borrowed:
        try:
            ours = (
                borrowed.family in (socket.AF_INET, socket.AF_INET6)
                and borrowed.type == socket.SOCK_STREAM
                and borrowed.getsockname()[1] == port
            )
        except OSError:
            ours = False
        yield borrowed if ours else None


class Door:
    """The side channel's listening TCP socket, which can stop taking connections without closing.

    Invariants: while shut, the kernel completes no new connection on the port (its SYNs
    are dropped), so zmq accepts at most the `LISTEN_BACKLOG` completed before; the port
    stays bound throughout; connections already accepted are never touched. Shutting
    needs Linux (a socket filter); elsewhere `can_shut` is False and the door stays open.
    """

    def __init__(self, host: str, port: int) -> None:
        """Bind and listen on `host`:`port` (`*` for every IPv4 address); OSError if not possible.

        A name is resolved to IPv4, as zmq does with its IPv6 option off (the clients'
        setting); an IPv6 literal binds IPv6."""
        name = "0.0.0.0" if host == "*" else host.strip("[]")
        family = socket.AF_INET6 if ":" in name else socket.AF_INET
        family, kind, proto, _, address = socket.getaddrinfo(
            name, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._socket = socket.socket(family, kind, proto)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq's own listeners
            self._socket.bind(address)
            self._socket.listen(LISTEN_BACKLOG)
        except OSError:
            self._socket.close()
            raise
        self.can_shut = sys.platform == "linux"
        self.shut = False
        # The filter program's instruction must stay at one address while attached.
        self._program = ctypes.create_string_buffer(_DROP_ALL, len(_DROP_ALL))

    @property
    def ipv6(self) -> bool:
        return self._socket.family == socket.AF_INET6

    @property
    def endpoint(self) -> str:
        """The zmq endpoint of the bound address (IPv6 in brackets)."""
        host, port = self._socket.getsockname()[:2]
        return f"tcp://[{host}]:{port}" if self.ipv6 else f"tcp://{host}:{port}"

    def descriptor_for_zmq(self) -> int:
        """A duplicate of the listening descriptor for `ZMQ_USE_FD`: zmq closes it when it is done."""
        return os.dup(self._socket.fileno())

    def set_shut(self, shut: bool) -> bool:
        """Shut or open the door; whether that changed anything."""
        if shut == self.shut or not self.can_shut:
            return False
        try:
            if shut:
                # struct sock_fprog: the number of instructions, then a pointer to them.
                program = struct.pack("HL", len(_DROP_ALL) // 8, ctypes.addressof(self._program))
                self._socket.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
            else:
                self._socket.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        except OSError as exc:  # a kernel without socket filters: the cuts alone bound the connections
            self.can_shut = False
            logger.warning("side channel: cannot shut the listening socket at the connection cap (%s)", exc)
            return False
        self.shut = shut
        return True

    def close(self) -> None:
        self._socket.close()


class ConnectionGate:
    """The monitor and ZAP sockets of one ROUTER socket, and the table they keep.

    Create it before the ROUTER binds (so no connection is accepted unseen), call
    `start(port)` once it has, register `sockets` with the serving thread's poller and
    call `serve()` from that thread; `close()` before closing the ROUTER socket. With the
    `door` the ROUTER listens on, it shuts that door while `max_connections` are held,
    and from `watched` held on while accepts wait to be judged (a cap derived from the
    descriptor limit: the accepts zmq makes meanwhile must not run the process out).
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        router: zmq.Socket[bytes],
        max_connections: int,
        max_per_host: int,
        door: Door | None = None,
        watched: int | None = None,
    ) -> None:
        self.table = ConnectionTable(max_connections, max_per_host)
        self._max = max_connections
        self._door = door
        self._watched = max_connections if watched is None else watched
        self._full = False  # the door was shut because the table is full (for the log)
        self._router = router
        self._port = 0
        self.closed = 0  # connections zmq closed, whatever the cause (the serving thread's)
        self._waiting: deque[list[bytes]] = deque()
        self._zap = context.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        # Refuse handshakes outright should the ZAP socket ever be missing (never admit unseen).
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        router.monitor(_MONITOR_ENDPOINT, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor = context.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        # zmq's I/O thread blocks on a full monitor pipe (stalling every connection of the
        # ROUTER, and deadlocking a close); unbounded, it only queues a few bytes per event
        # while this thread is not running.
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.connect(_MONITOR_ENDPOINT)

    def start(self, port: int) -> None:
        """Count connections accepted on `port` (the ROUTER's, once bound)."""
        self._port = port

    @property
    def sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        return self._monitor, self._zap

    def serve(self) -> list[tuple[Refused, str]]:
        """Handle what the monitor and ZAP have for us (bounded per call); the connections
        cut, as (limit, host)."""
        # Requests are read before the monitor: the accept of each precedes it in there.
        for _ in range(EVENTS_PER_ROUND):
            try:
                self._waiting.append(self._zap.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        while len(self._waiting) > WAITING_HANDSHAKES:
            self._answer(self._waiting.popleft(), admitted=False)
        refused, caught_up = self._drain_monitor()
        if caught_up:  # every waiting handshake's accept has been judged
            while self._waiting:
                self._answer(self._waiting.popleft())
        return refused

    def _drain_monitor(self) -> tuple[list[tuple[Refused, str]], bool]:
        """Up to `EVENTS_PER_ROUND` events: the connections cut, and whether none are left."""
        refused: list[tuple[Refused, str]] = []
        for _ in range(EVENTS_PER_ROUND):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self._fit_door(caught_up=True)
                return refused, True
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_ACCEPTED:
                cut = self._accepted(int(event["value"]))
                if cut is not None:
                    refused.append(cut)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.closed += 1
                self.table.remove(int(event["value"]))
            self._fit_door(caught_up=False)  # after each event: the sooner shut, the fewer accepted
        return refused, False

    def _fit_door(self, caught_up: bool) -> None:
        """Shut the door while the table is full, and from `watched` on while accepts wait
        to be judged (zmq accepts on while this thread catches up)."""
        if self._door is None:
            return
        held = len(self.table)
        full = held >= self._max
        self._door.set_shut(full or (not caught_up and held >= self._watched))
        if full != self._full and self._door.shut == full:
            self._full = full
            if full:
                logger.warning("side channel: %d connections held, the most allowed: new ones wait", held)
            else:
                logger.info("side channel: below the connection cap again; taking new connections")

    def _accepted(self, fd: int) -> tuple[Refused, str] | None:
        with _borrowed(fd, self._port) as connection:
            if connection is None:
                return None
            try:
                host = host_key(connection.getpeername()[0])
            except OSError:  # the peer is gone already: its close event follows
                return None
            limit = self.table.add(fd, host)
            if limit is None:
                return None
            # zmq reads end-of-stream from it next and closes it (a close event follows);
            # an error means the peer is gone already.
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            return limit, host

    def _answer(self, request: list[bytes], admitted: bool | None = None) -> None:
        # [zmq routing id, b"", version, request id, domain, address, routing id, mechanism, ...]
        if len(request) < 8 or request[1] != b"" or request[2] != b"1.0":
            return  # not libzmq's: nothing waits for an answer
        # A connection that was cut is dead whatever it is told (its socket is shut down);
        # one whose host holds no counted connection was cut, or is gone already.
        if admitted is None:
            admitted = self.table.holds(host_key(request[5].decode("ascii", "replace")))
        status = (b"200", b"OK") if admitted else (b"400", b"over the connection limit")
        self._zap.send_multipart([request[0], b"", b"1.0", request[3], *status, b"", b""])

    def close(self) -> None:
        self._router.disable_monitor()
        self._monitor.close()
        self._zap.close()
