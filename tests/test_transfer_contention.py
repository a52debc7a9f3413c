"""A pull shares the host: waiting costs no core, and one reader cannot stall the others.

On a P/D host the transports share the cores with the engines' own busy loops. A pull
that keeps a core busy while it waits (Mooncake's binding waited for a batch by polling
its status in a loop that never sleeps) starved the threads that really move the bytes,
and a serving side that one stalled reader could hold up would turn one slow decode into
a stalled prefill engine for everyone. Both are checked here on the real libraries,
between real processes.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

from pdconnect.transfer import TRANSPORT_KINDS, TransferState, create_transport
from pdconnect.transfer.loopback import Buffer, LoopbackPeer, digest
from tests.test_transfer_loopback import BLOCK_BYTES, PEER, POOL_BYTES, _freeze, kv_layout

pytestmark = [pytest.mark.transport, pytest.mark.timeout(180)]


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_a_mooncake_pull_waiting_on_a_frozen_peer_leaves_the_cores_to_others() -> None:
    """The peer is frozen for 3 s while a pull waits on it: this process spends a small
    part of that time on the CPU (polls), not a core's worth. Mooncake's blocking batch
    read spent ~100% of a core here (its status loop never sleeps). (NIXL needs no such
    test: over loopback UCX reads a stopped peer's memory directly, so nothing waits.)"""
    kind = "mooncake"
    with LoopbackPeer(kind, POOL_BYTES, protocol="tcp") as peer:
        transport = create_transport(kind, host="127.0.0.1")
        buffer = Buffer(POOL_BYTES)
        try:
            transport.register([buffer.region])
            transport.connect(PEER, peer.ready.metadata)
            layouts = (kv_layout(buffer.addr, POOL_BYTES // BLOCK_BYTES),
                       kv_layout(peer.ready.pool_addr, peer.ready.pool_size // BLOCK_BYTES))
            from pdconnect.kvlayout import pull_ranges
            warm = pull_ranges(*layouts, [(0, 0)])
            assert transport.pull(PEER, warm, timeout=20).wait(30) is TransferState.DONE
            pid = peer.process.pid
            assert pid is not None
            ranges = pull_ranges(*layouts, [(i, i) for i in range(1, 65)])
            _freeze(pid)
            try:
                wall, cpu = time.monotonic(), _process_cpu_seconds()
                transfer = transport.pull(PEER, ranges, timeout=60)
                state = transfer.wait(3.0)
                wall, cpu = time.monotonic() - wall, _process_cpu_seconds() - cpu
            finally:
                os.kill(pid, signal.SIGCONT)
            assert state is TransferState.PENDING  # still waiting on the frozen peer
            assert cpu < 0.25 * wall, f"waiting {wall:.1f} s on a frozen peer took {cpu:.2f} s of CPU"
            assert transfer.wait(60) is TransferState.DONE  # the thawed peer serves it
            assert digest(buffer, [(local, n) for local, _, n in ranges]) == peer.digest(
                [(remote, n) for _, remote, n in ranges])
        finally:
            transport.close()


def _stopped_reader(kind: str, metadata: bytes, pool_addr: int, pool_size: int, pipe: Connection) -> None:
    """A second decode: connects, says so, then pulls the whole pool over and over."""
    transport = create_transport(kind, host="127.0.0.1")
    buffer = Buffer(pool_size)
    transport.register([buffer.region])
    transport.connect(PEER, metadata)
    everything = [(buffer.addr, pool_addr, pool_size)]
    pipe.send("connected")
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
        reader = context.Process(target=_stopped_reader, daemon=True,
                                 args=(kind, peer.ready.metadata, peer.ready.pool_addr, peer.ready.pool_size, child))
        reader.start()
        transport = create_transport(kind, host="127.0.0.1")
        buffer = Buffer(POOL_BYTES)
        try:
            assert parent.poll(60) and parent.recv() == "connected"
            time.sleep(0.5)  # well inside its endless reads
            assert reader.pid is not None
            _freeze(reader.pid)
            transport.register([buffer.region])
            transport.connect(PEER, peer.ready.metadata)
            layouts = (kv_layout(buffer.addr, POOL_BYTES // BLOCK_BYTES),
                       kv_layout(peer.ready.pool_addr, peer.ready.pool_size // BLOCK_BYTES))
            from pdconnect.kvlayout import pull_ranges
            for round_ in range(3):
                ranges = pull_ranges(*layouts, [(i, i) for i in range(round_ * 8, round_ * 8 + 8)])
                started = time.monotonic()
                transfer = transport.pull(PEER, ranges, timeout=30)
                assert transfer.wait(40) is TransferState.DONE, transfer.error
                assert time.monotonic() - started < 15, "a stopped reader held up another reader's pull"
                assert digest(buffer, [(local, n) for local, _, n in ranges]) == peer.digest(
                    [(remote, n) for _, remote, n in ranges])
        finally:
            if reader.pid is not None:
                os.kill(reader.pid, signal.SIGCONT)
            reader.kill()
            reader.join(10)
            transport.close()
