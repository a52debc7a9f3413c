"""The transport contract: one interface the connector uses to pull KV bytes from a peer.

The decode side PULLS: it reads ranges of the prefill side's registered memory into its
own. Everything is raw addresses and lengths, so this package needs no torch (a router
pod has none). Memory is registered as host memory (DRAM): GPU KV caches would need
NIXL's VRAM segment type and Mooncake's CUDA build, not yet wired here.

Life of a transport::

    t = create_transport("mooncake", host="10.0.0.5")          # or "nixl"
    t.register([MemoryRegion(addr, length), ...])              # before metadata()
    blob = t.metadata()                                        # send to peers
    t.connect("engine-7/rank0", their_blob)                    # idempotent per name
    xfer = t.pull("engine-7/rank0", [(local, remote, n), ...], timeout=30.0)
    while xfer.poll() is TransferState.PENDING: ...            # never blocks
    t.close()

Invariants every implementation keeps (enforced here, in the base classes, so the two
transports cannot drift apart):
- `pull` validates every range against our registered regions and the peer's advertised
  ones before anything moves: a wrong address is a `TransferError`, never a stray write.
- `Transfer.poll` never blocks and never raises; a transfer still running when its
  deadline passes is FAILED ("timed out"), so a dead or stuck peer cannot hang a caller.
- A FAILED transfer may not yet be *quiescent*: the library can still be writing into
  the local ranges (Mooncake gives up only at its own timeout). Callers must not reuse
  those local bytes until `Transfer.quiescent` is true.
- Library failures after validation (peer gone, connection reset) surface as FAILED
  transfers with a reason, logged once, on logger `pdconnect.transfer`.
"""

from __future__ import annotations

import bisect
import enum
import logging
import operator
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import msgspec

from pdconnect.transfer.ranges import Range, RangeTable

__all__ = [
    "LOG",
    "METADATA_VERSION",
    "DoneTransfer",
    "FailedTransfer",
    "MemoryRegion",
    "PeerInfo",
    "Transfer",
    "TransferError",
    "TransferState",
    "Transport",
    "decode_metadata",
]

LOG = logging.getLogger("pdconnect.transfer")

# Bumped when the metadata layout changes; peers refuse a version they do not speak.
METADATA_VERSION = 1


class TransferError(Exception):
    """A transport could not start, register memory or connect a peer, or a pull was
    asked for something impossible (unknown peer, memory outside registered regions).

    The message says what was asked, what happened and, where known, what to do.
    """


class TransferState(enum.Enum):
    """Where an in-flight batch stands; DONE and FAILED are final."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class MemoryRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A span of registered memory: `length` bytes starting at address `addr`."""

    addr: int
    length: int

    @property
    def end(self) -> int:
        return self.addr + self.length


class PeerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What `Transport.metadata()` carries: who we are and which memory a peer may read.

    `endpoint` is the library's own connection blob (Mooncake: the P2P session name
    "host:port"; NIXL: the agent metadata); `protocol` is the sender's effective
    protocol, so a TCP side and an RDMA side refuse each other at connect time instead
    of failing every transfer; the regions are ours, so the puller can check its ranges
    before the library touches any memory.
    """

    kind: str
    version: int
    protocol: str
    endpoint: bytes
    regions: tuple[MemoryRegion, ...]


_METADATA_DECODER: msgspec.msgpack.Decoder[PeerInfo] = msgspec.msgpack.Decoder(PeerInfo)
_METADATA_ENCODER = msgspec.msgpack.Encoder()


def decode_metadata(blob: bytes, *, expected_kind: str | None = None) -> PeerInfo:
    """Parse a peer's metadata; raises TransferError saying what is wrong with it."""
    try:
        info = _METADATA_DECODER.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise TransferError(f"peer metadata is not pdconnect transfer metadata ({len(blob)} bytes): {exc}") from None
    if info.version != METADATA_VERSION:
        raise TransferError(
            f"peer metadata version {info.version} is not ours ({METADATA_VERSION}): "
            "the two engines run different pdconnect releases"
        )
    if expected_kind is not None and info.kind != expected_kind:
        raise TransferError(
            f"peer metadata is for transport {info.kind!r}, this side runs "
            f"{expected_kind!r}: both engines must set the same `transport`"
        )
    return info


