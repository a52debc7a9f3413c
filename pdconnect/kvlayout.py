"""From KV cache tensors' real shapes and strides to the byte ranges of each block.

vLLM registers one KV cache tensor per layer, and where a block's bytes live depends on
the attention backend: the CPU backend packs a block into one range
(`[num_blocks, kv_heads, block_size, 2*head_size]`), flash-attn splits it into a K and
a V range (`[2, num_blocks, block_size, kv_heads, head_size]`), FlashInfer keeps it whole
(`[num_blocks, 2, ...]`), the HND permutations reorder the strides, MLA has no K/V split,
and vLLM 0.33's layer-interleaved layouts (`VLLM_KV_CACHE_LAYOUT=BHLNC`: one buffer per
group, `[blocks, heads, layers, tokens, content]` in memory) leave each head's share of a
layer's block between the other layers' shares. Rather than a table of backends,
`TensorLayout` describes any strided tensor and derives a block's segments from its shape
and strides, so a new backend needs no code here.

Terms: the *block dim* indexes blocks. A *segment* is the largest contiguous run of a
block: the innermost dims (smallest strides) as long as each stride is the product of the
sizes inside it. Every other dim is *outer*: each index of it is a separate segment —
dims with a stride above the block dim's (flash-attn's K/V plane) and dims inside a block
whose next run is not adjacent (BHLNC's heads, with the other layers in between) alike.
A block's *packed bytes* are its segments concatenated in memory order; two layouts are
compatible when every element of a block sits at the same packed offset in both,
whatever the segment boundaries.

Speed: a pull of thousands of blocks over dozens of layers is computed per request on
the decode engine's transport thread, so the arithmetic is done once per layout (the
geometry, memoized on the layout's shape, strides, element size and block dim) and
once per pair of layouts (the per-block pieces), and the per-block work is numpy
broadcasting over every block and every layer of one geometry at once. numpy is
imported where ranges are computed, not at module import: a process that only
decodes layouts from messages (a router) needs none.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from pdconnect.transfer.ranges import RangeTable, merge_table

__all__ = [
    "BLOCK_DIM_SENTINEL",
    "HEAD_DIM_SENTINEL",
    "LayoutError",
    "TensorLayout",
    "locate_block_dim",
    "locate_head_dim",
    "pull_ranges",
    "pull_ranges_for_layers",
]

# A prime no model dimension equals: computing a backend's KV shape with this many
# blocks makes the block dim the only dim of that size.
BLOCK_DIM_SENTINEL = 100_003
# Another such prime, for the heads dim (`locate_head_dim`).
HEAD_DIM_SENTINEL = 10_007


# Real layouts split a block into at most a few planes (K and V); far more segments
# means the block dim was misidentified, and enumerating them would be slow. A head slice
# of an NHD layout has one segment per token and plane (2 x 1024 for 1024-token blocks).
_MAX_SEGMENTS_PER_BLOCK = 4096


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
    # The dim that counts KV heads, located by the worker from the attention backend's
    # shape (never guessed from sizes); None where a block has no head split (MLA).
    head_dim: int | None = None

    def __post_init__(self) -> None:
        _geometry(self)  # raises LayoutError for anything we cannot address
        if self.head_dim is not None and (self.head_dim == self.block_dim or not 0 <= self.head_dim < len(self.shape)):
            raise LayoutError(
                f"head_dim {self.head_dim} is not a head dim of shape {self.shape} (block_dim {self.block_dim})"
            )

    @classmethod
    def of(cls, tensor: _TensorLike, *, block_dim: int, head_dim: int | None = None) -> TensorLayout:
        """The layout of a live tensor (torch or anything with the same accessors)."""
        return cls(
            tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), block_dim, head_dim
        )

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def num_heads(self) -> int:
        """KV heads in each block (1 where a block has no head split)."""
        return 1 if self.head_dim is None else self.shape[self.head_dim]

    def head_slice(self, start: int, count: int) -> TensorLayout:
        """The same tensor restricted to heads `[start, start + count)` of every block.

        Where the heads dim is outermost within a block (CPU `[blocks, heads, tokens,
        2*head_size]`, HND) a slice is one contiguous range per block; where it is not
        (NHD `[blocks, tokens, heads, head_size]`) it is one range per token, and the
        geometry below finds that from the strides.
        """
        if not (start >= 0 and count >= 1 and start + count <= self.num_heads):
            raise LayoutError(f"heads [{start}, {start + count}) are not heads of a block with {self.num_heads}")
        if count == self.num_heads:
            return self
        assert self.head_dim is not None  # num_heads > 1
        shape = list(self.shape)
        shape[self.head_dim] = count
        base = self.base_addr + start * self.strides[self.head_dim] * self.itemsize
        return TensorLayout(base, tuple(shape), self.strides, self.itemsize, self.block_dim, self.head_dim)

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
            raise LayoutError(f"block {block_id} out of range: the layout has {self.num_blocks} blocks")


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


def pull_ranges(
    local: TensorLayout, remote: TensorLayout, block_pairs: Iterable[tuple[int, int]], *, merged: bool = True
) -> RangeTable:
    """`(local_addr, remote_addr, length)` copies bringing remote blocks into local ones.

    `block_pairs` holds `(local_block, remote_block)`. Raises LayoutError naming what
    differs when the layouts do not hold a block's elements in the same order.
    `merged=False` keeps one range per piece of each block, in block-pair order
    (what a client without merging would send; benchmarks compare the two).
    """
    return RangeTable(_pull_table([local], [remote], block_pairs, merged=merged, name_layer=False))


def pull_ranges_for_layers(
    local: Sequence[TensorLayout],
    remote: Sequence[TensorLayout],
    block_pairs: Iterable[tuple[int, int]],
    *,
    merged: bool = True,
) -> RangeTable:
    """`pull_ranges` over every layer (same block ids in each), merged once."""
    if len(local) != len(remote):
        raise LayoutError(f"layer count differs: local {len(local)} vs remote {len(remote)}")
    return RangeTable(_pull_table(local, remote, block_pairs, merged=merged, name_layer=True))


def locate_head_dim(shape: Sequence[int], num_heads: int, *, block_dim: int) -> int:
    """The index of the dim that counts KV heads in `shape`.

    As with `locate_block_dim`, compute `shape` with a distinctive head count (e.g.
    `HEAD_DIM_SENTINEL`) so no size dim can tie with it.
    """
    hits = [dim for dim, size in enumerate(shape) if size == num_heads and dim != block_dim]
    if len(hits) != 1:
        raise LayoutError(
            f"cannot tell the heads dim of shape {tuple(shape)}: {len(hits)} dims equal "
            f"num_heads={num_heads}; compute the shape with num_kv_heads={HEAD_DIM_SENTINEL} "
            "(HEAD_DIM_SENTINEL) so exactly one does"
        )
    return hits[0]


# --- geometry -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """A layout's block structure in bytes, derived once from shape and strides."""

    block_stride: int  # bytes from block b to block b+1
    segment_offsets: tuple[int, ...]  # each segment's start, from the block's start
    segment_bytes: int
    block_shape: tuple[int, ...]  # the shape without the block dim
    packed_strides: tuple[int, ...]  # per non-block dim: element stride in packed bytes


