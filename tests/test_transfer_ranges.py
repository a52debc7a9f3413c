"""The pull path's range arithmetic, checked against references written independently.

`kvlayout` derives byte ranges from cached geometry with numpy broadcasting, and
`merge_ranges` merges them vectorized; both are checked here against plain element-by-element
and range-by-range Python written for this test, on several layouts (CPU, flash-attn NHD
and HND, FlashInfer, MLA, vLLM 0.33's layer-interleaved BHLNC, mixed layers), so a fast
path that drifts from the meaning of a layout fails loudly. No transport and no torch:
layouts are described by hand.
"""

from __future__ import annotations

import itertools
import pickle
import random

import msgspec
import pytest

from connectors.settings import ConnectorSettings
from pdconnect.kvlayout import LayoutError, TensorLayout, pull_ranges, pull_ranges_for_layers
from pdconnect.transfer import RangeTable, TransferError, create_transport, merge_range_groups, merge_ranges

BLOCKS, HEADS, TOKENS, HEAD = 6, 2, 4, 3


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, run = [], 1
    for size in reversed(shape):
        strides.append(run)
        run *= size
    return tuple(reversed(strides))


def _permuted(base: int, shape: tuple[int, ...], order: tuple[int, ...], itemsize: int, block_dim: int) -> TensorLayout:
    """A contiguous tensor of `shape` viewed through `.permute(order)`, as torch would."""
    strides = _contiguous_strides(shape)
    return TensorLayout(base, tuple(shape[d] for d in order), tuple(strides[d] for d in order), itemsize, block_dim)


LAYERS = 3  # layers sharing one allocation in the interleaved layouts


def _bhlnc(base: int, n: int, layer: int = 0) -> TensorLayout:
    """Layer `layer`'s `[B, H, N, C]` view of vLLM 0.33's BHLNC cache (VLLM_KV_CACHE_LAYOUT).

    Every layer of a group shares one buffer laid out `[B, H, L, N, C]` in memory, so a
    layer's slice of one head of one block sits between the other layers' slices: a
    block of a layer is one separate range per head. Written out by hand from that
    memory order, not through `_permuted`, so the test does not share its arithmetic.
    """
    c = 2 * HEAD  # K and V packed in the content dim, as in vLLM 0.33's [B, H, N, C] views
    itemsize = 2
    return TensorLayout(
        base + layer * TOKENS * c * itemsize,
        (n, HEADS, TOKENS, c),
        (HEADS * LAYERS * TOKENS * c, LAYERS * TOKENS * c, c, 1),
        itemsize,
        0,
    )


# name -> (make(base, num_blocks), the logical block shape every backend agrees on)
LAYOUTS = {
    # [blocks, heads, tokens, 2*head]: the CPU backend, K and V packed in the last dim.
    "cpu": lambda base, n: _permuted(base, (n, HEADS, TOKENS, 2 * HEAD), (0, 1, 2, 3), 2, 0),
    # [2, blocks, tokens, heads, head]: flash-attn NHD, a K and a V plane per block.
    "flash_attn": lambda base, n: _permuted(base, (2, n, TOKENS, HEADS, HEAD), (0, 1, 2, 3, 4), 2, 1),
    # flash-attn's logical shape over HND memory ([2, blocks, heads, tokens, head]).
    "flash_attn_hnd": lambda base, n: _permuted(base, (2, n, HEADS, TOKENS, HEAD), (0, 1, 3, 2, 4), 2, 1),
    # [blocks, 2, tokens, heads, head]: FlashInfer NHD, one range per block.
    "flashinfer": lambda base, n: _permuted(base, (n, 2, TOKENS, HEADS, HEAD), (0, 1, 2, 3, 4), 2, 0),
    "flashinfer_hnd": lambda base, n: _permuted(base, (n, 2, HEADS, TOKENS, HEAD), (0, 1, 3, 2, 4), 2, 0),
    # flash-attn's logical shape over HND memory with the block dim outermost.
    "flash_attn_blocks_outermost": lambda base, n: _permuted(base, (n, 2, HEADS, TOKENS, HEAD), (1, 0, 3, 2, 4), 2, 1),
    # [B, H, L, N, C] in memory, the middle layer's view: heads of a block interleaved
    # with the other layers' (the same logical block as "cpu", i.e. vLLM 0.33's LBHNC).
    "bhlnc": lambda base, n: _bhlnc(base, n, layer=1),
}

