"""Range merging and peer metadata decoding (transport-independent); Mooncake retry accounting (FAKE binding)."""

from __future__ import annotations

import msgspec
import pytest

from pdconnect.transfer import (
    MemoryRegion,
    PeerInfo,
    Transfer,
    TransferError,
    TransferState,
    create_transport,
    decode_metadata,
    merge_ranges,
)
from pdconnect.transfer.transport import METADATA_VERSION


def test_ranges_adjacent_on_both_sides_merge_into_one_descriptor() -> None:
    ranges = [(0x2000, 0x9000, 0x1000), (0x1000, 0x8000, 0x1000), (0x3000, 0xA000, 0x800)]
    assert merge_ranges(ranges) == [(0x1000, 0x8000, 0x2800)]


def test_ranges_adjacent_on_one_side_only_stay_apart() -> None:
    local_only = [(0x1000, 0x8000, 0x1000), (0x2000, 0x9800, 0x1000)]
    remote_only = [(0x1000, 0x8000, 0x1000), (0x2800, 0x9000, 0x1000)]
    assert merge_ranges(local_only) == local_only
    assert merge_ranges(remote_only) == remote_only


def test_empty_ranges_vanish_and_overlapping_destinations_are_refused() -> None:
    assert merge_ranges([(0x1000, 0x8000, 0)]) == []
    with pytest.raises(ValueError, match="destination ranges overlap"):
        merge_ranges([(0x1000, 0x8000, 0x1000), (0x1800, 0x20000, 0x1000)])


def test_metadata_decoding_names_what_is_wrong() -> None:
    good = PeerInfo(
        kind="nixl", version=METADATA_VERSION, protocol="ucx", endpoint=b"blob", regions=(MemoryRegion(4096, 8192),)
    )
    blob = msgspec.msgpack.encode(good)
    assert decode_metadata(blob, expected_kind="nixl") == good
    with pytest.raises(TransferError, match="not pdconnect transfer metadata"):
        decode_metadata(b"\x00garbage")
    with pytest.raises(TransferError, match="for transport 'nixl', this side runs 'mooncake'"):
        decode_metadata(blob, expected_kind="mooncake")
    future = msgspec.msgpack.encode(
        PeerInfo(kind="nixl", version=METADATA_VERSION + 1, protocol="ucx", endpoint=b"", regions=())
    )
    with pytest.raises(TransferError, match="different pdconnect releases"):
        decode_metadata(future)


def test_unknown_transport_kind_is_refused() -> None:
    with pytest.raises(TransferError, match="unknown transport 'rdma'"):
        create_transport("rdma", host="127.0.0.1")


class _FakeMooncake:
    """FAKE Mooncake binding (which cannot be made to do this on cue): the first `fail_at_once`
    reads submitted end FAILED at once, as its TCP lanes fail a peer's whole queue when a
    connect round is used up (pdconnect.transfer.mooncake); every later read succeeds,
    unless `gone`, when every read fails at once, as for a peer that is not there."""

    def __init__(self, fail_at_once: int, gone: bool = False) -> None:
        self.fail_at_once = fail_at_once
        self.gone = gone
        self.submitted: list[int] = []

    def batch_transfer_async_read(self, session: str, local: list[int], remote: list[int], length: list[int]) -> int:
        self.submitted.append(remote[0])
        return len(self.submitted)  # a batch id, never the binding's failure sentinel 0

    def transfer_check_status(self, batch: int) -> int:
        return -1 if self.gone or batch <= self.fail_at_once else 1


def _fake_pull(engine: _FakeMooncake, ranges: int) -> Transfer:
    from pdconnect.transfer.mooncake import _MooncakeTransfer

    table = [(0x1000 * i, 0x9000 * i, 64) for i in range(ranges)]
    return _MooncakeTransfer(engine, "127.0.0.1:1", table, 10.0, "fake", {"127.0.0.1:1"})


def test_FAKE_mooncake_queue_failed_at_once_is_read_again_and_served() -> None:
    """Eight reads queued for a peer fail in the same instant (a used-up connect round);
    each is read again once and the pull is served. Before, the second of them to fail
    at once ended the pull as "peer unreachable or gone"."""
    engine = _FakeMooncake(fail_at_once=8)
    transfer = _fake_pull(engine, 8)
    assert transfer.wait(5.0) is TransferState.DONE, transfer.error
    assert sorted(engine.submitted) == sorted(2 * [0x9000 * i for i in range(8)])


def test_FAKE_mooncake_peer_whose_reads_all_fail_at_once_is_gone_at_once() -> None:
    engine = _FakeMooncake(fail_at_once=0, gone=True)
    transfer = _fake_pull(engine, 8)
    assert transfer.wait(5.0) is TransferState.FAILED
    assert transfer.error is not None and "failed at once 2 times" in transfer.error
    assert len(engine.submitted) <= 2 * 8, "a gone peer was read again and again"
