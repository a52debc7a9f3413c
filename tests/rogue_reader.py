"""A rogue reader for the engine fault suite: a decode-role child that pulls a prefill engine's KV memory in a loop.

The child does what a decode worker does before its first pull (`connectors.worker`'s
handshake: a signed side-channel `Handshake`, then `Transport.connect` with the
`HandshakeReply`'s transport metadata) and then pulls the largest KV cache tensor the
reply's layouts describe, whole, into a local `Buffer`, over and over. The parent
(`RogueReader`) learns over a pipe when the first pull is in flight, and can then stop
the child (SIGSTOP: a decode that stops reading) or kill it (SIGKILL: one that
disappears), and find the sockets through which the prefill engine still holds bytes
for it (`queued_for`). Children are spawned, never forked: the transport libraries run
threads a fork would leave half-copied.
"""

from __future__ import annotations

import contextlib
import ipaddress
import multiprocessing
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Self

import msgspec

from pdconnect.kvlayout import TensorLayout
from pdconnect.protocol import CompatInfo, Handshake, HandshakeReply, ParallelShape
from pdconnect.sidechannel import SideChannelClient
from pdconnect.testbed.keys import keyring
from pdconnect.testbed.processes import freeze
from pdconnect.transfer import TransferState, create_transport
from pdconnect.transfer.loopback import Buffer, stop_child

__all__ = ["Pulling", "RogueReader", "TcpSocket", "group_pids", "socket_inodes", "tcp_sockets"]

PEER = "prefill/rank0"
# The kernel's TCP_ESTABLISHED (include/net/tcp_states.h), as /proc/net/tcp prints it.
TCP_ESTABLISHED = 1
# Each pull gets this long: far beyond any test, so a stopped pull never ends by itself.
PULL_TIMEOUT_S = 600.0
# The largest tensor's span is read whole up to this: far beyond any socket buffer (a few
# MiB), so a stop lands mid-pull; no more, as the engines share this host's memory.
PULL_BYTES_MAX = 256 << 20
# The layouts arrive msgspec-encoded (`connectors.metadata.encode_layouts`); that module
# imports vLLM, which this child has no need to load.
_LAYOUTS: msgspec.msgpack.Decoder[dict[int, list[TensorLayout]]] = msgspec.msgpack.Decoder(
    dict[int, list[TensorLayout]]
)


@dataclass(frozen=True)
class _Job:
    """What the child is to read (picklable, so it crosses the spawn)."""

    side_channel: str
    transport: str
    compat: CompatInfo
    handshake_timeout_s: float


@dataclass(frozen=True)
class Pulling:
    """The child's first message: its first pull is in flight."""

    pid: int
    nbytes: int
    layout_shape: tuple[int, ...]
    effective_protocol: str


def _extent(layout: TensorLayout) -> int:
    """Bytes from a tensor's base to just past its last element (strides in elements)."""
    return layout.itemsize * (1 + sum((size - 1) * stride for size, stride in zip(layout.shape, layout.strides)))


def _read_forever(job: _Job, pipe: Connection) -> None:
    client = SideChannelClient(job.side_channel, "decode", keyring("decode"), job.handshake_timeout_s)
    try:
        reply = client.request(
            Handshake(
                engine_id="rogue-reader", tp_rank=0, compat=job.compat, parallel=ParallelShape(tp_size=1, tp_rank=0)
            )
        )
    finally:
        client.close()
    if not isinstance(reply, HandshakeReply):
        raise RuntimeError(f"the handshake was answered with {type(reply).__name__}")
    largest = max((layout for group in _LAYOUTS.decode(reply.layouts).values() for layout in group), key=_extent)
    nbytes = min(_extent(largest), PULL_BYTES_MAX)
    # The engines' own setting (`pd_kv_transfer`): Mooncake over TCP; NIXL ignores it.
    transport = create_transport(job.transport, host="127.0.0.1", protocol="tcp")
    buffer = Buffer(nbytes)
    transport.register([buffer.region])
    transport.connect(PEER, reply.transport_metadata)
    whole = [(buffer.addr, largest.base_addr, nbytes)]
    pull = transport.pull(PEER, whole, timeout=PULL_TIMEOUT_S)
    pipe.send(("pulling", Pulling(os.getpid(), nbytes, largest.shape, transport.effective_protocol)))
    while True:
        if pull.wait(PULL_TIMEOUT_S) is not TransferState.DONE:
            raise RuntimeError(f"a pull ended {pull.poll().name}: {pull.error}")
        pull = transport.pull(PEER, whole, timeout=PULL_TIMEOUT_S)


