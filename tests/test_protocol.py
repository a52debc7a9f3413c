"""The wire protocol and settings: strict decoding, authentication, and errors that name the problem."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from connectors.settings import ConnectorSettings, parse_kv_transfer_config
from pdconnect.envelope import EnvelopeError, ReplayGuard, decode_message, encode_message
from pdconnect.errors import ConfigError
from pdconnect.protocol import (
    PROTOCOL_VERSION, Ack, CompatInfo, Done, GroupCompat, Heartbeat, ProtocolError, Release, decode_plan,
)
from pdconnect.sidechannel import SideChannelClient, SideChannelError, SideChannelServer, release_remote

PLAN = {
    "remote_engine_id": "p0", "remote_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 5700,
    "compat_hash": "abc", "num_prompt_tokens": 5131, "lease_expires_at": 1.0,
    "groups": [{"group": 0, "runs": [{"start": 0, "block_ids": [4, 5, 6]}]},
               {"group": 1, "runs": [{"start": 74, "block_ids": [9, 10, 11]}, {"start": 78, "block_ids": [12]}],
                "slack": [74, 75, 76]}],
    "do_remote_prefill": True,
}


def test_plan_round_trips_and_maps_logical_indices_to_prefill_blocks():
    plan = decode_plan(PLAN)
    assert plan.groups[1].by_index() == {74: 9, 75: 10, 76: 11, 78: 12}
    assert plan.side_channel == "tcp://127.0.0.1:5700"
    assert decode_plan(msgspec.to_builtins(plan)) == plan


@pytest.mark.parametrize(("change", "message"), [
    ({"remote_port": "5700"}, "Expected `int`, got `str` - at `$.remote_port`"),
    ({"num_prompt_tokens": 0}, "num_prompt_tokens must be positive"),
    ({"surprise": 1}, "unknown field `surprise`"),
    ({"pdconnect": 99}, "plan protocol 99"),
    ({"groups": [{"group": 0, "runs": [{"start": 0}]}]}, "missing required field `block_ids`"),
])
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


def test_messages_are_authenticated_when_a_secret_is_set():
    data = encode_message(Done(request_ids=["r1"]), secret=b"k")
    assert decode_message(data, secret=b"k") == Done(request_ids=["r1"])
    for wrong in (b"other", None):
        if wrong is None:
            data_plain = encode_message(Done(request_ids=["r1"]))
            with pytest.raises(ProtocolError, match="authentication failed"):
                decode_message(data_plain, secret=b"k")
        else:
            with pytest.raises(ProtocolError, match="authentication failed"):
                decode_message(data, secret=wrong)


def test_garbage_and_wrong_versions_are_refused():
    with pytest.raises(ProtocolError, match="malformed side-channel envelope"):
        decode_message(b"\x00garbage")
    wrong_version = msgspec.msgpack.encode({"version": 7, "body": msgspec.msgpack.encode(Ack())})
    with pytest.raises(ProtocolError, match="version 7"):
        decode_message(wrong_version)


class _Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_every_signed_envelope_carries_a_fresh_nonce_and_time_under_the_mac():
    first, second = (msgspec.msgpack.decode(encode_message(Ack(), secret=b"k", now=100.0, reply_to=b"r" * 16))
                     for _ in range(2))
    assert first["nonce"] != second["nonce"] and first["sent_at"] == 100.0 and first["reply_to"] == b"r" * 16
    # Moving the time, changing the nonce or the request answered breaks the MAC: a genuine
    # answer to one request cannot be passed off as the answer to another.
    for field, value in (("sent_at", 200.0), ("nonce", second["nonce"]), ("reply_to", b"s" * 16),
                         ("version", PROTOCOL_VERSION + 1)):
        forged = msgspec.msgpack.encode({**first, field: value})
        with pytest.raises(ProtocolError, match=f"authentication failed|version {PROTOCOL_VERSION + 1}"):
            decode_message(forged, secret=b"k")
    stripped = msgspec.msgpack.encode({k: v for k, v in first.items() if k != "reply_to"})
    with pytest.raises(ProtocolError, match="authentication failed"):
        decode_message(stripped, secret=b"k")
    # Without a secret an envelope is versioned and has an id: nothing to sign, nothing to stamp.
    assert set(msgspec.msgpack.decode(encode_message(Ack()))) == {"version", "body", "nonce"}


def test_the_replay_guard_refuses_replays_and_messages_outside_the_window():
    clock = _Clock(1000.0)
    guard = ReplayGuard(30.0, clock=clock)
    data = encode_message(Heartbeat(request_ids=["lease"]), secret=b"k", now=1000.0)
    assert decode_message(data, b"k", replay_guard=guard) == Heartbeat(request_ids=["lease"])
    with pytest.raises(EnvelopeError, match="replayed") as info:
        decode_message(data, b"k", replay_guard=guard)
    assert info.value.kind == "replayed"
    # Clock skew up to the window is tolerated both ways; beyond it the message is stale.
    for sent_at, accepted in ((970.0, True), (1030.0, True), (969.0, False), (1031.0, False),
                              (float("nan"), False), (float("inf"), False)):
        message = encode_message(Ack(), secret=b"k", now=sent_at)
        if accepted:
            assert decode_message(message, b"k", replay_guard=guard) == Ack()
        else:
            with pytest.raises(EnvelopeError, match="stale") as info:
                decode_message(message, b"k", replay_guard=guard)
            assert info.value.kind == "stale"
    # Once the window has passed, the captured message is stale, not merely a replay,
    # and its nonce is forgotten: the cache holds only what can still be replayed.
    assert len(guard) == 3
    clock.now = 1100.0
    with pytest.raises(EnvelopeError, match="stale"):
        decode_message(data, b"k", replay_guard=guard)
    decode_message(encode_message(Ack(), secret=b"k", now=1100.0), b"k", replay_guard=guard)
    assert len(guard) == 1


def test_a_full_replay_cache_refuses_instead_of_forgetting_nonces():
    guard = ReplayGuard(30.0, capacity=2)
    kept = [encode_message(Ack(), secret=b"k") for _ in range(2)]
    for data in kept:
        decode_message(data, b"k", replay_guard=guard)
    with pytest.raises(EnvelopeError, match="too many") as info:
        decode_message(encode_message(Ack(), secret=b"k"), b"k", replay_guard=guard)
    assert info.value.kind == "overloaded"
    with pytest.raises(EnvelopeError, match="replayed"):  # still remembered
        decode_message(kept[0], b"k", replay_guard=guard)


def test_unauthenticated_messages_never_reach_the_replay_cache():
    guard = ReplayGuard(30.0, capacity=1)
    for _ in range(3):
        with pytest.raises(EnvelopeError, match="authentication failed"):
            decode_message(encode_message(Ack(), secret=b"forger"), b"k", replay_guard=guard)
    assert len(guard) == 0
    assert decode_message(encode_message(Ack(), secret=b"k"), b"k", replay_guard=guard) == Ack()


def _compat(**changes) -> CompatInfo:
    base = dict(model="m", dtype="float32", cache_dtype="auto",
                groups=(GroupCompat(kind="full_attention", block_size=256, sliding_window=None, eagle=True,
                                    page_bytes=4096),),
                cache_hit_alignment=256, speculative="eagle3:1", tp_size=8, kv_layout="default")
    return CompatInfo(**{**base, **changes})


def test_compat_differences_name_each_field():
    ours, theirs = _compat(), _compat(tp_size=4, dtype="bfloat16")
    assert ours.digest() != theirs.digest() and ours.digest() == _compat().digest()
    assert ours.differences(theirs) == ["dtype: 'float32' vs 'bfloat16'", "tp_size: 8 vs 4"]


def test_side_channel_serves_answers_and_times_out_on_a_dead_peer():
    server = SideChannelServer("127.0.0.1", 0, lambda m: Ack(unknown=list(m.request_ids)), secret=b"k")
    try:
        assert release_remote(server.address, ["r1"], "client gone", secret=b"k") == Ack(unknown=["r1"])
        client = SideChannelClient(server.address, secret=b"k")
        assert client.request(Heartbeat(request_ids=["a", "b"])) == Ack(unknown=["a", "b"])
        client.close()
        with pytest.raises(SideChannelError, match="authentication failed"):
            release_remote(server.address, ["r1"], "x", secret=b"wrong")
    finally:
        server.close()
    with pytest.raises(SideChannelError, match="not sent: no connection"):
        release_remote(server.address, ["r1"], "x", secret=b"k", timeout=0.3)


def test_an_answer_that_arrived_in_time_is_taken_by_a_client_that_woke_late(monkeypatch):
    """The client's thread is descheduled right after sending (a busy engine on few cores)
    and wakes past its deadline with the answer waiting in its socket: that is an answer,
    not silence. Before, the deadline was checked before the socket and the request
    failed with "no answer" (seen as heartbeats "not delivered" to an idle prefill)."""
    import pdconnect.sidechannel as sidechannel

    server = SideChannelServer("127.0.0.1", 0, lambda m: Ack(unknown=list(m.request_ids)))
    client = SideChannelClient(server.address, timeout=1.0)
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
        client.request(Heartbeat(request_ids=["warm"]))  # connected
        monkeypatch.setattr(sidechannel.time, "monotonic", starved_clock)
        assert client.request(Heartbeat(request_ids=["late"])) == Ack(unknown=["late"])
    finally:
        monkeypatch.undo()
        client.close()
        server.close()


def test_a_handler_error_is_a_refusal_not_a_dead_server():
    def broken(message):
        raise RuntimeError("boom")

    server = SideChannelServer("127.0.0.1", 0, broken)
    try:
        client = SideChannelClient(server.address, timeout=2)
        for _ in range(2):  # the serving thread survives the first failure
            with pytest.raises(SideChannelError, match="internal error"):
                client.request(Release(request_ids=["r"], reason="x"))
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
        ({"side_channel_port": 70000}, "side_channel_port must be in 0..65535"),
        ({"transfer_timeout_seconds": 0}, "transfer_timeout_seconds must be positive"),
        ({"secret": "a", "secret_env": "B"}, "either secret or secret_env"),
    ]:
        with pytest.raises(ConfigError, match="invalid kv_connector_extra_config") as info:
            ConnectorSettings.from_extra_config(extra)
        assert message in str(info.value)


def test_a_reachable_side_channel_needs_a_secret_or_an_explicit_opt_out():
    with pytest.raises(ConfigError, match="reachable from other machines"):
        ConnectorSettings.from_extra_config({"side_channel_host": "0.0.0.0"})
    for extra in ({"secret_env": "PD_SECRET"}, {"secret": "s"}, {"allow_insecure_side_channel": True}):
        assert ConnectorSettings.from_extra_config({"side_channel_host": "0.0.0.0", **extra})
    assert ConnectorSettings.from_extra_config({"side_channel_host": "localhost"}).secret is None
    for extra in ({"side_channel_max_message_bytes": 0}, {"side_channel_max_age_seconds": -1}):
        with pytest.raises(ConfigError, match="must be positive"):
            ConnectorSettings.from_extra_config(extra)


def test_secret_is_read_from_the_environment(monkeypatch):
    settings = ConnectorSettings.from_extra_config({"secret_env": "PD_SECRET"})
    monkeypatch.setenv("PD_SECRET", "hunter2")
    assert settings.resolve_secret() == b"hunter2"
    monkeypatch.delenv("PD_SECRET")
    with pytest.raises(ConfigError, match="PD_SECRET"):
        settings.resolve_secret()


def test_kv_transfer_config_json_is_checked_as_the_engine_would():
    role, settings = parse_kv_transfer_config(
        '{"kv_connector":"PDConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"transport":"nixl"}}')
    assert role == "kv_consumer" and settings.transport == "nixl"
    for text, message in [("{", "not valid JSON"), ('{"kv_connector":"Nixl","kv_role":"kv_both"}', "PDConnector"),
                          ('{"kv_connector":"PDConnector","kv_role":"boss"}', "kv_role")]:
        with pytest.raises(ConfigError, match=message):
            parse_kv_transfer_config(text)
