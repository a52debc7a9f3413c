"""The wire protocol between engines and the router: typed msgspec messages, strictly decoded.

Two channels carry these types:
- the side channel (zmq, `pdconnect.sidechannel`): handshake, claims, heartbeats, done
  and release notices, each wrapped in `pdconnect.envelope`'s envelope (protocol
  version, the sender's role and direction, message id, the id a reply answers and,
  with keys, time and the sender role's Ed25519 signature); `SENDERS` says which role
  may send which message, the rule every receiver applies;
- `kv_transfer_params` (JSON inside the OpenAI request/response): the `TransferPlan` a
  prefill engine returns and a decode engine consumes, passed through by the router.

Decoding is validation: a malformed message raises `ProtocolError` naming the field,
and nothing half-parsed travels further.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "COMPAT_REASONS",
    "PROTOCOL_VERSION",
    "SENDERS",
    "Ack",
    "BlockRun",
    "Claim",
    "CompatInfo",
    "Direction",
    "Done",
    "GroupCompat",
    "GroupTransfer",
    "Handshake",
    "HandshakeReply",
    "Heartbeat",
    "LeaseMessage",
    "Message",
    "Mismatch",
    "ProtocolError",
    "Refusal",
    "Release",
    "Role",
    "TransferPlan",
    "decode_plan",
    "describe_mismatches",
    "is_remote_decode_request",
]

# 2: replies name the request they answer (`Envelope.reply_to`, signed with the rest).
# 3: envelopes name the sender's role and direction; signatures are per role (Ed25519).
# 4: messages that act on a lease name the prefill engine they are for (`to_engine`).
# 5: unequal TP: compat is TP-independent (model-wide KV heads, bytes per head), and
#    handshakes carry each side's parallel shape (`ParallelShape`).
# 6: a handshake refused for an incompatible record carries the refusing engine's record
#    (`Refusal.compat`), so the asker names every differing field with both values;
#    compat values are range-checked on decode; a plan's digest covers its compat digest.
PROTOCOL_VERSION = 6


class ProtocolError(ValueError):
    """A message or `kv_transfer_params` object failed validation."""


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every wire type: immutable, unknown fields rejected.

    msgspec hands the options down to subclasses, but a type checker reads `frozen` per
    class: each subclass says `frozen=True` again (it changes nothing at run time)."""


# --- compatibility -----------------------------------------------------------------

# Indices and block ids are never negative; the decode engine checks the upper bounds
# against its own geometry (`connectors.plan_checks`), which the wire format cannot know.
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class GroupCompat(_Strict, frozen=True):
    """What must match, per KV cache group, for one engine's blocks to be another's.

    Nothing here depends on tensor parallelism, so engines of different TP sizes agree:
    `kv_heads` counts the group's KV heads model-wide (`latent`: one MLA latent head,
    whole on every rank), and `head_page_bytes` is one head's share of a block, the same
    on every rank whatever the TP size (a rank's page is its heads times this).
    """

    kind: Literal["full_attention", "sliding_window"]
    block_size: Positive
    sliding_window: Positive | None
    eagle: bool
    kv_heads: NonNegative  # 0: the connector could not tell (`connectors.vllm_adapter.group_kv_heads`)
    latent: bool
    head_page_bytes: Positive


class Mismatch(msgspec.Struct, frozen=True):
    """One field two compat records disagree on: `reason` is the field's name (a fixed set,
    fit for a metric label), `where` names it for people ("group 1 block_size")."""

    reason: str
    where: str
    ours: object
    theirs: object


class CompatInfo(_Strict, frozen=True):
    """Everything two engines must agree on before a block can move between them.

    Compared field by field so a refusal names what differs, not just "hash mismatch".
    """

    model: str
    dtype: str
    cache_dtype: str
    groups: tuple[GroupCompat, ...]
    cache_hit_alignment: Positive
    speculative: str
    kv_layout: str
    protocol_version: int = PROTOCOL_VERSION

    def digest(self) -> str:
        """A short stable hash of all fields, carried in every plan."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]

    def mismatches(self, other: CompatInfo) -> list[Mismatch]:
        """Every field that differs, in declaration order, group fields group by group.

        Groups are compared index by index up to the shorter list; a differing count is
        one more mismatch ("groups", the two counts).
        """
        found = []
        for name in self.__struct_fields__:
            ours, theirs = getattr(self, name), getattr(other, name)
            if name != "groups":
                if ours != theirs:
                    found.append(Mismatch(name, name, ours, theirs))
                continue
            for index, (mine, peer) in enumerate(zip(self.groups, other.groups)):
                found.extend(
                    Mismatch(field, f"group {index} {field}", getattr(mine, field), getattr(peer, field))
                    for field in mine.__struct_fields__
                    if getattr(mine, field) != getattr(peer, field)
                )
            if len(self.groups) != len(other.groups):
                found.append(Mismatch("groups", "number of KV cache groups", len(self.groups), len(other.groups)))
        return found

    def differences(self, other: CompatInfo) -> list[str]:
        """Human-readable `field: ours vs theirs` for every field that differs."""
        return [f"{m.where}: {m.ours!r} vs {m.theirs!r}" for m in self.mismatches(other)]


def describe_mismatches(mismatches: list[Mismatch], ours: str, theirs: str) -> str:
    """`mismatches` in words, both sides' values each: "group 1 block_size: prefill engine
    'p0' 64, this decode engine 128; ..." (`theirs` and `ours` name the two sides)."""
    return "; ".join(f"{m.where}: {theirs} {m.theirs!r}, {ours} {m.ours!r}" for m in mismatches)


