"""Delivery of notices to prefill engines: one queue, one worker and one connection per peer.

A decode engine tells prefill engines that it still wants a lease (heartbeats), that it
claims or is done with one, or that it gives it up; the router tells them to free a
request's blocks (releases). The caller (a scheduler thread, the router's event loop)
must never wait on the network, so it only enqueues here; the network waits happen on
notifier threads.

Heartbeats and releases are batched per peer: whatever is due for an address when its
worker gets to it goes out as one message per engine named (every notice names the
prefill engine it is for, `to_engine`, and a server refuses one naming another engine).
A release the peer did not answer (down, or stalled past the deadline) is kept and sent
again until its own deadline (the lease's end: after that the prefill engine frees the
blocks itself), so a stalled prefill engine still gets it when it runs again; at most
`max_pending_releases` ids wait per peer, and any beyond are dropped and counted
("releases_dropped"), as are those whose deadline passed unanswered ("releases_expired").

Each peer address has its own FIFO queue and worker thread, so a prefill engine that is
down (every request waits out the full timeout) delays only messages for itself. Every
message is answered, refused or failed within `timeout_seconds` of `send()` (messages
queued behind a dead peer fail without being sent once their time is up), so a dead
peer's backlog drains quickly instead of growing.

Nothing ends a worker but `close()`: every round of every loop is guarded, and a
malformed address, a refused message, a zmq error or an exception raised by a callback
is logged, counted and confined to the one message it concerns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdconnect.keyring import Keyring
from pdconnect.protocol import Handshake, Heartbeat, Message, Release, Role
from pdconnect.sidechannel import NoAnswer, RefusedByPeer, SideChannelClient, SideChannelError

__all__ = ["PeerNotifier"]

logger = logging.getLogger("pdconnect.notifier")

Count = Callable[[str, int], None]
OnReply = Callable[[str, Message, Message], None]
# (address, message, reason, unanswered): unanswered is True when the peer may never have
# seen the message (no answer in time, or not sent), False when it refused or answered
# something unusable; a caller may resend only the former.
OnFailure = Callable[[str, Message, str, bool], None]


# A queued stand-in for "whatever of this kind is due for the address, built when sent".
Batch = Literal["heartbeat", "releases"]


@dataclass(frozen=True)
class _Outgoing:
    """One queued notice, or a `Batch` stand-in for the address's heartbeat or releases."""

    address: str
    message: Message | Batch
    deadline: float  # time.monotonic() by which it must be answered


@dataclass(frozen=True)
class _PendingRelease:
    reason: str
    until: float  # time.monotonic() after which it is no longer worth sending


@dataclass
class _Peer:
    """A queue and the worker that empties it: one prefill engine's, or (address None) the
    shared overflow queue for addresses beyond `max_peers`."""

    address: str | None
    queue: queue.SimpleQueue[_Outgoing | None] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None


