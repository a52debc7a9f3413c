"""A prefill engine whose compat record differs is refused at handshake, naming each field with both values.

A decode engine refuses every plan whose compat digest is not its own record's (the
integrity check, `connectors.plan_checks`); before this, that refusal said only
"incompatible prefill engine". Now the decode engine handshakes with the prefill engine
named by such a plan, once per (engine, address, digest): the prefill engine refuses the
handshake and sends its record back, and the decode engine names every field that
differs with both values, logs that once, counts the refusal by field
(`pdconnect:compat_refusals_total{reason}`) and fails each such request with the first
field and both values.

Levels:
- the records themselves (`CompatInfo.mismatches`, `judge`): every field, expected
  values written out by hand;
- a real lease desk process over a real side channel: the refusal carries the record;
- real vLLM schedulers and workers over Mooncake (`tests.pd_harness.SimEngine`): two
  engines whose sliding-window block sizes differ, the once-per-engine handshake, a
  prefill engine restarted with another geometry after a good handshake, a forged digest;
- fuzz: handshakes whose parallel shape and compat record carry every wrong msgpack type
  and out-of-range value, sent signed to a real desk: each refused naming the field, the
  desk keeps serving.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any, cast

import msgspec
import pytest

from connectors.compat import PeerVerdicts, judge
from connectors.geometry import Geometry, GroupGeometry
from connectors.kvsim import random_tokens
from connectors.lease_desk import LeaseDesk, Start
from connectors.settings import ConnectorSettings
from connectors.stats import PDConnectorStats
from pdconnect.envelope import encode_message, open_envelope
from pdconnect.protocol import (
    COMPAT_REASONS,
    CompatInfo,
    GroupCompat,
    HandshakeReply,
    Message,
    Mismatch,
    ParallelShape,
    Refusal,
)
from pdconnect.sidechannel import RefusedByPeer, SideChannelClient
from pdconnect.testbed.keys import connector_keys, keyring
from tests.compat_records import FULL, OURS, SINGLE_RANK, SLIDING, handshake
from tests.params_fuzz import JSON_VALUES
from tests.pd_harness import GEOMETRY, SimEngine
from tests.waiting import wait_until

KEY = ("prefill-0", "tcp://127.0.0.1:5700", "plan-digest")


def _group(group: GroupCompat, **changes: Any) -> GroupCompat:
    return msgspec.structs.replace(group, **changes)


def _record_case(field: str, ours: object, theirs: object) -> tuple[str, CompatInfo, list[Mismatch]]:
    """The prefill engine's record with `field` set to `theirs`, and the mismatch naming both values."""
    return field, msgspec.structs.replace(OURS, **{field: theirs}), [Mismatch(field, field, ours, theirs)]


def _group_case(field: str, index: int, ours: object, theirs: object) -> tuple[str, CompatInfo, list[Mismatch]]:
    """The same for a field of group `index`."""
    groups = list(OURS.groups)
    groups[index] = _group(groups[index], **{field: theirs})
    where = f"group {index} {field}"
    return field, msgspec.structs.replace(OURS, groups=tuple(groups)), [Mismatch(field, where, ours, theirs)]


# (what changes in the prefill engine's record, the mismatches expected, by hand)
FIELD_CASES: list[tuple[str, CompatInfo, list[Mismatch]]] = [
    _record_case("model", "tiny-hybrid", "other"),
    _record_case("dtype", "float32", "bfloat16"),
    _record_case("cache_dtype", "auto", "fp8"),
    _record_case("cache_hit_alignment", 256, 512),
    _record_case("speculative", "eagle3:1", "none"),
    _record_case("kv_layout", "default", "HND"),
    _record_case("protocol_version", OURS.protocol_version, 5),
    _group_case("kind", 1, "sliding_window", "full_attention"),
    _group_case("block_size", 1, 64, 32),
    _group_case("sliding_window", 1, 128, 4096),
    _group_case("eagle", 0, True, False),
    _group_case("kv_heads", 0, 2, 8),
    _group_case("latent", 0, False, True),
    _group_case("head_page_bytes", 0, 4096, 2048),
    ("groups", msgspec.structs.replace(OURS, groups=(FULL,)), [Mismatch("groups", "number of KV cache groups", 2, 1)]),
]


def test_the_field_cases_cover_every_field_of_both_records():
    """A field added to either record without a case here fails this test."""
    assert sorted(name for name, _, _ in FIELD_CASES) == sorted(set(COMPAT_REASONS) - {"digest", "handshake"})


