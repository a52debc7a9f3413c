"""The wire protocol and settings: strict decoding, authentication, and errors that name the problem."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from connectors.settings import ConnectorSettings, parse_kv_transfer_config
from pdconnect.envelope import EnvelopeError, ReplayGuard, encode_message, open_envelope
from pdconnect.errors import ConfigError
from pdconnect.keyring import Keyring, SigningKey, public_key_text
from pdconnect.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Claim,
    CompatInfo,
    Direction,
    Done,
    GroupCompat,
    Handshake,
    Heartbeat,
    Message,
    ParallelShape,
    ProtocolError,
    Release,
    decode_plan,
)
from pdconnect.sidechannel import SideChannelClient, SideChannelError, SideChannelServer, release_remote
from pdconnect.testbed.keys import PEER_KEYS, SECRETS, keyring
from tests.compat_records import OURS, SINGLE_RANK

PLAN = {
    "remote_engine_id": "p0",
    "remote_request_id": "r1",
    "remote_host": "127.0.0.1",
    "remote_port": 5700,
    "compat_hash": "abc",
    "num_prompt_tokens": 5131,
    "lease_expires_at": 1.0,
    "groups": [
        {"group": 0, "runs": [{"start": 0, "block_ids": [4, 5, 6]}]},
        {
            "group": 1,
            "runs": [{"start": 74, "block_ids": [9, 10, 11]}, {"start": 78, "block_ids": [12]}],
            "slack": [74, 75, 76],
        },
    ],
    "do_remote_prefill": True,
}


def test_plan_round_trips_and_maps_logical_indices_to_prefill_blocks():
    plan = decode_plan(PLAN)
    assert plan.groups[1].by_index() == {74: 9, 75: 10, 76: 11, 78: 12}
    assert plan.side_channel == "tcp://127.0.0.1:5700"
    assert decode_plan(msgspec.to_builtins(plan)) == plan


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_port": "5700"}, "Expected `int`, got `str` - at `$.remote_port`"),
        ({"num_prompt_tokens": 0}, "num_prompt_tokens must be positive"),
        ({"surprise": 1}, "unknown field `surprise`"),
        ({"pdconnect": 99}, "plan protocol 99"),
        ({"groups": [{"group": 0, "runs": [{"start": 0}]}]}, "missing required field `block_ids`"),
    ],
)
def test_malformed_plans_are_refused_with_the_field_named(change, message):
    with pytest.raises(ProtocolError, match="malformed kv_transfer_params") as info:
        decode_plan({**PLAN, **change})
    assert message in str(info.value)


def test_a_plan_missing_a_required_field_is_refused():
    with pytest.raises(ProtocolError, match="missing required field `remote_engine_id`"):
        decode_plan({k: v for k, v in PLAN.items() if k != "remote_engine_id"})


def test_vllm_added_keys_are_accepted():
    plan = decode_plan({**PLAN, "remote_prefill_cached_tokens": 128, "prompt_token_ids": [1, 2]})
    assert plan.remote_prefill_cached_tokens == 128


def _open(data: bytes, keys: Keyring | None, direction: Direction = "request", **options) -> Message:
    return open_envelope(data, keys, direction, **options).message


PREFILL, DECODE, ROUTER = keyring("prefill"), keyring("decode"), keyring("router")


def test_messages_are_signed_by_their_role_and_checked_by_the_receiver():
    data = encode_message(Done(to_engine="prefill-0", request_ids=["r1"]), "decode", DECODE)
    assert _open(data, PREFILL) == Done(to_engine="prefill-0", request_ids=["r1"])
    unsigned = encode_message(Done(to_engine="prefill-0", request_ids=["r1"]), "decode")
    guessed = encode_message(
        Done(to_engine="prefill-0", request_ids=["r1"]), "decode", keyring("decode", secret="x" * 32)
    )
    for refused in (unsigned, guessed):
        with pytest.raises(EnvelopeError, match="no valid decode signature") as info:
            _open(refused, PREFILL)
        assert info.value.kind == "unauthenticated"


def test_no_role_can_pass_for_another_or_send_what_its_role_may_not():
    """The router holds the router's secret only: whatever it signs, a prefill engine takes
    nothing but a release from it, and a decode engine takes no answer from it. Before, one
    secret signed for all three, and the router pod could answer decode as a prefill engine."""
    ack = Ack(unknown=[])
    # Its own role, but a kind the router may not send: refused after the signature holds.
    for message in (
        Heartbeat(to_engine="prefill-0", request_ids=["l"]),
        Claim(to_engine="prefill-0", lease_id="l", claimant="c", plan_digest="d"),
        Done(to_engine="prefill-0", request_ids=["l"]),
    ):
        with pytest.raises(EnvelopeError, match="a router may not send") as info:
            _open(encode_message(message, "router", ROUTER), PREFILL)
        assert info.value.kind == "forbidden"
    assert _open(
        encode_message(Release(to_engine="prefill-0", request_ids=["l"], reason="gone"), "router", ROUTER), PREFILL
    )
    # Claiming another role: its key is not that role's, so the signature fails.
    forged = msgspec.msgpack.decode(encode_message(ack, "router", ROUTER))
    as_prefill = {**forged, "sender": "prefill"}
    with pytest.raises(EnvelopeError, match="no valid prefill signature"):
        _open(msgspec.msgpack.encode(as_prefill), DECODE, "reply")
    with pytest.raises(ValueError, match="cannot sign as prefill"):
        encode_message(ack, "prefill", ROUTER)
    # Answers come from prefill only, requests never do; a request is no answer.
    with pytest.raises(EnvelopeError, match="a decode may not send Ack as a reply"):
        _open(encode_message(ack, "decode", DECODE), DECODE, "reply")
    with pytest.raises(EnvelopeError, match="a prefill may not send Heartbeat as a request"):
        _open(encode_message(Heartbeat(to_engine="prefill-0", request_ids=["l"]), "prefill", PREFILL), PREFILL)
    with pytest.raises(EnvelopeError, match="request sent where a reply was expected"):
        _open(encode_message(Heartbeat(to_engine="prefill-0", request_ids=["l"]), "decode", DECODE), DECODE, "reply")
    assert _open(encode_message(ack, "prefill", PREFILL), DECODE, "reply") == ack
    # Without keys the roles are the peer's word, but the rules still hold.
    with pytest.raises(EnvelopeError, match="a router may not send Heartbeat"):
        _open(encode_message(Heartbeat(to_engine="prefill-0", request_ids=["l"]), "router"), None)


def test_a_role_trusts_every_key_listed_for_it_and_signs_with_its_own():
    """Rotation: verifiers list the current and the next key of a role; pods of that role
    move to the next secret one by one, and both are accepted throughout."""
    current, upcoming = SECRETS["decode"], "next-decode-secret-" + "n" * 32
    both = f"decode:{public_key_text(current.encode())} decode:{public_key_text(upcoming.encode())}"
    verifier = keyring("prefill", trusted=both)
    for secret in (current, upcoming):
        assert _open(encode_message(Ack(), "prefill", PREFILL), keyring("decode", secret=secret), "reply") == Ack()
        signed = encode_message(
            Heartbeat(to_engine="prefill-0", request_ids=["l"]), "decode", keyring("decode", secret=secret)
        )
        assert _open(signed, verifier) == Heartbeat(to_engine="prefill-0", request_ids=["l"])
    retired = keyring("prefill", trusted=f"decode:{public_key_text(upcoming.encode())}")
    with pytest.raises(EnvelopeError, match="no valid decode signature"):
        _open(encode_message(Heartbeat(to_engine="prefill-0", request_ids=["l"]), "decode", keyring("decode")), retired)


@pytest.mark.parametrize("secret", ["", "short", "x" * 31])
def test_a_secret_shorter_than_a_key_is_refused_at_start(secret, monkeypatch):
    with pytest.raises(ConfigError, match=r"at least 32|shorter than 32"):
        SigningKey(secret.encode())
    with pytest.raises(ConfigError, match="shorter than 32"):
        ConnectorSettings.from_extra_config({"secret": secret or "-", "peer_keys": PEER_KEYS})
    monkeypatch.setenv("PD_SECRET", secret or "-")
    settings = ConnectorSettings.from_extra_config({"secret_env": "PD_SECRET", "peer_keys": PEER_KEYS})
    with pytest.raises(ConfigError, match="at least 32"):
        settings.resolve_keys(frozenset({"decode"}))


def test_garbage_and_wrong_versions_are_refused():
    with pytest.raises(ProtocolError, match="malformed side-channel envelope"):
        _open(b"\x00garbage", None)
    wrong_version = msgspec.msgpack.encode({"version": 7, "body": msgspec.msgpack.encode(Ack())})
    with pytest.raises(ProtocolError, match="version 7"):
        _open(wrong_version, None)


class _Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_every_signed_envelope_carries_a_fresh_nonce_and_time_under_the_signature():
    first, second = (
        msgspec.msgpack.decode(encode_message(Ack(), "prefill", PREFILL, now=100.0, reply_to=b"r" * 16))
        for _ in range(2)
    )
    assert first["nonce"] != second["nonce"] and first["sent_at"] == 100.0 and first["reply_to"] == b"r" * 16
    # Moving the time, changing the nonce, the request answered, the role or the direction
    # breaks the signature: a genuine answer to one request cannot be passed off as the
    # answer to another, nor a message of one role as another's.
    for field, value in (
        ("sent_at", 200.0),
        ("nonce", second["nonce"]),
        ("reply_to", b"s" * 16),
        ("version", PROTOCOL_VERSION + 1),
        ("sender", "decode"),
        ("direction", "request"),
    ):
        forged = msgspec.msgpack.encode({**first, field: value})
        with pytest.raises(ProtocolError, match=f"authentication failed|version {PROTOCOL_VERSION + 1}|expected"):
            _open(forged, DECODE, "reply")
    stripped = msgspec.msgpack.encode({k: v for k, v in first.items() if k != "reply_to"})
    with pytest.raises(ProtocolError, match="authentication failed"):
        _open(stripped, DECODE, "reply")
    # Without keys an envelope is versioned, names its role and direction, and has an id.
    assert set(msgspec.msgpack.decode(encode_message(Ack(), "prefill"))) == {
        "version",
        "sender",
        "direction",
        "body",
        "nonce",
    }


def test_the_replay_guard_refuses_replays_and_messages_outside_the_window():
    clock = _Clock(1000.0)
    guard = ReplayGuard(30.0, clock=clock)
    data = encode_message(Heartbeat(to_engine="prefill-0", request_ids=["lease"]), "decode", DECODE, now=1000.0)
    assert _open(data, PREFILL, replay_guard=guard) == Heartbeat(to_engine="prefill-0", request_ids=["lease"])
    with pytest.raises(EnvelopeError, match="replayed") as info:
        _open(data, PREFILL, replay_guard=guard)
    assert info.value.kind == "replayed"
    # Clock skew up to the window is tolerated both ways; beyond it the message is stale.
    for sent_at, accepted in (
        (970.0, True),
        (1030.0, True),
        (969.0, False),
        (1031.0, False),
        (float("nan"), False),
        (float("inf"), False),
    ):
        message = encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE, now=sent_at)
        if accepted:
            assert _open(message, PREFILL, replay_guard=guard) == Done(to_engine="prefill-0", request_ids=[])
        else:
            with pytest.raises(EnvelopeError, match="stale") as info:
                _open(message, PREFILL, replay_guard=guard)
            assert info.value.kind == "stale"
    # Once the window has passed, the captured message is stale, not merely a replay,
    # and its nonce is forgotten: the cache holds only what can still be replayed.
    assert len(guard) == 3
    clock.now = 1100.0
    with pytest.raises(EnvelopeError, match="stale"):
        _open(data, PREFILL, replay_guard=guard)
    _open(
        encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE, now=1100.0),
        PREFILL,
        replay_guard=guard,
    )
    assert len(guard) == 1


def test_a_clock_stepped_back_does_not_reopen_a_captured_message_to_replay():
    """Issue 35: after the receiver's clock stepped back 2 s, a message whose nonce had
    been forgotten (its window had passed) was inside the window again and accepted."""
    clock = _Clock(1000.0)
    guard = ReplayGuard(30.0, clock=clock)
    data = encode_message(Heartbeat(to_engine="prefill-0", request_ids=["lease"]), "decode", DECODE, now=1000.0)
    _open(data, PREFILL, replay_guard=guard)
    clock.now = 1030.5  # the window has just passed: the nonce is forgotten...
    _open(
        encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE, now=1030.5),
        PREFILL,
        replay_guard=guard,
    )
    clock.now = 1028.5  # ...and the wall clock steps back 2 s
    with pytest.raises(EnvelopeError, match="stale") as info:
        _open(data, PREFILL, replay_guard=guard)
    assert info.value.kind == "stale"
    # A fresh message sent on the stepped clock is still accepted.
    assert _open(
        encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE, now=1028.5),
        PREFILL,
        replay_guard=guard,
    )


def test_a_full_replay_cache_refuses_instead_of_forgetting_nonces():
    guard = ReplayGuard(30.0, capacity=2)
    kept = [encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE) for _ in range(2)]
    for data in kept:
        _open(data, PREFILL, replay_guard=guard)
    with pytest.raises(EnvelopeError, match="too many") as info:
        _open(
            encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE), PREFILL, replay_guard=guard
        )
    assert info.value.kind == "overloaded"
    with pytest.raises(EnvelopeError, match="replayed"):  # still remembered
        _open(kept[0], PREFILL, replay_guard=guard)


def test_unauthenticated_messages_never_reach_the_replay_cache():
    guard = ReplayGuard(30.0, capacity=1)
    forger = keyring("decode", secret="f" * 40)
    for _ in range(3):
        with pytest.raises(EnvelopeError, match="authentication failed"):
            _open(
                encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", forger),
                PREFILL,
                replay_guard=guard,
            )
    assert len(guard) == 0
    assert _open(
        encode_message(Done(to_engine="prefill-0", request_ids=[]), "decode", DECODE), PREFILL, replay_guard=guard
    )


def test_compat_differences_name_each_field():
    ours, theirs = OURS, msgspec.structs.replace(OURS, kv_layout="LBNHC", dtype="bfloat16")
    assert ours.digest() != theirs.digest() and ours.digest() == msgspec.structs.replace(OURS).digest()
    assert ours.differences(theirs) == ["dtype: 'float32' vs 'bfloat16'", "kv_layout: 'default' vs 'LBNHC'"]


def test_compat_leaves_tensor_parallelism_out():
    # Engines of different TP sizes must agree: nothing per rank is in the record.
    assert not {"tp_size", "page_bytes"} & set(CompatInfo.__struct_fields__)
    assert not {"tp_size", "page_bytes"} & set(GroupCompat.__struct_fields__)


def test_parallel_shape_rank_must_be_in_range():
    assert ParallelShape(tp_size=2, tp_rank=1).tp_rank == 1
    for bad in ({"tp_size": 2, "tp_rank": 2}, {"tp_size": 0, "tp_rank": 0}, {"tp_size": 2, "tp_rank": -1}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(bad), type=ParallelShape)


def test_handshakes_carry_both_sides_parallel_shape():
    ask = Handshake(engine_id="d", tp_rank=1, compat=OURS, parallel=SINGLE_RANK)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ask), type=Handshake).parallel.tp_size == 1


def test_side_channel_serves_answers_and_times_out_on_a_dead_peer():
    server = SideChannelServer(
        "127.0.0.1", 0, lambda m: Ack(unknown=list(m.request_ids)), PREFILL, engine_id="prefill-0"
    )
    try:
        assert release_remote(server.address, "prefill-0", ["r1"], "client gone", ROUTER) == Ack(unknown=["r1"])
        client = SideChannelClient(server.address, "decode", DECODE)
        assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["a", "b"])) == Ack(unknown=["a", "b"])
        client.close()
        with pytest.raises(SideChannelError, match="authentication failed"):
            release_remote(server.address, "prefill-0", ["r1"], "x", keyring("router", secret="w" * 32))
        # A router that believes another prefill key takes no answer from this one.
        with pytest.raises(SideChannelError, match=r"bad reply.*no valid prefill signature"):
            release_remote(
                server.address,
                "prefill-0",
                ["r1"],
                "x",
                keyring("router", trusted=f"prefill:{public_key_text(b'o' * 32)}"),
            )
    finally:
        server.close()
    with pytest.raises(SideChannelError, match="not sent: no connection"):
        release_remote(server.address, "prefill-0", ["r1"], "x", ROUTER, timeout=0.3)


def test_an_answer_that_arrived_in_time_is_taken_by_a_client_that_woke_late(monkeypatch):
    """The client's thread is descheduled right after sending (a busy engine on few cores)
    and wakes past its deadline with the answer waiting in its socket: that is an answer,
    not silence. Before, the deadline was checked before the socket and the request
    failed with "no answer" (seen as heartbeats "not delivered" to an idle prefill)."""
    import pdconnect.sidechannel as sidechannel

    server = SideChannelServer("127.0.0.1", 0, lambda m: Ack(unknown=list(m.request_ids)), engine_id="prefill-0")
    client = SideChannelClient(server.address, "decode", timeout=1.0)
    clock = {"reads": 0}
    real = time.monotonic
    caller = threading.get_ident()

    def starved_clock() -> float:
        if threading.get_ident() != caller:  # the server's thread keeps the real clock
            return real()
        clock["reads"] += 1
        if clock["reads"] == 2:  # the first look at the deadline, after the send
            time.sleep(0.5)  # the answer arrives while this thread is not running
            return real() + 5.0
        return real()

    try:
        client.request(Heartbeat(to_engine="prefill-0", request_ids=["warm"]))  # connected
        monkeypatch.setattr(sidechannel.time, "monotonic", starved_clock)
        assert client.request(Heartbeat(to_engine="prefill-0", request_ids=["late"])) == Ack(unknown=["late"])
    finally:
        monkeypatch.undo()
        client.close()
        server.close()


def test_a_handler_error_is_a_refusal_not_a_dead_server():
    def broken(message):
        raise RuntimeError("boom")

    server = SideChannelServer("127.0.0.1", 0, broken, engine_id="prefill-0")
    try:
        client = SideChannelClient(server.address, "decode", timeout=2)
        for _ in range(2):  # the serving thread survives the first failure
            with pytest.raises(SideChannelError, match="internal error"):
                client.request(Release(to_engine="prefill-0", request_ids=["r"], reason="x"))
        client.close()
    finally:
        server.close()


def test_settings_refuse_unknown_keys_and_bad_values():
    assert ConnectorSettings.from_extra_config(None).transport == "mooncake"
    for extra, message in [
        ({"transprot": "nixl"}, "unknown field `transprot`"),
        ({"transport": "ftp"}, "Invalid enum value 'ftp'"),
        ({"protocol": "udp"}, "Invalid enum value 'udp'"),
        ({"lease_seconds": 5, "heartbeat_seconds": 10}, "heartbeat_seconds (10.0) must be shorter"),
        ({"side_channel_port": 70000}, "side_channel_port must be <= 65535, got 70000"),
        ({"side_channel_port": -1}, "side_channel_port must be >= 0, got -1"),
        ({"transfer_timeout_seconds": 0}, "transfer_timeout_seconds must be positive"),
        ({"secret": "a", "secret_env": "B"}, "not several"),
        ({"secret": SECRETS["decode"]}, "go together"),
        ({"peer_keys": PEER_KEYS}, "go together"),
        ({"secret": SECRETS["decode"], "peer_keys": "decode:AAAA"}, "not a base64 Ed25519 public key"),
        ({"secret": SECRETS["decode"], "peer_keys": "boss:AAAA"}, "expected role:key"),
    ]:
        with pytest.raises(ConfigError, match="invalid kv_connector_extra_config") as info:
            ConnectorSettings.from_extra_config(extra)
        assert message in str(info.value)


def test_a_reachable_side_channel_needs_a_secret_or_an_explicit_opt_out():
    with pytest.raises(ConfigError, match="reachable from other machines"):
        ConnectorSettings.from_extra_config({"side_channel_host": "0.0.0.0"})
    for extra in (
        {"secret_env": "PD_SECRET", "peer_keys_env": "PD_KEYS"},
        {"secret": SECRETS["prefill"], "peer_keys": PEER_KEYS},
        {"allow_insecure_side_channel": True},
    ):
        assert ConnectorSettings.from_extra_config({"side_channel_host": "0.0.0.0", **extra})
    assert ConnectorSettings.from_extra_config({"side_channel_host": "localhost"}).secret is None
    for extra in ({"side_channel_max_message_bytes": 0}, {"side_channel_max_age_seconds": -1}):
        with pytest.raises(ConfigError, match="must be positive"):
            ConnectorSettings.from_extra_config(extra)


def test_keys_are_read_from_the_environment_and_must_cover_every_peer_role(monkeypatch):
    settings = ConnectorSettings.from_extra_config({"secret_env": "PD_SECRET", "peer_keys_env": "PD_KEYS"})
    monkeypatch.setenv("PD_SECRET", SECRETS["decode"])
    monkeypatch.setenv("PD_KEYS", PEER_KEYS)
    keys = settings.resolve_keys(frozenset({"decode"}))
    assert keys is not None and keys.signs_as == "decode"
    signed = encode_message(Heartbeat(to_engine="prefill-0", request_ids=["l"]), "decode", keys)
    assert _open(signed, PREFILL) == Heartbeat(to_engine="prefill-0", request_ids=["l"])
    # A decode engine that was given no prefill key could verify no answer: refused at start.
    monkeypatch.setenv("PD_KEYS", PEER_KEYS.split()[1])
    with pytest.raises(ConfigError, match="needs the public keys of prefill"):
        settings.resolve_keys(frozenset({"decode"}))
    monkeypatch.delenv("PD_SECRET")
    with pytest.raises(ConfigError, match="PD_SECRET"):
        settings.resolve_keys(frozenset({"decode"}))


def test_without_keys_an_engine_talks_to_this_machine_only():
    """A plan names the host its prefill engine answers on; without keys nothing proves who
    answers there, so only loopback hosts are followed (or any, on an explicit opt-out)."""
    unsigned = ConnectorSettings.from_extra_config({})
    assert [unsigned.may_dial(h) for h in ("127.0.0.1", "localhost", "::1", "10.0.0.7", "prefill-0")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    keyed = ConnectorSettings.from_extra_config({"secret": SECRETS["decode"], "peer_keys": PEER_KEYS})
    opted_out = ConnectorSettings.from_extra_config({"allow_insecure_side_channel": True})
    assert keyed.may_dial("10.0.0.7") and opted_out.may_dial("10.0.0.7")


def test_kv_transfer_config_json_is_checked_as_the_engine_would():
    role, settings = parse_kv_transfer_config(
        '{"kv_connector":"PDConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"transport":"nixl"}}'
    )
    assert role == "kv_consumer" and settings.transport == "nixl"
    for text, message in [
        ("{", "not valid JSON"),
        ('{"kv_connector":"Nixl","kv_role":"kv_both"}', "PDConnector"),
        ('{"kv_connector":"PDConnector","kv_role":"boss"}', "kv_role"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_kv_transfer_config(text)