class PeerNotifier:
    """Sends notices to prefill engines from per-peer daemon threads; callers never block.

    Heartbeats: every `heartbeat_seconds`, each address with watched ids gets one
    `Heartbeat` listing all of them, built from the watched set when it is sent (a
    heartbeat still queued behind a slow peer is not queued twice). Replies go to
    `on_reply(address, sent, reply)` (including an `Ack` whose `unknown` lists ids the
    peer no longer holds); timeouts, refusals and errors go to
    `on_failure(address, sent, reason, unanswered)` and are counted as
    "notification_failures", except a handshake's `Refusal`, which is its answer and goes
    to `on_reply`.
    Callbacks run on notifier threads; an exception they raise is logged and counted
    as "notifier_callback_errors". Anything else unexpected is "notifier_errors".

    A worker whose peer has had nothing to send and no watched ids for `idle_seconds`
    ends, so engines that went away do not leave threads behind. Addresses come from
    requests' `kv_transfer_params`, which anyone can craft, so at most `max_peers`
    addresses get their own worker; the rest share one overflow worker (in turn, as
    before per-peer delivery) and are counted as "notifier_overflow".
    """

    def __init__(
        self,
        *,
        sender: Role,
        keys: Keyring | None,
        timeout_seconds: float,
        heartbeat_seconds: float,
        count: Count,
        on_reply: OnReply | None = None,
        on_failure: OnFailure | None = None,
        idle_seconds: float = 60.0,
        max_peers: int = 256,
        max_pending_releases: int = 4096,
    ) -> None:
        if min(timeout_seconds, heartbeat_seconds, idle_seconds, max_peers, max_pending_releases) <= 0:
            raise ValueError(
                "timeout_seconds, heartbeat_seconds, idle_seconds, max_peers and max_pending_releases must be positive"
            )
        self._sender: Role = sender
        self._keys = keys
        self._timeout = timeout_seconds
        self._heartbeat_seconds = heartbeat_seconds
        self._idle_seconds = idle_seconds
        self._max_peers = max_peers
        self._max_pending_releases = max_pending_releases
        self._count_callback = count
        self._on_reply = on_reply
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._overflow: _Peer | None = None
        self._watched: dict[str, set[tuple[str, str]]] = {}  # address -> (engine id, request id)
        self._beats_pending: set[str] = set()  # addresses with a heartbeat queued
        # address -> (engine id, request id) -> why, until when
        self._releases: dict[str, dict[tuple[str, str], _PendingRelease]] = {}
        self._releases_queued: set[str] = set()  # addresses with their releases' batch queued
        self._releases_in_flight = 0
        self._releases_full: set[str] = set()  # addresses that dropped releases since their last batch
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="pdconnect-notifier-beat", daemon=True)
        self._ticker.start()

    # --- called from the scheduler thread -------------------------------------------

    def watch(self, address: str, engine_id: str, request_id: str) -> None:
        """Heartbeat `request_id` to engine `engine_id` at `address` every `heartbeat_seconds` until unwatched."""
        with self._lock:
            self._watched.setdefault(address, set()).add((engine_id, request_id))

    def unwatch(self, address: str, engine_id: str, request_id: str) -> None:
        with self._lock:
            ids = self._watched.get(address)
            if ids is not None:
                ids.discard((engine_id, request_id))
                if not ids:
                    del self._watched[address]

    def send(self, address: str, message: Message) -> None:
        """Queue `message` for `address`; returns at once and never raises."""
        if self._stop.is_set():
            logger.warning("notifier closed: %s to %s not sent", type(message).__name__, address)
            self._count("notification_failures")
            return
        try:
            with self._lock:
                self._queue_for(address).put(_Outgoing(address, message, time.monotonic() + self._timeout))
        except Exception:  # e.g. no thread could be started: lose this message, not the caller
            self._count("notifier_errors")
            logger.exception("notifier could not queue %s to %s", type(message).__name__, address)

    def release(self, address: str, engine_id: str, request_ids: list[str], reason: str, until: float) -> None:
        """Free `request_ids` on engine `engine_id` at `address`, resent while unanswered until
        `until` (monotonic); returns at once and never raises."""
        if self._stop.is_set():
            self._count("releases_dropped", len(request_ids))
            return
        try:
            with self._lock:
                pending = self._releases.setdefault(address, {})
                room = self._max_pending_releases - len(pending)
                fresh = [(engine_id, i) for i in request_ids if (engine_id, i) not in pending]
                for key in fresh[: max(room, 0)]:
                    pending[key] = _PendingRelease(reason, until)
                if len(fresh) > room:
                    self._count("releases_dropped", len(fresh) - max(room, 0))
                    if address not in self._releases_full:  # once per episode: the counter has the rest
                        self._releases_full.add(address)
                        logger.warning("notifier: %d releases wait for %s; new ones dropped", len(pending), address)
                self._queue_releases(address)
        except Exception:  # e.g. no thread could be started: lose these releases, not the caller
            self._count("notifier_errors")
            logger.exception("notifier could not queue releases to %s", address)

    def pending_releases(self) -> int:
        """Release ids queued or in flight, all addresses together."""
        with self._lock:
            return sum(len(ids) for ids in self._releases.values()) + self._releases_in_flight

    def _queue_releases(self, address: str) -> None:
        """Queue the address's release batch unless it is queued already; the caller holds the lock."""
        if address in self._releases_queued or not self._releases.get(address):
            return
        self._queue_for(address).put(_Outgoing(address, "releases", time.monotonic() + self._timeout))
        self._releases_queued.add(address)

    def close(self) -> None:
        """Stop every worker; requests in flight are abandoned (no callbacks after this)."""
        self._stop.set()
        with self._lock:
            peers = [*self._peers.values(), *([self._overflow] if self._overflow is not None else [])]
        for peer in peers:
            peer.queue.put(None)  # wake a worker waiting for work
        # Workers notice the stop within one poll step (0.1 s), even mid-request.
        deadline = time.monotonic() + 2.0
        for thread in [self._ticker, *(p.thread for p in peers if p.thread is not None)]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # --- notifier threads -----------------------------------------------------------

    def _queue_for(self, address: str) -> queue.SimpleQueue[_Outgoing | None]:
        """The queue serving `address`, its worker started if need be; the caller holds the lock."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer.queue
        if len(self._peers) < self._max_peers:
            peer = self._peers[address] = self._started(_Peer(address))
            return peer.queue
        # Messages to one address keep their order except across this boundary (an
        # address that overflowed may get a worker of its own once others retire).
        self._count("notifier_overflow")
        logger.warning(
            "notifier: more than %d prefill engines at once; %s shares the overflow queue", self._max_peers, address
        )
        if self._overflow is None:
            self._overflow = self._started(_Peer(None))
        return self._overflow.queue

    def _started(self, peer: _Peer) -> _Peer:
        peer.thread = threading.Thread(target=self._work, args=(peer,), name="pdconnect-notifier", daemon=True)
        peer.thread.start()
        return peer

    def _tick(self) -> None:
        while not self._stop.wait(self._heartbeat_seconds):
            try:
                deadline = time.monotonic() + self._timeout
                with self._lock:
                    for address in list(self._watched):
                        if address not in self._beats_pending:
                            self._queue_for(address).put(_Outgoing(address, "heartbeat", deadline))
                            self._beats_pending.add(address)
            except Exception:
                self._count("notifier_errors")
                logger.exception("notifier could not schedule heartbeats; trying again next round")

    def _work(self, peer: _Peer) -> None:
        # A dedicated worker keeps one connection; the overflow worker opens one per message.
        client = self._client(peer.address) if peer.address else None
        try:
            while not self._stop.is_set():
                try:
                    try:
                        item = peer.queue.get(timeout=self._idle_seconds)
                    except queue.Empty:
                        if self._retire(peer):
                            return
                        continue
                    if item is not None:
                        self._deliver(item, client)
                except Exception:  # nothing may end a worker but close()
                    self._count("notifier_errors")
                    logger.exception("notifier error for %s; still running", peer.address or "overflow")
                    self._stop.wait(0.01)  # a fault that repeats must not spin a core
        finally:
            if client is not None:
                client.close()

    def _retire(self, peer: _Peer) -> bool:
        """End an idle worker, unless something arrived for it meanwhile."""
        with self._lock:
            if not peer.queue.empty():
                return False
            if peer.address is None:
                self._overflow = None
                return True
            if peer.address in self._watched or peer.address in self._releases:
                return False
            del self._peers[peer.address]
            return True

    def _client(self, address: str) -> SideChannelClient:
        return SideChannelClient(address, self._sender, self._keys, self._timeout)

    def _deliver(self, item: _Outgoing, client: SideChannelClient | None) -> None:
        address, message = item.address, item.message
        if message == "releases":
            self._deliver_releases(item, client)
            return
        if message == "heartbeat":
            with self._lock:
                self._beats_pending.discard(address)
                watched = sorted(self._watched.get(address, ()))
            by_engine: dict[str, list[str]] = {}
            for engine_id, request_id in watched:
                by_engine.setdefault(engine_id, []).append(request_id)
            for engine_id, ids in by_engine.items():
                self._send(item, Heartbeat(to_engine=engine_id, request_ids=ids), client)
            return
        assert not isinstance(message, str)
        self._send(item, message, client)

    def _send(self, item: _Outgoing, message: Message, client: SideChannelClient | None) -> bool:
        """Send one message and report it; True if it was answered (even by a refusal)."""
        address = item.address
        remaining = item.deadline - time.monotonic()
        if remaining <= 0:
            self._failed(
                address,
                message,
                f"not sent: {address} did not take earlier messages within {self._timeout:.1f}s",
                unanswered=True,
            )
            return False
        own = client is None
        sender = self._client(address) if client is None else client
        try:
            reply = sender.request(message, timeout=remaining, cancel=self._stop)
        except RefusedByPeer as exc:
            if not isinstance(message, Handshake):
                self._failed(address, message, str(exc), unanswered=False)
                return True
            # A refused handshake is still the peer's answer: its refusal may carry the
            # peer's compat record, which is what the asker wanted to see.
            reply = exc.refusal
        except SideChannelError as exc:
            self._failed(address, message, str(exc), unanswered=isinstance(exc, NoAnswer))
            return not isinstance(exc, NoAnswer)
        except Exception as exc:  # e.g. a message that cannot be encoded: this message only
            logger.exception("notifier could not send %s to %s", type(message).__name__, address)
            self._failed(address, message, f"{type(exc).__name__}: {exc}", unanswered=False)
            return True
        finally:
            if own:
                sender.close()
        self._callback(self._on_reply, address, message, reply)
        return True

    def _deliver_releases(self, item: _Outgoing, client: SideChannelClient | None) -> None:
        address = item.address
        with self._lock:
            self._releases_queued.discard(address)
            self._releases_full.discard(address)
            pending = self._releases.pop(address, {})
            self._releases_in_flight += len(pending)
        try:
            self._send_releases(item, client, pending)
        finally:
            with self._lock:
                self._releases_in_flight -= len(pending)

    def _send_releases(
        self, item: _Outgoing, client: SideChannelClient | None, pending: dict[tuple[str, str], _PendingRelease]
    ) -> None:
        address = item.address
        now = time.monotonic()
        expired = [i for i, p in pending.items() if p.until <= now]
        if expired:
            self._count("releases_expired", len(expired))
            logger.warning("notifier: %d releases to %s unanswered until their leases ended", len(expired), address)
        batches: dict[tuple[str, str], list[str]] = {}  # (engine id, reason) -> request ids
        for (engine_id, request_id), wanted in pending.items():
            if wanted.until > now:
                batches.setdefault((engine_id, wanted.reason), []).append(request_id)
        for (engine_id, reason), ids in batches.items():
            release = Release(to_engine=engine_id, request_ids=ids, reason=reason)
            if self._stop.is_set() or self._send(item, release, client):
                continue
            # Unanswered: the peer may be down or stalled; keep them for another try.
            self._count("release_retries", len(ids))
            with self._lock:
                kept = self._releases.setdefault(address, {})
                for key in ((engine_id, i) for i in ids):
                    if len(kept) < self._max_pending_releases:
                        kept.setdefault(key, pending[key])
                    elif key not in kept:
                        self._count("releases_dropped")
                self._queue_releases(address)

    def _failed(self, address: str, message: Message, reason: str, *, unanswered: bool) -> None:
        if self._stop.is_set():
            return  # closing: the request was abandoned, not refused
        self._count("notification_failures")
        logger.warning("could not deliver %s to %s: %s", type(message).__name__, address, reason)
        self._callback(self._on_failure, address, message, reason, unanswered)

    def _callback(self, callback: Callable[..., None] | None, *args: object) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            self._count("notifier_callback_errors")
            logger.exception("notifier callback %s failed", getattr(callback, "__name__", callback))

    def _count(self, name: str, amount: int = 1) -> None:
        try:
            self._count_callback(name, amount)
        except Exception:  # a broken counter must not take delivery down with it
            logger.exception("notifier could not count %s", name)
