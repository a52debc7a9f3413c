"""The prefill engine's side channel answers from a process of its own (`connectors.lease_desk`).

The side-channel thread used to share the engine process's interpreter lock with the
scheduler's step loop, and every message it served gave the lock up a dozen times (zmq,
the connection gate, signing and verifying): a router's release took 0.9-2.0 s, past its
2 s deadline in 2 of 6 runs of the integrity module (docs/transfer-under-contention.md).
These tests drive a real desk process over a real side channel.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from connectors.lease_desk import DeskGone, LeaseDesk, Start
from connectors.settings import ConnectorSettings
from pdconnect.protocol import Ack, Claim, CompatInfo
from pdconnect.sidechannel import SideChannelClient, release_remote
from pdconnect.testbed.keys import connector_keys, keyring

pytestmark = pytest.mark.transport

BASE = {
    "transport": "mooncake", "protocol": "tcp", "side_channel_port": 0,
    "lease_seconds": 30.0, "heartbeat_seconds": 1.0, "handshake_timeout_seconds": 3.0,
    "transfer_timeout_seconds": 10.0,
}
COMPAT = CompatInfo(model="tiny", dtype="float32", cache_dtype="auto", groups=(), cache_hit_alignment=16,
                    speculative="", tp_size=1, kv_layout="test")
WAIT_S = 10.0  # bound on waits for the desk's reports; none is a performance claim


def _desk(port: int = 0) -> LeaseDesk:
    settings = ConnectorSettings.from_extra_config({**BASE, **connector_keys("kv_producer")})
    return LeaseDesk(Start("prefill-desk", COMPAT, settings, ["prefill"], port))


def _wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_claim_sent_the_moment_its_lease_is_opened_finds_it():
    """The desk applies every waiting `Open` before it answers: a plan handed out the
    instant its lease was opened is never "unknown" to its claimant."""
    desk = _desk()
    client = SideChannelClient(f"tcp://127.0.0.1:{desk.port}", "decode", keyring("decode"), 5.0)
    try:
        for i in range(50):
            desk.open(f"r{i}", f"lease-{i}", "digest")
            answer = client.request(Claim(lease_id=f"lease-{i}", claimant="decode-a", plan_digest="digest"))
            assert answer == Ack(unknown=[]), i
    finally:
        client.close()
        desk.close()


def test_a_lease_that_ends_on_the_desk_is_reported_to_the_scheduler():
    desk = _desk()
    try:
        desk.open("r1", "lease-1", "digest")
        address = f"tcp://127.0.0.1:{desk.port}"
        assert release_remote(address, ["r1"], "client disconnected", keyring("router")).unknown == []
        ended: list = []
        _wait_for(lambda: ended.extend(desk.take_ended()) or ended, "the release was not reported")
        assert [(e.request_id, e.reason) for e in ended] == [("r1", "released: client disconnected")]
        # The scheduler counts it as it frees the blocks; the desk's totals do not.
        assert "releases" not in desk.totals()
    finally:
        desk.close()


def test_a_desk_that_cannot_bind_its_port_says_why():
    taken = _desk()
    try:
        with pytest.raises(DeskGone, match="cannot bind"):
            _desk(port=taken.port)
    finally:
        taken.close()


def test_a_desk_that_dies_is_gone_and_lends_nothing_more():
    desk = _desk()
    try:
        desk.open("r1", "lease-1", "digest")
        os.kill(desk.pid, signal.SIGKILL)
        _wait_for(lambda: desk.gone, "a killed desk was not noticed")
        with pytest.raises(DeskGone):
            desk.open("r2", "lease-2", "digest")
    finally:
        desk.close()
