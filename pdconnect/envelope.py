"""The side-channel envelope: version, sender role, direction, message id and, with keys, time and a signature.

Every side-channel message travels inside one `Envelope`. It names who sends it (a
`Role`: prefill, decode or router) and which way it goes (request or reply); every
envelope carries a random `nonce`, the message's id, and a reply names the id of the
request it answers in `reply_to`, so a client that keeps one connection across
timeouts can tell a late answer to an earlier request from the answer it waits for.

With keys (`pdconnect.keyring`) the envelope also carries the sender's wall-clock time,
the id of the key that signed it and an Ed25519 signature over version, role,
direction, nonce, time, `reply_to`, key id and body together: none of them can be
changed, and the role cannot be claimed, without that role's secret. The receiver then
applies `pdconnect.protocol.SENDERS`: a message kind the signing role may not send in
that direction is refused, whoever signed it. A receiving server keeps a
`ReplayGuard`: a message whose time lies outside the accepted window is stale, and a
nonce seen before inside the window is a replay; both are refused. Without that, a
captured heartbeat could be sent again forever and keep a lease alive.

Decoding is validation: every field has a type and a size (ids are exactly
`NONCE_BYTES`, signatures exactly 64 bytes), so any byte string a peer sends either
opens or raises `EnvelopeError`, never anything else. Error texts go back to the peer
as refusals, so they name what was wrong with the *peer's* message and never a local
value (our keys, version or window).
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections.abc import Callable
from typing import Annotated, Literal, NamedTuple

import msgspec

from pdconnect.keyring import KEY_ID_BYTES, SIGNATURE_BYTES, Keyring
from pdconnect.protocol import (
    PROTOCOL_VERSION,
    SENDERS,
    Ack,
    Direction,
    HandshakeReply,
    Message,
    ProtocolError,
    Refusal,
    Role,
)

__all__ = [
    "DEFAULT_MAX_AGE_SECONDS",
    "NONCE_BYTES",
    "Envelope",
    "EnvelopeError",
    "Opened",
    "ReplayGuard",
    "direction_of",
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
# holds a key from growing the cache without limit.
DEFAULT_REPLAY_CAPACITY = 1 << 18

EnvelopeErrorKind = Literal["malformed", "version", "unauthenticated", "forbidden", "stale", "replayed", "overloaded"]

Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
KeyId = Annotated[bytes, msgspec.Meta(min_length=KEY_ID_BYTES, max_length=KEY_ID_BYTES)]
Signature = Annotated[bytes, msgspec.Meta(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)]

_REPLIES = (HandshakeReply, Ack, Refusal)


class EnvelopeError(ProtocolError):
    """An envelope was refused; `kind` names the reason for counters and metrics."""

    def __init__(self, kind: EnvelopeErrorKind, text: str) -> None:
        super().__init__(text)
        self.kind: EnvelopeErrorKind = kind


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Version, sender role, direction, message id (`nonce`), the id answered (`reply_to`,
    replies only) and, with keys, send time, key id and signature around one encoded message.

    Unset fields are left off the wire: an unsigned request is version, role, direction,
    nonce and body.
    """

    version: int
    sender: Role
    direction: Direction
    nonce: Nonce
    body: bytes
    reply_to: Nonce | None = None
    sent_at: float | None = None
    key_id: KeyId | None = None
    signature: Signature | None = None


class _Header(msgspec.Struct, frozen=True, kw_only=True):
    """What is read of an envelope before it is checked: its version (so that another
    version is refused as such, whatever else it changed) and its id (so that even a
    refusal names the request it answers)."""

    version: object = None
    nonce: object = None


class Opened(NamedTuple):
    """A checked envelope's message, the id of the request it answers (replies only) and its sender's role."""

    message: Message
    reply_to: bytes | None
    sender: Role


# Created once: decoding is validation, and `Message` is whatever union protocol.py defines.
_header_decoder: msgspec.msgpack.Decoder[_Header] = msgspec.msgpack.Decoder(_Header)
_envelope_decoder: msgspec.msgpack.Decoder[Envelope] = msgspec.msgpack.Decoder(Envelope)
_message_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()
_SIGNATURE_DOMAIN = "pdconnect-side-channel"


def new_nonce() -> bytes:
    """A message id never used before (random: ids also defeat replays)."""
    return os.urandom(NONCE_BYTES)


def direction_of(message: Message) -> Direction:
    """Answers travel as replies, everything else as requests (`SENDERS` lists each kind once)."""
    return "reply" if isinstance(message, _REPLIES) else "request"


def _signed_bytes(envelope: Envelope) -> bytes:
    # msgpack of one fixed tuple: every field typed and length-prefixed, so no two
    # envelopes share an input, whatever sizes a peer chooses.
    return _encoder.encode(
        (
            _SIGNATURE_DOMAIN,
            envelope.version,
            envelope.sender,
            envelope.direction,
            envelope.nonce,
            envelope.sent_at,
            envelope.reply_to,
            envelope.key_id,
            envelope.body,
        )
    )


