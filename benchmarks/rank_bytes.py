"""The bytes each decode rank needs, from a model's config.json, against what its metrics say it pulled.

`benchmarks.parallel`'s arithmetic, kept apart from its engines: per attention group,
blocks pulled x block size x layers of the group x 2 (K and V) x the KV heads the rank
holds (heads / decode TP, at least 1: fewer heads than ranks are replicated) x head_dim x
dtype bytes. It is computed from the geometry alone, never from the connector's mapping
(`pdconnect.tpmap`), so a rank that pulled a head twice shows as pulled > needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pdconnect.bench.scrape import MetricsSnapshot

__all__ = [
    "GroupGeometry",
    "ModelGeometry",
    "RankBytes",
    "heads_per_rank",
    "model_geometry",
    "needed_bytes_per_rank",
    "rank_bytes_between",
]

ATTENTION_KINDS: tuple[Literal["full_attention", "sliding_attention"], ...] = ("full_attention", "sliding_attention")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
# The connector's per-kind block counters, and the attention group each kind belongs to.
BLOCK_KINDS = {"full_attention": "full_attention", "tail": "sliding_attention", "slack": "sliding_attention"}
RANK_BYTES = "pdconnect:rank_bytes_transferred"


# ---------------------------------------------------------------------------------------
# What a decode rank needs, from the model's geometry alone


class GroupGeometry(NamedTuple):
    """One attention kind of the model: its layers and each layer's KV heads and head size."""

    kind: Literal["full_attention", "sliding_attention"]
    layers: int
    kv_heads: int
    head_dim: int


class ModelGeometry(NamedTuple):
    """A model's attention groups, with the engine's block size and KV dtype's bytes."""

    block_size: int
    dtype_bytes: int
    groups: tuple[GroupGeometry, ...]

    def group(self, kind: str) -> GroupGeometry | None:
        return next((g for g in self.groups if g.kind == kind), None)


def model_geometry(config: Mapping[str, Any], block_size: int, dtype: str) -> ModelGeometry:
    """A Hugging Face config.json's attention geometry (`layer_types` when it has them, all
    full attention otherwise), with the engine's block size and KV dtype."""
    layers = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or ["full_attention"] * layers)
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    kv_heads = int(config.get("num_key_value_heads", config["num_attention_heads"]))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    groups = tuple(
        GroupGeometry(kind, types.count(kind), kv_heads, head_dim) for kind in ATTENTION_KINDS if kind in types
    )
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return ModelGeometry(block_size, DTYPE_BYTES[dtype], groups)


def heads_per_rank(kv_heads: int, tp_size: int) -> int:
    """KV heads each rank of a TP engine holds: an equal share, or one replicated head when
    there are fewer heads than ranks (as vLLM shards them)."""
    if kv_heads >= tp_size:
        if kv_heads % tp_size:
            raise ValueError(f"{kv_heads} KV heads do not split over tp_size {tp_size}")
        return kv_heads // tp_size
    if tp_size % kv_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of {kv_heads} KV heads")
    return 1


def needed_bytes_per_rank(geometry: ModelGeometry, tp_size: int, blocks: Mapping[str, float]) -> int:
    """The bytes one decode rank of a `tp_size` engine must pull for `blocks` (per kind of
    `BLOCK_KINDS`, counted once, not per rank): K and V of its heads, every layer of the block's group."""
    total = 0
    for kind, count in blocks.items():
        group = geometry.group(BLOCK_KINDS[kind])
        if group is None:
            if count:
                raise ValueError(f"{count} {kind} blocks, but the model has no {BLOCK_KINDS[kind]} layers")
            continue
        per_block = 2 * group.layers * geometry.block_size * heads_per_rank(group.kv_heads, tp_size) * group.head_dim
        total += round(count) * per_block * geometry.dtype_bytes
    return total


# ---------------------------------------------------------------------------------------
# What the decode engine says it pulled, per rank


@dataclass(frozen=True)
class RankBytes:
    """One decode rank's bytes over the measured step: pulled (its metric) and needed (the geometry)."""

    engine: str  # vLLM's engine label: the data-parallel rank
    tp_rank: str
    pulled: int
    needed: int

    @property
    def excess(self) -> int:
        """Bytes pulled beyond what the rank needs (a duplicate or a wrong slice); negative: short."""
        return self.pulled - self.needed


def _by_labels(snapshot: MetricsSnapshot, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    wanted = {name, f"{name}_total"}
    out: dict[tuple[str, ...], float] = {}
    for sample_name, labels, value in snapshot.samples:
        if sample_name in wanted:
            key = tuple(dict(labels).get(k, "") for k in keys)
            out[key] = out.get(key, 0.0) + value
    return out


def rank_bytes_between(
    before: MetricsSnapshot, after: MetricsSnapshot, geometry: ModelGeometry, tp_size: int
) -> list[RankBytes]:
    """Each decode rank's pulled and needed bytes between two scrapes of a decode engine.

    Blocks are counted by every TP rank of an engine for the same blocks: per rank, the
    engine's count over `tp_size` (a count that does not divide is reported as it is).
    """
    pulled_after = _by_labels(after, RANK_BYTES, "engine", "tp_rank")
    pulled_before = _by_labels(before, RANK_BYTES, "engine", "tp_rank")
    blocks: dict[str, dict[str, float]] = {}
    for kind in BLOCK_KINDS:
        name = f"pdconnect:blocks_{kind}"
        start = _by_labels(before, name, "engine")
        for (engine,), value in _by_labels(after, name, "engine").items():
            blocks.setdefault(engine, {})[kind] = (value - start.get((engine,), 0.0)) / tp_size
    # A rank that pulled nothing has no series: it is still owed what its engine's blocks need.
    keys = set(pulled_after) | {
        (e, str(r)) for e, kinds in blocks.items() if any(kinds.values()) for r in range(tp_size)
    }
    rows = []
    for engine, rank in sorted(keys):
        pulled = round(pulled_after.get((engine, rank), 0.0) - pulled_before.get((engine, rank), 0.0))
        needed = needed_bytes_per_rank(geometry, tp_size, blocks.get(engine, {}))
        if pulled or needed:
            rows.append(RankBytes(engine, rank, pulled, needed))
    return rows
