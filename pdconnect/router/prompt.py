"""A prompt as routing sees it: its token ids and the content keys of their prefixes, computed once per request.

Block hashes cannot be recomputed outside the engine (vLLM seeds them per process), so the
router names a token prefix by a content key: `chain_keys(tokens, g)` hashes each run of
g tokens with the key of the prefix before it. An engine's index keys its blocks this way
(`kvindex`), and a lookup (`lookup.longest_hit`) computes the same keys for a request's
tokens. One request is looked up on several engines (the kv-aware policy, then the
decode-first decider), so `RoutingPrompt` carries the keys computed so far, by
granularity, and every lookup of the request extends the same lists instead of hashing
the prompt again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["RoutingPrompt", "block_keys", "chain_keys"]


def chain_keys(tokens: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """The content key of every full block of `tokens` (a block's key covers its whole prefix)."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


def block_keys(tokens: Sequence[int], block_size: int, granularity: int) -> list[int]:
    """The content key of every full `block_size` block of `tokens` in the key space of
    `granularity` (which divides `block_size`): the g-level chain key of its last sub-block."""
    ratio = block_size // granularity
    return chain_keys(tokens, granularity)[ratio - 1 :: ratio]


@dataclass
class RoutingPrompt:
    """One request's token ids and their chain keys by granularity. Invariant: `keys[g]` is
    a prefix of `chain_keys(tokens, g)`; lookups extend it only as far as they reach."""

    tokens: Sequence[int]
    keys: dict[int, list[int]] = field(default_factory=dict)

    def keys_upto(self, granularity: int, blocks: int) -> list[int]:
        """`keys[granularity]`, extended to at least `blocks` keys (fewer if the prompt is shorter)."""
        known = self.keys.setdefault(granularity, [])
        if len(known) < blocks:
            start = len(known) * granularity
            tail = self.tokens[start : blocks * granularity]
            known.extend(chain_keys(tail, granularity, known[-1] if known else 0))
        return known

    def fill(self, granularities: Iterable[int]) -> None:
        """Every chain key at each granularity, for a worker thread: the part of a lookup
        that scales with the prompt (a 128k-token prompt costs milliseconds). The caller
        must not share the prompt with another thread meanwhile."""
        for size in set(granularities):
            self.keys_upto(size, len(self.tokens) // size)