def _geometry(layout: TensorLayout) -> _Geometry:
    # tuple(): a layout built by hand may hold lists, which the memo cannot key on.
    return _geometry_of(tuple(layout.shape), tuple(layout.strides), layout.itemsize, layout.block_dim)


# Memoized: a pure function of immutable values, and every layer of a model shares a few
# geometries, so deriving them once per process instead of once per call per layer is
# what makes a pull's arithmetic cheap. Bounded, so a process seeing many peers cannot
# grow it without limit.
@functools.lru_cache(maxsize=256)
def _geometry_of(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, block_dim: int) -> _Geometry:
    if len(shape) != len(strides):
        raise LayoutError(f"shape {shape} and strides {strides} differ in length")
    if not 0 <= block_dim < len(shape):
        raise LayoutError(f"block_dim {block_dim} is not a dim of shape {shape}")
    if itemsize <= 0 or any(n <= 0 for n in shape) or any(s < 0 for s in strides):
        raise LayoutError(
            f"itemsize {itemsize}, shape {shape}, strides {strides}: sizes must be positive and strides non-negative"
        )
    _check_no_overlap(shape, strides)
    # Dims of size 1 have arbitrary strides and address nothing; leave them out.
    dims = sorted((d for d in range(len(shape)) if d != block_dim and shape[d] > 1), key=lambda d: -strides[d])
    block_stride = strides[block_dim]
    # The segment: from the innermost dim out, while each stride is the product of the
    # sizes inside it. What stops the run may lie inside the block (BHLNC: a head's next
    # run belongs to another layer) or outside it (flash-attn's K/V plane); either way
    # each index of the remaining dims is a separate segment. No overlap (checked above)
    # keeps the block dim itself out of the run whenever it has more than one block.
    segment_elems = 1
    split = len(dims)
    while split and strides[dims[split - 1]] == segment_elems:
        split -= 1
        segment_elems *= shape[dims[split]]
    inner, outer = dims[split:], dims[:split]  # both by decreasing stride
    segments = math.prod(shape[d] for d in outer)
    if segments > _MAX_SEGMENTS_PER_BLOCK:
        raise LayoutError(
            f"block_dim {block_dim} of shape {shape}, strides {strides} would cut each block "
            f"into {segments} segments of {segment_elems} elements (more than "
            f"{_MAX_SEGMENTS_PER_BLOCK}): is it really the block dim?"
        )
    offsets = tuple(
        sum(i * strides[d] for i, d in zip(index, outer)) * itemsize
        for index in itertools.product(*(range(shape[d]) for d in outer))
    )
    packed = {d: strides[d] for d in inner}
    run = segment_elems
    for d in reversed(outer):
        packed[d] = run
        run *= shape[d]
    block_shape = tuple(n for d, n in enumerate(shape) if d != block_dim)
    packed_strides = tuple(packed.get(d, 0) for d in range(len(shape)) if d != block_dim)
    return _Geometry(block_stride * itemsize, offsets, segment_elems * itemsize, block_shape, packed_strides)