# Why a decode engine refuses a plan of another compat digest: the first field of both
# records that differs (`CompatInfo.mismatches`), the group count, "digest" for a plan
# whose digest is neither engine's record's, "handshake" when no record could be had.
COMPAT_REASONS: tuple[str, ...] = (
    *(f for f in CompatInfo.__struct_fields__ if f != "groups"),
    *GroupCompat.__struct_fields__,
    "groups",
    "digest",
    "handshake",
)


# --- the transfer plan (kv_transfer_params) ----------------------------------------


class BlockRun(_Strict, frozen=True):
    """Consecutive logical blocks `start, start+1, ...` held on P in `block_ids`."""

    start: NonNegative
    block_ids: list[NonNegative]


class GroupTransfer(_Strict, frozen=True):
    """One KV cache group's share of a plan: every block P holds for D, by logical index.

    `slack` lists the logical indices beyond the window tail (sliding-window groups):
    the decode engine receives them into blocks it allocates itself and publishes them
    into its prefix cache, because its core never allocates them.
    """

    group: NonNegative
    runs: list[BlockRun]
    slack: list[NonNegative] = []

    def by_index(self) -> dict[int, int]:
        """Logical block index -> P block id."""
        return {run.start + i: bid for run in self.runs for i, bid in enumerate(run.block_ids)}


class TransferPlan(_Strict, frozen=True):
    """What a prefill engine returns in `kv_transfer_params` for the decode engine.

    Invariant: every block named here is held on P, under lease `lease_id`, until D
    reports done, the lease expires, or someone sends a release for it. `lease_id` is
    new for every hand-off, so "lease L is still held" proves the blocks were never
    freed and reused since the plan was made. `prompt_digest` names the prompt the KV
    belongs to (`connectors.identity`): a plan pasted onto another prompt is refused.
    Both default to "" only so that old or foreign params still decode (the router
    needs the side channel to send a release); a decode engine refuses them empty.
    """

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    compat_hash: str
    num_prompt_tokens: int
    lease_expires_at: float
    groups: list[GroupTransfer]
    lease_id: str = ""
    prompt_digest: str = ""
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

    def digest(self) -> str:
        """What a claim names so the prefill engine can tell its own plan from an altered one.

        Covers every field that decides which bytes land where: the lease, the prompt,
        each group's blocks, and the compat digest (which layout the bytes have: a plan
        of a prefill engine restarted with another geometry, its digest edited to match
        the decode engine's, would otherwise pass the decode engine's digest check with
        a handshake the worker kept from before the restart). A plan edited in transit
        (by a client or a proxy) no longer matches what the prefill engine recorded, and
        its claim is refused.
        """
        covered = (
            self.lease_id,
            self.prompt_digest,
            self.num_prompt_tokens,
            self.remote_engine_id,
            self.groups,
            self.compat_hash,
        )
        return hashlib.sha256(msgspec.msgpack.encode(covered)).hexdigest()[:32]


