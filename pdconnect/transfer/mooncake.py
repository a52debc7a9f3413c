"""Mooncake Transfer Engine as a `Transport`: P2P handshake (no etcd), RDMA or TCP.

What Mooncake does on its own, and what we do about it:
- It ignores the protocol argument when choosing the data path: it installs RDMA when
  it finds an RDMA NIC and TCP otherwise (so "rdma" silently becomes TCP on a host
  without one, and "tcp" becomes RDMA on a host with one). We force its hand with
  `MC_FORCE_HCA` / `MC_FORCE_TCP` while the engine starts, so the data path in use is
  the one we decided, and `effective_protocol` is a fact, not a guess.
- Its TCP transport refuses batches of more than 1024 pending transfers per peer by
  default; the connector moves thousands of small blocks, so we raise the limits
  (unless the operator set them).
- Its Python binding waits for a batch (`batch_transfer_sync_read`,
  `get_batch_transfer_status`) by polling the status in a loop that never sleeps, a core
  busy for the whole read; its non-blocking `transfer_check_status` reports only a batch's
  first descriptor. So each range is submitted as a batch of one and the batches are polled
  without blocking, like NIXL's requests: no thread of ours spins beside Mooncake's I/O
  thread. Reads from a peer whose segment is already open are submitted by the caller,
  inside `pull()` (`connect()` opens it, below): a helper thread would need the interpreter lock for every submission,
  and in a live engine the step loop holds it for up to a switch interval (5 ms) each
  time, so a pull of 48 ranges took 15 ms (p90 130 ms) against 2 ms with an idle caller.
  A read ends at Mooncake's own timeout (`MC_TRANSFER_TIMEOUT`, default 30 s) at
  the latest; until then a timed-out pull is FAILED but not `quiescent`.
- Its TCP sessions can stall: on a loaded host a read on a just-opened connection made
  no progress for the whole 30 s (no status frame from the peer) while the next read, on
  a fresh connection, took milliseconds. So a TCP session that makes no progress for
  `stall_seconds` is dropped (`MC_TCP_PROGRESS_TIMEOUT_SEC`, `MC_TCP_STATUS_TIMEOUT_SEC`,
  unless the operator set them) and a read that failed that way is made again, on a
  fresh connection, for as long as the pull's deadline allows: a prefill engine stopped
  for longer than two stall periods (seen: ~14 s on a loaded CI host, all its processes
  at once) then still delivers within the transfer timeout. A read that failed at once
  (refused, or cut off: the peer is gone or restarting) is made again only once, so a
  gone peer fails the pull in moments, not at its deadline. Reading again is safe: the
  destination is this request's own blocks, rewritten whole, and the lease is confirmed
  after the read, not before.
- It opens a peer's segment on the first read to it, fetching the segment's descriptor
  through the peer's handshake server, which serves one connection at a time, and holding
  the one lock every submission of the process takes: a read behind a silent client of
  that server waited for it to give up (6.7 s against 6 ms), and a read to another peer,
  already open, waited as long (4.75 s, docs/parallel.md). So `connect()` opens the segment
  with a read of zero bytes, bounded like the probe, and reads never open one.
- Its TCP lanes fail a whole queue at once without touching the network: a peer's reads
  queued while none of its connections is usable, once every connection has been tried in
  the current connect round, all end FAILED in the same instant ("connect failed"), and a
  new round begins. Stall drops use rounds up: after a peer stopped for longer than a
  stall period, the first reads made to it once it runs again failed this way in about
  one pull of three (no socket call between submit and failure, `strace`), while reads made
  again a moment later, in the new round, took milliseconds (docs/handoff-integrity.md).
  So "failed at once" is counted per range: each range is read again once, and the peer
  counts as gone when a range fails at once on its second attempt too.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pdconnect.transfer._host import env_defaults, rdma_devices, scoped_env
from pdconnect.transfer.ranges import Range, RangeTable
from pdconnect.transfer.transport import LOG, MemoryRegion, PeerInfo, Transfer, TransferError, TransferState, Transport

__all__ = ["MooncakeTransport", "engine_env"]

_TCP_QUEUE_LIMITS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}

# Each data path is forced by one variable; the other must be absent, because
# MC_FORCE_TCP wins over MC_FORCE_HCA inside Mooncake.
_FORCE = {
    "rdma": {"MC_FORCE_HCA": "1", "MC_FORCE_TCP": None},
    "tcp": {"MC_FORCE_TCP": "1", "MC_FORCE_HCA": None},
}

_METADATA_SERVER = "P2PHANDSHAKE"

# Seconds without progress after which a TCP session is dropped and the read made again.
DEFAULT_STALL_SECONDS = 10.0
# A failed read that took less than this was refused or cut off, not dropped for a stall:
# Mooncake's stall timeouts are whole seconds, at least 1.
_STALL_FLOOR_SECONDS = 1.0
# Attempts of one range that failed at once, after which the peer counts as gone.
_QUICK_FAILURES = 2


def _stall_env(stall_seconds: float) -> dict[str, str]:
    seconds = str(max(1, math.ceil(stall_seconds)))  # Mooncake reads whole seconds
    return {"MC_TCP_PROGRESS_TIMEOUT_SEC": seconds, "MC_TCP_STATUS_TIMEOUT_SEC": seconds}


def engine_env(protocol: str, stall_seconds: float = DEFAULT_STALL_SECONDS) -> dict[str, str | None]:
    """The variables our engine starts under for `protocol` (None: unset), defaults
    included; a benchmark gives a bare engine the same, so only the API differs."""
    return {**_TCP_QUEUE_LIMITS, **_stall_env(stall_seconds), **_FORCE[protocol]}


class MooncakeTransport(Transport[str]):
    """Reads peers' memory with Mooncake TE; a peer handle is its P2P session name."""

    name = "mooncake"

    def __init__(
        self,
        *,
        host: str,
        protocol: str = "rdma",
        device_name: str = "",
        require_rdma: bool = False,
        connect_timeout: float = 5.0,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
    ) -> None:
        super().__init__()
        if protocol not in _FORCE:
            raise TransferError(f"mooncake protocol must be 'rdma' or 'tcp', got {protocol!r}")
        if require_rdma and protocol != "rdma":
            raise TransferError(f"require_rdma contradicts protocol {protocol!r}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                f"the mooncake transport needs the mooncake-transfer-engine package "
                f"(mooncake-transfer-engine-non-cuda on hosts without CUDA): {exc}"
            ) from None
        env_defaults({**_TCP_QUEUE_LIMITS, **_stall_env(stall_seconds)})
        self._connect_timeout = connect_timeout
        self._engine, self.effective_protocol = _start_engine(TransferEngine, host, protocol, device_name, require_rdma)
        # Sessions whose segment the binding has opened (it caches the handle by name):
        # submitting to them cannot block on a handshake.
        self._open_sessions: set[str] = set()
        wrapped = f"[{host}]" if ":" in host else host
        self._session = f"{wrapped}:{self._engine.get_rpc_port()}"
        LOG.info(
            "mooncake: session %s, protocol requested %s, effective %s%s",
            self._session,
            protocol,
            self.effective_protocol,
            f" (devices {device_name})" if device_name else "",
        )

    @property
    def session(self) -> str:
        """Our P2P session name, "host:port", as peers address us."""
        return self._session

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        rc = self._engine.batch_register_memory([r.addr for r in regions], [r.length for r in regions])
        if rc != 0:
            raise TransferError(f"mooncake refused to register {len(regions)} region(s): rc={rc}")

    def _endpoint(self) -> bytes:
        return self._session.encode()

    def _connect(self, peer: str, info: PeerInfo) -> str:
        try:
            session = info.endpoint.decode()
            host, _, port = session.rpartition(":")
            if not host or not 0 < int(port) < 65536:
                raise ValueError(session)
        except ValueError:
            raise TransferError(f"peer {peer}: mooncake endpoint {info.endpoint[:64]!r} is not 'host:port'") from None
        # Mooncake's handshake server serves one connection at a time and waits 5 s on a
        # client that connected and sent nothing before it takes the next: a probe queued
        # behind a slow client (another decode rank of a TP1 -> TP2 pairing, descheduled)
        # can go unanswered for a whole connect timeout. One more probe, queued behind the
        # first, is answered once the server has moved on (docs/parallel.md).
        rc = None
        for _ in range(_PROBE_ATTEMPTS):
            rc = _call_bounded(lambda: self._engine.send_probe(session), self._connect_timeout)
            if rc is not None:
                break
        if rc != 0:
            outcome = f"no reply within {self._connect_timeout:g} s" if rc is None else f"rc={rc}"
            raise TransferError(
                f"peer {peer}: Mooncake's handshake probe to {session} failed ({outcome}); "
                "is the prefill engine up and its host reachable from here?"
            )
        self._open_segment(peer, session, info)
        return session

    def _open_segment(self, peer: str, session: str, info: PeerInfo) -> None:
        """Open the peer's segment now, so that no read waits on its handshake server.

        The binding opens a segment on the first read to it: it fetches the segment's
        descriptor through the peer's handshake server (`openSegment` ->
        `SocketHandShakePlugin::exchangeMetadata`), which serves one connection at a time,
        and it does so holding the one lock every submission takes, so a read to any other
        peer waited too (4.75 s behind a silent client, docs/parallel.md). A read of zero
        bytes opens it without touching memory and, unlike `get_first_buffer_address`,
        without holding the interpreter lock. Not answered within the probe's attempts:
        the peer's handshake server is stuck, and the connect fails like a probe would.
        """
        local = next(iter(self._local), None)
        if local is None or not info.regions:
            return  # nothing registered on one side: no read can be made, none will open it
        bound = self._connect_timeout * _PROBE_ATTEMPTS
        # Past the bound the submitting thread stays inside the binding, holding the lock every
        # submission takes (`TransferEnginePy::batchTransferAsyncRead` opens the segment under
        # its `mutex_`), until Mooncake gives up itself: it awaits the metadata reply with
        # SO_RCVTIMEO fixed at 60 s (`SocketHandShakePlugin::doConnect`). No setting reaches
        # that wait: MC_HANDSHAKE_CONNECT_TIMEOUT bounds connect() alone, and the engine's
        # initialize takes no timeout. Measured on 0.3.13.post1: behind a port that accepts
        # and never answers the open returned after 60.6 s, with that variable set to 2 or
        # not; behind a full accept queue, after 5.0 s unset and 2.0 s set to 2.
        # A pull of its own: submitted on its own thread (the segment is not open yet), its
        # batch polled and freed like any read's, the whole of it within `bound`.
        opening = _MooncakeTransfer(
            self._engine, session, [(local.addr, info.regions[0].addr, 0)], bound, f"open-{peer}", self._open_sessions
        )
        if opening.wait(math.inf) is not TransferState.DONE:
            raise TransferError(
                f"peer {peer}: Mooncake could not open {session}'s segment ({opening.error}; bound "
                f"{bound:g} s) although its probe was answered"
            )

    def _pull(self, handle: str, ranges: Sequence[Range], timeout: float, description: str) -> Transfer:
        return _MooncakeTransfer(self._engine, handle, ranges, timeout, description, self._open_sessions)

    def _disconnect(self, peer: str, handle: str) -> None:
        # The binding keeps its segment handle cached by session name and offers no way
        # to close it; a restarted peer gets a new random port, hence a new session.
        self._open_sessions.discard(handle)

    def _close(self) -> None:
        # Running pulls hold their own reference: the engine is destroyed only after
        # the last one returns, never under a thread still inside it.
        del self._engine