def _check_no_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """Refuse layouts where two indices share memory (a block would alias another)."""
    extent = 1
    for stride, size in sorted((s, n) for s, n in zip(strides, shape) if n > 1):
        if stride < extent:
            raise LayoutError(
                f"shape {shape} with strides {strides} overlaps itself: "
                f"a dim of size {size} has stride {stride} < {extent}"
            )
        extent = stride * size


# --- matching two layouts ---------------------------------------------------------------


def _pull_table(
    local: Sequence[TensorLayout],
    remote: Sequence[TensorLayout],
    block_pairs: Iterable[tuple[int, int]],
    *,
    merged: bool,
    name_layer: bool,
) -> Any:
    """The (N, 3) int64 table of `(local_addr, remote_addr, length)` for every layer.

    Row order, unmerged: layer, then block pair, then piece within the block.
    Consecutive layers with the same pair of geometries (the usual case: every layer of
    a KV cache group) are computed in one broadcast.
    """
    import numpy as np

    pairs = np.array(block_pairs if isinstance(block_pairs, Sequence) else list(block_pairs), dtype=np.int64).reshape(
        -1, 2
    )
    local_ids, remote_ids = pairs[:, 0], pairs[:, 1]
    # Every layer gets the same block ids: their extremes decide all the range checks.
    extremes = (
        (int(local_ids.min()), int(local_ids.max()), int(remote_ids.min()), int(remote_ids.max()))
        if len(pairs)
        else None
    )
    parts = []
    run: list[tuple[int, int]] = []  # (local base, remote base) of layers sharing `key`
    key: tuple[TensorLayout, TensorLayout] | None = None
    for layer, (mine, theirs) in enumerate(zip(local, remote)):
        try:
            _pieces(mine, theirs)  # refuses layouts whose blocks do not match
            if extremes is not None:
                for layout, block in zip((mine, mine, theirs, theirs), extremes):
                    layout._check_block(block)
        except LayoutError as exc:
            raise (LayoutError(f"layer {layer}: {exc}") if name_layer else exc) from None
        if key is not None and _same_geometry(key, (mine, theirs)):
            run.append((mine.base_addr, theirs.base_addr))
            continue
        if key is not None:
            parts.append(_broadcast(np, key, run, local_ids, remote_ids))
        key, run = (mine, theirs), [(mine.base_addr, theirs.base_addr)]
    if key is not None:
        parts.append(_broadcast(np, key, run, local_ids, remote_ids))
    table = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)
    return merge_table(table) if merged else table


def _same_geometry(a: tuple[TensorLayout, TensorLayout], b: tuple[TensorLayout, TensorLayout]) -> bool:
    return all(
        x.shape == y.shape and x.strides == y.strides and x.itemsize == y.itemsize and x.block_dim == y.block_dim
        for x, y in zip(a, b)
    )


