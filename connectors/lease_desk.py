"""The prefill engine's side channel in a process of its own: leases answered off the engine's lock.

Why a process (docs/transfer-under-contention.md, "The side channel waited for the
interpreter lock"): in the engine process the side-channel thread shares the interpreter
lock with the scheduler's step loop. Each message costs the serving thread a dozen calls
that give the lock up (zmq's poll, recv and send, the connection gate, Ed25519's verify and
sign), and winning it back from a thread that runs Python without pause takes a switch
interval (5 ms) each time, far longer on busy cores: while a prefill engine stepped, one
release took 1.0-2.0 s and a single verify or sign up to 0.7 s. In a process of its own,
with no busy thread beside it, the desk answers in milliseconds however busy the engine.

The desk owns the authoritative `LeaseTable` (claims, heartbeats, done, releases, and
expiry against its own drain time) and answers handshakes from the replies the scheduler
hands it; the scheduler keeps the blocks. They talk over the desk's stdin and stdout in
length-prefixed msgpack frames:
- scheduler to desk: `Start`; `Open` for each lease lent; `Replies` once the workers'
  handshake data is known. Closing stdin (or the scheduler's death) stops the desk.
- desk to scheduler: `Ready` with its port (or `Failed`), then `Ended` for each lease
  that ended and `Counts` (running totals) whenever they changed.

Invariants: a lease is opened on the desk before its plan leaves the scheduler, and the
desk applies every frame waiting on its stdin before it answers a message, so no claim
arrives before the lease it names. The scheduler frees a lease's blocks only once the
lease has left the desk's table (`Ended`), or once the desk is gone and nothing can be
answered "held" any more.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import msgspec

from connectors.leases import ClaimAnswer, LeaseTable
from connectors.settings import ConnectorSettings
from pdconnect.protocol import (
    Ack,
    Claim,
    CompatInfo,
    Done,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Message,
    Refusal,
    Release,
    Role,
    describe_mismatches,
)
from pdconnect.sidechannel import SideChannelServer

__all__ = ["DESK_COUNTERS", "RELEASED", "DeskGone", "Ended", "LeaseDesk", "Start", "main"]

logger = logging.getLogger("pdconnect.connector")

# What the desk counts of its own answers, beside the side-channel server's counters.
# Releases are not among them: the scheduler counts one as it frees the blocks (see `Ended`).
DESK_COUNTERS = ("bad_transfer_params", "handshake_refusals")
# How an `Ended` reason begins when a release notice ended the lease (its sender's reason follows).
RELEASED = "released: "
# How often the desk's main loop looks for expired leases and changed counts.
_ROUND_SECONDS = 0.05
_LENGTH = struct.Struct(">I")


class Start(msgspec.Struct, frozen=True, tag="start"):
    engine_id: str
    compat: CompatInfo
    settings: ConnectorSettings
    roles: list[Role]
    port: int


class Open(msgspec.Struct, frozen=True, tag="open"):
    request_id: str
    lease_id: str
    plan_digest: str


class Replies(msgspec.Struct, frozen=True, tag="replies"):
    by_rank: dict[int, HandshakeReply]


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    port: int


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    reason: str


class Ended(msgspec.Struct, frozen=True, tag="ended"):
    """A lease ended on the desk; its reason begins with RELEASED if a release notice ended it.

    The scheduler frees the blocks and counts the release in the step that takes this
    frame. The desk's `Counts` come in a frame of their own, perhaps after that step, and a
    prefill engine whose last hold this was takes no further step to report them."""

    request_id: str
    reason: str


class Counts(msgspec.Struct, frozen=True, tag="counts"):
    totals: dict[str, int]


ToDesk = Start | Open | Replies
FromDesk = Ready | Failed | Ended | Counts


class DeskGone(RuntimeError):
    """The desk process is not running: no lease can be lent or confirmed."""


class _Frames:
    """Length-prefixed msgpack frames over a pipe; `take` never blocks on a partial frame."""

    def __init__(self, kind: object) -> None:
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(kind)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def take(self) -> list[ToDesk | FromDesk]:
        frames = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if len(self._buffer) < _LENGTH.size + length:
                break
            frames.append(self._decoder.decode(bytes(self._buffer[_LENGTH.size : _LENGTH.size + length])))
            del self._buffer[: _LENGTH.size + length]
        return frames


_encoder = msgspec.msgpack.Encoder()


def _frame(message: ToDesk | FromDesk) -> bytes:
    payload = _encoder.encode(message)
    return _LENGTH.pack(len(payload)) + payload


# --- the scheduler's side ---------------------------------------------------------------


class LeaseDesk:
    """The scheduler's handle on its desk process.

    `open`, `set_replies`, `has_ended`, `take_ended`, `totals` and `close` run on the
    scheduler thread; a reader thread of its own collects what the desk reports, and any
    fault there is logged and ends in `gone`, never in a dead thread with the desk's
    reports unread. The reader sets `news` (when given) as a lease ends or the desk goes,
    so an idle scheduler can sleep until then (`connectors.scheduler`).
    """

    def __init__(self, start: Start, startup_timeout: float = 60.0, news: threading.Event | None = None) -> None:
        # Set whenever a lease ends or the desk goes: what an idle scheduler waits for.
        self._news = news if news is not None else threading.Event()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "connectors.lease_desk"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin: IO[bytes] = self._process.stdin
        self._write_lock = threading.Lock()
        self._ended: collections.deque[Ended] = collections.deque()
        self._totals: dict[str, int] = {}
        self._answer: Ready | Failed | None = None
        self._started = threading.Event()
        self._closing = False
        self.gone = False
        self._reader = threading.Thread(
            target=self._read, args=(self._process.stdout,), name="pdconnect-lease-desk", daemon=True
        )
        self._reader.start()
        with contextlib.suppress(DeskGone):  # the reader says why below
            self._send(start)
        if not self._started.wait(startup_timeout) or not isinstance(self._answer, Ready):
            why = self._answer.reason if isinstance(self._answer, Failed) else "no answer"
            self.close()
            raise DeskGone(f"the side-channel desk did not start: {why}")
        self.port: int = self._answer.port

    @property
    def pid(self) -> int:
        """The desk process's id (it logs under it)."""
        return self._process.pid

    def open(self, request_id: str, lease_id: str, plan_digest: str) -> None:
        """Lend a lease; on return the desk will have it before any message naming it."""
        self._send(Open(request_id, lease_id, plan_digest))

    def set_replies(self, by_rank: dict[int, HandshakeReply]) -> None:
        self._send(Replies(by_rank))

    def has_ended(self) -> bool:
        """Whether ended leases wait to be taken (or the desk is gone: every lease has ended)."""
        return bool(self._ended) or self.gone

    def take_ended(self) -> list[Ended]:
        ended = []
        while self._ended:
            ended.append(self._ended.popleft())
        return ended

    def totals(self) -> dict[str, int]:
        """The desk's running counter totals: the server's and `DESK_COUNTERS`."""
        return dict(self._totals)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._stdin.close()  # the desk stops when its stdin ends
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=10)

    def _send(self, message: ToDesk) -> None:
        if self.gone:
            raise DeskGone("the side-channel desk has exited")
        try:
            with self._write_lock:
                self._stdin.write(_frame(message))
                self._stdin.flush()
        except (OSError, ValueError) as exc:  # a broken pipe: the desk died
            self.gone = True
            raise DeskGone(f"the side-channel desk has exited: {exc}") from None

    def _read(self, stdout: IO[bytes]) -> None:
        frames = _Frames(FromDesk)
        try:
            while data := os.read(stdout.fileno(), 65536):
                frames.feed(data)
                for frame in frames.take():
                    if isinstance(frame, Ended):
                        self._ended.append(frame)
                        self._news.set()
                    elif isinstance(frame, Counts):
                        self._totals = dict(frame.totals)
                    elif isinstance(frame, Ready | Failed):
                        self._answer = frame
                        self._started.set()
        except Exception:  # a reader that dies would leave every lease unreported
            logger.exception("side-channel desk: cannot read its reports")
        finally:
            self.gone = True
            self._news.set()
            self._started.set()
            if not self._closing:
                logger.error(
                    "side-channel desk exited (status %s): no lease can be lent or confirmed; "
                    "leased blocks are freed and new prefills hand nothing off",
                    self._process.poll(),
                )


