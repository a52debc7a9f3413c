"""From KV cache tensors' real shapes and strides to the byte ranges of each block.

vLLM registers one KV cache tensor per layer, and where a block's bytes live depends on
the attention backend: the CPU backend packs a block into one range
(`[num_blocks, kv_heads, block_size, 2*head_size]`), flash-attn splits it into a K and
a V range (`[2, num_blocks, block_size, kv_heads, head_size]`), FlashInfer keeps it whole
(`[num_blocks, 2, ...]`), the HND permutations reorder the strides, MLA has no K/V split.
Rather than a table of backends, `TensorLayout` describes any strided tensor and derives
a block's segments from its shape and strides, so a new backend needs no code here.

Terms: the *block dim* indexes blocks; dims whose stride is larger than the block dim's
are *outer* (each index of them is a separate segment of a block); dims with smaller
strides are *inner* and must form one contiguous run (a segment). A block's *packed
bytes* are its segments concatenated in memory order; two layouts are compatible when
every element of a block sits at the same packed offset in both, whatever the segment
boundaries.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from pdconnect.transfer.base import Range, coalesce

__all__ = [
    "BLOCK_DIM_SENTINEL", "LayoutError", "TensorLayout", "locate_block_dim", "pull_ranges",
    "pull_ranges_for_layers",
]

# A prime no model dimension equals: computing a backend's KV shape with this many
# blocks makes the block dim the only dim of that size.
BLOCK_DIM_SENTINEL = 100_003


# Real layouts split a block into at most a few planes (K and V); far more segments
# means the block dim was misidentified, and enumerating them would be slow.
_MAX_SEGMENTS_PER_BLOCK = 1024


class LayoutError(ValueError):
    """A tensor layout cannot be split into blocks, or two layouts do not match."""


class _TensorLike(Protocol):
    """What `TensorLayout.of` reads from a tensor (torch's names; no torch import)."""

    @property
    def shape(self) -> Sequence[int]: ...
    def stride(self) -> Sequence[int]: ...
    def data_ptr(self) -> int: ...
    def element_size(self) -> int: ...


class TensorLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV cache tensor: where it is and how its elements are laid out.

    `strides` are in elements, as torch reports them. Travels in handshake messages so
    the puller can address the peer's blocks. Validated on construction (and on
    decoding): every method may assume a well-formed, non-overlapping layout.
    """

    base_addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    block_dim: int

    def __post_init__(self) -> None:
        _geometry(self)  # raises LayoutError for anything we cannot address

    @classmethod
    def of(cls, tensor: _TensorLike, *, block_dim: int) -> TensorLayout:
        """The layout of a live tensor (torch or anything with the same accessors)."""
        return cls(tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.element_size(), block_dim)

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def segments_per_block(self) -> int:
        return len(_geometry(self).segment_offsets)

    @property
    def bytes_per_block(self) -> int:
        return _packed_bytes(_geometry(self))

    def block_segments(self, block_id: int) -> list[tuple[int, int]]:
        """The contiguous `(addr, length)` byte segments of one block, in memory order."""
        self._check_block(block_id)
        geometry = _geometry(self)
        start = self.base_addr + block_id * geometry.block_stride
        return [(start + offset, geometry.segment_bytes) for offset in geometry.segment_offsets]

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(f"block {block_id} out of range: the layout has "
                              f"{self.num_blocks} blocks")


def locate_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The index of the dim that counts blocks in `shape`.

    Compute `shape` with a distinctive `num_blocks` (e.g. `BLOCK_DIM_SENTINEL`): with a
    small count the block dim could tie with a head or size dim.
    """
    hits = [dim for dim, size in enumerate(shape) if size == num_blocks]
    if len(hits) != 1:
        raise LayoutError(
            f"cannot tell the block dim of shape {tuple(shape)}: {len(hits)} dims equal "
            f"num_blocks={num_blocks}; compute the shape with num_blocks="
            f"{BLOCK_DIM_SENTINEL} (BLOCK_DIM_SENTINEL) so exactly one does"
        )
    return hits[0]


def pull_ranges(local: TensorLayout, remote: TensorLayout,
                block_pairs: Iterable[tuple[int, int]]) -> list[Range]:
    """`(local_addr, remote_addr, length)` copies bringing remote blocks into local ones.

    `block_pairs` holds `(local_block, remote_block)`. Raises LayoutError naming what
    differs when the layouts do not hold a block's elements in the same order.
    """
    return coalesce(_layer_ranges(local, remote, block_pairs))


def pull_ranges_for_layers(local: Sequence[TensorLayout], remote: Sequence[TensorLayout],
                           block_pairs: Sequence[tuple[int, int]]) -> list[Range]:
    """`pull_ranges` over every layer (same block ids in each), coalesced once."""
    if len(local) != len(remote):
        raise LayoutError(f"layer count differs: local {len(local)} vs remote {len(remote)}")
    ranges: list[Range] = []
    for layer, (mine, theirs) in enumerate(zip(local, remote)):
        try:
            ranges.extend(_layer_ranges(mine, theirs, block_pairs))
        except LayoutError as exc:
            raise LayoutError(f"layer {layer}: {exc}") from None
    return coalesce(ranges)


# --- geometry -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """A layout's block structure in bytes, derived once from shape and strides."""

    block_stride: int                 # bytes from block b to block b+1
    segment_offsets: tuple[int, ...]  # each segment's start, from the block's start
    segment_bytes: int
    block_shape: tuple[int, ...]      # the shape without the block dim
    packed_strides: tuple[int, ...]   # per non-block dim: element stride in packed bytes


