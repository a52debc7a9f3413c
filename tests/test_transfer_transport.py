"""Range merging and peer metadata decoding: the transport-independent rules."""

from __future__ import annotations

import msgspec
import pytest

from pdconnect.transfer import MemoryRegion, PeerInfo, TransferError, create_transport, decode_metadata, merge_ranges
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