@pytest.mark.parametrize(("name", "theirs", "expected"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_each_differing_field_is_named_with_both_values(name: str, theirs: CompatInfo, expected: list[Mismatch]):
    # The record as it travels: encoded and strictly decoded, in a refusal.
    refusal: Refusal = msgspec.msgpack.decode(
        msgspec.msgpack.encode(Refusal(reason="incompatible engines", compat=theirs)), type=Refusal
    )
    assert refusal.compat == theirs
    assert OURS.mismatches(refusal.compat) == expected
    first = expected[0]
    verdict = judge(OURS, (*KEY[:2], theirs.digest()), refusal)
    assert verdict.reason == name and verdict.lasting
    assert f"{first.where}: prefill engine {first.theirs!r}, this decode engine {first.ours!r}" in verdict.message
    assert f"{first.where} {first.theirs!r} there, {first.ours!r} here" in verdict.short


def test_the_message_names_every_field_that_differs_in_order():
    theirs = msgspec.structs.replace(OURS, dtype="bfloat16", groups=(FULL, _group(SLIDING, block_size=128)))
    verdict = judge(OURS, ("prefill-7", "tcp://10.0.0.7:5600", theirs.digest()), theirs_refusal(theirs))
    assert verdict.message == (
        "kv_transfer_params come from an incompatible prefill engine: 'prefill-7' at tcp://10.0.0.7:5600: "
        "dtype: prefill engine 'bfloat16', this decode engine 'float32'; "
        "group 1 block_size: prefill engine 128, this decode engine 64"
    )
    assert verdict.short == (
        "kv_transfer_params come from an incompatible prefill engine: 'prefill-7' at tcp://10.0.0.7:5600: "
        "dtype 'bfloat16' there, 'float32' here and 1 more (every field logged at its handshake)"
    )
    assert verdict.reason == "dtype"


def theirs_refusal(theirs: CompatInfo) -> Refusal:
    return Refusal(reason="incompatible engines", compat=theirs)


def test_a_plan_whose_digest_is_neither_record_is_refused_as_stale_or_altered():
    verdict = judge(OURS, KEY, theirs_refusal(OURS))
    assert verdict.reason == "digest" and not verdict.lasting
    assert "the plan's compat digest plan-digest is not that engine's record" in verdict.message
    # A record that differs and is not the plan's either: named, but not kept for the digest.
    theirs = msgspec.structs.replace(OURS, dtype="bfloat16")
    stale = judge(OURS, KEY, theirs_refusal(theirs))
    assert stale.reason == "dtype" and not stale.lasting and "is not that engine's record's either" in stale.message


def test_no_record_means_the_handshake_failed_and_says_why():
    unanswered = judge(OURS, KEY, None, "no answer from tcp://127.0.0.1:5700 within 5.0s")
    assert unanswered.reason == "handshake" and not unanswered.lasting
    assert unanswered.message.endswith("its handshake failed: no answer from tcp://127.0.0.1:5700 within 5.0s")
    refused = judge(OURS, KEY, Refusal(reason="no worker for TP rank 0"))
    assert refused.message.endswith("its handshake failed: no worker for TP rank 0")


def test_verdicts_are_asked_once_per_engine_and_digest_and_kept_only_when_lasting(caplog):
    caplog.set_level(logging.WARNING, logger="pdconnect.connector")
    peers = PeerVerdicts(OURS)
    theirs = msgspec.structs.replace(OURS, groups=(FULL, _group(SLIDING, block_size=32)))
    key = ("prefill-0", "tcp://127.0.0.1:5700", theirs.digest())
    assert peers.ask(key) and not peers.ask(key)  # the second plan waits for the same answer
    assert peers.verdict(key) is None
    (made,) = peers.answer(key[1], theirs_refusal(theirs))
    assert made.reason == "block_size" and peers.verdict(key) == made
    assert not peers.ask(key)  # kept: later plans are refused without a handshake
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "group 1 block_size: prefill engine 32, this decode engine 64" in logged[0]
    # A passing verdict (no answer) goes to the plans that waited; the next plan asks again.
    other = ("prefill-1", "tcp://127.0.0.1:5701", "d")
    assert peers.ask(other)
    peers.answer(other[1], None, "no answer")
    told = peers.verdict(other)
    assert told is not None and told.reason == "handshake"
    assert peers.ask(other) and peers.verdict(other) is None


def test_refusals_are_counted_by_reason_and_aggregate():
    stats = PDConnectorStats()
    stats.count_reason("compat_refusals", "block_size")
    other = PDConnectorStats()
    other.count_reason("compat_refusals", "block_size", 2)
    other.count_reason("compat_refusals", "dtype")
    stats.aggregate(other)
    assert stats.reduce() == {"compat_refusals[block_size]": 3, "compat_refusals[dtype]": 1}
    with pytest.raises(AssertionError):
        stats.count_reason("compat_refusals", "whatever a peer said")


# --- a real desk over a real side channel ------------------------------------------------

DESK_SETTINGS = {"transport": "mooncake", "protocol": "tcp", "side_channel_port": 0, "handshake_timeout_seconds": 10.0}


@pytest.fixture(scope="module")
def desk() -> Iterator[LeaseDesk]:
    settings = ConnectorSettings.from_extra_config({**DESK_SETTINGS, **connector_keys("kv_producer")})
    desk = LeaseDesk(Start("prefill-desk", OURS, settings, ["prefill"], 0))
    yield desk
    desk.close()


def _handshake(desk: LeaseDesk, compat: CompatInfo) -> Message:
    client = SideChannelClient(f"tcp://127.0.0.1:{desk.port}", "decode", keyring("decode"), 10.0)
    try:
        return client.request(handshake("decode-x", compat))
    finally:
        client.close()


@pytest.mark.transport
def test_a_desk_refuses_an_incompatible_handshake_with_its_record(desk):
    theirs = msgspec.structs.replace(OURS, groups=(FULL, _group(SLIDING, block_size=128)))
    with pytest.raises(RefusedByPeer) as refused:
        _handshake(desk, theirs)
    assert refused.value.refusal == Refusal(reason="incompatible engines: block_size differ", compat=OURS)
    # The asker names the field with both values from that record.
    verdict = judge(theirs, ("prefill-desk", "tcp://x", OURS.digest()), refused.value.refusal)
    assert "group 1 block_size: prefill engine 64, this decode engine 128" in verdict.message


# --- fuzz: the handshake's typed fields with wrong msgpack types and out-of-range values -----

BYTES = b"\x00\x01"
VALUES: tuple[Any, ...] = (*JSON_VALUES, BYTES, -(2**63), 2**63)


def _int_at_least(low: int) -> Any:
    return lambda v: type(v) is int and low <= v < 2**64


def _text(v: Any) -> bool:
    return type(v) is str


def _flag(v: Any) -> bool:
    return type(v) is bool


# Place in the handshake -> which values decode, from the declarations and their documented
# ranges (tp_size >= 1, 0 <= tp_rank < tp_size, block sizes, windows, alignment and bytes
# per head positive, head counts non-negative), written out here rather than read from them.
PLACES: dict[tuple[str | int, ...], Any] = {
    ("parallel", "tp_size"): _int_at_least(1),
    ("parallel", "tp_rank"): lambda v: v == 0 and type(v) is int,  # tp_size is 1
    ("compat", "model"): _text,
    ("compat", "dtype"): _text,
    ("compat", "cache_dtype"): _text,
    ("compat", "cache_hit_alignment"): _int_at_least(1),
    ("compat", "speculative"): _text,
    ("compat", "kv_layout"): _text,
    ("compat", "protocol_version"): lambda v: type(v) is int and -(2**63) <= v < 2**64,
    ("compat", "groups"): lambda v: v == [],  # a list of groups: only the empty one among VALUES
    ("compat", "groups", 1, "kind"): lambda v: v in ("full_attention", "sliding_window"),
    ("compat", "groups", 1, "block_size"): _int_at_least(1),
    ("compat", "groups", 1, "sliding_window"): lambda v: v is None or _int_at_least(1)(v),
    ("compat", "groups", 1, "eagle"): _flag,
    ("compat", "groups", 1, "kv_heads"): _int_at_least(0),
    ("compat", "groups", 1, "latent"): _flag,
    ("compat", "groups", 1, "head_page_bytes"): _int_at_least(1),
}


def _json_path(place: tuple[str | int, ...]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in place)


def _with(body: dict[str, Any], place: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    body = msgspec.msgpack.decode(msgspec.msgpack.encode(body))  # a deep copy
    target: Any = body
    for step in place[:-1]:
        target = target[step]
    target[place[-1]] = value
    return body


def _answer(desk: LeaseDesk, message: Message) -> Message | str:
    """The desk's answer to `message` (a dict with a handshake's fields passes for one: it is
    encoded the same way), or its refusal's reason."""
    client = SideChannelClient(f"tcp://127.0.0.1:{desk.port}", "decode", keyring("decode"), 10.0)
    try:
        return client.request(message)
    except RefusedByPeer as exc:
        return exc.refusal.reason
    finally:
        client.close()


def test_the_fuzz_covers_every_field_of_the_shape_and_both_records():
    covered = {place[-1] for place in PLACES}
    assert covered == set(ParallelShape.__struct_fields__) | set(CompatInfo.__struct_fields__) | set(
        GroupCompat.__struct_fields__
    )


@pytest.mark.transport
def test_handshake_fields_of_every_wrong_type_and_range_are_refused_naming_them_and_the_desk_serves_on(desk):
    """Each case is signed as a decode engine would sign it, so it reaches the decoder."""
    valid = msgspec.to_builtins(handshake("decode-fuzz", OURS))
    problems: list[str] = []
    for place, accepts in PLACES.items():
        for value in VALUES:
            label = f"{_json_path(place)} = {value!r}"
            # A connection per case: a connection refused too often is cut (the refusal budget).
            answer = _answer(desk, cast(Message, _with(valid, place, value)))
            if accepts(value):
                # Decoded: the desk judged the record (or had no worker to describe).
                if isinstance(answer, str) and answer.startswith("malformed"):
                    problems.append(f"{label}: refused as malformed: {answer}")
            elif not (isinstance(answer, str) and answer.startswith("malformed side-channel message")):
                problems.append(f"{label}: not refused as malformed: {answer!r}")
            elif place[0] == "compat" and _json_path(place) not in answer:
                problems.append(f"{label}: the refusal does not name the field: {answer}")
            elif place[0] == "parallel" and "$.parallel" not in answer:
                problems.append(f"{label}: the refusal does not name the shape: {answer}")
    # The desk still answers a well-formed handshake, and describes itself in its refusal.
    theirs = msgspec.structs.replace(OURS, kv_layout="HND")
    answered = _answer(desk, handshake("decode-fuzz", theirs))
    assert answered == "incompatible engines: kv_layout differ"
    assert problems == []
    assert not desk.gone


def test_a_refusal_with_a_record_is_signed_and_opened_like_any_reply():
    data = encode_message(
        Refusal(reason="incompatible engines: dtype differ", compat=OURS), "prefill", keyring("prefill")
    )
    opened = open_envelope(data, keyring("decode"), "reply")
    assert opened.message == Refusal(reason="incompatible engines: dtype differ", compat=OURS)
    reply = HandshakeReply(
        engine_id="p",
        tp_rank=0,
        compat=OURS,
        parallel=SINGLE_RANK,
        transport="mooncake",
        transport_metadata=b"",
        layouts=b"",
    )
    assert judge(OURS, KEY, reply).reason == "digest"


# --- real schedulers and workers over Mooncake ------------------------------------------

SIM = {
    "transport": "mooncake",
    "protocol": "tcp",
    "lease_seconds": 4.0,
    "heartbeat_seconds": 1.0,
    "handshake_timeout_seconds": 5.0,
    "transfer_timeout_seconds": 10.0,
}
# The decode engine's geometry (256/64, window 128) with the sliding-window group at
# 32-token blocks, and with a window of 256.
OTHER_GEOMETRY = Geometry(
    (
        GroupGeometry("full_attention", 256, eagle=True),
        GroupGeometry("sliding_window", 32, 128, eagle=True),
    )
)
WIDER_WINDOW = Geometry(
    (
        GroupGeometry("full_attention", 256, eagle=True),
        GroupGeometry("sliding_window", 64, 256, eagle=True),
    )
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _prefill(engine_id: str, port: int, geometry: Geometry) -> SimEngine:
    return SimEngine(
        role="kv_producer", extra={**SIM, "side_channel_port": port}, engine_id=engine_id, geometry=geometry
    )


def _plan(prefill: SimEngine, request_id: str, tokens: list[int]) -> dict[str, Any]:
    prefill.add(request_id, tokens, {"do_remote_decode": True}, 1)
    params = prefill.result(request_id).kv_transfer_params
    assert params is not None
    return params


def _handshake_refusals(prefill: SimEngine) -> int:
    """The prefill desk's count of refused handshakes, once it has reported one."""
    producer = prefill.connector.scheduler_half.producer
    assert producer is not None
    return wait_until(
        lambda: producer.desk.totals().get("handshake_refusals", 0), "the desk to report its refusal", 10.0
    )


@pytest.fixture(scope="module")
def decode() -> Iterator[SimEngine]:
    engine = SimEngine(role="kv_consumer", extra={**SIM, "side_channel_port": 0}, engine_id="decode-compat")
    yield engine
    engine.shutdown()


def _tokens(seed: int, n: int = 600) -> list[int]:
    return random_tokens(n, seed)


@pytest.mark.transport
def test_block_sizes_that_differ_are_refused_at_handshake_naming_both_once_per_engine(decode, caplog):
    caplog.set_level(logging.INFO)
    prefill = _prefill("prefill-32", _free_port(), OTHER_GEOMETRY)
    try:
        before = dict(decode.counters)
        for i in range(3):
            decode.add(f"b{i}", _tokens(i), _plan(prefill, f"b{i}", _tokens(i)))
            assert decode.result(f"b{i}").finish_reason == "error"
        decode.drain()
        assert decode.free_blocks() == decode.start_free_blocks
        # One handshake for the three plans: the prefill engine refused it once.
        assert _handshake_refusals(prefill) == 1
        assert decode.counter("compat_refusals[block_size]") - before.get("compat_refusals[block_size]", 0) == 3
        assert decode.counter("bytes_transferred") == before.get("bytes_transferred", 0)
        named = "group 1 block_size: prefill engine 32, this decode engine 64"
        once = [r for r in caplog.records if named in r.getMessage()]
        assert len(once) == 1 and once[0].name == "pdconnect.connector", [r.getMessage() for r in once]
        per_request = [r.getMessage() for r in caplog.records if "refusing kv_transfer_params" in r.getMessage()]
        assert len(per_request) == 3
        assert all("group 1 block_size 32 there, 64 here" in m for m in per_request), per_request
    finally:
        prefill.shutdown()


@pytest.mark.transport
def test_a_prefill_engine_restarted_with_another_geometry_is_still_refused_at_plan_time(decode, caplog):
    """After a good handshake (and a served request) the same engine id at the same address
    comes back with a sliding window of 256 tokens: its plans carry another digest, which
    the plan check refuses whatever the worker remembers of the first handshake; one
    whose digest was edited back is refused by the claim."""
    port = _free_port()
    prefill = _prefill("prefill-r", port, GEOMETRY)
    try:
        good = _plan(prefill, "r0", _tokens(10))
        decode.add("r0", _tokens(10), good)
        assert decode.result("r0").finish_reason == "length"
        # A forged digest from the good engine: refused, its record matching this engine's.
        forged = {**_plan(prefill, "r1", _tokens(11)), "compat_hash": "0" * 16}
        decode.add("r1", _tokens(11), forged)
        assert decode.result("r1").finish_reason == "error"
        assert decode.counter("compat_refusals[digest]") >= 1
        assert "the plan's compat digest 0000000000000000 is not that engine's record" in caplog.text
    finally:
        prefill.shutdown()
    pulled = decode.counter("bytes_transferred")
    restarted = _prefill("prefill-r", port, WIDER_WINDOW)
    try:
        decode.add("r2", _tokens(12), _plan(restarted, "r2", _tokens(12)))
        assert decode.result("r2").finish_reason == "error"
        assert decode.counter("bytes_transferred") == pulled  # nothing read with the old handshake
        assert f"'prefill-r' at tcp://127.0.0.1:{port}: group 1 sliding_window: prefill engine 256" in caplog.text
        # Its plan with the digest edited to the old one passes the decode engine's checks
        # (same block sizes), and the worker still has the old handshake: the claim refuses it (a plan's digest covers
        # its compat digest), so no byte is read with the old layout.
        edited = {**_plan(restarted, "r3", _tokens(13)), "compat_hash": good["compat_hash"]}
        decode.add("r3", _tokens(13), edited)
        assert decode.result("r3").finish_reason == "error"
        assert decode.counter("bytes_transferred") == pulled
        assert "differs from the plan lent under this lease" in caplog.text
        decode.drain()
        assert decode.free_blocks() == decode.start_free_blocks
    finally:
        restarted.shutdown()