class _MooncakeTransfer(Transfer):
    """One asynchronous Mooncake batch per range, polled without blocking.

    Why not one `batch_transfer_sync_read`: the binding waits for it by calling the batch
    status in a loop without sleeping or yielding, so every pull kept a core busy from
    submit to completion (for a stalled read, until Mooncake's timeout) while the engine's
    own threads and Mooncake's I/O thread, the one that moves the bytes, waited for CPU.
    `transfer_check_status` answers at once, but only for a batch's first descriptor, so
    each range is a batch of one: its status is the range's status.

    Polls ask about batches in submission order and stop at the first one still running:
    Mooncake ends a session's batches almost always in that order (over loopback TCP, 93
    of 1440 batches of 32 KiB ended before one submitted earlier), so the later ones are
    then still running too, and every call into the binding gives up the interpreter lock
    and must win it back from the engine's step. A pull of n ranges costs about n + polls
    calls, not n per poll. A failure behind a running batch is seen once the batches
    before it ended, which a stall or a gone peer does to all of them.

    A read to a session whose segment is not open (`connect()` opens it; a failed submission
    forgets it) would open it with a handshake that a frozen peer leaves unanswered, so such
    reads, and reads made again after a failure, are submitted on a short-lived thread of
    the pull's own, never on the poller's. Once the segment is open (`open_sessions`, shared by the transport's
    pulls), submitting only queues work for Mooncake's I/O threads and the caller does it
    at once: a thread of ours would wait for the interpreter lock, which an engine's step
    holds, once per range. Polls only ask Mooncake how batches stand.

    A range whose batch failed after a stall drop (`_STALL_FLOOR_SECONDS` or more) is read
    again, on a fresh connection, until the pull's deadline; a range that failed at once
    is read again until it has failed at once `_QUICK_FAILURES` times, and then the peer is
    taken for gone and nothing more is submitted. Per range, not per pull: Mooncake fails
    every read queued for a peer in one instant when a connect round is used up (the
    module docstring), which says nothing of the peer until the reads made again fail too.
    The pull is quiescent once nothing is being submitted and no batch
    is outstanding: Mooncake's own session timeouts end every batch, so that always comes.
    """

    def __init__(
        self,
        engine: Any,
        session: str,
        ranges: Sequence[Range],
        timeout: float,
        description: str,
        open_sessions: set[str],
    ) -> None:
        super().__init__(description, timeout)
        self._engine = engine
        self._session = session
        if isinstance(ranges, RangeTable):
            local, remote, length = ranges.table.T.tolist()
        else:
            local, remote, length = ([r[i] for r in ranges] for i in range(3))
        self._ranges: list[tuple[int, int, int]] = list(zip(local, remote, length))
        self._attempts = [0] * len(self._ranges)
        self._lock = threading.Lock()
        # Under the lock: range index -> (batch id, when submitted) for every batch not yet
        # ended; ranges waiting for the submitter; whether it runs; the first failure.
        self._outstanding: dict[int, tuple[int, float]] = {}
        self._to_submit: deque[int] = deque(range(len(self._ranges)))
        self._submitting = False
        self._failure: str | None = None
        self._done = 0
        self._quick_failures = [0] * len(self._ranges)  # per range: attempts that failed at once
        self._open_sessions = open_sessions
        self._start_submitter(inline=session in open_sessions)

    def _start_submitter(self, inline: bool = False) -> None:
        with self._lock:
            if self._submitting or not self._to_submit:
                return
            self._submitting = True
        if inline:
            self._submit_queued()
        else:
            threading.Thread(target=self._submit_queued, daemon=True, name=f"pdconnect-{self.description}").start()

    def _submit_queued(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._to_submit or self._failure is not None:
                        self._to_submit.clear()
                        return
                    index = self._to_submit.popleft()
                local, remote, length = self._ranges[index]
                self._attempts[index] += 1
                batch = self._engine.batch_transfer_async_read(self._session, [local], [remote], [length])
                with self._lock:
                    if batch == 0:  # the binding's failure sentinel: the segment could not be opened
                        self._open_sessions.discard(self._session)
                        self._failure = self._failure or f"mooncake could not start a read from {self._session}"
                    else:
                        self._open_sessions.add(self._session)
                        self._outstanding[index] = (batch, time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - a helper thread: reported through poll(), which must not raise
            with self._lock:
                self._failure = self._failure or f"mooncake batch read raised {exc!r}"
        finally:
            with self._lock:
                self._submitting = False

    def _status(self) -> tuple[TransferState, str | None]:
        self._check_outstanding()
        with self._lock:
            if self._failure is not None:
                return TransferState.FAILED, self._failure
            if self._done == len(self._ranges):
                return TransferState.DONE, None
        return TransferState.PENDING, None

    def _check_outstanding(self) -> None:
        """Ask Mooncake about the outstanding batches in the order they were submitted, up to the
        first still running; queue failed ranges again."""
        with self._lock:
            outstanding = list(self._outstanding.items())
        now = time.monotonic()
        again = []
        for index, (batch, submitted) in outstanding:
            code = self._engine.transfer_check_status(batch)
            if code == 0 or code == -2:  # running; -2: past Mooncake's timeout, not yet ended
                break  # the later batches, queued behind it, are asked next time (see the class)
            with self._lock:  # 1 and -1 have freed the batch inside the binding
                del self._outstanding[index]
                if code == 1:
                    self._done += 1
                    continue
                if self._failure is not None:
                    continue
                if now - submitted < _STALL_FLOOR_SECONDS:
                    self._quick_failures[index] += 1
                    if self._quick_failures[index] >= _QUICK_FAILURES:
                        self._failure = (
                            f"mooncake reads from {self._session} failed at once "
                            f"{self._quick_failures[index]} times (range {index}): peer unreachable "
                            "or gone (its log on stderr says which)"
                        )
                        continue
                if now >= self._deadline:
                    self._failure = "a mooncake read failed and the pull's deadline has passed"
                    continue
                self._to_submit.append(index)
                again.append((index, now - submitted))
        for index, took in again:
            LOG.warning(
                "transfer %s: mooncake read of range %d failed after %.1f s (attempt %d); reading it "
                "again on a fresh connection",
                self.description,
                index,
                took,
                self._attempts[index],
            )
        if again:
            self._start_submitter()

    def _release(self) -> bool:
        # Nothing can be cancelled: the local ranges are untouched once every batch ended.
        self._check_outstanding()
        with self._lock:
            return not self._submitting and not self._outstanding

    def _idle(self, seconds: float) -> None:
        time.sleep(seconds)


def _start_engine(
    factory: Callable[[], Any], host: str, protocol: str, device_name: str, require_rdma: bool
) -> tuple[Any, str]:
    """An initialized engine and the protocol it really uses."""
    if protocol == "rdma":
        devices = rdma_devices()
        # Without any kernel RDMA device the forced attempt cannot succeed; skipping it
        # saves the second a failed engine takes to shut down.
        engine = _initialize(factory, host, "rdma", device_name) if devices else None
        if engine is not None:
            return engine, "rdma"
        why = (
            f"Mooncake could not start RDMA (kernel RDMA devices: "
            f"{', '.join(devices) or 'none'}; device_name={device_name!r})"
        )
        if require_rdma:
            raise TransferError(f"{why}; require_rdma is set, so not falling back to tcp")
        LOG.warning("mooncake: %s; falling back to tcp", why)
    engine = _initialize(factory, host, "tcp", device_name)
    if engine is None:
        raise TransferError(
            f"Mooncake TransferEngine.initialize({host!r}, {_METADATA_SERVER!r}, 'tcp') "
            "failed; its log on stderr says why (bad host, no free port)"
        )
    return engine, "tcp"


def _initialize(factory: Callable[[], Any], host: str, protocol: str, device_name: str) -> Any | None:
    engine = factory()
    with scoped_env(_FORCE[protocol]):
        rc = engine.initialize(host, _METADATA_SERVER, protocol, device_name)
    return engine if rc == 0 else None


_PROBE_ATTEMPTS = 2  # a probe that got no reply is sent once more; a refusal is final


def _call_bounded(call: Callable[[], int], timeout: float) -> int | None:
    """`call()`'s result, or None if it has not returned after `timeout` seconds.

    For library calls with long built-in timeouts (Mooncake's handshake waits 60 s for
    a reply): the caller moves on and the thread finishes in the background.
    """
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True, name="pdconnect-mooncake-probe")
    worker.start()
    worker.join(timeout)
    return result[0] if result else None