# --- the desk process ---------------------------------------------------------------------


class _Desk:
    """The desk's state: its lease table, handshake replies, counters and server."""

    def __init__(self, start: Start, stdin_fd: int, out: IO[bytes]) -> None:
        self.start = start
        self._stdin_fd, self._out = stdin_fd, out
        self._frames = _Frames(ToDesk)
        self._lock = threading.Lock()  # frames are applied by one thread at a time
        self._out_lock = threading.Lock()
        self._replies: dict[int, HandshakeReply] = {}
        self._counts = dict.fromkeys(DESK_COUNTERS, 0)
        self._open = True
        self.leases: LeaseTable[None] = LeaseTable(start.settings.lease_seconds)
        settings = start.settings
        self.server = SideChannelServer(
            settings.side_channel_host,
            start.port,
            self.answer,
            settings.resolve_keys(frozenset(start.roles)),
            engine_id=start.engine_id,
            max_message_bytes=settings.side_channel_max_message_bytes,
            max_age_seconds=settings.side_channel_max_age_seconds,
            allow_insecure=settings.allow_insecure_side_channel,
            max_connections=settings.side_channel_max_connections,
            max_connections_per_host=settings.side_channel_max_connections_per_host,
        )

    def serve(self) -> None:
        """Until stdin ends: apply frames, expire leases, report what ended and the counts."""
        sent: dict[str, int] = {}
        while self._open:
            select.select([self._stdin_fd], [], [], _ROUND_SECONDS)
            self._apply_waiting_frames()
            self.leases.expire(self._judged_at())
            for lease in self.leases.take_ended():
                self._report(Ended(lease.request_id, lease.ended_because))
            totals = {**self.server.counts(), **self._counts}
            if totals != sent:
                self._report(Counts(totals))
                sent = totals
        self.server.close()

    def _judged_at(self) -> float:
        """The instant up to which a silent peer loses its leases.

        The side channel's `drained_at`, so a heartbeat queued behind a starved serving
        thread keeps its lease; but never more than one lease time behind now, so a channel
        that stays backed up cannot hold an abandoned lease: it ends within twice its lease
        time plus one round (docs/handoff-integrity.md).
        """
        return max(self.server.drained_at, time.monotonic() - self.leases.lease_seconds)

    def _apply_waiting_frames(self) -> None:
        with self._lock:
            while self._open:
                readable, _, _ = select.select([self._stdin_fd], [], [], 0)
                if not readable:
                    break
                data = os.read(self._stdin_fd, 65536)
                if not data:
                    self._open = False  # the scheduler closed us, or died
                    break
                self._frames.feed(data)
            for frame in self._frames.take():
                if isinstance(frame, Open):
                    self.leases.open(frame.request_id, frame.lease_id, frame.plan_digest, None)
                elif isinstance(frame, Replies):
                    self._replies = dict(frame.by_rank)

    def _report(self, message: FromDesk) -> None:
        with self._out_lock:
            self._out.write(_frame(message))
            self._out.flush()

    def answer(self, message: Message) -> Message:
        """The side-channel handler (server thread): every lease the scheduler lent is known."""
        self._apply_waiting_frames()
        if isinstance(message, Handshake):
            return self._answer_handshake(message)
        if isinstance(message, Claim):
            answer = self.leases.claim(message.lease_id, message.claimant, message.plan_digest)
            if answer is ClaimAnswer.TAKEN:
                return Refusal(reason="lease is claimed by another decode request")
            if answer is ClaimAnswer.ALTERED:
                self._counts["bad_transfer_params"] += 1
                return Refusal(reason="the claimed plan differs from the plan lent under this lease")
            return Ack(unknown=[message.lease_id] if answer is ClaimAnswer.UNKNOWN else [])
        if isinstance(message, Heartbeat):
            return Ack(unknown=self.leases.beat(message.request_ids))
        if isinstance(message, Done):
            why = "decode done" if message.ok else "decode gave up"
            return Ack(unknown=[i for i in message.request_ids if not self.leases.end(i, why, message.claimant)])
        if isinstance(message, Release):
            ended = [i for i in message.request_ids if self.leases.end(i, RELEASED + message.reason, message.claimant)]
            return Ack(unknown=[i for i in message.request_ids if i not in ended])
        return Refusal(reason=f"unexpected message {type(message).__name__}")

    def _answer_handshake(self, message: Handshake) -> Message:
        compat = self.start.compat
        if message.compat != compat:
            self._counts["handshake_refusals"] += 1
            logger.warning(
                "refused handshake from decode engine %r: incompatible (%s)",
                message.engine_id,
                describe_mismatches(
                    compat.mismatches(message.compat), ours="this prefill engine", theirs="decode engine"
                ),
            )
            fields = sorted({m.reason for m in compat.mismatches(message.compat)})
            # Our record goes back so the asker names every field with both values: it is
            # what a compatible asker gets in the reply anyway (no secret, no transport details).
            return Refusal(reason=f"incompatible engines: {', '.join(fields)} differ", compat=compat)
        reply = self._replies.get(message.tp_rank)
        if reply is None:
            self._counts["handshake_refusals"] += 1
            return Refusal(reason=f"no worker for TP rank {message.tp_rank}")
        return reply


def main() -> int:
    """`python -m connectors.lease_desk`: serve one engine's side channel until stdin ends."""
    logging.basicConfig(
        level=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        format=f"(lease desk pid={os.getpid()}) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stderr,
    )
    stdin_fd, out = sys.stdin.buffer.fileno(), sys.stdout.buffer
    frames = _Frames(ToDesk)
    # The scheduler sends nothing after Start until we answer: Start is all there is.
    while not (waiting := frames.take()):
        if not (data := os.read(stdin_fd, 65536)):
            return 0  # closed before it started
        frames.feed(data)
    start = waiting[0]
    if not isinstance(start, Start):
        out.write(_frame(Failed(f"expected a start frame, got {type(start).__name__}")))
        out.flush()
        return 2
    try:
        desk = _Desk(start, stdin_fd, out)
    except Exception as exc:  # noqa: BLE001 - a bad port or keys: the scheduler raises with this text
        out.write(_frame(Failed(f"{type(exc).__name__}: {exc}")))
        out.flush()
        return 1
    out.write(_frame(Ready(desk.server.port)))
    out.flush()
    desk.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
