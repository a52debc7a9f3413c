"""What the connector's halves tell each other: scheduler -> worker each step, worker -> peers once.

vLLM moves `KVConnectorMetadata` from the scheduler process to every worker each step
and `KVConnectorHandshakeMetadata` from each worker to the scheduler once at start-up;
both cross process boundaries by pickling, so they hold only plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from pdconnect.kvlayout import TensorLayout
from pdconnect.protocol import ParallelShape

__all__ = ["PDConnectorMetadata", "PDHandshakeMetadata", "PullSpec", "decode_layouts", "encode_layouts"]


@dataclass(frozen=True)
class PullSpec:
    """One request's load on the decode engine: which remote blocks go into which local ones.

    `block_pairs` maps a KV cache group to `(local_block_id, remote_block_id)` pairs;
    `blocks_by_kind` counts them for metrics. A spec with `fail_reason` set moves
    nothing: the scheduler already knows the load cannot succeed and lets the worker
    report the failure, so it follows vLLM's own failure path and policy. After the
    read, the worker claims `lease_id` as `claimant` again: the load succeeds only if
    the prefill engine still holds the lease for it.
    """

    request_id: str
    remote_engine_id: str
    side_channel: str
    compat_hash: str
    block_pairs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    blocks_by_kind: dict[str, int] = field(default_factory=dict)
    fail_reason: str | None = None
    lease_id: str = ""
    claimant: str = ""
    plan_digest: str = ""


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    """One step's instructions for the workers.

    `pulls`: loads to start. `release`: prefill-side requests whose blocks may be freed
    now (decode done, released, or lease expired); the workers echo them back as
    `finished_sending`, which is how vLLM frees delayed blocks.
    """

    pulls: list[PullSpec] = field(default_factory=list)
    release: list[str] = field(default_factory=list)


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What one worker tells peers about itself, served by the scheduler's side channel."""

    tp_rank: int
    transport: str
    transport_metadata: bytes
    layouts: bytes  # `encode_layouts` of this rank's per-group tensor layouts
    parallel: ParallelShape  # the engine's TP size and this rank


_layouts_encoder = msgspec.msgpack.Encoder()
_layouts_decoder: msgspec.msgpack.Decoder[dict[int, list[TensorLayout]]] = msgspec.msgpack.Decoder(
    dict[int, list[TensorLayout]]
)


def encode_layouts(layouts: dict[int, list[TensorLayout]]) -> bytes:
    return _layouts_encoder.encode(layouts)


def decode_layouts(data: bytes) -> dict[int, list[TensorLayout]]:
    return _layouts_decoder.decode(data)
