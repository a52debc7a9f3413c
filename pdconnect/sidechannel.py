"""The side channel: request/reply over zmq between decode engines, the router and a prefill engine.

The prefill engine runs one `SideChannelServer` (a ROUTER socket served by a daemon
thread); decode workers, decode schedulers and the router talk to it through
`SideChannelClient` (a DEALER socket with a deadline on every request). Messages travel
in the envelope of `pdconnect.envelope` (version, sender role, direction and message id;
a reply names the request it answers; with keys, time and the sender role's signature).
The server answers as "prefill" and accepts only what `pdconnect.protocol.SENDERS`
lets each role ask; a client accepts answers from "prefill" only.

A client keeps its connection across timeouts, and that is what makes a stalled peer
safe to talk to. A prefill engine on busy cores can stop running for seconds (its
side-channel thread starved of the GIL, or all its processes held by a loaded host:
seen for 6 to 35 s on a 2-core CI machine); requests sent on an open connection wait in
its socket buffers and are all handled when it runs again, so every heartbeat still
extends its lease. A client that reconnected after each timeout lost them instead: a
new connection needs the stalled peer's handshake before it carries anything, and
closing it unsent dropped the message (see docs/handoff-integrity.md, "A stalled
prefill engine"). Late answers then arrive on the same connection; the client takes
only the answer naming its current request.

The server never touches engine state itself: its handler must be thread-safe (the
connector's handler only enqueues events for the scheduler thread or reads immutable
handshake data). Nothing a peer sends may end the serving thread: a peer is anyone who
can reach the port, so every frame count, size and byte string is either answered with
a `Refusal`, dropped unanswered (no readable id: nobody waits for it) or dropped by zmq
(beyond `max_message_bytes`: zmq closes that connection), and counted; the log says so
at most once per `LOG_EVERY_SECONDS` per reason, never once per message.

A flood cannot starve other peers. zmq's ROUTER socket takes messages from its
connections in turn, so a flooding connection gets one turn per round like everyone
else; and each connection has a budget of refusals (`REFUSAL_BURST`, refilled at
`REFUSAL_RATE` per second): a connection past it has its messages dropped unread,
which costs a receive and nothing else, until its budget refills. A peer that sends
valid messages is never refused, so it never spends budget.

Nor can many connections: each host may hold `max_connections_per_host` and all hosts
together `max_connections` (`pdconnect.admission`); a connection beyond either is cut
before it carries a message, and counted, and while `max_connections` are held the
listening socket takes no new connection at all. Handshakes that do not finish within
`HANDSHAKE_SECONDS` are closed, and dead peers are found by TCP keepalive and zmq
heartbeats.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from pdconnect.admission import DESCRIPTOR_HEADROOM, ConnectionGate, Door, Refused, descriptor_cap
from pdconnect.envelope import (
    DEFAULT_MAX_AGE_SECONDS,
    EnvelopeError,
    ReplayGuard,
    encode_message,
    new_nonce,
    open_envelope,
    request_id_of,
)
from pdconnect.keyring import Keyring
from pdconnect.protocol import Ack, LeaseMessage, Message, ProtocolError, Refusal, Release, Role

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_HOST",
    "SERVER_COUNTERS",
    "NoAnswer",
    "RefusedByPeer",
    "SideChannelClient",
    "SideChannelError",
    "SideChannelServer",
    "is_loopback_host",
    "release_remote",
]

logger = logging.getLogger("pdconnect.sidechannel")

Handler = Callable[[Message], Message]

# The server receives handshakes, heartbeats, claims, done and release notices. The
# largest are heartbeats and done/release batches: one id is ~100 bytes, so this admits
# tens of thousands of ids per message while zmq cuts anything bigger before Python
# allocates it (the reply direction, with transport metadata, is not limited).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20

# Requests a client lets wait unread in a stalled server's socket (a heartbeat a second
# and a claim or two per request): beyond this a request fails as "not sent", so a
# peer that stalls for minutes does not face an unbounded backlog when it wakes.
UNREAD_REQUESTS = 64

# Refusals one connection may cause at once, and per second after that, before its
# messages are dropped unread. A live peer is refused rarely (a version skew, a key
# rotation gone wrong), so these only bite a connection that sends garbage.
REFUSAL_BURST = 32
REFUSAL_RATE = 8.0
# Connections whose refusal budget is remembered; beyond this the oldest are forgotten
# (a flood spread over more connections than this still costs a refusal per message).
BUDGETED_CONNECTIONS = 4096
# The serving thread logs each kind of refusal at most this often, with a count.
LOG_EVERY_SECONDS = 10.0
# Connections one source address may hold open on a server, and all addresses together.
# A decode engine holds one per prefill engine for its notices and, per tensor-parallel
# worker, one for claims and one while it handshakes: 2 * TP + 1, 17 at TP 8; the router
# holds one. A node running 8 decode engines from one address needs ~24 (more only
# behind a NAT), so 64 leaves headroom without letting one host take much of the total.
# The total bounds the descriptors and zmq sessions one prefill engine spends on the
# side channel: 4096 serves ~240 TP-8 decode engines, far below vLLM's raised fd limit.
MAX_CONNECTIONS = 4096
MAX_CONNECTIONS_PER_HOST = 64
# A connection that has not finished zmq's handshake by then is closed (zmq's default is
# 30 s); a client's own requests give up sooner (its deadline), and it reconnects.
HANDSHAKE_SECONDS = 10
# Dead peers are found by TCP keepalive and zmq heartbeats, and their connections closed.
_KEEPALIVE_OPTIONS = (
    (zmq.TCP_KEEPALIVE, 1),
    (zmq.TCP_KEEPALIVE_IDLE, 30),
    (zmq.TCP_KEEPALIVE_INTVL, 10),
    (zmq.TCP_KEEPALIVE_CNT, 3),
    (zmq.HEARTBEAT_IVL, 10_000),
    (zmq.HEARTBEAT_TIMEOUT, 30_000),
)

# Every counter the server keeps, present from the start so exporters see zeros.
SERVER_COUNTERS = (
    "received",  # messages that passed the envelope checks and reached the handler
    "refused_frames",  # not exactly one frame after the peer's identity (e.g. a REQ socket)
    "refused_malformed",
    "refused_version",
    "refused_unauthenticated",
    "refused_forbidden",  # a role sending what it may not (protocol.SENDERS)
    "refused_stale",
    "refused_replayed",
    "refused_overloaded",  # the envelope checks, by `EnvelopeError.kind`
    "refused_wrong_engine",  # a lease message naming another engine (`to_engine`)
    "dropped_over_budget",  # a connection past its refusal budget: dropped unread
    "connections_over_host_limit",  # a connection cut: its host held max_connections_per_host
    "connections_over_limit",  # a connection cut: the server held max_connections
    "connections_closed",  # every accepted connection closed, by its peer, a cut or an error
    "handler_errors",  # the handler raised or answered something unencodable
    "serve_errors",  # anything else that went wrong in one round of the serving loop
    "late_rounds",  # rounds that began LATE_ROUND_SECONDS or more after the one before
)

# A serving round waits at most `_POLL_MILLISECONDS` for a message, then handles one; a
# round that begins this long after the one before means the serving thread did not run
# (the interpreter lock held by a call that keeps it, no CPU, the process stopped) or one
# message took that long to handle. Either way every peer waited: it is counted and logged.
LATE_ROUND_SECONDS = 1.0
_POLL_MILLISECONDS = 100


class SideChannelError(RuntimeError):
    """The peer did not answer in time, refused, or answered something unexpected."""


class RefusedByPeer(SideChannelError):
    """The peer answered with a `Refusal` (kept in `refusal`: a handshake's may carry the
    peer's compat record)."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class NoAnswer(SideChannelError):
    """No reply within the deadline: the peer may be slow, gone, or may never have seen
    the message, so unlike a refusal this says nothing about what the peer decided."""


def is_loopback_host(host: str) -> bool:
    """True for `localhost`, 127.0.0.0/8 and ::1: addresses no other machine can reach."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name or interface name: it may well be reachable
        return False


class _Counters:
    """Named counters shared by the serving thread and whoever reads them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _RefusalBudgets:
    """A token bucket of refusals per connection (zmq routing identity); serving thread only.

    Invariant: a connection is refused at most `burst + rate * t` times in any `t`
    seconds; past that, its messages are dropped before any decoding or signing.
    """

    def __init__(self, burst: int, rate: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst, self._rate, self._capacity, self._clock = float(burst), rate, capacity, clock
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # id -> (tokens, at)

    def _tokens(self, connection: bytes, now: float) -> float:
        tokens, at = self._buckets.get(connection, (self._burst, now))
        return min(self._burst, tokens + (now - at) * self._rate)

    def allows(self, connection: bytes) -> bool:
        return connection not in self._buckets or self._tokens(connection, self._clock()) >= 1.0

    def charge(self, connection: bytes) -> None:
        now = self._clock()
        self._buckets[connection] = (self._tokens(connection, now) - 1.0, now)
        self._buckets.move_to_end(connection)
        while len(self._buckets) > self._capacity:
            self._buckets.popitem(last=False)


class _QuietLog:
    """Admits one log line per reason per `every` seconds; the admitted line says how many were left out."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._every, self._clock = every, clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def admit(self, reason: str) -> str | None:
        """None to stay quiet; else a note (maybe empty) to end the line with."""
        now = self._clock()
        if now - self._last.get(reason, -self._every) < self._every:
            self._left_out[reason] = self._left_out.get(reason, 0) + 1
            return None
        self._last[reason] = now
        left_out = self._left_out.pop(reason, 0)
        return f" ({left_out} more since the last report, counted)" if left_out else ""


class SideChannelServer:
    """Serves one handler on `tcp://host:port` from a daemon thread until `close()`.

    Invariants: the serving thread runs until `close()`, whatever arrives; each message
    gets at most one reply, to the identity that sent it; nothing a peer sends is
    answered with a local value (keys, version, window, exception text); the handler
    sees only messages whose sender role may send them (`protocol.SENDERS`), signed by
    that role when the server has `keys` (which sign its answers as "prefill"); a
    message that acts on a lease reaches it only if it names this server's `engine_id`.

    Binding an address other machines can reach needs `keys`, unless the operator opts
    out with `allow_insecure=True` (a trusted, isolated network). At most
    `max_connections_per_host` connections per source address and `max_connections` in
    all are open at once (see `pdconnect.admission`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        keys: Keyring | None = None,
        *,
        engine_id: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS,
        allow_insecure: bool = False,
        refusal_burst: int = REFUSAL_BURST,
        refusal_rate: float = REFUSAL_RATE,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
    ) -> None:
        if keys is None and not allow_insecure and not is_loopback_host(host):
            raise SideChannelError(
                f"refusing to serve the side channel on {host} without keys: anyone who can reach "
                "it could free or keep blocks; set secret_env and peer_keys, bind a loopback address, "
                "or set allow_insecure_side_channel on an isolated network"
            )
        if keys is not None and keys.signs_as != "prefill":
            raise SideChannelError(f"a side-channel server answers as prefill, not with {keys.signs_as} keys")
        if max_message_bytes <= 0:
            raise SideChannelError(f"max_message_bytes must be positive, got {max_message_bytes}")
        if not 0 < max_connections_per_host <= max_connections:
            raise SideChannelError(
                "need 0 < max_connections_per_host <= max_connections, "
                f"got {max_connections_per_host} and {max_connections}"
            )
        capped = descriptor_cap(max_connections)
        if capped < max_connections:
            logger.warning(
                "side channel: at most %d connections (not %d): the process may open %d descriptors "
                "(RLIMIT_NOFILE), and needs some for itself",
                capped,
                max_connections,
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )
        self.max_connections = capped
        max_connections_per_host = min(max_connections_per_host, capped)
        if not engine_id:
            raise SideChannelError("a side-channel server needs the id of the engine it serves")
        self.engine_id = engine_id
        self._handler = handler
        self._keys = keys
        self._guard = ReplayGuard(max_age_seconds) if keys is not None else None
        self._counters = _Counters(SERVER_COUNTERS)
        self._budgets = _RefusalBudgets(refusal_burst, refusal_rate, BUDGETED_CONNECTIONS)
        self._log = _QuietLog(LOG_EVERY_SECONDS)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # zmq drops the connection of a peer that sends a bigger frame, before any copy.
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_SECONDS * 1000)
        for option, value in _KEEPALIVE_OPTIONS:
            self._socket.setsockopt(option, value)
        try:
            # The listening socket is the gate's, to shut at the connection cap.
            self._door = Door(host, port)
        except OSError as exc:
            self._socket.close()
            self._context.term()
            raise SideChannelError(f"cannot bind side channel on {host}:{port}: {exc}") from None
        self._socket.setsockopt(zmq.IPV6, int(self._door.ipv6))
        self._socket.setsockopt(zmq.USE_FD, self._door.descriptor_for_zmq())
        # Before the bind: no connection may be accepted unseen.
        # A cap the descriptor limit set is watched from one headroom below it (see admission).
        watched = capped - DESCRIPTOR_HEADROOM if capped < max_connections else capped
        self._gate = ConnectionGate(self._context, self._socket, capped, max_connections_per_host, self._door, watched)
        self._closes_counted = 0
        try:
            self._socket.bind(self._door.endpoint)
        except zmq.ZMQError as exc:
            self._gate.close()
            self._socket.close()
            self._door.close()
            self._context.term()
            raise SideChannelError(f"cannot bind side channel on {host}:{port}: {exc}") from None
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._gate.start(self.port)
        self._stop = threading.Event()
        self._drained_at = time.monotonic()
        self._thread = threading.Thread(target=self._serve, name="pdconnect-sidechannel", daemon=True)
        self._thread.start()
        logger.info(
            "side channel listening on %s%s",
            self.address,
            "" if keys is not None else " (no keys: messages are not authenticated)",
        )

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._socket, *self._gate.sockets):
            poller.register(sock, zmq.POLLIN)
        previous_round = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    polled_at = time.monotonic()
                    self._check_round(polled_at - previous_round)
                    previous_round = polled_at
                    ready = dict(poller.poll(_POLL_MILLISECONDS))
                    # Connections first (bounded per round): none carries a message uncounted.
                    self._admit()
                    if self._socket in ready:
                        self._serve_one(self._socket.recv_multipart())
                        # Drained whenever the queue is empty after a message, not only after an
                        # idle poll: a channel busy with traffic is never idle for a whole poll.
                        checked_at = time.monotonic()
                        if not self._socket.poll(0, zmq.POLLIN):
                            self._drained_at = checked_at
                    else:
                        # Nothing was waiting: every message sent before `polled_at` is answered.
                        self._drained_at = polled_at
                except Exception:  # nothing may end this loop but close()
                    self._counters.add("serve_errors")
                    if (note := self._log.admit("serve_error")) is not None:
                        logger.exception("side channel: error while serving a message; still serving%s", note)
                    # A fault that repeats every round must not spin a core or flood the log.
                    self._stop.wait(0.01)
        finally:
            self._gate.close()
            self._socket.close()
            self._door.close()
            self._context.term()

    def _check_round(self, gap: float) -> None:
        if gap < LATE_ROUND_SECONDS:
            return
        self._counters.add("late_rounds")
        if (note := self._log.admit("late_round")) is not None:
            logger.warning(
                "side channel: a serving round began %.1f s after the one before; every peer's messages "
                "waited (the serving thread got no interpreter lock or CPU, or one message took that long)%s",
                gap,
                note,
            )

    def _admit(self) -> None:
        """One round of the connection gate; a fault there is counted and logged, and
        leaves the messages of admitted peers served."""
        try:
            for limit, host in self._gate.serve():
                self._cut(limit, host)
        except Exception:
            self._counters.add("serve_errors")
            if (note := self._log.admit("admission_error")) is not None:
                logger.exception("side channel: error while admitting connections; still serving%s", note)
            self._stop.wait(0.01)  # a fault that repeats must not spin a core
        finally:  # closes seen before a fault are counted too
            self._counters.add("connections_closed", self._gate.closed - self._closes_counted)
            self._closes_counted = self._gate.closed

    def _cut(self, limit: Refused, host: str) -> None:
        name, what = {
            "host": ("connections_over_host_limit", "max_connections_per_host"),
            "total": ("connections_over_limit", "max_connections"),
        }[limit]
        self._counters.add(name)
        if (note := self._log.admit(name)) is not None:
            logger.warning("side channel: cut a connection from %s, beyond %s%s", host, what, note)

    @property
    def drained_at(self) -> float:
        """The latest `time.monotonic()` before which every arrived message was handled.

        A starved serving thread (a long forward pass holding the GIL on the same process)
        leaves messages queued; whoever judges a peer silent (lease expiry) must not count
        time past this instant against it.
        """
        return self._drained_at

    def _serve_one(self, frames: list[bytes]) -> None:
        # A ROUTER socket prepends the sender's identity; a DEALER peer sends one frame.
        identity, payload = frames[0], frames[1:]
        if not self._budgets.allows(identity):
            self._counters.add("dropped_over_budget")
            if (note := self._log.admit("over_budget")) is not None:
                logger.warning("side channel: dropped messages of a connection past its refusal budget%s", note)
            return
        if len(payload) == 1:
            answer = self._answer(identity, payload[0])
            if answer is not None:
                self._socket.send_multipart([identity, answer])
            return
        self._refused(identity, "frames", f"{len(payload)} frames (expected 1)")
        # A REQ peer puts an empty delimiter first and only reads replies that carry one.
        delimiter = [b""] if payload and payload[0] == b"" else []
        refusal = Refusal(reason=f"expected exactly one frame per message, got {len(payload)}")
        self._socket.send_multipart([identity, *delimiter, self._encode(refusal, None)])

    def _refused(self, identity: bytes, kind: str, text: str) -> None:
        self._counters.add(f"refused_{kind}")
        self._budgets.charge(identity)
        if (note := self._log.admit(kind)) is not None:
            logger.warning("side channel refused a message: %s%s", text, note)

    def _encode(self, message: Message, reply_to: bytes | None) -> bytes:
        return encode_message(message, "prefill", self._keys, reply_to=reply_to)

    def _answer(self, identity: bytes, data: bytes) -> bytes | None:
        # Every answer names the request it answers, refusals too: the client waits for it.
        reply_to = request_id_of(data)
        try:
            message = open_envelope(data, self._keys, "request", replay_guard=self._guard).message
        except EnvelopeError as exc:
            self._refused(identity, exc.kind, str(exc))
            # Without a readable id no client can be waiting for an answer: none is sent.
            return None if reply_to is None else self._encode(Refusal(reason=str(exc)), reply_to)
        if isinstance(message, LeaseMessage) and message.to_engine != self.engine_id:
            # Signed and fresh, but for another engine: its ids may name our leases by chance.
            text = f"a {type(message).__name__} for engine {message.to_engine!r} reached engine {self.engine_id!r}"
            self._refused(identity, "wrong_engine", text)
            return self._encode(Refusal(reason=f"this is not engine {message.to_engine!r}"), reply_to)
        self._counters.add("received")
        try:
            return self._encode(self._handler(message), reply_to)
        except Exception:  # a handler bug must not kill the serving thread
            self._counters.add("handler_errors")
            logger.exception("side channel handler failed on %s", type(message).__name__)
            # The exception text stays in our log: it may name local state.
            return self._encode(Refusal(reason="internal error"), reply_to)

    @property
    def connections(self) -> int:
        """Connections counted as open now (read from another thread: a moment's snapshot)."""
        return len(self._gate.table)

    def counts(self) -> dict[str, int]:
        """A snapshot of the server's counters (`SERVER_COUNTERS`), e.g. for metrics."""
        return self._counters.snapshot()

    @property
    def port(self) -> int:
        """The bound port (useful when asked to bind port 0)."""
        return int(self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class SideChannelClient:
    """Sends one message at a time to a server and waits for its reply, with a deadline.

    One connection for the client's life (see the module docstring): a request that timed
    out stays sent, and its late answer is recognised by the id it names and dropped.
    Requests go out as `sender` (signed by `keys`, whose role it must be); only answers a
    prefill engine may send are accepted, signed by a trusted prefill key when there are
    keys. Nothing is queued while the server is unreachable (`zmq.IMMEDIATE`): a request
    that could not go out by its deadline fails as "not sent" and is never delivered
    later. Every failure, including a zmq error on a malformed address, is a SideChannelError.
    """

    def __init__(self, address: str, sender: Role, keys: Keyring | None = None, timeout: float = 5.0) -> None:
        if keys is not None and keys.signs_as != sender:
            raise ValueError(f"keys of {keys.signs_as} cannot send as {sender}")
        self.address = address
        self._sender: Role = sender
        self._keys = keys
        self._timeout = timeout
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] | None = None
        self._lock = threading.Lock()

    def _connected(self) -> zmq.Socket[bytes]:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)
            # Requests a stalled server has not read yet; beyond this, "not sent".
            socket.setsockopt(zmq.SNDHWM, UNREAD_REQUESTS)
            for option, value in _KEEPALIVE_OPTIONS:
                socket.setsockopt(option, value)
            try:
                socket.connect(self.address)
            except zmq.ZMQError:
                socket.close()
                raise
            self._socket = socket
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def request(
        self, message: Message, *, timeout: float | None = None, cancel: threading.Event | None = None
    ) -> Message:
        """Send and wait; raises SideChannelError on timeout, refusal, a bad reply or `cancel`.

        `timeout` overrides the client's deadline for this request; with `cancel`, the
        wait ends soon after that event is set (a closing notifier must not wait out a
        dead peer's full deadline).
        """
        seconds = self._timeout if timeout is None else timeout
        with self._lock:
            try:
                reply = self._exchange(message, seconds, cancel)
            except zmq.ZMQError as exc:
                self._reset()
                raise SideChannelError(f"cannot talk to {self.address}: {exc}") from None
        if isinstance(reply, Refusal):
            raise RefusedByPeer(f"{self.address} refused {type(message).__name__}: {reply.reason}", reply)
        return reply

    def _exchange(self, message: Message, seconds: float, cancel: threading.Event | None) -> Message:
        socket = self._connected()
        deadline = time.monotonic() + seconds
        request_id = new_nonce()
        data = encode_message(message, self._sender, self._keys, nonce=request_id)
        while not _sent(socket, data):  # not connected yet, or the server's backlog is full
            if not self._poll(socket, zmq.POLLOUT, deadline, cancel):
                raise NoAnswer(f"not sent: no connection to {self.address} took it within {seconds:.1f}s")
        while True:
            if not self._poll(socket, zmq.POLLIN, deadline, cancel):
                raise NoAnswer(f"no answer from {self.address} within {seconds:.1f}s")
            reply = self._answer_to(request_id, socket.recv())
            if reply is not None:
                return reply

    def _poll(self, socket: zmq.Socket[bytes], event: int, deadline: float, cancel: threading.Event | None) -> bool:
        """Wait for `event` until `deadline` (in 0.1 s steps when cancellable); False if it did not come.

        A thread that was not scheduled (a busy engine on few cores) can wake past its
        deadline with the answer already waiting: it still looks once, and that counts.
        """
        while True:
            if cancel is not None and cancel.is_set():
                raise SideChannelError(f"request to {self.address} cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bool(socket.poll(0, event))
            step = remaining if cancel is None else min(remaining, 0.1)
            if socket.poll(max(1, int(step * 1000)), event):
                return True

    def _answer_to(self, request_id: bytes, data: bytes) -> Message | None:
        """The reply in `data` if it answers `request_id`; None for a late answer to an
        earlier request (dropped); SideChannelError if it cannot be read."""
        try:
            opened = open_envelope(data, self._keys, "reply")
        except ProtocolError as exc:  # its id cannot be trusted either: whichever it is, it is bad
            raise SideChannelError(f"bad reply from {self.address}: {exc}") from None
        if opened.reply_to != request_id:
            logger.debug("side channel: dropped a late answer from %s", self.address)
            return None
        return opened.message

    def close(self) -> None:
        with self._lock:
            self._reset()


def _sent(socket: zmq.Socket[bytes], data: bytes) -> bool:
    try:
        socket.send(data, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def release_remote(
    address: str,
    engine_id: str,
    request_ids: list[str],
    reason: str,
    keys: Keyring | None = None,
    timeout: float = 2.0,
) -> Ack:
    """Tell prefill engine `engine_id` at `address`, as the router, to free requests' blocks
    now (one connection, one message)."""
    client = SideChannelClient(address, "router", keys, timeout)
    try:
        reply = client.request(Release(to_engine=engine_id, request_ids=request_ids, reason=reason))
    finally:
        client.close()
    if not isinstance(reply, Ack):
        raise SideChannelError(f"{address} answered {type(reply).__name__} to a release")
    return reply
