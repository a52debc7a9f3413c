"""Delivery of decode-side notices to prefill engines: one queue and one worker per peer.

A decode engine tells prefill engines that it still wants a lease (heartbeats), that it
claims or is done with one, or that it gives it up. The scheduler thread must never wait
on the network, so it only enqueues here; the network waits happen on notifier threads.

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

from pdconnect.protocol import Heartbeat, Message
from pdconnect.sidechannel import NoAnswer, SideChannelClient, SideChannelError

__all__ = ["PeerNotifier"]

logger = logging.getLogger("pdconnect.notifier")

Count = Callable[[str, int], None]
OnReply = Callable[[str, Message, Message], None]
# (address, message, reason, unanswered): unanswered is True when the peer may never have
# seen the message (no answer in time, or not sent), False when it refused or answered
# something unusable; a caller may resend only the former.
OnFailure = Callable[[str, Message, str, bool], None]


@dataclass(frozen=True)
class _Outgoing:
    """One queued notice; `message` None stands for "the address's heartbeat, built when sent"."""

    address: str
    message: Message | None
    deadline: float  # time.monotonic() by which it must be answered


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
    "notification_failures".
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
        secret: bytes | None,
        timeout_seconds: float,
        heartbeat_seconds: float,
        count: Count,
        on_reply: OnReply | None = None,
        on_failure: OnFailure | None = None,
        idle_seconds: float = 60.0,
        max_peers: int = 256,
    ) -> None:
        if timeout_seconds <= 0 or heartbeat_seconds <= 0 or idle_seconds <= 0 or max_peers <= 0:
            raise ValueError("timeout_seconds, heartbeat_seconds, idle_seconds and max_peers must be positive")
        self._secret = secret
        self._timeout = timeout_seconds
        self._heartbeat_seconds = heartbeat_seconds
        self._idle_seconds = idle_seconds
        self._max_peers = max_peers
        self._count_callback = count
        self._on_reply = on_reply
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._overflow: _Peer | None = None
        self._watched: dict[str, set[str]] = {}
        self._beats_pending: set[str] = set()  # addresses with a heartbeat queued
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="pdconnect-notifier-beat", daemon=True)
        self._ticker.start()

    # --- called from the scheduler thread -------------------------------------------

    def watch(self, address: str, request_id: str) -> None:
        """Heartbeat `request_id` to `address` every `heartbeat_seconds` until unwatched."""
        with self._lock:
            self._watched.setdefault(address, set()).add(request_id)

    def unwatch(self, address: str, request_id: str) -> None:
        with self._lock:
            ids = self._watched.get(address)
            if ids is not None:
                ids.discard(request_id)
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
                            self._queue_for(address).put(_Outgoing(address, None, deadline))
                            self._beats_pending.add(address)
            except Exception:
                self._count("notifier_errors")
                logger.exception("notifier could not schedule heartbeats; trying again next round")

    def _work(self, peer: _Peer) -> None:
        # A dedicated worker keeps one connection; the overflow worker opens one per message.
        client = SideChannelClient(peer.address, self._secret, self._timeout) if peer.address else None
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
            if peer.address in self._watched:
                return False
            del self._peers[peer.address]
            return True

    def _deliver(self, item: _Outgoing, client: SideChannelClient | None) -> None:
        address, message = item.address, item.message
        if message is None:
            with self._lock:
                self._beats_pending.discard(address)
                ids = sorted(self._watched.get(address, ()))
            if not ids:
                return
            message = Heartbeat(request_ids=ids)
        remaining = item.deadline - time.monotonic()
        if remaining <= 0:
            self._failed(
                address,
                message,
                f"not sent: {address} did not take earlier messages within {self._timeout:.1f}s",
                unanswered=True,
            )
            return
        own = client is None
        sender = SideChannelClient(address, self._secret, self._timeout) if client is None else client
        try:
            reply = sender.request(message, timeout=remaining, cancel=self._stop)
        except SideChannelError as exc:
            self._failed(address, message, str(exc), unanswered=isinstance(exc, NoAnswer))
            return
        except Exception as exc:  # e.g. a message that cannot be encoded: this message only
            logger.exception("notifier could not send %s to %s", type(message).__name__, address)
            self._failed(address, message, f"{type(exc).__name__}: {exc}", unanswered=False)
            return
        finally:
            if own:
                sender.close()
        self._callback(self._on_reply, address, message, reply)

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

    def _count(self, name: str) -> None:
        try:
            self._count_callback(name, 1)
        except Exception:  # a broken counter must not take delivery down with it
            logger.exception("notifier could not count %s", name)