class ReplayGuard:
    """Refuses authenticated messages that are stale or were already accepted.

    Invariant: every nonce accepted less than `max_age_seconds` ago (by its own send
    time) is remembered, so it cannot be accepted twice; a message older than that is
    refused as stale, so forgetting its nonce afterwards is safe. The cache is bounded by
    `capacity`: when full, new messages are refused (failing closed) rather than older
    nonces dropped, which would reopen them to replay. Thread-safe; one per server.

    The guard's own time never runs backwards (the latest wall-clock reading it has seen):
    were the clock stepped back, a message whose nonce was already forgotten would be
    inside the window again. After a step back the window stays where it was until the
    clock catches up, so peers whose clocks stepped with it by more than the window are
    refused as stale (failing closed) meanwhile.
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
        self._latest = float("-inf")  # the latest time read from `clock`
        self._expiry: dict[bytes, float] = {}
        self._by_expiry: list[tuple[float, bytes]] = []

    def check(self, nonce: bytes, sent_at: float) -> None:
        """Accept (and remember) this nonce, or raise EnvelopeError saying stale/replayed."""
        with self._lock:
            now = self._latest = max(self._latest, self._clock())
            # Written so that NaN fails too: only a time inside the window passes.
            if not (now - self.max_age_seconds <= sent_at <= now + self.max_age_seconds):
                raise EnvelopeError(
                    "stale", "stale side-channel message (its time is outside the accepted window; check clocks)"
                )
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
    sender: Role,
    keys: Keyring | None = None,
    *,
    now: float | None = None,
    nonce: bytes | None = None,
    reply_to: bytes | None = None,
) -> bytes:
    """Serialize one side-channel message from `sender` with its id; with keys, stamp time and sign.

    `keys` sign as their own role, which must be `sender`. `nonce` is the message's id (a
    fresh one by default), `reply_to` the id of the request this message answers, `now`
    overrides the send time (wall clock, seconds since the epoch).
    """
    envelope = Envelope(
        version=PROTOCOL_VERSION,
        sender=sender,
        direction=direction_of(message),
        nonce=new_nonce() if nonce is None else nonce,
        body=_encoder.encode(message),
        reply_to=reply_to,
    )
    if keys is None:
        return _encoder.encode(envelope)
    if keys.signs_as != sender:
        raise ValueError(f"keys of {keys.signs_as} cannot sign as {sender}")
    stamped = msgspec.structs.replace(envelope, sent_at=time.time() if now is None else now, key_id=keys.signing.key_id)
    return _encoder.encode(msgspec.structs.replace(stamped, signature=keys.signing.sign(_signed_bytes(stamped))))


def request_id_of(data: bytes) -> bytes | None:
    """The id of the request in `data`, for its reply to name; read without any check, so
    that a refusal of an envelope that fails them still reaches the client waiting for it.
    None when `data` is not an envelope with a well-formed id (no client waits for that)."""
    try:
        nonce = _header_decoder.decode(data).nonce
    except msgspec.DecodeError:
        return None
    return nonce if isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES else None


def open_envelope(
    data: bytes, keys: Keyring | None, direction: Direction, *, replay_guard: ReplayGuard | None = None
) -> Opened:
    """Check version, shape, direction, then (with keys) signature, then (with a guard)
    time and nonce; decode; then check that the sender's role may send that message.

    Raises EnvelopeError (a ProtocolError) saying what was wrong, and nothing else for
    any `data`. The guard is consulted only after the signature holds, so unauthenticated
    traffic can never fill its cache. Without keys the role is the peer's word only: the
    direction and role rules still hold, so a well-behaved peer is told what it did wrong.
    """
    try:
        version = _header_decoder.decode(data).version
    except msgspec.DecodeError as exc:
        raise EnvelopeError("malformed", f"malformed side-channel envelope: {exc}") from None
    if version != PROTOCOL_VERSION:
        shown = version if isinstance(version, int) else type(version).__name__
        raise EnvelopeError("version", f"unsupported side-channel protocol version {shown}")
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EnvelopeError("malformed", f"malformed side-channel envelope: {exc}") from None
    if envelope.direction != direction:
        raise EnvelopeError("forbidden", f"a side-channel {envelope.direction} sent where a {direction} was expected")
    if keys is not None:
        if (
            envelope.signature is None
            or envelope.key_id is None
            or envelope.sent_at is None
            or not keys.trusted.verify(envelope.sender, envelope.key_id, envelope.signature, _signed_bytes(envelope))
        ):
            raise EnvelopeError(
                "unauthenticated", f"side-channel authentication failed (no valid {envelope.sender} signature)"
            )
        if replay_guard is not None:
            replay_guard.check(envelope.nonce, envelope.sent_at)
    try:
        message = _message_decoder.decode(envelope.body)
    except msgspec.DecodeError as exc:
        raise EnvelopeError("malformed", f"malformed side-channel message: {exc}") from None
    if envelope.sender not in SENDERS.get((direction, type(message)), frozenset()):
        raise EnvelopeError("forbidden", f"a {envelope.sender} may not send {type(message).__name__} as a {direction}")
    return Opened(message, envelope.reply_to, envelope.sender)
