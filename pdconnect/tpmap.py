"""Which prefill TP ranks each decode TP rank reads, and which KV heads of their blocks.

A KV cache group's heads are split over the TP ranks the way vLLM splits them (its
`QKVParallelLinear`): with `T` KV heads on `tp` ranks,

- `T >= tp`: `tp` must divide `T`; rank `r` holds heads `[r*T/tp, (r+1)*T/tp)`;
- `T < tp`: `T` must divide `tp`; each head is replicated on `tp/T` ranks, and rank `r`
  holds head `r*T // tp` alone;
- a latent group (MLA: one latent vector per token, no head split) is whole on every rank.

A decode rank needs the heads it holds; each comes from one prefill rank that holds it.
Where several prefill ranks hold the same head (replicated heads, latent groups), the
decode ranks that need that head are spread over them in order, so no byte is read twice
by one decode rank and the reads fall on as many prefill ranks as there are readers
(decode rank `k` of `n` needing a head held by `c` prefill ranks reads replica
`k*c // n`: vLLM's `r*P_TP // D_TP` for MLA). Consecutive heads from the same prefill
rank that sit consecutively on both sides become one `HeadRead`.

The pairing is refused (`PairingError`, naming both sides' values) where a side's head
count does not split over its TP size, or the two sides disagree on the groups' head
counts. Pure arithmetic, no vLLM: the decode worker calls it at handshake, `pdconnect
plan` prints it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "GroupHeads",
    "HeadRead",
    "PairingError",
    "check_pairing",
    "check_rank_heads",
    "describe",
    "group_reads",
    "heads_of_rank",
    "rank_reads",
    "reads_for_rank",
    "source_ranks",
]


class PairingError(ValueError):
    """Two engines' parallel shapes cannot exchange KV blocks."""


@dataclass(frozen=True)
class GroupHeads:
    """One KV cache group's heads, model-wide (not per rank)."""

    kv_heads: int
    latent: bool = False  # MLA: one latent head, whole on every rank


@dataclass(frozen=True)
class HeadRead:
    """`count` heads from `prefill_rank`'s block at head `remote_start` into this rank's
    block at head `local_start` (head indices within each rank's own tensor)."""

    prefill_rank: int
    remote_start: int
    local_start: int
    count: int


def _check_split(side: str, tp_size: int, group_id: int, group: GroupHeads) -> None:
    if tp_size < 1:
        raise PairingError(f"{side}: tp_size {tp_size} is not a TP size")
    if group.latent:
        if group.kv_heads != 1:
            raise PairingError(f"{side}: group {group_id} is latent (MLA) with {group.kv_heads} KV heads, not 1")
        return
    heads = group.kv_heads
    if heads < 1 or (heads % tp_size and tp_size % heads):
        known = (
            f"{heads} KV heads, which do not split"
            if heads
            else "an unknown number of KV heads (see docs/parallel.md), not split"
        )
        raise PairingError(f"{side}: group {group_id} has {known} over tp_size {tp_size} (one must divide the other)")


def heads_of_rank(tp_size: int, group: GroupHeads, rank: int) -> range:
    """The model-wide KV heads TP rank `rank` of `tp_size` holds."""
    _check_split("engine", tp_size, 0, group)
    if not 0 <= rank < tp_size:
        raise PairingError(f"rank {rank} is not a rank of tp_size {tp_size}")
    if group.latent:
        return range(1)
    heads = group.kv_heads
    if heads >= tp_size:
        per_rank = heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * heads // tp_size
    return range(head, head + 1)


def _holders(tp_size: int, group: GroupHeads, head: int) -> list[int]:
    return [r for r in range(tp_size) if head in heads_of_rank(tp_size, group, r)]