def _geometry(layout: TensorLayout) -> _Geometry:
    shape, strides, block_dim = layout.shape, layout.strides, layout.block_dim
    if len(shape) != len(strides):
        raise LayoutError(f"shape {shape} and strides {strides} differ in length")
    if not 0 <= block_dim < len(shape):
        raise LayoutError(f"block_dim {block_dim} is not a dim of shape {shape}")
    if layout.itemsize <= 0 or any(n <= 0 for n in shape) or any(s < 0 for s in strides):
        raise LayoutError(f"itemsize {layout.itemsize}, shape {shape}, strides {strides}: "
                          "sizes must be positive and strides non-negative")
    _check_no_overlap(shape, strides)
    # Dims of size 1 have arbitrary strides and address nothing; leave them out.
    dims = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1]
    block_stride = strides[block_dim]
    inner = sorted((d for d in dims if strides[d] < block_stride), key=lambda d: -strides[d])
    outer = sorted((d for d in dims if strides[d] > block_stride), key=lambda d: -strides[d])
    # Contiguity of the inner dims: from the innermost out, each stride is the product of
    # the sizes inside it.
    segment_elems = 1
    for d in reversed(inner):
        if strides[d] != segment_elems:
            raise LayoutError(
                f"the part of a block inside dim {block_dim} is not contiguous: dim {d} has "
                f"stride {strides[d]}, contiguity needs {segment_elems} (shape {shape}, "
                f"strides {strides})"
            )
        segment_elems *= shape[d]
    segments = math.prod(shape[d] for d in outer)
    if segments > _MAX_SEGMENTS_PER_BLOCK:
        raise LayoutError(
            f"block_dim {block_dim} of shape {shape}, strides {strides} would cut each block "
            f"into {segments} segments: is it really the block dim?"
        )
    offsets = tuple(
        sum(i * strides[d] for i, d in zip(index, outer)) * layout.itemsize
        for index in itertools.product(*(range(shape[d]) for d in outer))
    )
    packed = {d: strides[d] for d in inner}
    run = segment_elems
    for d in reversed(outer):
        packed[d] = run
        run *= shape[d]
    block_shape = tuple(n for d, n in enumerate(shape) if d != block_dim)
    packed_strides = tuple(packed.get(d, 0) for d in range(len(shape)) if d != block_dim)
    return _Geometry(block_stride * layout.itemsize, offsets, segment_elems * layout.itemsize,
                     block_shape, packed_strides)


def _check_no_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """Refuse layouts where two indices share memory (a block would alias another)."""
    extent = 1
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if stride < extent:
            raise LayoutError(f"shape {shape} with strides {strides} overlaps itself: "
                              f"a dim of size {size} has stride {stride} < {extent}")
        extent = stride * size


# --- matching two layouts ---------------------------------------------------------------


def _layer_ranges(local: TensorLayout, remote: TensorLayout,
                  block_pairs: Iterable[tuple[int, int]]) -> list[Range]:
    mine, theirs = _geometry(local), _geometry(remote)
    pieces = _matching_pieces(local, mine, remote, theirs)
    ranges: list[Range] = []
    for local_block, remote_block in block_pairs:
        local._check_block(local_block)
        remote._check_block(remote_block)
        local_start = local.base_addr + local_block * mine.block_stride
        remote_start = remote.base_addr + remote_block * theirs.block_stride
        ranges.extend((local_start + lo, remote_start + ro, n) for lo, ro, n in pieces)
    return ranges


def _matching_pieces(local: TensorLayout, mine: _Geometry, remote: TensorLayout,
                     theirs: _Geometry) -> list[tuple[int, int, int]]:
    """`(local_offset, remote_offset, length)` within one block, covering it exactly.

    Where one side splits a block into more segments than the other (flash-attn's K and
    V planes against a whole block), segments are cut at both sides' boundaries.
    """
    if local.itemsize != remote.itemsize:
        raise LayoutError(f"element size differs: local {local.itemsize} B vs remote "
                          f"{remote.itemsize} B (different KV cache dtypes)")
    if mine.block_shape != theirs.block_shape:
        raise LayoutError(f"block shape differs: local {mine.block_shape} vs remote "
                          f"{theirs.block_shape} (shape {local.shape} vs {remote.shape})")
    if mine.packed_strides != theirs.packed_strides:
        raise LayoutError(
            f"element order inside a block differs (per-block segments: local "
            f"{_describe_segments(mine)}, remote {_describe_segments(theirs)}; packed strides "
            f"{mine.packed_strides} vs {theirs.packed_strides}): a byte copy would scramble "
            "heads or tokens (e.g. an HND layout against an NHD one)"
        )
    cuts = sorted({*range(0, _packed_bytes(mine), mine.segment_bytes),
                   *range(0, _packed_bytes(theirs), theirs.segment_bytes),
                   _packed_bytes(mine)})
    return [(_address_in_block(mine, start), _address_in_block(theirs, start), end - start)
            for start, end in itertools.pairwise(cuts)]


def _packed_bytes(geometry: _Geometry) -> int:
    return geometry.segment_bytes * len(geometry.segment_offsets)


def _address_in_block(geometry: _Geometry, packed_offset: int) -> int:
    segment, within = divmod(packed_offset, geometry.segment_bytes)
    return geometry.segment_offsets[segment] + within


def _describe_segments(geometry: _Geometry) -> str:
    return f"{len(geometry.segment_offsets)} x {geometry.segment_bytes} B"

