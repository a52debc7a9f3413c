"""The TP mapping: which prefill ranks and heads each decode rank reads, with expected
values worked out by hand from vLLM's head split (rank r of tp holds heads
[r*T/tp, (r+1)*T/tp), or head r*T//tp when T < tp)."""

from __future__ import annotations

import pytest

from pdconnect.tpmap import (
    GroupHeads,
    HeadRead,
    PairingError,
    check_pairing,
    check_rank_heads,
    group_reads,
    heads_of_rank,
    rank_reads,
    reads_for_rank,
    source_ranks,
)

TWO = GroupHeads(2)
LATENT = GroupHeads(1, latent=True)


def test_heads_of_rank_split_and_replicated() -> None:
    assert [heads_of_rank(2, GroupHeads(8), r) for r in range(2)] == [range(4), range(4, 8)]
    # 2 heads on 4 ranks: each head on two ranks.
    assert [heads_of_rank(4, TWO, r) for r in range(4)] == [range(1), range(1), range(1, 2), range(1, 2)]
    assert [heads_of_rank(3, LATENT, r) for r in range(3)] == [range(1)] * 3


def test_p_tp2_to_d_tp1_reads_one_head_from_each_prefill_rank() -> None:
    assert group_reads(2, 1, TWO, 0) == [HeadRead(0, 0, 0, 1), HeadRead(1, 0, 1, 1)]


def test_p_tp1_to_d_tp2_reads_its_head_slice() -> None:
    assert group_reads(1, 2, TWO, 0) == [HeadRead(0, 0, 0, 1)]
    assert group_reads(1, 2, TWO, 1) == [HeadRead(0, 1, 0, 1)]
    # 8 heads, P TP2 -> D TP4: decode rank 1 holds heads 2-3, the upper half of P0's 0-3.
    assert group_reads(2, 4, GroupHeads(8), 1) == [HeadRead(0, 2, 0, 2)]
    assert group_reads(2, 4, GroupHeads(8), 2) == [HeadRead(1, 0, 0, 2)]


def test_p_tp1_to_d_tp4_more_ranks_than_heads() -> None:
    # D ranks 0,1 hold head 0; 2,3 hold head 1; all from the single prefill rank.
    assert [group_reads(1, 4, TWO, d) for d in range(4)] == [
        [HeadRead(0, 0, 0, 1)],
        [HeadRead(0, 0, 0, 1)],
        [HeadRead(0, 1, 0, 1)],
        [HeadRead(0, 1, 0, 1)],
    ]


def test_replicated_prefill_heads_are_read_once() -> None:
    # 2 heads on P TP4 (P0,P1 hold head 0; P2,P3 head 1) -> D TP1: one read per head.
    assert group_reads(4, 1, TWO, 0) == [HeadRead(0, 0, 0, 1), HeadRead(2, 0, 1, 1)]
    # One KV head, P TP2 -> D TP1: P1 holds a copy and is not read.
    assert group_reads(2, 1, GroupHeads(1), 0) == [HeadRead(0, 0, 0, 1)]


def test_replicated_sources_are_spread_over_prefill_ranks() -> None:
    assert [group_reads(2, 2, LATENT, d) for d in range(2)] == [[HeadRead(0, 0, 0, 1)], [HeadRead(1, 0, 0, 1)]]
    assert [group_reads(4, 2, LATENT, d)[0].prefill_rank for d in range(2)] == [0, 2]
    assert [group_reads(2, 4, LATENT, d)[0].prefill_rank for d in range(4)] == [0, 0, 1, 1]
    # 2 heads on P TP4 -> D TP4: each decode rank reads its own replica.
    assert [group_reads(4, 4, TWO, d)[0].prefill_rank for d in range(4)] == [0, 1, 2, 3]


def test_consecutive_heads_from_one_rank_merge() -> None:
    assert group_reads(2, 1, GroupHeads(8), 0) == [HeadRead(0, 0, 0, 4), HeadRead(1, 0, 4, 4)]


def test_hybrid_groups_map_separately() -> None:
    # MiMo-V2's shape: sliding-window layers with 4 KV heads, full layers with 2.
    groups = [GroupHeads(4), TWO]
    reads = rank_reads(1, groups, 2, groups, 1)
    assert reads == {0: [HeadRead(0, 2, 0, 2)], 1: [HeadRead(0, 1, 0, 1)]}
    assert source_ranks(rank_reads(2, groups, 1, groups, 0)) == [0, 1]


@pytest.mark.parametrize(
    ("prefill_tp", "prefill", "decode_tp", "decode", "names"),
    [
        (2, [GroupHeads(3)], 1, [GroupHeads(3)], ["prefill", "3 KV heads", "tp_size 2"]),
        (1, [GroupHeads(6)], 4, [GroupHeads(6)], ["decode", "6 KV heads", "tp_size 4"]),
        (2, [TWO], 1, [GroupHeads(4)], ["prefill has 2 KV heads", "decode has 4 KV heads"]),
        (2, [LATENT], 1, [GroupHeads(1)], ["latent", "decode has 1 KV heads"]),
        (2, [TWO], 2, [TWO, TWO], ["prefill has 1 KV cache groups", "decode has 2"]),
    ],
)
def test_impossible_pairings_name_both_sides(
    prefill_tp: int, prefill: list[GroupHeads], decode_tp: int, decode: list[GroupHeads], names: list[str]
) -> None:
    with pytest.raises(PairingError) as raised:
        check_pairing(prefill_tp, prefill, decode_tp, decode)
    for name in names:
        assert name in str(raised.value)


def test_equal_tp_reads_the_twin_rank_whole_whatever_the_head_count() -> None:
    # Even a group whose model-wide head count is unknown (0) pairs at equal TP.
    assert reads_for_rank(2, 2, [GroupHeads(0)], 1, {0: 1}) == {0: [HeadRead(1, 0, 0, 1)]}
    with pytest.raises(PairingError, match="unknown number of KV heads"):
        reads_for_rank(2, 1, [GroupHeads(0)], 0, {0: 1})


def test_the_real_tensors_must_hold_the_split_heads() -> None:
    assert reads_for_rank(2, 1, [TWO], 0, {0: 2}) == {0: [HeadRead(0, 0, 0, 1), HeadRead(1, 0, 1, 1)]}
    with pytest.raises(PairingError, match="decode rank 0, group 0: its KV tensors hold 1 heads per block, but 2 KV"):
        reads_for_rank(2, 1, [TWO], 0, {0: 1})
    check_rank_heads("prefill", 2, [TWO, GroupHeads(4)], 1, {0: 1, 1: 2})
    with pytest.raises(PairingError, match=r"prefill rank 1, group 1: .* hold 4 heads .* gives 2"):
        check_rank_heads("prefill", 2, [TWO, GroupHeads(4)], 1, {0: 1, 1: 4})


def test_four_heads_replicated_over_eight_prefill_ranks_read_by_two_decode_ranks() -> None:
    # P rank r holds head r*4//8: P0,P1 head 0; P2,P3 head 1; P4,P5 head 2; P6,P7 head 3.
    four = GroupHeads(4)
    assert group_reads(8, 2, four, 0) == [HeadRead(0, 0, 0, 1), HeadRead(2, 0, 1, 1)]
    assert group_reads(8, 2, four, 1) == [HeadRead(4, 0, 0, 1), HeadRead(6, 0, 1, 1)]
