"""Compat records written out by hand, for the tests that build, compare or send one.

`OURS` is a decode engine's record with two groups (`FULL`, 256-token full attention, and
`SLIDING`, 64-token blocks with a window of 128, both drafting with EAGLE); a test
derives the record it needs with `msgspec.structs.replace`. `group` builds a group's
record from what a test varies; `handshake` is a decode rank's handshake carrying a record.
"""

from __future__ import annotations

from typing import Literal

from pdconnect.protocol import CompatInfo, GroupCompat, Handshake, ParallelShape

# One rank of one: the parallel shape every single-rank handshake carries.
SINGLE_RANK = ParallelShape(tp_size=1, tp_rank=0)


def group(
    kind: Literal["full_attention", "sliding_window"],
    block_size: int,
    window: int | None = None,
    *,
    kv_heads: int,
    head_page_bytes: int,
    eagle: bool = True,
    latent: bool = False,
) -> GroupCompat:
    """One KV cache group's record (`window`: the sliding window, None for full attention)."""
    fields = (kind, block_size, window, eagle, kv_heads, latent, head_page_bytes)
    return GroupCompat(*fields)  # the declaration's order


FULL = group("full_attention", 256, kv_heads=2, head_page_bytes=4096)
SLIDING = group("sliding_window", 64, 128, kv_heads=4, head_page_bytes=1024)
OURS = CompatInfo(
    model="tiny-hybrid",
    dtype="float32",
    cache_dtype="auto",
    groups=(FULL, SLIDING),
    cache_hit_alignment=256,
    speculative="eagle3:1",
    kv_layout="default",
)


def handshake(engine_id: str, compat: CompatInfo) -> Handshake:
    """A single-rank decode engine's handshake asking with `compat`."""
    return Handshake(engine_id=engine_id, tp_rank=0, compat=compat, parallel=SINGLE_RANK)
