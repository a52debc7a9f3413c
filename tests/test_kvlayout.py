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
    BLOCK_DIM_SENTINEL, LayoutError, TensorLayout, locate_block_dim, pull_ranges,
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


def _mla(num_blocks: int) -> torch.Tensor:
    return torch.empty(num_blocks, BLOCK, 4 * HEAD)


CUDA_LAYOUTS: dict[str, tuple[Callable[[int], torch.Tensor], int]] = {
    "flash_attn": (_flash_attn, 2),
    "flash_attn_hnd": (_flash_attn_hnd, 2),
    "flashinfer": (_flashinfer, 1),
    "flashinfer_hnd": (_flashinfer_hnd, 1),
    "flash_attn_blocks_outermost": (_flash_attn_blocks_outermost, 1),
    "mla": (_mla, 1),
}


def _layout(make: Callable[[int], torch.Tensor], num_blocks: int = NUM_BLOCKS) -> tuple[
        torch.Tensor, TensorLayout]:
    """A tensor and its layout, the block dim found the way the connector finds it."""
    block_dim = locate_block_dim(make(BLOCK_DIM_SENTINEL).shape, BLOCK_DIM_SENTINEL)
    tensor = make(num_blocks)
    return tensor, TensorLayout.of(tensor, block_dim=block_dim)


def _element_indices(layout: TensorLayout, segments: list[tuple[int, int]]) -> list[int]:
    """Storage element indices covered by byte segments."""
    indices: list[int] = []
    for addr, length in segments:
        first = (addr - layout.base_addr) // layout.itemsize
        indices.extend(range(first, first + length // layout.itemsize))
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
    tensor = storage.as_strided(tensor.shape, tensor.stride())
    layout = TensorLayout.of(tensor, block_dim=layout.block_dim)
    assert layout.segments_per_block == segments_per_block
    for block in range(NUM_BLOCKS):
        segments = layout.block_segments(block)
        covered = _element_indices(layout, segments)
        expected = tensor.select(layout.block_dim, block).flatten().tolist()
        assert sorted(covered) == sorted(expected)
        assert len(covered) == len(set(covered))  # no byte pulled twice
        assert sum(length for _, length in segments) == layout.bytes_per_block


@pytest.mark.parametrize("local_name,remote_name", [
    ("flash_attn", "flashinfer"),
    ("flashinfer_hnd", "flash_attn_blocks_outermost"),
    ("flash_attn_hnd", "flashinfer_hnd"),
])
def test_pull_ranges_move_blocks_between_backends_cuda_layout_on_cpu_tensor(
        local_name: str, remote_name: str) -> None:
    local, local_layout = _layout(CUDA_LAYOUTS[local_name][0])
    remote, remote_layout = _layout(CUDA_LAYOUTS[remote_name][0])
    local.zero_()
    remote.copy_(torch.randn(remote.shape))
    pairs = [(0, 3), (1, 4), (4, 0)]
    for local_addr, remote_addr, length in pull_ranges(local_layout, remote_layout, pairs):
        ctypes.memmove(local_addr, remote_addr, length)
    for local_block, remote_block in pairs:
        assert torch.equal(local.select(local_layout.block_dim, local_block),
                           remote.select(remote_layout.block_dim, remote_block))
    untouched = local.select(local_layout.block_dim, 2)
    assert not untouched.any()


def test_pull_ranges_coalesce_runs_of_blocks_per_kv_plane_cuda_layout_on_cpu_tensor() -> None:
    local, local_layout = _layout(_flash_attn)
    remote, remote_layout = _layout(_flash_attn, num_blocks=NUM_BLOCKS + 4)
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
    half = TensorLayout.of(torch.empty(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.float16),
                           block_dim=0)
    with pytest.raises(LayoutError, match="element size differs: local 4 B vs remote 2 B"):
        pull_ranges(cpu, half, [(0, 0)])
    with pytest.raises(LayoutError, match="block 6 out of range"):
        pull_ranges(cpu, cpu, [(0, 6)])


def test_block_with_non_contiguous_inside_is_refused() -> None:
    # Half of the last dim: rows inside a block have gaps, so no segment is contiguous.
    tensor = torch.empty(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)[..., :HEAD]
    with pytest.raises(LayoutError, match="not contiguous: dim 2 has stride 16, contiguity needs"):
        TensorLayout.of(tensor, block_dim=0)


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
    broken = msgspec.msgpack.encode({"base_addr": 1, "shape": [4, 8], "strides": [16, 2],
                                     "itemsize": 2, "block_dim": 0})
    with pytest.raises(msgspec.ValidationError, match="not contiguous"):
        msgspec.msgpack.decode(broken, type=TensorLayout)


def test_a_wrong_block_dim_is_caught_not_enumerated() -> None:
    # Calling the head-size dim the block dim would cut a "block" into thousands of pieces.
    with pytest.raises(LayoutError, match="is it really the block dim"):
        TensorLayout.of(torch.empty(4096, HEADS, BLOCK, 2 * HEAD), block_dim=3)
