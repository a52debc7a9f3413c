"""The prefill engine's side channel answers from a process of its own (`connectors.lease_desk`).

The side-channel thread used to share the engine process's interpreter lock with the
scheduler's step loop, and every message it served gave the lock up a dozen times (zmq,
the connection gate, signing and verifying): a router's release took 0.9-2.0 s, past its
2 s deadline in 2 of 6 runs of the integrity module (docs/transfer-under-contention.md).
These tests drive a real desk process over a real side channel.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Self

import pytest
import zmq

from connectors.lease_desk import DeskGone, Ended, LeaseDesk, Start
from connectors.settings import ConnectorSettings
from pdconnect.protocol import Ack, Claim, CompatInfo, Heartbeat
from pdconnect.sidechannel import NoAnswer, SideChannelClient, SideChannelError, release_remote
from pdconnect.testbed.keys import connector_keys, keyring
from tests.connector_support import loopback_settings
from tests.waiting import wait_until

pytestmark = pytest.mark.transport

BASE = loopback_settings(handshake_timeout_seconds=3.0)
COMPAT = CompatInfo(
    model="tiny",
    dtype="float32",
    cache_dtype="auto",
    groups=(),
    cache_hit_alignment=16,
    speculative="",
    kv_layout="test",
)
WAIT_S = 10.0  # bound on waits for the desk's reports; none is a performance claim


def _desk(port: int = 0, engine_id: str = "prefill-desk", **overrides: float) -> LeaseDesk:
    settings = ConnectorSettings.from_extra_config({**BASE, **overrides, **connector_keys("kv_producer")})
    return LeaseDesk(Start(engine_id, COMPAT, settings, ["prefill"], port))


def test_a_claim_sent_the_moment_its_lease_is_opened_finds_it():
    """The desk applies every waiting `Open` before it answers: a plan handed out the
    instant its lease was opened is never "unknown" to its claimant."""
    desk = _desk()
    try:
        _each_claim_finds_its_lease(desk, 50, 5.0)
    finally:
        desk.close()


def _each_claim_finds_its_lease(desk: LeaseDesk, count: int, deadline_s: float) -> None:
    """Open `count` leases, each claimed at once by a client that waits `deadline_s` for its answer."""
    client = SideChannelClient(f"tcp://127.0.0.1:{desk.port}", "decode", keyring("decode"), deadline_s)
    try:
        for i in range(count):
            desk.open(f"r{i}", f"lease-{i}", "digest")
            claim = Claim(to_engine="prefill-desk", lease_id=f"lease-{i}", claimant="decode-a", plan_digest="digest")
            answer = client.request(claim)
            assert answer == Ack(unknown=[]), i
    finally:
        client.close()


def test_a_lease_that_ends_on_the_desk_is_reported_to_the_scheduler():
    desk = _desk()
    try:
        desk.open("r1", "lease-1", "digest")
        address = f"tcp://127.0.0.1:{desk.port}"
        assert release_remote(address, "prefill-desk", ["r1"], "client disconnected", keyring("router")).unknown == []
        ended: list = []
        wait_until(lambda: ended.extend(desk.take_ended()) or ended, "the release to be reported", WAIT_S)
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
        wait_until(lambda: desk.gone, "a killed desk to be noticed", WAIT_S)
        with pytest.raises(DeskGone):
            desk.open("r2", "lease-2", "digest")
    finally:
        desk.close()


# --- a side channel that is never idle (issue 35) --------------------------------------
# The desk used to expire leases only up to the side channel's `drained_at`, which moved
# only when a 100 ms poll found nothing: under a steady stream of signed heartbeats and
# junk, an abandoned lease stayed held until the traffic stopped. Bounded traffic, loopback.

LEASE_S = 1.0
# Each source sends about 100 messages a second (200 in all) for at most this long: the
# documented bound (twice the lease time plus a round) with room for a loaded machine.
TRAFFIC_S = 2 * LEASE_S + 3.0
GAP_S = 0.01
# Messages of each kind the desk has taken before a test lends its lease: traffic is flowing.
FLOWING = 5


class _Traffic:
    """Signed heartbeats (for leases the desk does not hold) and junk frames, until stopped."""

    def __init__(self, port: int) -> None:
        self.address = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.sent = {"heartbeats": 0, "junk": 0}
        self.ran_out = False
        self._threads = [threading.Thread(target=self._beats), threading.Thread(target=self._junk)]

    def _beats(self) -> None:
        client = SideChannelClient(self.address, "decode", keyring("decode"), 2.0)
        try:
            self._every_gap(
                lambda: self._count(
                    "heartbeats", client.request(Heartbeat(to_engine="prefill-desk", request_ids=["gone"]))
                )
            )
        finally:
            client.close()

    def _junk(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            self._every_gap(lambda: self._count("junk", sock.send(b"\x00junk, not an envelope")))
        finally:
            sock.close()
            context.term()

    def wait_flowing(self) -> None:
        """Until the desk has answered heartbeats and taken junk: the channel is busy from here on."""
        wait_until(
            lambda: min(self.sent.values()) >= FLOWING,
            f"{FLOWING} heartbeats answered and {FLOWING} junk frames sent",
            WAIT_S,
            observe=lambda: dict(self.sent),
        )

    def _count(self, kind: str, _: object) -> None:
        self.sent[kind] += 1

    def _every_gap(self, send: Callable[[], None]) -> None:
        ends = time.monotonic() + TRAFFIC_S
        while not self.stop.is_set():
            if time.monotonic() >= ends:
                self.ran_out = True
                return
            # A busy desk may not answer one heartbeat in time; the traffic goes on.
            with contextlib.suppress(NoAnswer):
                send()
            time.sleep(GAP_S)

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(TRAFFIC_S + 5)


@pytest.fixture
def busy_desk() -> Iterator[LeaseDesk]:
    desk = _desk(lease_seconds=LEASE_S, heartbeat_seconds=0.3)
    yield desk
    desk.close()


def test_an_abandoned_lease_ends_while_the_side_channel_stays_busy(busy_desk: LeaseDesk) -> None:
    desk = busy_desk
    ended: list[Ended] = []
    with _Traffic(desk.port) as traffic:
        traffic.wait_flowing()  # the side channel is busy before the lease is lent
        desk.open("r1", "lease-1", "digest")  # its decode engine died: nobody beats for it

        def ended_or_ran_out() -> bool:
            ended.extend(desk.take_ended())
            return bool(ended) or traffic.ran_out

        wait_until(
            ended_or_ran_out,
            "the abandoned lease to end, or the traffic to run out",
            TRAFFIC_S + WAIT_S,
        )
        still_busy = not traffic.ran_out
    assert [(e.request_id, e.reason) for e in ended] == [("r1", "lease expired")]
    assert still_busy, "the lease ended only once the traffic stopped"
    assert traffic.sent["heartbeats"] > 0 and traffic.sent["junk"] > 0


def test_the_desk_answers_a_claim_within_its_deadline_under_the_same_traffic(busy_desk: LeaseDesk) -> None:
    with _Traffic(busy_desk.port) as traffic:
        traffic.wait_flowing()
        _each_claim_finds_its_lease(busy_desk, 20, 2.0)


def test_a_release_for_one_prefill_engine_is_refused_by_another():
    """Issue 35: a router-signed Release names the engine it is for; another engine's
    desk refuses it and keeps its lease, the named engine's desk accepts it."""
    desk_a, desk_b = _desk(engine_id="prefill-a"), _desk(engine_id="prefill-b")
    try:
        for desk in (desk_a, desk_b):
            desk.open("r1", "lease-1", "digest")
        address_a, address_b = (f"tcp://127.0.0.1:{d.port}" for d in (desk_a, desk_b))
        with pytest.raises(SideChannelError, match=r"refused Release: .*engine"):
            release_remote(address_b, "prefill-a", ["r1"], "client disconnected", keyring("router"))
        client = SideChannelClient(address_b, "decode", keyring("decode"), WAIT_S)
        try:  # B still lends lease-1: its claimant is told it is held
            claim = Claim(to_engine="prefill-b", lease_id="lease-1", claimant="decode-a", plan_digest="digest")
            assert client.request(claim) == Ack()
        finally:
            client.close()
        assert desk_b.take_ended() == []
        assert release_remote(address_a, "prefill-a", ["r1"], "client disconnected", keyring("router")) == Ack()
        ended: list = []
        wait_until(lambda: ended.extend(desk_a.take_ended()) or ended, "A to end the released lease", WAIT_S)
        assert [(e.request_id, e.reason) for e in ended] == [("r1", "released: client disconnected")]
        wait_until(
            lambda: desk_b.totals().get("refused_wrong_engine") == 1,
            "B to count the refusal",
            WAIT_S,
            observe=desk_b.totals,
        )
    finally:
        desk_a.close()
        desk_b.close()