def decode_plan(params: dict[str, Any]) -> TransferPlan:
    """Validate a decode request's `kv_transfer_params`; ProtocolError says what is wrong."""
    try:
        return msgspec.convert(params, TransferPlan, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed kv_transfer_params: {exc}") from None


def is_remote_decode_request(params: dict[str, Any] | None) -> bool:
    """True for the prefill leg of a P/D request (the router sets `do_remote_decode`)."""
    return params is not None and params.get("do_remote_decode") is True


# --- side-channel messages -----------------------------------------------------------


class _Msg(_Strict, frozen=True, tag_field="type"):
    """Base of side-channel messages; `type` names the kind on the wire."""


class _ToEngine(_Msg, frozen=True):
    """Base of the messages that act on a lease: each names the prefill engine it is for.

    Lease and request ids are only unique per engine, and a signature proves who sent a
    message, not where: without `to_engine`, a notice signed for engine A and delivered
    (by a proxy, a stale address, a replay within the window) to engine B would act on
    B's lease of the same id. The side-channel server refuses one naming another engine.
    """

    to_engine: str


class ParallelShape(_Strict, frozen=True):
    """How an engine is split: its TP size and the sender's (or the described) rank."""

    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    tp_rank: NonNegative

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of tp_size {self.tp_size}")


class Handshake(_Msg, frozen=True, tag="handshake"):
    """A decode worker asks the prefill engine for one TP rank's transport details.

    `tp_rank` is the prefill rank asked for (a decode rank may read several);
    `parallel` is the asking decode worker's own shape.
    """

    engine_id: str
    tp_rank: int
    compat: CompatInfo
    parallel: ParallelShape


class HandshakeReply(_Msg, frozen=True, tag="handshake_reply"):
    """Transport metadata and per-layer KV layouts of one prefill TP rank.

    `parallel` is the prefill engine's TP size and the rank described.
    """

    engine_id: str
    tp_rank: int
    compat: CompatInfo
    parallel: ParallelShape
    transport: str
    transport_metadata: bytes
    # msgspec-encoded `pdconnect.kvlayout` descriptions, one per registered KV tensor.
    layouts: bytes


class Heartbeat(_ToEngine, frozen=True, tag="heartbeat"):
    """The decode engine still wants these leases' blocks: extend them.

    Ids are lease ids (or, from older peers, prefill request ids); the `Ack` lists in
    `unknown` every id the prefill engine no longer holds, so decode fails that load.
    """

    request_ids: list[str]


class Claim(_ToEngine, frozen=True, tag="claim"):
    """A decode request takes the loan of a plan's blocks, or confirms it still holds it.

    Sent when decode first sees the request and again after its pull has read the
    blocks: an `Ack` with `lease_id` not in `unknown` proves the blocks were held, for
    this claimant, from the moment the plan was made until now. A lease is claimed by
    one decode request at a time; another claimant, or a plan whose `digest()` differs
    from the one the lease was opened with, is refused.
    """

    lease_id: str
    claimant: str
    plan_digest: str


class Done(_ToEngine, frozen=True, tag="done"):
    """The decode engine finished pulling (or gave up): P may free these blocks.

    With `claimant` set, a lease claimed by somebody else is left alone: a refused
    claimant giving up must not free the blocks another decode request is reading.
    """

    request_ids: list[str]
    ok: bool = True
    claimant: str | None = None


class Release(_ToEngine, frozen=True, tag="release"):
    """Free these requests' blocks now (client gone, decode aborted)."""

    request_ids: list[str]
    reason: str
    claimant: str | None = None


class Ack(_Msg, frozen=True, tag="ack"):
    """Accepted. `unknown` lists request ids the prefill engine does not hold."""

    unknown: list[str] = []


class Refusal(_Msg, frozen=True, tag="refusal"):
    """The peer refused the message; `reason` says why in words for the log.

    A handshake refused for an incompatible record carries the refusing engine's own
    record in `compat`, so the asker can name each field that differs with both values
    (the record is what a successful handshake hands any decode engine anyway).
    """

    reason: str
    compat: CompatInfo | None = None


Message = Handshake | HandshakeReply | Heartbeat | Claim | Done | Release | Ack | Refusal
LeaseMessage = Heartbeat | Claim | Done | Release

# --- who may send what -----------------------------------------------------------------

# The three parties of the side channel. A prefill engine serves; decode engines and the
# router ask. An engine with `kv_role` "kv_both" is prefill and decode at once.
Role = Literal["prefill", "decode", "router"]
Direction = Literal["request", "reply"]

# (direction, message kind) -> the roles allowed to send it. Everything a prefill engine
# is asked comes from decode, except a release, which the router may send too (the
# client went away); every answer comes from a prefill engine. A pair not listed here is
# refused whoever signed it: the router cannot claim, heartbeat or answer, decode
# cannot answer, and prefill cannot ask.
SENDERS: dict[tuple[Direction, type[Message]], frozenset[Role]] = {
    ("request", Handshake): frozenset({"decode"}),
    ("request", Claim): frozenset({"decode"}),
    ("request", Heartbeat): frozenset({"decode"}),
    ("request", Done): frozenset({"decode"}),
    ("request", Release): frozenset({"decode", "router"}),
    ("reply", HandshakeReply): frozenset({"prefill"}),
    ("reply", Ack): frozenset({"prefill"}),
    ("reply", Refusal): frozenset({"prefill"}),
}