# Pairs whose blocks hold the same elements in the same packed order.
COMPATIBLE = [
    ("cpu", "cpu"),
    ("flash_attn", "flash_attn"),
    ("flash_attn", "flashinfer"),
    ("flashinfer", "flash_attn"),
    ("flash_attn_hnd", "flashinfer_hnd"),
    ("flashinfer_hnd", "flash_attn_blocks_outermost"),
    ("flash_attn_blocks_outermost", "flash_attn_hnd"),
    ("bhlnc", "bhlnc"),
    ("bhlnc", "cpu"),
    ("cpu", "bhlnc"),
]


def _element_address(layout: TensorLayout, block: int, index: tuple[int, ...]) -> int:
    """Byte address of the element at `index` (over the non-block dims) of `block`."""
    full = list(index)
    full.insert(layout.block_dim, block)
    return layout.base_addr + sum(i * s for i, s in zip(full, layout.strides)) * layout.itemsize


def _reference_byte_map(local: TensorLayout, remote: TensorLayout, pairs: list[tuple[int, int]]) -> dict[int, int]:
    """local byte -> remote byte, element by element: what a correct pull must copy."""
    block_shape = [n for d, n in enumerate(local.shape) if d != local.block_dim]
    mapping = {}
    for local_block, remote_block in pairs:
        for index in itertools.product(*(range(n) for n in block_shape)):
            mine = _element_address(local, local_block, index)
            theirs = _element_address(remote, remote_block, index)
            for byte in range(local.itemsize):
                mapping[mine + byte] = theirs + byte
    return mapping


def _byte_map(ranges: list[tuple[int, int, int]]) -> dict[int, int]:
    mapping: dict[int, int] = {}
    for local, remote, length in ranges:
        for offset in range(length):
            assert local + offset not in mapping, "a destination byte is written twice"
            mapping[local + offset] = remote + offset
    return mapping


