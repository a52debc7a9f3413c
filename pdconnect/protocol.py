"""The wire protocol between engines and the router: typed msgspec messages, strictly decoded.

Two channels carry these types:
- the side channel (zmq, `pdconnect.sidechannel`): handshake, heartbeats, done and
  release notices, each wrapped in an `Envelope` that carries the protocol version and,
  when a shared secret is configured, an HMAC of the message;
- `kv_transfer_params` (JSON inside the OpenAI request/response): the `TransferPlan` a
  prefill engine returns and a decode engine consumes, passed through by the router.

Decoding is validation: a malformed message raises `ProtocolError` naming the field,
and nothing half-parsed travels further.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Literal

import msgspec

__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "CompatInfo", "GroupCompat", "BlockRun",
    "GroupTransfer", "TransferPlan", "Handshake", "HandshakeReply", "Heartbeat",
    "Done", "Release", "Ack", "Refusal", "Message", "Envelope", "encode_message",
    "decode_message", "decode_plan", "is_remote_decode_request",
]

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message or `kv_transfer_params` object failed validation."""


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every wire type: immutable, unknown fields rejected."""


# --- compatibility -----------------------------------------------------------------


class GroupCompat(_Strict):
    """What must match, per KV cache group, for one engine's blocks to be another's."""

    kind: Literal["full_attention", "sliding_window"]
    block_size: int
    sliding_window: int | None
    eagle: bool
    page_bytes: int


class CompatInfo(_Strict):
    """Everything two engines must agree on before a block can move between them.

    Compared field by field so a refusal names what differs, not just "hash mismatch".
    """

    model: str
    dtype: str
    cache_dtype: str
    groups: tuple[GroupCompat, ...]
    cache_hit_alignment: int
    speculative: str
    tp_size: int
    kv_layout: str
    protocol_version: int = PROTOCOL_VERSION

    def digest(self) -> str:
        """A short stable hash of all fields, carried in every plan."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]

    def differences(self, other: CompatInfo) -> list[str]:
        """Human-readable `field: ours vs theirs` for every field that differs."""
        return [
            f"{name}: {getattr(self, name)!r} vs {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


# --- the transfer plan (kv_transfer_params) ----------------------------------------


class BlockRun(_Strict):
    """Consecutive logical blocks `start, start+1, ...` held on P in `block_ids`."""

    start: int
    block_ids: list[int]


class GroupTransfer(_Strict):
    """One KV cache group's share of a plan: every block P holds for D, by logical index.

    `slack` lists the logical indices beyond the window tail (sliding-window groups):
    the decode engine receives them into blocks it allocates itself and publishes them
    into its prefix cache, because its core never allocates them.
    """

    group: int
    runs: list[BlockRun]
    slack: list[int] = []

    def by_index(self) -> dict[int, int]:
        """Logical block index -> P block id."""
        return {run.start + i: bid for run in self.runs for i, bid in enumerate(run.block_ids)}


class TransferPlan(_Strict):
    """What a prefill engine returns in `kv_transfer_params` for the decode engine.

    Invariant: every block named here is held on P until D reports done, the lease
    expires, or someone sends a release for it.
    """

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    compat_hash: str
    num_prompt_tokens: int
    lease_expires_at: float
    groups: list[GroupTransfer]
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    pdconnect: int = PROTOCOL_VERSION
    # Keys vLLM itself adds to or reads from kv_transfer_params: the prefill engine's own
    # cache hit (usage reporting) and the prompt's token ids (chat re-tokenization).
    remote_prefill_cached_tokens: int | None = None
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.pdconnect != PROTOCOL_VERSION:
            raise ValueError(f"plan protocol {self.pdconnect}, this engine speaks {PROTOCOL_VERSION}")
        if self.num_prompt_tokens <= 0:
            raise ValueError("num_prompt_tokens must be positive")
        if not 0 < self.remote_port < 65536:
            raise ValueError(f"remote_port out of range: {self.remote_port}")

    @property
    def side_channel(self) -> str:
        return f"tcp://{self.remote_host}:{self.remote_port}"


def decode_plan(params: dict[str, Any]) -> TransferPlan:
    """Validate a decode request's `kv_transfer_params`; ProtocolError says what is wrong."""
    try:
        return msgspec.convert(params, TransferPlan, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed kv_transfer_params: {exc}") from None


def is_remote_decode_request(params: dict[str, Any] | None) -> bool:
    """True for the prefill leg of a P/D request (the router sets `do_remote_decode`)."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


# --- side-channel messages -----------------------------------------------------------


class _Msg(_Strict, tag_field="type"):
    """Base of side-channel messages; `type` names the kind on the wire."""


class Handshake(_Msg, tag="handshake"):
    """A decode worker asks the prefill engine for one TP rank's transport details."""

    engine_id: str
    tp_rank: int
    compat: CompatInfo


class HandshakeReply(_Msg, tag="handshake_reply"):
    """Transport metadata and per-layer KV layouts of one prefill TP rank."""

    engine_id: str
    tp_rank: int
    compat: CompatInfo
    transport: str
    transport_metadata: bytes
    # msgspec-encoded `pdconnect.kvlayout` descriptions, one per registered KV tensor.
    layouts: bytes


class Heartbeat(_Msg, tag="heartbeat"):
    """The decode engine still wants these requests' blocks: extend their lease."""

    request_ids: list[str]


class Done(_Msg, tag="done"):
    """The decode engine finished pulling (or gave up): P may free these blocks."""

    request_ids: list[str]
    ok: bool = True


class Release(_Msg, tag="release"):
    """Free these requests' blocks now (client gone, decode aborted)."""

    request_ids: list[str]
    reason: str


class Ack(_Msg, tag="ack"):
    """Accepted. `unknown` lists request ids the prefill engine does not hold."""

    unknown: list[str] = []


class Refusal(_Msg, tag="refusal"):
    """The peer refused the message; `reason` says why in words for the log."""

    reason: str


Message = Handshake | HandshakeReply | Heartbeat | Done | Release | Ack | Refusal


class Envelope(_Strict):
    """Version and optional HMAC-SHA256 around one encoded message."""

    version: int
    body: bytes
    mac: bytes | None = None


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_message_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def encode_message(message: Message, secret: bytes | None = None) -> bytes:
    """Serialize and (with a secret) authenticate one side-channel message."""
    body = _encoder.encode(message)
    mac = _mac(secret, body) if secret is not None else None
    return _encoder.encode(Envelope(version=PROTOCOL_VERSION, body=body, mac=mac))


def decode_message(data: bytes, secret: bytes | None = None) -> Message:
    """Check version and HMAC, then decode; ProtocolError says what was wrong."""
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed side-channel envelope: {exc}") from None
    if envelope.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"side-channel protocol version {envelope.version}, expected {PROTOCOL_VERSION}"
        )
    if secret is not None:
        if envelope.mac is None or not hmac.compare_digest(envelope.mac, _mac(secret, envelope.body)):
            raise ProtocolError("side-channel authentication failed (wrong or missing secret)")
    try:
        return _message_decoder.decode(envelope.body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed side-channel message: {exc}") from None
