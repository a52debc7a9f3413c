"""A serving peer in a child process, for tests and benchmarks of the transports.

The child ("prefill") owns a pool of random bytes registered with a real transport and
answers four requests over a pipe: its metadata, digests of byte ranges (so the parent
can check what it pulled without holding a copy), its CPU time (so a benchmark counts
what serving cost), and stop. The parent ("decode") can
also kill it outright to play a crashed peer. Children are spawned, never forked: the
transport libraries run threads that a fork would leave half-copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Self

import msgspec

from pdconnect.transfer import MemoryRegion, create_transport

__all__ = ["Buffer", "LoopbackPeer", "PeerReady", "digest", "stop_child"]

# Fill the pool in chunks: one huge os.urandom call needs the whole pool twice in memory.
_FILL_CHUNK = 16 << 20


class Buffer:
    """Page-aligned anonymous memory with a stable address, for registration."""

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._anchor)
        self.size = size

    @property
    def region(self) -> MemoryRegion:
        return MemoryRegion(self.addr, self.size)

    def fill_random(self) -> None:
        for start in range(0, self.size, _FILL_CHUNK):
            end = min(start + _FILL_CHUNK, self.size)
            self._map[start:end] = os.urandom(end - start)

    def zero(self) -> None:
        ctypes.memset(self.addr, 0, self.size)

    def bytes_at(self, addr: int, length: int) -> bytes:
        offset = addr - self.addr
        if not (offset >= 0 and offset + length <= self.size):
            raise ValueError(f"[{addr:#x}, +{length}) is outside this buffer")
        return self._map[offset : offset + length]


def digest(buffer: Buffer, ranges: Sequence[tuple[int, int]]) -> str:
    """One hash over the bytes of `(addr, length)` ranges, in order."""
    h = hashlib.sha1()
    for addr, length in ranges:
        h.update(buffer.bytes_at(addr, length))
    return h.hexdigest()


class PeerReady(msgspec.Struct, frozen=True):
    """The child's first message: how to reach it and where its pool lives."""

    metadata: bytes
    pool_addr: int
    pool_size: int
    effective_protocol: str


@dataclass
class _Serve:
    """What the child is asked to serve (picklable, so it crosses the spawn)."""

    kind: str
    pool_size: int
    protocol: str
    nixl_progress_delay_us: int | None = None


class LoopbackPeer:
    """The parent's handle on a serving child; a context manager that always reaps it."""

    def __init__(
        self,
        kind: str,
        pool_size: int,
        *,
        protocol: str = "rdma",
        nixl_progress_delay_us: int | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        job = _Serve(kind, pool_size, protocol, nixl_progress_delay_us)
        self.process = context.Process(target=_serve, args=(job, child_end), daemon=True)
        self.process.start()
        child_end.close()
        self.ready: PeerReady = self._receive(start_timeout)

    def digest(self, ranges: Sequence[tuple[int, int]], timeout: float = 60.0) -> str:
        """The child's digest of its own `(addr, length)` ranges."""
        self._pipe.send(("digest", list(ranges)))
        return str(self._receive(timeout))

    def cpu_seconds(self, timeout: float = 60.0) -> float:
        """CPU time (user + system, every thread) the child has used so far."""
        self._pipe.send(("cpu", None))
        return float(self._receive(timeout))

    def kill(self) -> None:
        """Crash the child (SIGKILL): no goodbye, no cleanup, like a lost node."""
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        stop_child(self.process, self._pipe, lambda: self._pipe.send(("stop", None)))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _receive(self, timeout: float) -> Any:
        if not self._pipe.poll(timeout):
            self.kill()
            raise TimeoutError(f"loopback peer sent nothing within {timeout:g} s")
        kind, payload = self._pipe.recv()
        if kind == "error":
            raise RuntimeError(f"loopback peer failed: {payload}")
        return payload


def _serve(job: _Serve, pipe: Connection) -> None:
    try:
        transport = create_transport(
            job.kind, host="127.0.0.1", protocol=job.protocol, nixl_progress_delay_us=job.nixl_progress_delay_us
        )
        pool = Buffer(job.pool_size)
        pool.fill_random()
        transport.register([pool.region])
        pipe.send(("ready", PeerReady(transport.metadata(), pool.addr, pool.size, transport.effective_protocol)))
    except Exception as exc:  # noqa: BLE001 - the peer process reports any start-up failure to its parent
        pipe.send(("error", repr(exc)))
        return
    while True:
        try:
            request, payload = pipe.recv()
        except EOFError:  # the parent is gone
            break
        if request == "stop":
            break
        if request == "cpu":
            pipe.send(("cpu", time.process_time()))
            continue
        pipe.send(("digest", digest(pool, payload)))
    transport.close()


def stop_child(process: BaseProcess, pipe: Connection, ask: Callable[[], None], grace_s: float = 10.0) -> None:
    """End a child process we talk to over `pipe`: `ask` it to stop (a pipe it no longer
    reads is ignored), wait `grace_s`, SIGKILL it if it is still there, close the pipe."""
    if process.is_alive():
        with contextlib.suppress(OSError):
            ask()
        process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join(grace_s)
    pipe.close()