def _pairs(seed: int, count: int, local_blocks: int, remote_blocks: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return list(zip(rng.sample(range(local_blocks), count), rng.sample(range(remote_blocks), count)))


@pytest.mark.parametrize("local_name,remote_name", COMPATIBLE)
@pytest.mark.parametrize("merged", [True, False])
def test_pull_ranges_copy_every_element_to_its_place(local_name: str, remote_name: str, merged: bool) -> None:
    local = LAYOUTS[local_name](1 << 20, BLOCKS)
    remote = LAYOUTS[remote_name](1 << 30, BLOCKS + 3)
    for seed in range(3):
        pairs = _pairs(seed, 4, BLOCKS, BLOCKS + 3)
        ranges = pull_ranges(local, remote, pairs, merged=merged)
        assert _byte_map(list(ranges)) == _reference_byte_map(local, remote, pairs)


def test_several_layers_of_mixed_layouts_match_the_reference_layer_by_layer() -> None:
    # Runs of equal geometry are computed in one broadcast: mix them so runs break.
    names = ["flash_attn", "flash_attn", "flashinfer", "flash_attn", "flashinfer", "flashinfer"]
    local = [LAYOUTS[n](((i + 1) << 24), BLOCKS) for i, n in enumerate(names)]
    remote = [LAYOUTS["flash_attn"]((i + 1) << 32, BLOCKS + 2) for i in range(len(names))]
    pairs = _pairs(11, 5, BLOCKS, BLOCKS + 2)
    expected: dict[int, int] = {}
    for mine, theirs in zip(local, remote):
        expected.update(_reference_byte_map(mine, theirs, pairs))
    for merged in (True, False):
        ranges = pull_ranges_for_layers(local, remote, pairs, merged=merged)
        assert _byte_map(list(ranges)) == expected


def test_interleaved_layers_of_one_buffer_are_pulled_without_touching_each_other() -> None:
    """BHLNC: every layer of a group in one buffer, a block of a layer split per head.

    All layers pulled: every element lands where the reference puts it, and since the
    layers of one head are adjacent in memory, a run of consecutive blocks on both sides
    merges into one range. One layer pulled: only its own bytes are written, not the
    other layers' slices between its heads.
    """
    local = [_bhlnc(1 << 20, BLOCKS, layer) for layer in range(LAYERS)]
    remote = [_bhlnc(1 << 30, BLOCKS + 3, layer) for layer in range(LAYERS)]
    block_bytes = HEADS * LAYERS * TOKENS * 2 * HEAD * 2  # every layer's share of a block
    for pairs in (_pairs(3, 4, BLOCKS, BLOCKS + 3), [(1, 4), (2, 5), (3, 6)]):
        expected: dict[int, int] = {}
        for mine, theirs in zip(local, remote):
            expected.update(_reference_byte_map(mine, theirs, pairs))
        for merged in (True, False):
            ranges = list(pull_ranges_for_layers(local, remote, pairs, merged=merged))
            assert _byte_map(ranges) == expected
            if not merged:
                assert len(ranges) == LAYERS * len(pairs) * HEADS  # one range per head
    contiguous = pull_ranges_for_layers(local, remote, [(1, 4), (2, 5), (3, 6)])
    assert contiguous == [(local[0].base_addr + block_bytes, remote[0].base_addr + 4 * block_bytes, 3 * block_bytes)]
    only_middle = _byte_map(list(pull_ranges(local[1], remote[1], [(2, 5)])))
    assert only_middle == _reference_byte_map(local[1], remote[1], [(2, 5)])
    neighbours = _reference_byte_map(local[0], remote[0], [(2, 5)]) | _reference_byte_map(local[2], remote[2], [(2, 5)])
    assert not only_middle.keys() & neighbours.keys()


def test_unmerged_ranges_come_layer_then_pair_then_piece() -> None:
    """What a client without merging sends: one range per block piece, in order."""
    local = [LAYOUTS["cpu"](1 << 20, BLOCKS), LAYOUTS["cpu"](2 << 20, BLOCKS)]
    remote = [LAYOUTS["cpu"](1 << 30, BLOCKS), LAYOUTS["cpu"](2 << 30, BLOCKS)]
    pairs = [(3, 0), (1, 5), (2, 2)]
    block_bytes = HEADS * TOKENS * 2 * HEAD * 2
    expected = [
        (mine.base_addr + lb * block_bytes, theirs.base_addr + rb * block_bytes, block_bytes)
        for mine, theirs in zip(local, remote)
        for lb, rb in pairs
    ]
    assert pull_ranges_for_layers(local, remote, pairs, merged=False) == expected
    assert pull_ranges_for_layers(local, remote, [], merged=False) == []


def test_errors_still_name_the_layer_and_the_block() -> None:
    cpu = LAYOUTS["cpu"](1 << 20, BLOCKS)
    nhd, hnd = LAYOUTS["flash_attn"](1 << 20, BLOCKS), LAYOUTS["flash_attn_hnd"](1 << 30, BLOCKS)
    with pytest.raises(LayoutError, match="layer 1: element order inside a block differs"):
        pull_ranges_for_layers([nhd, nhd], [nhd, hnd], [(0, 0)])
    with pytest.raises(LayoutError, match=f"block {BLOCKS} out of range"):
        pull_ranges(cpu, cpu, [(0, 1), (BLOCKS, 2)])
    with pytest.raises(LayoutError, match="block -1 out of range"):
        pull_ranges(cpu, cpu, [(0, -1)])


def _reference_merge(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge, one range at a time, what is adjacent on both sides (overlap: ValueError)."""
    out: list[list[int]] = []
    for local, remote, length in sorted(r for r in ranges if r[2] > 0):
        if out and local < out[-1][0] + out[-1][2]:
            raise ValueError("overlap")
        if out and local == out[-1][0] + out[-1][2] and remote == out[-1][1] + out[-1][2]:
            out[-1][2] += length
        else:
            out.append([local, remote, length])
    return [(a, b, c) for a, b, c in out]


def test_merge_ranges_matches_a_range_by_range_reference() -> None:
    rng = random.Random(5)
    for _ in range(300):
        # Slots of 64 bytes, some adjacent on both sides, some on one side only, some empty.
        slots = rng.sample(range(40), rng.randint(0, 30))
        ranges = []
        for slot in slots:
            remote_slot = slot + rng.choice([0, 0, 0, 1, 7])
            ranges.append((4096 + 64 * slot, (1 << 20) + 64 * remote_slot, rng.choice([64, 64, 64, 0])))
        rng.shuffle(ranges)
        assert merge_ranges(ranges) == _reference_merge(ranges)


def test_merge_range_groups_equals_merging_the_concatenation() -> None:
    """The per-KV-cache-group form the worker can use: same answer, no tuples in between."""
    full = [LAYOUTS["flash_attn"]((i + 1) << 24, BLOCKS) for i in range(2)]
    window = [LAYOUTS["cpu"]((i + 5) << 24, BLOCKS) for i in range(2)]
    groups = [
        pull_ranges_for_layers(full, full, [(b, b) for b in range(4)]),
        pull_ranges_for_layers(window, window, [(4, 2), (5, 3)]),
    ]
    merged = merge_range_groups(groups)
    assert merged == _reference_merge([r for group in groups for r in group])
    assert merged.total_bytes == sum(length for *_, length in merged)
    assert merge_range_groups([]) == []


def test_merge_ranges_refuses_ranges_that_are_not_triples() -> None:
    with pytest.raises(ValueError, match="triples; 2 ranges hold 7 numbers"):
        merge_ranges([(0x1000, 0x2000, 64), (0x3000, 0x4000, 64, 1)])  # type: ignore[list-item]  # the wrong shape on purpose


def test_merge_ranges_refuses_overlapping_destinations() -> None:
    with pytest.raises(
        ValueError,
        match=r"destination ranges overlap: \[0x1000, \+64\) and "
        r"\[0x1020, \+64\)",
    ):
        merge_ranges([(0x1020, 0, 64), (0x1000, 0x9000, 64)])


def test_range_table_reads_like_a_list_and_cannot_change() -> None:
    ranges = merge_ranges([(300, 30, 10), (100, 10, 10), (110, 25, 5)])
    assert isinstance(ranges, RangeTable)
    assert ranges == [(100, 10, 10), (110, 25, 5), (300, 30, 10)]
    assert ranges[0] == (100, 10, 10) and ranges[1:] == [(110, 25, 5), (300, 30, 10)]
    assert all(type(x) is int for r in ranges for x in r)
    assert merge_ranges(ranges) == ranges  # merging twice changes nothing
    with pytest.raises(ValueError):
        ranges.table[0, 2] = 1 << 20  # what the transport validated is what it posts
    assert pickle.loads(pickle.dumps(list(ranges))) == ranges


def test_nixl_progress_delay_is_a_setting_and_refuses_a_negative_value() -> None:
    settings = ConnectorSettings.from_extra_config({"nixl_progress_delay_us": 1000})
    assert settings.nixl_progress_delay_us == 1000
    assert ConnectorSettings().nixl_progress_delay_us == 200
    assert msgspec.convert({}, ConnectorSettings).nixl_progress_delay_us == 200
    with pytest.raises(TransferError, match="progress_delay_us must be >= 0"):
        create_transport("nixl", host="127.0.0.1", nixl_progress_delay_us=-1)
