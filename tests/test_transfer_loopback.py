"""Both transports, for real, between two processes over loopback.

The "prefill" side is a spawned child (`pdconnect.transfer.loopback`) serving a pool
of random bytes; this test process is the "decode" side and pulls from it. Failure
tests kill or freeze the child and prove the pull ends, FAILED, by its deadline. The
last tests check that a pull shares the host: waiting on a frozen peer costs no core, and
a reader stopped mid-transfer stalls no other reader of the same peer.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest

from pdconnect.kvlayout import TensorLayout, pull_ranges
from pdconnect.testbed.processes import freeze
from pdconnect.transfer import (
    TRANSPORT_KINDS,
    PeerInfo,
    RangeTable,
    Transfer,
    TransferError,
    TransferState,
    Transport,
    create_transport,
    merge_ranges,
)
from pdconnect.transfer._host import rdma_devices
from pdconnect.transfer.loopback import Buffer, LoopbackPeer, digest
from pdconnect.transfer.transport import METADATA_VERSION, decode_metadata
from tests.waiting import wait_until

pytestmark = [pytest.mark.transport, pytest.mark.timeout(120)]

# The CPU backend's KV layout [num_blocks, kv_heads, block_size, 2*head_size], fp16:
# 2 * 32 * 128 * 2 B = 16 KiB per block.
KV_SHAPE = (2, 32, 128)
BLOCK_BYTES = 16 << 10
POOL_BLOCKS = 512
POOL_BYTES = POOL_BLOCKS * BLOCK_BYTES
PEER = "prefill-0/rank0"
# How late a deadline may be noticed on a busy shared host (a poll is not a hard RT timer).
SLACK = 1.0


def kv_layout(base_addr: int, num_blocks: int) -> TensorLayout:
    shape = (num_blocks, *KV_SHAPE)
    strides = (KV_SHAPE[0] * KV_SHAPE[1] * KV_SHAPE[2], KV_SHAPE[1] * KV_SHAPE[2], KV_SHAPE[2], 1)
    return TensorLayout(base_addr, shape, strides, 2, 0)


@dataclass
class Decode:
    """This process's side: a transport with a registered buffer, connected to a peer."""

    kind: str
    transport: Transport[Any]
    buffer: Buffer
    peer: LoopbackPeer

    def ranges(self, block_pairs: list[tuple[int, int]]) -> RangeTable:
        return pull_ranges(
            kv_layout(self.buffer.addr, self.buffer.size // BLOCK_BYTES),
            kv_layout(self.peer.ready.pool_addr, self.peer.ready.pool_size // BLOCK_BYTES),
            block_pairs,
        )

    def assert_pulled(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        mine = digest(self.buffer, [(local, n) for local, _, n in ranges])
        theirs = self.peer.digest([(remote, n) for _, remote, n in ranges])
        assert mine == theirs, "pulled bytes differ from the prefill side's"


@pytest.fixture(params=TRANSPORT_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@contextlib.contextmanager
def decode_side(kind: str, protocol: str = "rdma") -> Iterator[Decode]:
    """A serving peer and this process's transport, registered and connected to it; both
    closed on the way out."""
    with LoopbackPeer(kind, POOL_BYTES, protocol=protocol) as peer:
        transport = create_transport(kind, host="127.0.0.1")
        try:
            buffer = Buffer(POOL_BYTES)
            transport.register([buffer.region])
            transport.connect(PEER, peer.ready.metadata)
            yield Decode(kind, transport, buffer, peer)
        finally:
            transport.close()


@pytest.fixture(scope="module", params=TRANSPORT_KINDS)
def shared(request: pytest.FixtureRequest) -> Iterator[Decode]:
    """One peer per transport for the tests that leave it alive."""
    with decode_side(request.param) as side:
        yield side


@pytest.fixture
def own(kind: str) -> Iterator[Decode]:
    """A peer of its own, for tests that kill or freeze it."""
    with decode_side(kind) as side:
        yield side


def _pull_and_wait(
    side: Decode, ranges: Sequence[tuple[int, int, int]], timeout: float
) -> tuple[Transfer, TransferState, float]:
    """Pull, wait well past the deadline, and time it from the start of the pull."""
    start = time.monotonic()
    transfer = side.transport.pull(PEER, ranges, timeout=timeout)
    state = transfer.wait(timeout + 30)
    return transfer, state, time.monotonic() - start


def test_pull_hundreds_of_blocks_brings_the_prefill_bytes(shared: Decode) -> None:
    shared.buffer.zero()
    # 37 is coprime to the pool size: a permutation, so no two blocks share a target.
    pairs = [(i, (37 * i + 5) % POOL_BLOCKS) for i in range(300)]
    ranges = shared.ranges(pairs)
    _, state, _ = _pull_and_wait(shared, ranges, timeout=30)
    assert state is TransferState.DONE
    shared.assert_pulled(ranges)


def test_partial_pull_of_scattered_blocks_touches_only_those_blocks(shared: Decode) -> None:
    shared.buffer.zero()
    rng = random.Random(7)
    local_blocks = rng.sample(range(POOL_BLOCKS), 40)
    pairs = list(zip(local_blocks, rng.sample(range(POOL_BLOCKS), 40)))
    ranges = shared.ranges(pairs)
    _, state, _ = _pull_and_wait(shared, ranges, timeout=30)
    assert state is TransferState.DONE
    shared.assert_pulled(ranges)
    untouched = set(range(POOL_BLOCKS)) - set(local_blocks)
    zero = bytes(BLOCK_BYTES)
    for block in untouched:
        assert shared.buffer.bytes_at(shared.buffer.addr + block * BLOCK_BYTES, BLOCK_BYTES) == zero, (
            f"block {block} was written"
        )


def test_empty_pull_is_done_at_once(shared: Decode) -> None:
    assert shared.transport.pull(PEER, [], timeout=1).poll() is TransferState.DONE


def test_pull_refuses_ranges_outside_registered_memory(shared: Decode) -> None:
    local, remote = shared.buffer.addr, shared.peer.ready.pool_addr
    with pytest.raises(TransferError, match=r"local range .* is not inside memory registered"):
        shared.transport.pull(PEER, [(local + POOL_BYTES - 8, remote, 16)], timeout=1)
    with pytest.raises(TransferError, match=r"remote range .* is not inside memory the peer"):
        shared.transport.pull(PEER, [(local, remote - 16, 16)], timeout=1)
    with pytest.raises(TransferError, match="'nobody': not connected"):
        shared.transport.pull("nobody", [(local, remote, 16)], timeout=1)
    with pytest.raises(TransferError, match="negative length -16"):
        shared.transport.pull(PEER, [(local + 64, remote, 16), (local + 32, remote, -16)], timeout=1)
    with pytest.raises(TransferError, match="negative length -16"):
        shared.transport.pull(PEER, RangeTable(np.array([[local + 32, remote, -16]])), timeout=1)
    # The numpy-backed ranges kvlayout returns are checked just the same, range by range.
    inside = [(local + 64 * i, remote + 64 * i, 32) for i in range(100)]
    with pytest.raises(TransferError, match=f"local range \\[{local + POOL_BYTES - 8:#x}, "):
        shared.transport.pull(PEER, merge_ranges([*inside, (local + POOL_BYTES - 8, remote, 16)]), timeout=1)
    with pytest.raises(TransferError, match=f"remote range \\[{remote - 16:#x}, "):
        shared.transport.pull(PEER, merge_ranges([(local, remote - 16, 16), *inside[1:]]), timeout=1)


def test_connect_with_garbage_metadata_raises_a_clear_error(shared: Decode) -> None:
    transport = shared.transport
    transport.connect(PEER, shared.peer.ready.metadata)  # idempotent: same blob again
    with pytest.raises(TransferError, match="not pdconnect transfer metadata"):
        transport.connect("garbage", os.urandom(64))
    other = next(k for k in TRANSPORT_KINDS if k != shared.kind)
    foreign = _metadata(other, transport.effective_protocol, b"x")
    with pytest.raises(TransferError, match=f"for transport '{other}'"):
        transport.connect("foreign", foreign)
    bad_endpoint = _metadata(shared.kind, transport.effective_protocol, b"\x00not an endpoint")
    expected = {"mooncake": "is not 'host:port'", "nixl": "NIXL rejected its agent metadata"}
    with pytest.raises(TransferError, match=expected[shared.kind]):
        transport.connect("bad-endpoint", bad_endpoint)
    rdma_peer = _metadata(shared.kind, "rdma", b"127.0.0.1:1")
    with pytest.raises(TransferError, match="moves bytes over rdma, this side over"):
        transport.connect("rdma-peer", rdma_peer)


def _metadata(kind: str, protocol: str, endpoint: bytes) -> bytes:
    """Hand-made peer metadata, for what a real peer would never send."""
    return msgspec.msgpack.encode(
        PeerInfo(kind=kind, version=METADATA_VERSION, protocol=protocol, endpoint=endpoint, regions=())
    )


def test_peer_killed_before_pull_fails_within_the_timeout(own: Decode) -> None:
    ranges = own.ranges([(0, 0)])
    assert own.transport.pull(PEER, ranges, timeout=10).wait(20) is TransferState.DONE
    own.peer.kill()
    transfer, state, elapsed = _pull_and_wait(own, own.ranges([(1, 1), (2, 2)]), timeout=5)
    assert state is TransferState.FAILED and transfer.error
    assert elapsed < 5 + SLACK


def test_a_gone_peer_fails_the_pull_long_before_its_deadline(own: Decode) -> None:
    """A peer that is gone refuses at once: that is not a stall, and waiting out a 20 s
    deadline for it would only hold the request's blocks. (Mooncake reads a stalled
    session again until the deadline; a refused read is made again once, not until then.)"""
    assert own.transport.pull(PEER, own.ranges([(0, 0)]), timeout=10).wait(20) is TransferState.DONE
    own.peer.kill()
    transfer, state, elapsed = _pull_and_wait(own, own.ranges([(1, 1), (2, 2)]), timeout=20)
    assert state is TransferState.FAILED and transfer.error
    assert elapsed < 5, f"a gone peer took {elapsed:.1f} s to fail a pull"


def test_peer_killed_mid_pull_never_hangs_nor_delivers_wrong_bytes(own: Decode) -> None:
    # Every block, scattered so nothing merges: thousands of descriptors in flight.
    pairs = [(i, (37 * i + 5) % POOL_BLOCKS) for i in range(POOL_BLOCKS)]
    ranges = own.ranges(pairs)
    expected = own.peer.digest([(remote, n) for _, remote, n in ranges])
    own.buffer.zero()
    start = time.monotonic()
    transfer = own.transport.pull(PEER, ranges, timeout=5)
    own.peer.kill()
    state = transfer.wait(30)
    elapsed = time.monotonic() - start
    assert elapsed < 5 + SLACK
    if state is TransferState.DONE:  # the copy won the race against the kill
        assert digest(own.buffer, [(local, n) for local, _, n in ranges]) == expected
    else:
        assert state is TransferState.FAILED and transfer.error


def test_frozen_peer_fails_at_the_deadline_then_settles(own: Decode) -> None:
    pid = own.peer.process.pid
    assert pid is not None
    freeze(pid)
    try:
        transfer, state, elapsed = _pull_and_wait(own, own.ranges([(3, 4)]), timeout=1.5)
        assert state is TransferState.FAILED
        assert transfer.error == "timed out after 1.5 s"
        assert 1.5 <= elapsed < 1.5 + SLACK
    finally:
        os.kill(pid, signal.SIGCONT)
    # Once the peer answers again the library lets go of our memory (Mooncake holds it
    # until the read returns, NIXL cancels at once).
    wait_until(lambda: transfer.quiescent, "the library to let go of our memory", 60)


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices")
def test_mooncake_reports_tcp_when_rdma_was_asked_for_on_a_host_without_rdma(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdconnect.transfer")
    transport = create_transport("mooncake", host="127.0.0.1", protocol="rdma")
    try:
        assert transport.effective_protocol == "tcp"
    finally:
        transport.close()
    assert "falling back to tcp" in caplog.text
    assert "protocol requested rdma, effective tcp" in caplog.text


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices")
@pytest.mark.parametrize("transport_kind", TRANSPORT_KINDS)
def test_require_rdma_refuses_a_host_without_rdma(transport_kind: str) -> None:
    with pytest.raises(TransferError, match="require_rdma is set"):
        create_transport(transport_kind, host="127.0.0.1", protocol="rdma", require_rdma=True)


def test_mooncake_tcp_is_tcp() -> None:
    transport = create_transport("mooncake", host="127.0.0.1", protocol="tcp")
    try:
        assert transport.effective_protocol == "tcp"
    finally:
        transport.close()


def test_transports_never_import_torch() -> None:
    """A router pod has no torch: creating either transport must not need it."""
    code = (
        "import sys\n"
        "from pdconnect.transfer import create_transport\n"
        "for kind in ('mooncake', 'nixl'):\n"
        "    create_transport(kind, host='127.0.0.1', protocol='tcp').close()\n"
        "import pdconnect.kvlayout\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


# --- a Mooncake TCP session that stops making progress -----------------------------------

STALL_S = 2  # whole seconds: Mooncake reads its TCP timeouts as integers


def _stalled_reader(metadata: bytes, pool_addr: int, pipe: Any) -> None:
    """A decode side in a process of its own: Mooncake's TCP timeouts are process-wide
    (set from the first transport), so this one must be the first in its process."""
    transport = create_transport("mooncake", host="127.0.0.1", protocol="tcp", mooncake_stall_seconds=STALL_S)
    buffer = Buffer(POOL_BYTES)
    transport.register([buffer.region])
    transport.connect(PEER, metadata)
    remote = kv_layout(pool_addr, POOL_BLOCKS)
    ranges = pull_ranges(kv_layout(buffer.addr, POOL_BLOCKS), remote, [(i, 3 * i + 1) for i in range(8)])
    pipe.send(transport.pull(PEER, ranges, timeout=20).wait(30).name)  # connected and warm
    pipe.recv()  # the peer is frozen now
    start = time.monotonic()
    transfer = transport.pull(PEER, ranges, timeout=20)
    state = transfer.wait(30)
    pipe.send(
        (
            state.name,
            time.monotonic() - start,
            transfer.error,
            [(remote_addr, n) for _, remote_addr, n in ranges],
            digest(buffer, [(local, n) for local, _, n in ranges]),
        )
    )
    transport.close()


@pytest.mark.parametrize("frozen_stalls", [1.5, 3.5])
def test_mooncake_read_on_a_stalled_session_is_made_again_until_the_deadline(frozen_stalls: float) -> None:
    """The peer is frozen for 1.5, then 3.5 stall timeouts: Mooncake drops each session
    that made no progress and the read is made again, on a fresh connection, until the
    thawed peer serves it, with the right bytes. Before, the read failed at the first drop
    (the bench's stall: a read on a just-opened connection that never progressed); then
    at the second (a CI host froze a prefill engine for ~14 s, a 4 s stall period)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with LoopbackPeer("mooncake", POOL_BYTES, protocol="tcp") as peer:
        parent, child = context.Pipe()
        reader = context.Process(
            target=_stalled_reader, args=(peer.ready.metadata, peer.ready.pool_addr, child), daemon=True
        )
        reader.start()
        try:
            assert parent.poll(60) and parent.recv() == "DONE"
            pid = peer.process.pid
            assert pid is not None
            freeze(pid)
            try:
                parent.send("go")
                time.sleep(frozen_stalls * STALL_S)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert parent.poll(60)
            state, elapsed, error, remote_ranges, pulled = parent.recv()
            assert state == "DONE", error
            assert elapsed >= STALL_S  # the first read really was dropped
            assert pulled == peer.digest(remote_ranges)
        finally:
            reader.join(30)
            if reader.is_alive():
                reader.kill()


# --- sharing the host: waiting costs no core, one stalled reader stalls no other ---


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_a_mooncake_pull_waiting_on_a_frozen_peer_leaves_the_cores_to_others() -> None:
    """The peer is frozen for 3 s while a pull waits on it: this process spends a small
    part of that time on the CPU (polls), not a core's worth. Mooncake's blocking batch
    read spent ~100% of a core here (its status loop never sleeps). (NIXL needs no such
    test: over loopback UCX reads a stopped peer's memory directly, so nothing waits.)"""
    with decode_side("mooncake", protocol="tcp") as side:
        assert side.transport.pull(PEER, side.ranges([(0, 0)]), timeout=20).wait(30) is TransferState.DONE
        pid = side.peer.process.pid
        assert pid is not None
        ranges = side.ranges([(i, i) for i in range(1, 65)])
        freeze(pid)
        try:
            wall, cpu = time.monotonic(), _process_cpu_seconds()
            transfer = side.transport.pull(PEER, ranges, timeout=60)
            state = transfer.wait(3.0)
            wall, cpu = time.monotonic() - wall, _process_cpu_seconds() - cpu
        finally:
            os.kill(pid, signal.SIGCONT)
        assert state is TransferState.PENDING  # still waiting on the frozen peer
        assert cpu < 0.25 * wall, f"waiting {wall:.1f} s on a frozen peer took {cpu:.2f} s of CPU"
        assert transfer.wait(60) is TransferState.DONE  # the thawed peer serves it
        side.assert_pulled(ranges)


def test_a_mooncake_pull_from_a_peer_in_use_is_submitted_by_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a live engine the step loop holds the interpreter lock nearly all the time, so a
    helper thread of ours gets it only at the step's switch intervals (5 ms), once per
    range it submits: our Mooncake pulls used to submit from one, and a pull of 48 ranges
    took 15 ms (p90 130 ms) behind a busy caller against 2 ms behind an idle one. The
    peer's segment is opened by `connect()` (its handshake, which a frozen peer can hold
    up, runs on a bounded thread there), so `pull()` hands every read to Mooncake itself,
    the first one included."""
    started: list[str] = []

    class RecordingThread(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(threading, "Thread", RecordingThread)
    with decode_side("mooncake", protocol="tcp") as side:
        assert [name for name in started if name.startswith("pdconnect-")], "connect() used no bounded thread"
        started.clear()
        first = side.transport.pull(PEER, side.ranges([(0, 0)]), timeout=20)
        assert first.wait(30) is TransferState.DONE
        ranges = side.ranges([(2 * i + 1, 3 * i + 1) for i in range(48)])
        assert len(ranges) == 48
        transfer = side.transport.pull(PEER, ranges, timeout=30)
        assert transfer.wait(30) is TransferState.DONE, transfer.error
        assert not [name for name in started if name.startswith("pdconnect-")], (
            f"a pull from a peer in use waited on helper threads: {started}"
        )
        side.assert_pulled(ranges)


def _stopped_reader(kind: str, metadata: bytes, pool_addr: int, pool_size: int, pipe: Connection) -> None:
    """A second decode: connects, pulls the whole pool once, says so, then pulls it over and
    over (from that message on it is always inside a read, but for an instant between two)."""
    transport = create_transport(kind, host="127.0.0.1")
    buffer = Buffer(pool_size)
    transport.register([buffer.region])
    transport.connect(PEER, metadata)
    everything = [(buffer.addr, pool_addr, pool_size)]
    transport.pull(PEER, everything, timeout=600).wait(600)
    pipe.send("reading")
    while True:
        transport.pull(PEER, everything, timeout=600).wait(600)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_a_reader_that_stops_mid_transfer_stalls_no_other_reader(kind: str) -> None:
    """A second decode process is stopped (SIGSTOP) while it pulls the whole pool, so its
    reads stop half-way and its sockets fill; this process's pulls from the same prefill
    side are still served, with the right bytes, each long before its deadline."""
    context = multiprocessing.get_context("spawn")
    with LoopbackPeer(kind, POOL_BYTES, protocol="tcp") as peer:
        parent, child = context.Pipe()
        reader = context.Process(
            target=_stopped_reader,
            daemon=True,
            args=(kind, peer.ready.metadata, peer.ready.pool_addr, peer.ready.pool_size, child),
        )
        reader.start()
        transport = create_transport(kind, host="127.0.0.1")
        buffer = Buffer(POOL_BYTES)
        try:
            assert parent.poll(60) and parent.recv() == "reading"
            assert reader.pid is not None
            freeze(reader.pid)
            transport.register([buffer.region])
            transport.connect(PEER, peer.ready.metadata)
            layouts = (
                kv_layout(buffer.addr, POOL_BYTES // BLOCK_BYTES),
                kv_layout(peer.ready.pool_addr, peer.ready.pool_size // BLOCK_BYTES),
            )
            for round_ in range(3):
                ranges = pull_ranges(*layouts, [(i, i) for i in range(round_ * 8, round_ * 8 + 8)])
                started = time.monotonic()
                transfer = transport.pull(PEER, ranges, timeout=30)
                assert transfer.wait(40) is TransferState.DONE, transfer.error
                assert time.monotonic() - started < 15, "a stopped reader held up another reader's pull"
                assert digest(buffer, [(local, n) for local, _, n in ranges]) == peer.digest(
                    [(remote, n) for _, remote, n in ranges]
                )
        finally:
            if reader.pid is not None:
                os.kill(reader.pid, signal.SIGCONT)
            reader.kill()
            reader.join(10)
            transport.close()


def test_a_mooncake_probe_queued_behind_a_silent_client_still_connects() -> None:
    """Mooncake's handshake server serves one connection at a time and gives a client that
    sent nothing 5 s (the connect timeout) before it takes the next: with one such client
    on the prefill side's handshake port, a single probe timed out and the load failed
    (P TP1 -> D TP2, docs/parallel.md). The second probe is answered."""
    with LoopbackPeer("mooncake", POOL_BYTES, protocol="tcp") as peer:
        session = decode_metadata(peer.ready.metadata, expected_kind="mooncake").endpoint.decode()
        host, _, port = session.rpartition(":")
        transport = create_transport("mooncake", host="127.0.0.1", protocol="tcp")
        try:
            with socket.create_connection((host, int(port))):  # connected, never sends
                transport.connect(PEER, peer.ready.metadata)
        finally:
            transport.close()


def test_a_mooncake_first_read_does_not_wait_on_the_peers_handshake_server() -> None:
    """The first read from a peer used to open its segment: Mooncake fetches the segment's
    descriptor through the peer's one-connection handshake server (`openSegment` ->
    `SocketHandShakePlugin::exchangeMetadata`, py-spy), so a client holding that port
    without sending held the read until the server gave up on it (6.7 s against 6 ms;
    the P DP2 -> D TP2 stalls, docs/parallel.md). The segment is opened by `connect()`
    now: the read is served while the silent client still holds the server."""
    with decode_side("mooncake", protocol="tcp") as side:
        session = decode_metadata(side.peer.ready.metadata, expected_kind="mooncake").endpoint.decode()
        host, _, port = session.rpartition(":")
        with socket.create_connection((host, int(port))) as silent:  # connected, never sends
            ranges = side.ranges([(0, 0), (3, 5)])
            transfer = side.transport.pull(PEER, ranges, timeout=30)
            assert transfer.wait(40) is TransferState.DONE, transfer.error
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):  # b"": the server gave up on it first
                silent.recv(1)
        side.assert_pulled(ranges)


def test_a_mooncake_segment_open_that_goes_unanswered_fails_the_connect_at_its_bound() -> None:
    """The probe is answered; then a client that never sends holds the peer's one-connection
    handshake server, which waits 5 s on it before it serves the segment open queued behind.
    `connect()` gives up on the open at its bound (two connect timeouts, 1 s here) and fails
    like a probe would, rather than connecting once the server moves on."""
    from pdconnect.transfer.mooncake import MooncakeTransport

    with LoopbackPeer("mooncake", POOL_BYTES, protocol="tcp") as peer, contextlib.ExitStack() as held:
        session = decode_metadata(peer.ready.metadata, expected_kind="mooncake").endpoint.decode()
        host, _, port = session.rpartition(":")
        transport = MooncakeTransport(host="127.0.0.1", protocol="tcp", connect_timeout=0.5)
        engine = transport._engine

        class HoldAfterProbe:
            """The engine, but a silent client takes the handshake server once the probe is answered."""

            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

            def send_probe(self, target: str) -> int:
                rc: int = engine.send_probe(target)
                held.enter_context(socket.create_connection((host, int(port))))  # connected, never sends
                return rc

        transport._engine = HoldAfterProbe()
        try:
            buffer = Buffer(POOL_BYTES)
            transport.register([buffer.region])
            with pytest.raises(TransferError, match=r"could not open .*timed out after 1 s"):
                transport.connect(PEER, peer.ready.metadata)
        finally:
            transport.close()
