"""KV tensor layouts to byte ranges: checked against real torch tensors (CPU only).

The CUDA backends' layouts are reproduced with CPU tensors of the same shapes and
strides (`..._cuda_layout_on_cpu_tensor`): no GPU is involved, only the arithmetic
that would address GPU memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import msgspec
import pytest
import torch

from pdconnect.kvlayout import (
    BLOCK_DIM_SENTINEL,
    HEAD_DIM_SENTINEL,
    LayoutError,
    TensorLayout,
    locate_block_dim,
    locate_head_dim,
    pull_ranges,
    pull_ranges_for_layers,
)

HEADS, BLOCK, HEAD = 2, 16, 8
NUM_BLOCKS = 6


def _cpu_backend(num_blocks: int) -> torch.Tensor:
    return torch.empty(num_blocks, HEADS, BLOCK, 2 * HEAD)


def _flash_attn(num_blocks: int) -> torch.Tensor:
    return torch.empty(2, num_blocks, BLOCK, HEADS, HEAD)


def _flash_attn_hnd(num_blocks: int) -> torch.Tensor:
    # vLLM's stride order (0, 1, 3, 2, 4): heads outside tokens in memory.
    return torch.empty(2, num_blocks, HEADS, BLOCK, HEAD).permute(0, 1, 3, 2, 4)


def _flashinfer(num_blocks: int) -> torch.Tensor:
    return torch.empty(num_blocks, 2, BLOCK, HEADS, HEAD)


def _flashinfer_hnd(num_blocks: int) -> torch.Tensor:
    return torch.empty(num_blocks, 2, HEADS, BLOCK, HEAD).permute(0, 1, 3, 2, 4)


def _flash_attn_blocks_outermost(num_blocks: int) -> torch.Tensor:
    # flash-attn's logical shape over HND memory where the block dim is outermost.
    return torch.empty(num_blocks, 2, HEADS, BLOCK, HEAD).permute(1, 0, 3, 2, 4)


LAYERS = 3  # layers sharing one allocation in vLLM 0.33's layer-interleaved layouts


def _bhlnc_all_layers(num_blocks: int) -> torch.Tensor:
    """vLLM 0.33's BHLNC cache (VLLM_KV_CACHE_LAYOUT=BHLNC) for one group: `[B, H, L, N, C]`
    in memory, K and V packed in C."""
    return torch.empty(num_blocks, HEADS, LAYERS, BLOCK, 2 * HEAD)


def _bhlnc(num_blocks: int, layer: int = 1) -> torch.Tensor:
    # One layer's [B, H, N, C] view, as vLLM registers it: each head's share of a block
    # lies between the other layers' shares, so a block is one segment per head.
    return _bhlnc_all_layers(num_blocks)[:, :, layer]


def _mla(num_blocks: int) -> torch.Tensor:
    return torch.empty(num_blocks, BLOCK, 4 * HEAD)


CUDA_LAYOUTS: dict[str, tuple[Callable[[int], torch.Tensor], int]] = {
    "flash_attn": (_flash_attn, 2),
    "flash_attn_hnd": (_flash_attn_hnd, 2),
    "flashinfer": (_flashinfer, 1),
    "flashinfer_hnd": (_flashinfer_hnd, 1),
    "flash_attn_blocks_outermost": (_flash_attn_blocks_outermost, 1),
    "mla": (_mla, 1),
    "bhlnc": (_bhlnc, HEADS),
}


def _layout(make: Callable[[int], torch.Tensor], num_blocks: int = NUM_BLOCKS) -> tuple[torch.Tensor, TensorLayout]:
    """A tensor and its layout, the block dim found the way the connector finds it."""
    block_dim = locate_block_dim(make(BLOCK_DIM_SENTINEL).shape, BLOCK_DIM_SENTINEL)
    tensor = make(num_blocks)
    return tensor, TensorLayout.of(tensor, block_dim=block_dim)


def _element_indices(storage_addr: int, itemsize: int, segments: list[tuple[int, int]]) -> list[int]:
    """Storage element indices covered by byte segments (counted from the storage's
    start, not the view's: a layer's view of a shared buffer starts inside it)."""
    indices: list[int] = []
    for addr, length in segments:
        first = (addr - storage_addr) // itemsize
        indices.extend(range(first, first + length // itemsize))
    return indices


def test_cpu_layout_block_is_one_range_with_the_block_rows_bytes() -> None:
    tensor, layout = _layout(_cpu_backend)
    tensor = tensor.to(torch.float16)
    layout = TensorLayout.of(tensor.copy_(torch.randn(tensor.shape)), block_dim=0)
    assert layout.segments_per_block == 1
    assert layout.bytes_per_block == HEADS * BLOCK * 2 * HEAD * 2
    for block in range(NUM_BLOCKS):
        [(addr, length)] = layout.block_segments(block)
        assert addr == tensor[block].data_ptr()
        assert length == tensor[block].numel() * tensor.element_size()
        assert ctypes.string_at(addr, length) == tensor[block].numpy().tobytes()


@pytest.mark.parametrize("name", sorted(CUDA_LAYOUTS))
def test_block_segments_cover_exactly_the_block_cuda_layout_on_cpu_tensor(name: str) -> None:
    make, segments_per_block = CUDA_LAYOUTS[name]
    tensor, layout = _layout(make)
    # Each element holds its own storage index, so a block's elements name the exact
    # memory the block occupies.
    storage = torch.arange(tensor.untyped_storage().nbytes() // 4, dtype=torch.int32)
    tensor = storage.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    layout = TensorLayout.of(tensor, block_dim=layout.block_dim)
    assert layout.segments_per_block == segments_per_block
    for block in range(NUM_BLOCKS):
        segments = layout.block_segments(block)
        covered = _element_indices(tensor.untyped_storage().data_ptr(), layout.itemsize, segments)
        expected = tensor.select(layout.block_dim, block).flatten().tolist()
        assert sorted(covered) == sorted(expected)
        assert len(covered) == len(set(covered))  # no byte pulled twice
        assert sum(length for _, length in segments) == layout.bytes_per_block


@pytest.mark.parametrize(
    "local_name,remote_name",
    [
        ("flash_attn", "flashinfer"),
        ("flashinfer_hnd", "flash_attn_blocks_outermost"),
        ("flash_attn_hnd", "flashinfer_hnd"),
    ],
)
def test_pull_ranges_move_blocks_between_backends_cuda_layout_on_cpu_tensor(local_name: str, remote_name: str) -> None:
    local, local_layout = _layout(CUDA_LAYOUTS[local_name][0])
    remote, remote_layout = _layout(CUDA_LAYOUTS[remote_name][0])
    local.zero_()
    remote.copy_(torch.randn(remote.shape))
    pairs = [(0, 3), (1, 4), (4, 0)]
    for local_addr, remote_addr, length in pull_ranges(local_layout, remote_layout, pairs):
        ctypes.memmove(local_addr, remote_addr, length)
    for local_block, remote_block in pairs:
        assert torch.equal(
            local.select(local_layout.block_dim, local_block), remote.select(remote_layout.block_dim, remote_block)
        )
    untouched = local.select(local_layout.block_dim, 2)
    assert not untouched.any()


@pytest.mark.parametrize(
    "local_name,remote_name",
    [
        ("bhlnc", "bhlnc"),
        ("bhlnc", "lbhnc"),
        ("lbhnc", "bhlnc"),
    ],
)
def test_pull_ranges_move_interleaved_layer_blocks_cuda_layout_on_cpu_tensor(local_name: str, remote_name: str) -> None:
    """vLLM 0.33's BHLNC against itself and against the layer-compact LBHNC (the CPU
    backend's `[blocks, heads, tokens, 2*head]` per layer), every layer of a group.

    Checked element by element on the tensors themselves (`select` over each layer's
    view), not through the layouts: every pulled block equals its source in every
    layer, and nothing else in either buffer changes — neither blocks outside the pairs
    nor, when only one layer is pulled, the other layers' slices between its heads.
    """

    def layer_views(name: str, num_blocks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if name == "bhlnc":
            whole = _bhlnc_all_layers(num_blocks)
            return whole, [whole[:, :, layer] for layer in range(LAYERS)]
        whole = torch.empty(LAYERS, num_blocks, HEADS, BLOCK, 2 * HEAD)  # [L, B, H, N, C]
        return whole, list(whole.unbind(0))

    local_whole, local = layer_views(local_name, NUM_BLOCKS)
    remote_whole, remote = layer_views(remote_name, NUM_BLOCKS + 2)
    remote_whole.copy_(torch.randn(remote_whole.shape))
    remote_before = remote_whole.clone()
    local_layouts = [TensorLayout.of(view, block_dim=0) for view in local]
    remote_layouts = [TensorLayout.of(view, block_dim=0) for view in remote]
    pairs = [(0, 3), (1, 4), (4, 0), (5, 7)]
    for only in (None, 1):
        local_whole.zero_()
        layers = range(LAYERS) if only is None else [only]
        ranges = pull_ranges_for_layers([local_layouts[i] for i in layers], [remote_layouts[i] for i in layers], pairs)
        for local_addr, remote_addr, length in ranges:
            ctypes.memmove(local_addr, remote_addr, length)
        for layer in range(LAYERS):
            for block in range(NUM_BLOCKS):
                source = dict(pairs).get(block)
                if layer in layers and source is not None:
                    assert torch.equal(local[layer][block], remote[layer][source])
                else:
                    assert not local[layer][block].any(), (layer, block)
        assert torch.equal(remote_whole, remote_before)


def test_interleaved_layout_against_another_element_order_is_refused() -> None:
    # BHLNC's heads are outside its tokens; LBNHC ([L, B, N, H, C]) has tokens outside
    # heads: a byte copy between them would scramble heads.
    _, bhlnc = _layout(_bhlnc)
    lbnhc = torch.empty(LAYERS, NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 1, 3, 2, 4)[1]
    with pytest.raises(LayoutError, match="element order inside a block differs"):
        pull_ranges(bhlnc, TensorLayout.of(lbnhc, block_dim=0), [(0, 0)])


def test_pull_ranges_merge_runs_of_blocks_per_kv_plane_cuda_layout_on_cpu_tensor() -> None:
    _local, local_layout = _layout(_flash_attn)
    _remote, remote_layout = _layout(_flash_attn, num_blocks=NUM_BLOCKS + 4)
    ranges = pull_ranges(local_layout, remote_layout, [(b, b + 2) for b in range(4)])
    # Four blocks, each a K and a V segment: one range per plane once merged.
    assert len(ranges) == 2
    assert sum(length for *_, length in ranges) == 4 * local_layout.bytes_per_block


def test_pull_ranges_for_layers_names_the_layer_that_differs() -> None:
    _, nhd = _layout(_flash_attn)
    _, hnd = _layout(_flash_attn_hnd)
    with pytest.raises(LayoutError, match="layer 1: element order inside a block differs"):
        pull_ranges_for_layers([nhd, nhd], [nhd, hnd], [(0, 0)])
    with pytest.raises(LayoutError, match="layer count differs"):
        pull_ranges_for_layers([nhd], [nhd, nhd], [(0, 0)])


def test_incompatible_layouts_are_refused_naming_the_mismatch() -> None:
    _, cpu = _layout(_cpu_backend)
    _, flash = _layout(_flash_attn)
    with pytest.raises(LayoutError, match="block shape differs"):
        pull_ranges(cpu, flash, [(0, 0)])
    half = TensorLayout.of(torch.empty(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.float16), block_dim=0)
    with pytest.raises(LayoutError, match="element size differs: local 4 B vs remote 2 B"):
        pull_ranges(cpu, half, [(0, 0)])
    with pytest.raises(LayoutError, match="block 6 out of range"):
        pull_ranges(cpu, cpu, [(0, 6)])


def test_block_with_gaps_inside_is_one_segment_per_contiguous_run() -> None:
    """A view whose rows have gaps (only K of the CPU backend's packed K|V): each row of
    each head is its own segment, the gaps (V) are neither addressed nor pulled.

    The same rule as BHLNC's heads: what stops the contiguous run inside a block makes
    more segments, it is not refused (it was before vLLM 0.33's interleaved layouts).
    """
    whole = torch.arange(NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD, dtype=torch.float32).reshape(
        NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD
    )
    keys = whole[..., :HEAD]
    layout = TensorLayout.of(keys, block_dim=0)
    assert layout.segments_per_block == HEADS * BLOCK
    assert layout.bytes_per_block == HEADS * BLOCK * HEAD * 4
    for block in range(NUM_BLOCKS):
        covered = _element_indices(whole.data_ptr(), 4, layout.block_segments(block))
        assert covered == keys[block].flatten().long().tolist()  # memory order, K only
    other = torch.zeros_like(whole)
    for local_addr, remote_addr, length in pull_ranges(
        TensorLayout.of(other[..., :HEAD], block_dim=0), layout, [(1, 2)]
    ):
        ctypes.memmove(local_addr, remote_addr, length)
    assert torch.equal(other[1, ..., :HEAD], keys[2])
    assert not other[1, ..., HEAD:].any() and not other[[0, *range(2, NUM_BLOCKS)]].any()


def test_overlapping_strides_are_refused() -> None:
    with pytest.raises(LayoutError, match="overlaps itself"):
        TensorLayout(4096, (4, 8), (4, 1), 2, 0)


def test_block_dim_is_located_only_when_unambiguous() -> None:
    assert locate_block_dim(_flash_attn(BLOCK_DIM_SENTINEL).shape, BLOCK_DIM_SENTINEL) == 1
    with pytest.raises(LayoutError, match="2 dims equal num_blocks=16"):
        locate_block_dim(_flash_attn(16).shape, 16)


def test_layout_travels_as_msgspec_and_is_validated_on_arrival() -> None:
    _, layout = _layout(_flash_attn_hnd)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=TensorLayout) == layout
    broken = msgspec.msgpack.encode({"base_addr": 1, "shape": [4, 8], "strides": [4, 1], "itemsize": 2, "block_dim": 0})
    with pytest.raises(msgspec.ValidationError, match="overlaps itself"):
        msgspec.msgpack.decode(broken, type=TensorLayout)


def test_a_wrong_block_dim_is_caught_not_enumerated() -> None:
    # Calling the head-size dim the block dim would cut a "block" into thousands of pieces.
    with pytest.raises(LayoutError, match="is it really the block dim"):
        TensorLayout.of(torch.empty(4096, HEADS, BLOCK, 2 * HEAD), block_dim=3)


# --- head slices (unequal TP) -------------------------------------------------------------

# Each maker takes (num_blocks, heads): a rank's tensor holds its own share of the heads.
HEADED_LAYOUTS: dict[str, Callable[[int, int], torch.Tensor]] = {
    # CPU LBHNC: a head's share of a block is one contiguous run.
    "cpu": lambda blocks, heads: torch.empty(blocks, heads, BLOCK, 2 * HEAD),
    # NHD: heads inside tokens, so a head slice is one run per token and K/V plane.
    "flash_attn": lambda blocks, heads: torch.empty(2, blocks, BLOCK, heads, HEAD),
    "flashinfer": lambda blocks, heads: torch.empty(blocks, 2, BLOCK, heads, HEAD),
    # HND: contiguous per K/V plane.
    "flash_attn_hnd": lambda blocks, heads: torch.empty(2, blocks, heads, BLOCK, HEAD).permute(0, 1, 3, 2, 4),
}


def _headed(name: str, heads: int) -> tuple[torch.Tensor, TensorLayout]:
    """A tensor filled with distinct values and its layout, block and heads dims found with
    sentinels the way the worker finds them."""
    make = HEADED_LAYOUTS[name]
    block_dim = locate_block_dim(make(BLOCK_DIM_SENTINEL, 1).shape, BLOCK_DIM_SENTINEL)
    head_dim = locate_head_dim(make(1, HEAD_DIM_SENTINEL).shape, HEAD_DIM_SENTINEL, block_dim=block_dim)
    tensor = make(NUM_BLOCKS, heads)
    tensor.copy_(torch.randn(tensor.shape))
    return tensor, TensorLayout.of(tensor, block_dim=block_dim, head_dim=head_dim)


def _copy(ranges: object) -> None:
    for local_addr, remote_addr, length in ranges:  # type: ignore[attr-defined]
        ctypes.memmove(local_addr, remote_addr, length)


def _block(tensor: torch.Tensor, layout: TensorLayout, block: int, heads: slice) -> torch.Tensor:
    """One block's elements for `heads`, in the tensor's logical order."""
    assert layout.head_dim is not None
    index: list[object] = [slice(None)] * tensor.dim()
    index[layout.block_dim] = block
    index[layout.head_dim] = heads
    return tensor[tuple(index)]


@pytest.mark.parametrize("name", sorted(HEADED_LAYOUTS))
def test_two_prefill_ranks_fill_one_decode_rank_head_by_head_cuda_layout_on_cpu_tensor(name: str) -> None:
    # P TP2 -> D TP1: decode's 2 heads come one from each prefill rank's 1-head block.
    local, local_layout = _headed(name, 2)
    local.zero_()
    pairs = [(0, 3), (4, 1)]
    remotes = [_headed(name, 1) for _ in range(2)]
    for rank, (_, remote_layout) in enumerate(remotes):
        _copy(pull_ranges(local_layout.head_slice(rank, 1), remote_layout, pairs))
    for rank, (remote, remote_layout) in enumerate(remotes):
        for local_block, remote_block in pairs:
            assert torch.equal(
                _block(local, local_layout, local_block, slice(rank, rank + 1)),
                _block(remote, remote_layout, remote_block, slice(0, 1)),
            )
    assert not _block(local, local_layout, 2, slice(None)).any()


@pytest.mark.parametrize("name", sorted(HEADED_LAYOUTS))
def test_a_decode_rank_reads_its_head_slice_of_each_block_cuda_layout_on_cpu_tensor(name: str) -> None:
    # P TP1 (4 heads) -> D TP2: decode rank 1 holds heads 2-3 and reads only those.
    remote, remote_layout = _headed(name, 4)
    local, local_layout = _headed(name, 2)
    local.zero_()
    pairs = [(1, 5), (2, 0)]
    ranges = pull_ranges(local_layout, remote_layout.head_slice(2, 2), pairs)
    assert ranges.total_bytes == len(pairs) * local_layout.bytes_per_block  # half the remote block, no more
    _copy(ranges)
    for local_block, remote_block in pairs:
        assert torch.equal(
            _block(local, local_layout, local_block, slice(None)),
            _block(remote, remote_layout, remote_block, slice(2, 4)),
        )


def test_head_slice_is_one_range_per_block_on_cpu_and_strided_on_nhd() -> None:
    _, cpu = _headed("cpu", 4)
    assert cpu.head_slice(1, 2).segments_per_block == 1
    _, nhd = _headed("flash_attn", 4)
    assert nhd.head_slice(1, 2).segments_per_block == 2 * BLOCK  # per K/V plane, per token


def test_head_slice_out_of_range_and_heads_dim_are_checked() -> None:
    _, layout = _headed("cpu", 2)
    with pytest.raises(LayoutError, match=r"heads \[1, 3\) are not heads of a block with 2"):
        layout.head_slice(1, 2)
    with pytest.raises(LayoutError, match="2 dims equal num_heads=2"):
        locate_head_dim((6, 2, 2, 16), 2, block_dim=0)
    with pytest.raises(LayoutError, match="is not a head dim"):
        TensorLayout(1, (4, 2), (2, 1), 2, 0, head_dim=0)


def test_a_layout_without_head_dim_decodes_from_older_peers() -> None:
    old = msgspec.msgpack.encode({"base_addr": 64, "shape": [4, 8], "strides": [8, 1], "itemsize": 2, "block_dim": 0})
    layout: TensorLayout = msgspec.msgpack.decode(old, type=TensorLayout)
    assert layout.head_dim is None and layout.num_heads == 1
    assert layout.head_slice(0, 1) is layout
