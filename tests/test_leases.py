"""The prefill engine's lease table: who may read a hand-off's blocks, and the invariant that makes "held" true."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from connectors.leases import CLAIM_ATTEMPTS, ClaimAnswer, LeaseTable, confirm_claim, new_lease_id
from pdconnect.protocol import Ack, Claim, Message, Refusal
from pdconnect.sidechannel import NoAnswer, SideChannelClient, SideChannelServer
from tests.waiting import wait_until


def _table(seconds: float = 60.0) -> LeaseTable[list[int]]:
    return LeaseTable(lease_seconds=seconds)


def test_a_lease_is_claimed_by_one_claimant_at_a_time():
    table = _table()
    table.open("r1", "L1", "plan", [1, 2])

    assert table.claim("L1", "decode-a/r", "plan") is ClaimAnswer.HELD
    assert table.claim("L1", "decode-a/r", "plan") is ClaimAnswer.HELD  # confirming is idempotent
    assert table.claim("L1", "decode-b/r", "plan") is ClaimAnswer.TAKEN


def test_a_claim_naming_another_plan_is_refused():
    table = _table()
    table.open("r1", "L1", "plan", [1])

    assert table.claim("L1", "decode-a/r", "altered") is ClaimAnswer.ALTERED
    # An altered claim takes nothing: the rightful claimant still can.
    assert table.claim("L1", "decode-b/r", "plan") is ClaimAnswer.HELD


def test_ended_and_unknown_leases_are_unknown_forever():
    table = _table()
    table.open("r1", "L1", "plan", [1])
    table.claim("L1", "c", "plan")

    assert table.end("L1", "decode done", claimant="c")
    assert table.claim("L1", "c", "plan") is ClaimAnswer.UNKNOWN
    assert table.claim("never", "c", "plan") is ClaimAnswer.UNKNOWN
    assert table.beat(["L1", "never"]) == ["L1", "never"]
    table.open("r1", "L2", "plan", [1])  # the same request handed off again: a new lease
    assert table.claim("L1", "c", "plan") is ClaimAnswer.UNKNOWN


def test_only_the_claimant_or_an_operator_ends_a_claimed_lease():
    table = _table()
    table.open("r1", "L1", "plan", [1])

    assert not table.end("L1", "gave up", claimant="stranger")  # unclaimed: no decode may end it
    table.claim("L1", "owner", "plan")
    assert not table.end("L1", "gave up", claimant="stranger")
    assert table.end("r1", "client gone")  # the router releases by request id
    assert [lease.request_id for lease in table.take_ended()] == ["r1"]


def test_blocks_are_handed_back_only_after_the_lease_left_the_table():
    table = _table(seconds=0.05)
    table.open("r1", "L1", "plan", [7, 8])
    time.sleep(0.1)

    assert table.take_ended() == []  # overdue, but nobody has judged the peer silent yet
    assert table.expire() == 1
    assert table.claim("L1", "c", "plan") is ClaimAnswer.UNKNOWN  # gone for every asker...
    ended = table.take_ended()
    # ...and the blocks come out of `ended` exactly once, for the scheduler thread to free.
    assert [(lease.held, lease.ended_because) for lease in ended] == [([7, 8], "lease expired")]
    assert table.take_ended() == [] and table.expire() == 0


def test_a_heartbeat_that_waited_behind_a_starved_server_keeps_its_lease():
    table = _table(seconds=0.05)
    table.open("r1", "L1", "plan", [1])
    drained_at = time.monotonic()  # the serving thread last emptied its queue here...
    time.sleep(0.1)  # ...then starved while the lease ran out and a heartbeat queued up

    assert table.expire(now=drained_at) == 0  # not silent: its heartbeat is still queued
    assert table.beat(["L1"]) == []  # the late heartbeat is answered and extends it
    assert table.expire(now=time.monotonic()) == 0


def test_heartbeats_keep_a_lease_alive_and_name_what_is_gone():
    table = _table(seconds=0.3)
    table.open("r1", "L1", "plan", [1])
    for _ in range(5):
        time.sleep(0.1)
        assert table.beat(["L1"]) == []
    assert table.expire() == 0
    time.sleep(0.4)
    assert table.expire() == 1
    assert table.beat(["L1"]) == ["L1"]


def test_concurrent_claims_leave_exactly_one_claimant():
    table = _table()
    table.open("r1", "L1", "plan", [1])
    answers: list[ClaimAnswer] = []
    threads = [
        threading.Thread(target=lambda i=i: answers.append(table.claim("L1", f"c{i}", "plan"))) for i in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert answers.count(ClaimAnswer.HELD) == 1
    assert answers.count(ClaimAnswer.TAKEN) == 15


def test_lease_ids_are_never_reused():
    assert len({new_lease_id() for _ in range(10_000)}) == 10_000


def test_the_side_channel_reports_when_it_last_drained_its_queue():
    import threading as _threading

    from pdconnect.protocol import Ack, Heartbeat
    from pdconnect.sidechannel import SideChannelClient, SideChannelServer

    entered, release = _threading.Event(), _threading.Event()

    def slow(message):  # a serving thread that cannot run, as under a GIL-holding forward pass
        entered.set()
        release.wait(5)
        return Ack()

    server = SideChannelServer("127.0.0.1", 0, slow, engine_id="prefill-0")
    try:
        client = SideChannelClient(server.address, "decode", None, timeout=5)
        answer: list[object] = []
        sender = _threading.Thread(
            target=lambda: answer.append(client.request(Heartbeat(to_engine="prefill-0", request_ids=["L"])))
        )
        sender.start()
        assert entered.wait(5)
        stuck = server.drained_at
        time.sleep(0.5)
        assert server.drained_at == stuck  # not drained while a message waits on its handler
        release.set()
        sender.join(5)
        assert answer
        # Caught up once it could serve.
        wait_until(lambda: server.drained_at > stuck, "the server to drain its queue again", 5)
        client.close()
    finally:
        server.close()


# --- confirming a claim from the decode side ---------------------------------------------


class _Peer:
    """A real side-channel server whose handler answers claims as told, counting them."""

    def __init__(self, answer: Callable[[int], Message]) -> None:
        self.calls = 0
        self._answer = answer
        self.server = SideChannelServer("127.0.0.1", 0, self._handle, engine_id="prefill-0")

    def _handle(self, message: Message) -> Message:
        self.calls += 1
        return self._answer(self.calls)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.server.port}"


CLAIM = Claim(to_engine="prefill-0", lease_id="lease-1", claimant="decode/r1", plan_digest="d")
# The late answer leaves the second attempt 0.75 s: room for a loaded machine's scheduling.
TIMEOUT = 1.0


def _confirm(answer: Callable[[int], Message]) -> tuple[str | None, int, int]:
    """(confirm_claim's verdict, claims the peer saw, retries announced)."""
    peer = _Peer(answer)
    retries: list[NoAnswer] = []
    client = SideChannelClient(peer.address, "decode", None, TIMEOUT)
    try:
        verdict = confirm_claim(client, CLAIM, retries.append)
    finally:
        client.close()
        peer.server.close()
    return verdict, peer.calls, len(retries)


def _late_then_ack(call: int) -> Message:
    if call == 1:
        # A starved prefill engine: this answer comes after the first attempt's deadline,
        # and the second attempt's in time (one serving thread: it waits behind this one).
        time.sleep(1.25 * TIMEOUT)
    return Ack()


def test_a_claim_answered_too_late_is_confirmed_by_the_next_attempt() -> None:
    verdict, calls, retries = _confirm(_late_then_ack)
    assert verdict is None and calls == 2 and retries == 1


def test_a_claim_never_answered_fails_after_every_attempt() -> None:
    def silent(call: int) -> Message:
        time.sleep(3 * TIMEOUT)
        return Ack()

    verdict, _, retries = _confirm(silent)
    assert verdict is not None and "no answer" in verdict
    assert retries == CLAIM_ATTEMPTS - 1


def test_a_refusal_or_an_unknown_lease_is_final() -> None:
    verdict, calls, retries = _confirm(lambda call: Refusal(reason="lease is claimed by another decode request"))
    assert verdict is not None and "claimed by another" in verdict and calls == 1 and retries == 0
    verdict, calls, retries = _confirm(lambda call: Ack(unknown=["lease-1"]))
    assert verdict == "the prefill engine no longer held the blocks when the read ended" and calls == 1