def _child(job: _Job, pipe: Connection) -> None:
    try:
        _read_forever(job, pipe)
    except Exception as exc:  # noqa: BLE001 - the child reports any failure to its parent
        pipe.send(("error", repr(exc)))


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp{,6}: endpoints as (address, port), queues in bytes.

    `tx_queue` counts a closing socket's FIN as a byte too: only an established socket's
    queue is data its owner could not send (`holds_unsent`)."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    tx_queue: int
    rx_queue: int

    @property
    def holds_unsent(self) -> bool:
        return self.state == TCP_ESTABLISHED and self.tx_queue > 0


def tcp_sockets() -> dict[int, TcpSocket]:
    """Every TCP socket of this network namespace, by inode."""
    found: dict[int, TcpSocket] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, state, queues, inode = fields[1], fields[2], fields[3], fields[4], int(fields[9])
                tx, rx = (int(q, 16) for q in queues.split(":"))
                found[inode] = TcpSocket(_endpoint(local), _endpoint(remote), int(state, 16), tx, rx)
    return found


def _endpoint(text: str) -> tuple[str, int]:
    """ "0100007F:1F90" -> ("127.0.0.1", 8080). The kernel prints each 32-bit word of the
    address in host order (little-endian here); an IPv4-mapped IPv6 address is read as the
    IPv4 one, as Mooncake's server answers an IPv4 client on a dual-stack socket."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The socket inodes open in any of `pids` (processes that are gone are skipped)."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def group_pids(pgid: int) -> list[int]:
    """Every live process of process group `pgid` (a vLLM server: API server, engine core)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                # Fields after the command name, which may hold spaces: state, ppid, pgrp.
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


class RogueReader:
    """The parent's handle on a rogue child; a context manager that always reaps it."""

    def __init__(
        self, side_channel: str, transport: str, compat: CompatInfo, handshake_timeout_s: float, start_timeout_s: float
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        job = _Job(side_channel, transport, compat, handshake_timeout_s)
        self.process: Any = context.Process(target=_child, args=(job, child_end), daemon=True)
        self.process.start()
        child_end.close()
        if not self._pipe.poll(start_timeout_s):
            self.close()
            raise TimeoutError(f"the rogue reader had no pull in flight within {start_timeout_s:g} s")
        try:
            kind, payload = self._pipe.recv()
        except EOFError:  # the child died before it could say anything
            self.process.join(10)
            kind, payload = "error", f"exited with code {self.process.exitcode}"
        if kind == "error":
            self.close()
            raise RuntimeError(f"the rogue reader failed: {payload}")
        self.pulling: Pulling = payload

    @property
    def pid(self) -> int:
        return self.pulling.pid

    def failure(self) -> str | None:
        """What the child reported going wrong since it started pulling, if anything."""
        if self._pipe.poll(0):
            with contextlib.suppress(EOFError, OSError):
                return str(self._pipe.recv()[1])
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and wait until every thread has really stopped (delivery is asynchronous)."""
        freeze(self.pid, timeout_s)

    def resume(self) -> None:
        """SIGCONT: it reads on where it stopped."""
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: gone without a goodbye, its sockets closed by the kernel."""
        self.process.kill()
        self.process.join(10)

    def sockets_from(self, pids: Iterable[int]) -> list[TcpSocket]:
        """Sockets of `pids` whose other end is a socket of this child (`tx_queue`: bytes
        they hold unsent for it)."""
        sockets = tcp_sockets()
        ours = {sockets[i].local for i in socket_inodes([self.pid]) if i in sockets}
        return [s for i in socket_inodes(pids) if (s := sockets.get(i)) and s.remote in ours]

    def close(self) -> None:
        """SIGCONT (a stopped process cannot act on SIGTERM), SIGTERM, then SIGKILL if need be."""

        def ask() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()

        stop_child(self.process, self._pipe, ask)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
