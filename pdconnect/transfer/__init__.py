"""Moving KV bytes between engines: one `Transport` interface, Mooncake and NIXL behind it.

The public surface is here (and `create_transport`, which picks an implementation):

- `transport`: the contract (`Transport`, `Transfer`, `MemoryRegion`, peer metadata),
  its invariants enforced in the base classes.
- `ranges`: the byte-range arithmetic (`Range`, `RangeTable`, `merge_ranges`).
- `mooncake`, `nixl`: the two implementations; `loopback`: a peer process serving
  registered memory, for tests and benchmarks; `_host`: host facts (RDMA devices, env).

Neither this package nor its users need torch: memory is raw addresses.
"""

from __future__ import annotations

from typing import Any

from pdconnect.transfer.ranges import Range, RangeTable, merge_range_groups, merge_ranges
from pdconnect.transfer.transport import (
    MemoryRegion,
    PeerInfo,
    Transfer,
    TransferError,
    TransferState,
    Transport,
    decode_metadata,
)

__all__ = [
    "TRANSPORT_KINDS",
    "MemoryRegion",
    "PeerInfo",
    "Range",
    "RangeTable",
    "Transfer",
    "TransferError",
    "TransferState",
    "Transport",
    "create_transport",
    "decode_metadata",
    "merge_range_groups",
    "merge_ranges",
]

TRANSPORT_KINDS = ("mooncake", "nixl")


def create_transport(
    kind: str,
    *,
    host: str,
    protocol: str = "rdma",
    device_name: str = "",
    require_rdma: bool = False,
    nixl_progress_delay_us: int | None = None,
    mooncake_stall_seconds: float | None = None,
) -> Transport[Any]:
    """A started transport of `kind` ("mooncake" | "nixl"); raises TransferError.

    `host` is the address peers reach us at; `protocol`, `device_name`,
    `require_rdma` and `nixl_progress_delay_us` (None: the transport's default) mean what
    `ConnectorSettings` says; `mooncake_stall_seconds` (None: the default) is how long a
    Mooncake TCP session may make no progress before a read is made again on a fresh
    one. The libraries are imported only here, so a process that never creates a
    transport never loads them.
    """
    if kind == "mooncake":
        from pdconnect.transfer.mooncake import DEFAULT_STALL_SECONDS, MooncakeTransport

        return MooncakeTransport(
            host=host,
            protocol=protocol,
            device_name=device_name,
            require_rdma=require_rdma,
            stall_seconds=mooncake_stall_seconds or DEFAULT_STALL_SECONDS,
        )
    if kind == "nixl":
        from pdconnect.transfer.nixl import NixlTransport

        return NixlTransport(
            host=host,
            protocol=protocol,
            device_name=device_name,
            require_rdma=require_rdma,
            progress_delay_us=nixl_progress_delay_us,
        )
    raise TransferError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORT_KINDS)}")