class _RegionIndex:
    """Sorted registered regions, answering "does [addr, addr+n) lie inside one?"."""

    def __init__(self, regions: Iterable[MemoryRegion]) -> None:
        self._regions = sorted(regions, key=lambda r: r.addr)
        self._starts = [r.addr for r in self._regions]

    def __iter__(self) -> Iterator[MemoryRegion]:
        return iter(self._regions)

    def contains(self, addr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + length <= self._regions[i].end

    def first_outside(self, addrs: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
        """The first `(addr, length)` not inside a single region, or None if all are.

        Pulls carry thousands of ranges; when they all fall in one region (the common
        case) one check of their overall extent, computed by builtins, replaces a
        Python-level lookup per range.
        """
        low, high = min(addrs), max(map(operator.add, addrs, lengths))
        if self.contains(low, high - low):
            return None
        return next(((a, n) for a, n in zip(addrs, lengths) if not self.contains(a, n)), None)

    def first_outside_table(self, addrs: Any, lengths: Any) -> tuple[int, int] | None:
        """`first_outside` for numpy columns: one vectorized extent check in the common case."""
        low, high = int(addrs.min()), int((addrs + lengths).max())
        if self.contains(low, high - low):
            return None
        return self.first_outside(addrs.tolist(), lengths.tolist())

    def overlaps(self, region: MemoryRegion) -> bool:
        i = bisect.bisect_right(self._starts, region.addr) - 1
        if i >= 0 and self._regions[i].end > region.addr:
            return True
        return i + 1 < len(self._regions) and self._regions[i + 1].addr < region.end


class Transfer(ABC):
    """One in-flight batch of reads from one peer.

    Subclasses only report what the library says (`_status`) and free what it holds
    (`_release`); the deadline, the final-state bookkeeping and the logging live here.
    """

    def __init__(self, description: str, timeout: float) -> None:
        self.description = description
        self.error: str | None = None
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._state = TransferState.PENDING
        self._quiescent = False

    @property
    def quiescent(self) -> bool:
        """True once the library can no longer write into this transfer's local ranges."""
        if self._state is not TransferState.PENDING:
            self._settle()
        return self._quiescent

    def poll(self) -> TransferState:
        """The current state; never blocks, never raises."""
        if self._state is TransferState.PENDING:
            try:
                state, error = self._status()
            except Exception as exc:  # noqa: BLE001 - the contract is "never raises": a library bug is a failure
                state, error = TransferState.FAILED, f"status check raised {exc!r}"
            if state is TransferState.PENDING and time.monotonic() > self._deadline:
                state, error = TransferState.FAILED, f"timed out after {self._timeout:g} s"
            if state is not TransferState.PENDING:
                self._finish(state, error)
        else:
            self._settle()  # retry a release the library refused earlier
        return self._state

    def wait(self, timeout: float) -> TransferState:
        """Poll until final or `timeout` seconds pass (for tests and benchmarks).

        Returns PENDING if `timeout` runs out first; only the pull's own deadline fails it.
        """
        give_up = time.monotonic() + timeout
        pause = 20e-6
        while (state := self.poll()) is TransferState.PENDING:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                return state
            self._idle(min(pause, remaining))
            pause = min(pause * 2, 1e-3)  # quick transfers are seen quickly, long ones cheaply
        return state

    def _finish(self, state: TransferState, error: str | None) -> None:
        self._state = state
        if state is TransferState.FAILED:
            self.error = error or "failed (the library gave no reason)"
            LOG.warning("transfer %s failed: %s", self.description, self.error)
        self._settle()

    def _settle(self) -> None:
        if self._quiescent:
            return
        try:
            self._quiescent = self._release()
        except Exception as exc:  # noqa: BLE001 - as in poll: a library bug must not escape
            LOG.warning("transfer %s: releasing its resources raised %r", self.description, exc)

    def _idle(self, seconds: float) -> None:
        """Wait for progress; implementations with a completion signal wait on it."""
        time.sleep(seconds)

    @abstractmethod
    def _status(self) -> tuple[TransferState, str | None]:
        """Ask the library how the batch stands, without blocking."""

    @abstractmethod
    def _release(self) -> bool:
        """Free library resources (idempotent); True if local memory is now untouched."""


class DoneTransfer(Transfer):
    """An empty pull: nothing to move, so already DONE."""

    def __init__(self, description: str) -> None:
        super().__init__(description, timeout=0.0)
        self._finish(TransferState.DONE, None)

    def _status(self) -> tuple[TransferState, str | None]:
        return TransferState.DONE, None

    def _release(self) -> bool:
        return True


class FailedTransfer(Transfer):
    """A pull the library refused to start: FAILED from the outset, nothing in flight."""

    def __init__(self, description: str, error: str) -> None:
        super().__init__(description, timeout=0.0)
        self._finish(TransferState.FAILED, error)

    def _status(self) -> tuple[TransferState, str | None]:
        return TransferState.FAILED, self.error

    def _release(self) -> bool:
        return True


PeerHandle = TypeVar("PeerHandle")


class _Peer(Generic[PeerHandle]):
    """A connected peer: its metadata as received and the library's handle for it."""

    def __init__(self, blob: bytes, info: PeerInfo, handle: PeerHandle) -> None:
        self.blob = blob
        self.regions = _RegionIndex(info.regions)
        self.handle = handle


class Transport(ABC, Generic[PeerHandle]):
    """A connection-oriented reader of peers' registered memory.

    `name` is the kind ("mooncake" | "nixl"); `effective_protocol` is what really moves
    the bytes ("rdma", "tcp", "ucx"), which can differ from what was asked for.
    Not thread-safe: one thread drives a transport; a transfer may be polled from
    another thread than the one that started it, by one poller at a time.
    """

    name: str
    effective_protocol: str

    def __init__(self) -> None:
        self._local = _RegionIndex(())
        self._peers: dict[str, _Peer[PeerHandle]] = {}
        self._closed = False

    # --- public surface ------------------------------------------------------------

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Make local memory readable by peers and writable by our pulls.

        Register everything before calling `metadata()`: peers learn our regions from it.
        """
        self._check_open()
        fresh = [r for r in regions if r.length > 0]
        with self._logging_refusal("register"):
            for region in fresh:
                if region.addr <= 0:
                    raise TransferError(f"cannot register {region}: address must be positive")
                if self._local.overlaps(region):
                    raise TransferError(f"cannot register {region}: overlaps a registered region")
            if not fresh:
                return
            self._register(fresh)
        self._local = _RegionIndex([*self._local, *fresh])
        LOG.info("%s: registered %d region(s), %d bytes", self.name, len(fresh), sum(r.length for r in fresh))

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to `connect` to reach us and address our memory."""
        self._check_open()
        info = PeerInfo(
            kind=self.name,
            version=METADATA_VERSION,
            protocol=self.effective_protocol,
            endpoint=self._endpoint(),
            regions=tuple(self._local),
        )
        return _METADATA_ENCODER.encode(info)

    def connect(self, peer: str, metadata: bytes) -> None:
        """Get ready to pull from `peer` (our name for it, e.g. engine id + rank).

        Idempotent: the same metadata again is a no-op; new metadata under a known name
        (the peer restarted) replaces the old connection.
        """
        self._check_open()
        known = self._peers.get(peer)
        if known is not None and known.blob == metadata:
            return
        with self._logging_refusal(f"connect to peer {peer}"):
            info = decode_metadata(metadata, expected_kind=self.name)
            if info.protocol != self.effective_protocol:
                raise TransferError(
                    f"peer {peer} moves bytes over {info.protocol}, this side over "
                    f"{self.effective_protocol}: both must use the same (RDMA NICs on both "
                    "hosts, or protocol 'tcp' on both)"
                )
            if known is not None:
                LOG.info("%s: peer %s sent new metadata, reconnecting", self.name, peer)
                self.disconnect(peer)
            handle = self._connect(peer, info)
        self._peers[peer] = _Peer(metadata, info, handle)
        LOG.info("%s: connected to peer %s (%d region(s))", self.name, peer, len(info.regions))

    def pull(self, peer: str, ranges: Sequence[Range], timeout: float) -> Transfer:
        """Start reading `(local_addr, remote_addr, length)` ranges from `peer`.

        Returns at once; the transfer FAILS by itself if not done within `timeout`.
        Raises TransferError only for caller mistakes (unknown peer, a range outside
        registered memory); library trouble is reported by the returned transfer.
        """
        self._check_open()
        with self._logging_refusal("pull"):
            target = self._checked_target(peer, ranges, timeout)
        description = f"{self.name}:{peer}[{len(ranges)} ranges]"
        if not ranges:
            return DoneTransfer(description)
        return self._pull(target.handle, ranges, timeout, description)

    def disconnect(self, peer: str) -> None:
        """Forget `peer`; pulls already started keep running to their end."""
        target = self._peers.pop(peer, None)
        if target is not None:
            self._disconnect(peer, target.handle)
            LOG.info("%s: disconnected from peer %s", self.name, peer)

    def close(self) -> None:
        """Disconnect every peer and free the library (idempotent).

        Transfers still in flight keep what they need alive until they settle.
        """
        if self._closed:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        self._closed = True
        self._close()
        LOG.info("%s: closed", self.name)

    def __enter__(self) -> Transport[PeerHandle]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name} transport is closed")

    def _checked_target(self, peer: str, ranges: Sequence[Range], timeout: float) -> _Peer[PeerHandle]:
        """The peer to pull from, once every range is known to be inside registered memory."""
        target = self._peers.get(peer)
        if target is None:
            raise TransferError(f"pull from {peer!r}: not connected (call connect first)")
        if timeout <= 0:
            raise TransferError(f"pull from {peer!r}: timeout must be positive, got {timeout}")
        if not ranges:
            return target
        if isinstance(ranges, RangeTable):
            table = ranges.table
            shortest = int(table[:, 2].min())
            bad_local = self._local.first_outside_table(table[:, 0], table[:, 2])
            bad_remote = target.regions.first_outside_table(table[:, 1], table[:, 2])
        else:
            locals_, remotes, lengths = zip(*ranges)
            shortest = min(lengths)
            bad_local = self._local.first_outside(locals_, lengths)
            bad_remote = target.regions.first_outside(remotes, lengths)
        # A negative length would pass the extent checks below and reach the library as
        # a huge unsigned size.
        if shortest < 0:
            raise TransferError(f"pull from {peer!r}: a range has negative length {shortest}")
        if bad := bad_local:
            raise TransferError(
                f"pull from {peer!r}: local range [{bad[0]:#x}, +{bad[1]}) is "
                "not inside memory registered with this transport"
            )
        if bad := bad_remote:
            raise TransferError(
                f"pull from {peer!r}: remote range [{bad[0]:#x}, +{bad[1]}) is not inside memory the peer registered"
            )
        return target

    @contextmanager
    def _logging_refusal(self, action: str) -> Iterator[None]:
        """Log a TransferError with what was being done, then let it propagate."""
        try:
            yield
        except TransferError as exc:
            LOG.warning("%s: %s refused: %s", self.name, action, exc)
            raise

    # --- what an implementation provides --------------------------------------------

    @abstractmethod
    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register with the library; raise TransferError on refusal."""

    @abstractmethod
    def _endpoint(self) -> bytes:
        """The library's connection blob for `PeerInfo.endpoint`."""

    @abstractmethod
    def _connect(self, peer: str, info: PeerInfo) -> PeerHandle:
        """Open the library's connection to a peer; raise TransferError on failure."""

    @abstractmethod
    def _pull(self, handle: PeerHandle, ranges: Sequence[Range], timeout: float, description: str) -> Transfer:
        """Start validated reads; library failures become a FAILED transfer."""

    @abstractmethod
    def _disconnect(self, peer: str, handle: PeerHandle) -> None:
        """Drop the library's connection to a peer (best effort, never raises)."""

    @abstractmethod
    def _close(self) -> None:
        """Free the library's resources (best effort, never raises)."""