def group_reads(prefill_tp: int, decode_tp: int, group: GroupHeads, decode_rank: int) -> list[HeadRead]:
    """What `decode_rank` reads for one group: one entry per run of consecutive heads."""
    _check_split("prefill", prefill_tp, 0, group)
    _check_split("decode", decode_tp, 0, group)
    mine = heads_of_rank(decode_tp, group, decode_rank)
    reads: list[HeadRead] = []
    for local, head in enumerate(mine):
        sources = _holders(prefill_tp, group, head)
        readers = _holders(decode_tp, group, head)
        source = sources[readers.index(decode_rank) * len(sources) // len(readers)]
        remote = head - heads_of_rank(prefill_tp, group, source).start
        last = reads[-1] if reads else None
        if (
            last is not None
            and last.prefill_rank == source
            and last.remote_start + last.count == remote
            and last.local_start + last.count == local
        ):
            reads[-1] = HeadRead(source, last.remote_start, last.local_start, last.count + 1)
        else:
            reads.append(HeadRead(source, remote, local, 1))
    return reads


def check_pairing(
    prefill_tp: int, prefill_groups: Sequence[GroupHeads], decode_tp: int, decode_groups: Sequence[GroupHeads]
) -> None:
    """Raise PairingError, naming both sides' values, unless every decode rank can be served."""
    if len(prefill_groups) != len(decode_groups):
        raise PairingError(f"prefill has {len(prefill_groups)} KV cache groups, decode has {len(decode_groups)}")
    for group_id, (theirs, mine) in enumerate(zip(prefill_groups, decode_groups)):
        if theirs != mine:
            raise PairingError(f"group {group_id}: prefill has {describe(theirs)}, decode has {describe(mine)}")
        try:
            _check_split("prefill", prefill_tp, group_id, theirs)
            _check_split("decode", decode_tp, group_id, mine)
        except PairingError as exc:
            raise PairingError(f"prefill tp_size {prefill_tp} -> decode tp_size {decode_tp}: {exc}") from None


def rank_reads(
    prefill_tp: int,
    prefill_groups: Sequence[GroupHeads],
    decode_tp: int,
    decode_groups: Sequence[GroupHeads],
    decode_rank: int,
) -> dict[int, list[HeadRead]]:
    """Group id -> what `decode_rank` reads for it, after `check_pairing`."""
    check_pairing(prefill_tp, prefill_groups, decode_tp, decode_groups)
    return {g: group_reads(prefill_tp, decode_tp, group, decode_rank) for g, group in enumerate(decode_groups)}


def check_rank_heads(
    side: str, tp_size: int, groups: Sequence[GroupHeads], rank: int, heads: Mapping[int, int]
) -> None:
    """Raise PairingError unless a rank's real tensors (`heads`: group id -> heads in its
    blocks) hold what the TP split says they hold: the mapping addresses heads by index."""
    for group_id, group in enumerate(groups):
        expected = len(heads_of_rank(tp_size, group, rank))
        if group_id in heads and heads[group_id] != expected:
            raise PairingError(
                f"{side} rank {rank}, group {group_id}: its KV tensors hold {heads[group_id]} heads per block, "
                f"but {describe(group)} over tp_size {tp_size} gives {expected}"
            )


def reads_for_rank(
    prefill_tp: int, decode_tp: int, groups: Sequence[GroupHeads], decode_rank: int, local_heads: Mapping[int, int]
) -> dict[int, list[HeadRead]]:
    """What `decode_rank` reads, group id -> reads, given its tensors' head counts.

    Equal TP sizes read the twin rank's whole blocks, whatever the head counts (a group
    whose model-wide count is unknown works there); unequal ones go through the mapping,
    checked against the decode rank's real tensors.
    """
    if prefill_tp == decode_tp:
        return {g: [HeadRead(decode_rank, 0, 0, n)] for g, n in local_heads.items()}
    reads = rank_reads(prefill_tp, groups, decode_tp, groups, decode_rank)
    check_rank_heads("decode", decode_tp, groups, decode_rank, local_heads)
    return reads


def source_ranks(reads: dict[int, list[HeadRead]]) -> list[int]:
    """The prefill ranks a decode rank's reads touch, in order."""
    return sorted({read.prefill_rank for group in reads.values() for read in group})


def describe(group: GroupHeads) -> str:
    """A group's heads in words, for refusals."""
    return "one latent (MLA) head" if group.latent else f"{group.kv_heads} KV heads"
