"""The side-channel envelope: protocol version, message id and, with a shared secret, an HMAC over id, time and message.

Every side-channel message travels inside one `Envelope`. Every envelope carries a random
`nonce`, the message's id; a reply names the id of the request it answers in
`reply_to`, so a client that keeps one connection across timeouts can tell a late answer
to an earlier request from the answer it waits for. With a secret the envelope also
carries the sender's wall-clock time, and the HMAC covers version, nonce, time, `reply_to`
and body together, so none of them can be changed without the secret. The receiving
server keeps a `ReplayGuard`: a message whose time lies outside the accepted window is
stale, and a nonce seen before inside the window is a replay; both are refused. Without
that, a captured heartbeat could be sent again forever and keep a lease alive.

Error texts go back to the peer as refusals, so they name what was wrong with the
*peer's* message and never a local value (our secret, version or window).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Literal, NamedTuple

import msgspec

from pdconnect.protocol import PROTOCOL_VERSION, Message, ProtocolError

__all__ = [
    "DEFAULT_MAX_AGE_SECONDS",
    "NONCE_BYTES",
    "Envelope",
    "EnvelopeError",
    "Opened",
    "ReplayGuard",
    "decode_message",
    "encode_message",
    "new_nonce",
    "open_envelope",
    "request_id_of",
]

# Also the clock skew tolerated between peers, in both directions.
DEFAULT_MAX_AGE_SECONDS = 30.0
NONCE_BYTES = 16
# Authenticated messages remembered at once. Heartbeats are batched per peer, so even a
# busy engine sees a few thousand messages per window; the bound only stops a peer that
# holds the secret from growing the cache without limit.
DEFAULT_REPLAY_CAPACITY = 1 << 18

EnvelopeErrorKind = Literal["malformed", "version", "unauthenticated", "stale", "replayed", "overloaded"]


class EnvelopeError(ProtocolError):
    """An envelope was refused; `kind` names the reason for counters and metrics."""

    def __init__(self, kind: EnvelopeErrorKind, text: str) -> None:
        super().__init__(text)
        self.kind: EnvelopeErrorKind = kind


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Version, message id (`nonce`), the id answered (`reply_to`, replies only) and, with a
    secret, send time and HMAC-SHA256 around one encoded message.

    Unset fields are left off the wire: an unsigned request is version, nonce and body.
    """

    version: int
    body: bytes
    mac: bytes | None = None
    nonce: bytes | None = None
    sent_at: float | None = None
    reply_to: bytes | None = None


class Opened(NamedTuple):
    """A checked envelope's message and the id of the request it answers (replies only)."""

    message: Message
    reply_to: bytes | None


# Created once: decoding is validation, and `Message` is whatever union protocol.py defines.
_envelope_decoder: msgspec.msgpack.Decoder[Envelope] = msgspec.msgpack.Decoder(Envelope)
_message_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()
_MAC_DOMAIN = b"pdconnect-side-channel\x00"


def new_nonce() -> bytes:
    """A message id never used before (random: ids also defeat replays)."""
    return os.urandom(NONCE_BYTES)


def _mac(secret: bytes, version: int, nonce: bytes, sent_at: float, reply_to: bytes | None, body: bytes) -> bytes:
    # Fixed-width or length-prefixed fields before the body: no two (nonce, time,
    # reply_to, body) tuples share an input.
    answered = b"" if reply_to is None else reply_to
    header = (
        struct.pack(">q", version)
        + nonce
        + struct.pack(">d", sent_at)
        + struct.pack(">?H", reply_to is not None, len(answered))
        + answered
    )
    return hmac.new(secret, _MAC_DOMAIN + header + body, hashlib.sha256).digest()