def _broadcast(
    np: Any, key: tuple[TensorLayout, TensorLayout], bases: list[tuple[int, int]], local_ids: Any, remote_ids: Any
) -> Any:
    """Rows for layers sharing `key`'s geometries: base + block * stride + piece offset."""
    mine, theirs = key
    local_offsets, remote_offsets, lengths = _pieces(mine, theirs)
    base = np.array(bases, dtype=np.int64).reshape(-1, 1, 1, 2)
    shape = (len(bases), len(local_ids), len(lengths))
    table = np.empty((*shape, 3), dtype=np.int64)
    table[..., 0] = (
        base[..., 0] + (local_ids * _geometry(mine).block_stride)[None, :, None] + local_offsets[None, None, :]
    )
    table[..., 1] = (
        base[..., 1] + (remote_ids * _geometry(theirs).block_stride)[None, :, None] + remote_offsets[None, None, :]
    )
    table[..., 2] = lengths[None, None, :]
    return table.reshape(-1, 3)


def _pieces(local: TensorLayout, remote: TensorLayout) -> tuple[Any, Any, Any]:
    """`_matching_pieces` of two layouts as int64 arrays (local offsets, remote offsets,
    lengths), memoized on their geometries."""
    return _pieces_of(
        tuple(local.shape),
        tuple(local.strides),
        local.itemsize,
        local.block_dim,
        tuple(remote.shape),
        tuple(remote.strides),
        remote.itemsize,
        remote.block_dim,
    )


# Memoized like `_geometry_of`, for the same reason; the arrays are read-only because
# every caller shares them.
@functools.lru_cache(maxsize=256)
def _pieces_of(
    local_shape: tuple[int, ...],
    local_strides: tuple[int, ...],
    local_itemsize: int,
    local_block_dim: int,
    remote_shape: tuple[int, ...],
    remote_strides: tuple[int, ...],
    remote_itemsize: int,
    remote_block_dim: int,
) -> tuple[Any, Any, Any]:
    import numpy as np

    local = _Dims(local_shape, local_strides, local_itemsize, local_block_dim)
    remote = _Dims(remote_shape, remote_strides, remote_itemsize, remote_block_dim)
    pieces = _matching_pieces(
        local,
        _geometry_of(local_shape, local_strides, local_itemsize, local_block_dim),
        remote,
        _geometry_of(remote_shape, remote_strides, remote_itemsize, remote_block_dim),
    )
    arrays = tuple(np.array(column, dtype=np.int64) for column in zip(*pieces))
    for array in arrays:
        array.flags.writeable = False
    return arrays  # type: ignore[return-value]  # three columns: `pieces` are (local, remote, length)


@dataclass(frozen=True)
class _Dims:
    """A layout without its address: what `_matching_pieces` names in its errors."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    block_dim: int


def _matching_pieces(local: _Dims, mine: _Geometry, remote: _Dims, theirs: _Geometry) -> list[tuple[int, int, int]]:
    """`(local_offset, remote_offset, length)` within one block, covering it exactly.

    Where one side splits a block into more segments than the other (flash-attn's K and
    V planes against a whole block), segments are cut at both sides' boundaries.
    """
    if local.itemsize != remote.itemsize:
        raise LayoutError(
            f"element size differs: local {local.itemsize} B vs remote {remote.itemsize} B (different KV cache dtypes)"
        )
    if mine.block_shape != theirs.block_shape:
        raise LayoutError(
            f"block shape differs: local {mine.block_shape} vs remote "
            f"{theirs.block_shape} (shape {local.shape} vs {remote.shape})"
        )
    if mine.packed_strides != theirs.packed_strides:
        raise LayoutError(
            f"element order inside a block differs (per-block segments: local "
            f"{_describe_segments(mine)}, remote {_describe_segments(theirs)}; packed strides "
            f"{mine.packed_strides} vs {theirs.packed_strides}): a byte copy would scramble "
            "heads or tokens (e.g. an HND layout against an NHD one)"
        )
    cuts = sorted(
        {
            *range(0, _packed_bytes(mine), mine.segment_bytes),
            *range(0, _packed_bytes(theirs), theirs.segment_bytes),
            _packed_bytes(mine),
        }
    )
    return [
        (_address_in_block(mine, start), _address_in_block(theirs, start), end - start)
        for start, end in itertools.pairwise(cuts)
    ]


def _packed_bytes(geometry: _Geometry) -> int:
    return geometry.segment_bytes * len(geometry.segment_offsets)


def _address_in_block(geometry: _Geometry, packed_offset: int) -> int:
    segment, within = divmod(packed_offset, geometry.segment_bytes)
    return geometry.segment_offsets[segment] + within


def _describe_segments(geometry: _Geometry) -> str:
    return f"{len(geometry.segment_offsets)} x {geometry.segment_bytes} B"