class ReplayGuard:
    """Refuses authenticated messages that are stale or were already accepted.

    Invariant: every nonce accepted less than `max_age_seconds` ago (by its own send
    time) is remembered, so it cannot be accepted twice; a message older than that is
    refused as stale, so forgetting its nonce afterwards is safe. The cache is bounded by
    `capacity`: when full, new messages are refused (failing closed) rather than older
    nonces dropped, which would reopen them to replay. Thread-safe; one per server.
    """

    def __init__(
        self,
        max_age_seconds: float = DEFAULT_MAX_AGE_SECONDS,
        *,
        capacity: int = DEFAULT_REPLAY_CAPACITY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be positive, got {max_age_seconds}")
        self.max_age_seconds = max_age_seconds
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._expiry: dict[bytes, float] = {}
        self._by_expiry: list[tuple[float, bytes]] = []

    def check(self, nonce: bytes, sent_at: float) -> None:
        """Accept (and remember) this nonce, or raise EnvelopeError saying stale/replayed."""
        now = self._clock()
        # Written so that NaN fails too: only a time inside the window passes.
        if not (now - self.max_age_seconds <= sent_at <= now + self.max_age_seconds):
            raise EnvelopeError(
                "stale", "stale side-channel message (its time is outside the accepted window; check clocks)"
            )
        with self._lock:
            self._forget_expired(now)
            if nonce in self._expiry:
                raise EnvelopeError("replayed", "replayed side-channel message (nonce already seen)")
            if len(self._expiry) >= self._capacity:
                raise EnvelopeError("overloaded", "too many side-channel messages in the replay window")
            expires = sent_at + self.max_age_seconds
            self._expiry[nonce] = expires
            heapq.heappush(self._by_expiry, (expires, nonce))

    def _forget_expired(self, now: float) -> None:
        while self._by_expiry and self._by_expiry[0][0] < now:
            _, nonce = heapq.heappop(self._by_expiry)
            del self._expiry[nonce]

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)


def encode_message(
    message: Message,
    secret: bytes | None = None,
    *,
    now: float | None = None,
    nonce: bytes | None = None,
    reply_to: bytes | None = None,
) -> bytes:
    """Serialize one side-channel message with its id; with a secret, stamp time and sign.

    `nonce` is the message's id (a fresh one by default), `reply_to` the id of the request
    this message answers, `now` overrides the send time (wall clock, seconds since the epoch).
    """
    body = _encoder.encode(message)
    nonce = new_nonce() if nonce is None else nonce
    if secret is None:
        return _encoder.encode(Envelope(version=PROTOCOL_VERSION, body=body, nonce=nonce, reply_to=reply_to))
    sent_at = time.time() if now is None else now
    mac = _mac(secret, PROTOCOL_VERSION, nonce, sent_at, reply_to, body)
    return _encoder.encode(
        Envelope(version=PROTOCOL_VERSION, body=body, mac=mac, nonce=nonce, sent_at=sent_at, reply_to=reply_to)
    )


def decode_message(data: bytes, secret: bytes | None = None, *, replay_guard: ReplayGuard | None = None) -> Message:
    """`open_envelope`'s message alone."""
    return open_envelope(data, secret, replay_guard=replay_guard).message


def request_id_of(data: bytes) -> bytes | None:
    """The id of the request in `data`, for its reply to name; read without any check, so
    that a refusal of an envelope that fails them still reaches the client waiting for it.
    None when `data` is not an envelope with a well-formed id."""
    try:
        nonce = _envelope_decoder.decode(data).nonce
    except msgspec.DecodeError:
        return None
    return nonce if nonce is not None and len(nonce) == NONCE_BYTES else None


def open_envelope(data: bytes, secret: bytes | None = None, *, replay_guard: ReplayGuard | None = None) -> Opened:
    """Check version, then (with a secret) HMAC, then (with a guard) time and nonce; then decode.

    Raises EnvelopeError (a ProtocolError) saying what was wrong. The guard is consulted
    only after the HMAC holds, so unauthenticated traffic can never fill its cache.
    """
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EnvelopeError("malformed", f"malformed side-channel envelope: {exc}") from None
    if envelope.version != PROTOCOL_VERSION:
        raise EnvelopeError("version", f"unsupported side-channel protocol version {envelope.version}")
    if secret is not None:
        if (
            envelope.mac is None
            or envelope.nonce is None
            or envelope.sent_at is None
            or len(envelope.nonce) != NONCE_BYTES
            or not hmac.compare_digest(
                envelope.mac,
                _mac(secret, envelope.version, envelope.nonce, envelope.sent_at, envelope.reply_to, envelope.body),
            )
        ):
            raise EnvelopeError("unauthenticated", "side-channel authentication failed (wrong or missing secret)")
        if replay_guard is not None:
            replay_guard.check(envelope.nonce, envelope.sent_at)
    try:
        message = _message_decoder.decode(envelope.body)
    except msgspec.DecodeError as exc:
        raise EnvelopeError("malformed", f"malformed side-channel message: {exc}") from None
    return Opened(message, envelope.reply_to)
