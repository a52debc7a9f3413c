"""The one module that names vLLM's KV-cache internals; the rest of pdconnect goes through it.

vLLM's `KVCacheCoordinator`, single-type managers and `BlockPool` are not a public API:
they change between releases. Keeping every reference to them here means a vLLM
upgrade touches one file, and `tests/test_vllm_adapter.py` runs this file against the
real classes so a drift shows up as a failing test, not as a silently wrong plan.

Two views are offered:
- `CacheRules`: the arithmetic the core applies to one request (which blocks a
  sliding window frees, which blocks its prefix cache keeps — replay boundaries and
  shared-prefix junction alike —, what a lookup would hit), always delegated to a real
  coordinator, never re-implemented;
- `BlockPoolOps`: the handful of block-pool operations the connector performs itself
  (hold, release, allocate shadow blocks, publish them under a request's hashes).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import vllm.v1.core.kv_cache_utils as kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import (
    KVCacheCoordinator,
    get_kv_cache_coordinator,
    replay_boundaries,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from connectors.geometry import Geometry, GroupGeometry, GroupKind, UnsupportedLayout, consecutive_runs
from pdconnect.kvlayout import HEAD_DIM_SENTINEL, LayoutError, locate_head_dim

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "BlockPoolOps",
    "CacheRules",
    "Geometry",
    "GroupGeometry",
    "GroupKind",
    "UnsupportedLayout",
    "build_kv_cache_config",
    "build_kv_cache_manager",
    "group_kind",
    "group_kv_heads",
    "locate_kv_head_dim",
    "unified_block_sizes",
]  # geometry types re-exported: callers that already pay for vLLM import them from here


def group_kind(spec: KVCacheSpec) -> GroupKind:
    """Classify a vLLM spec; sliding-window specs first (some subclass full attention)."""
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, FullAttentionSpec) and spec.sliding_window is None:
        return "full_attention"
    raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not supported by pdconnect")


class _SpecFields(TypedDict):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


def _spec(group: GroupGeometry) -> KVCacheSpec:
    # Head geometry does not affect any block arithmetic; it only sizes pages.
    common: _SpecFields = {"block_size": group.block_size, "num_kv_heads": 1, "head_size": 64, "dtype": torch.float16}
    if group.kind == "sliding_window":
        window = group.sliding_window
        assert window is not None  # GroupGeometry requires one of a sliding-window group
        if not group.prefix_cacheable:
            # The one sliding window vLLM does not prefix-cache: DeepSeek-V4.1's bounded
            # replay (the spec itself says so, through `prefix_cacheable`).
            return SlidingWindowMLASpec(sliding_window=window, bounded_replay=True, **common)
        return SlidingWindowSpec(sliding_window=window, **common)
    if not group.prefix_cacheable:
        raise UnsupportedLayout("vLLM has no non-cacheable full-attention group pdconnect could plan")
    return FullAttentionSpec(**common)


def build_kv_cache_config(geometry: Geometry, num_blocks: int) -> KVCacheConfig:
    """A real vLLM `KVCacheConfig` for a geometry (no tensors: scheduler-side only)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=_spec(g), is_eagle_group=g.eagle)
            for i, g in enumerate(geometry.groups)
        ],
        prefix_cache_retention_interval=geometry.retention_interval,
    )


def build_kv_cache_manager(
    geometry: Geometry, num_blocks: int, max_model_len: int = 1 << 17, enable_kv_cache_events: bool = False
) -> KVCacheManager:
    """A real vLLM `KVCacheManager` for a geometry, as the scheduler would build it."""
    try:
        return KVCacheManager(
            build_kv_cache_config(geometry, num_blocks),
            max_model_len=max_model_len,
            scheduler_block_size=geometry.scheduler_block_size,
            hash_block_size=geometry.hash_block_size,
            enable_caching=True,
            use_eagle=geometry.use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
        )
    except (AssertionError, ValueError) as exc:
        raise UnsupportedLayout(f"vLLM rejects this geometry: {exc or type(exc).__name__}") from None


def _build_coordinator(geometry: Geometry) -> KVCacheCoordinator:
    return build_kv_cache_manager(geometry, num_blocks=2).coordinator


@dataclass(frozen=True)
class GroupRules:
    """What the planner needs to know about one group, read from vLLM's objects."""

    group_id: int
    kind: GroupKind
    block_size: int
    sliding_window: int | None
    eagle: bool
    prefix_cacheable: bool


class _IndexedCacheView:
    """Stands in for a `BlockPool` during a lookup probe: "cached" is a set of logical indices.

    The probe runs vLLM's own `find_longest_cache_hit` over synthetic request hashes
    (`_probe_hash`), so the answer is the real lookup's answer for the given content.
    """

    def __init__(
        self, hash_block_size: int, block_sizes: Sequence[int], cached: Mapping[int, set[int]], lookahead: int = 0
    ):
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = lookahead
        self.null_block = KVCacheBlock(block_id=0)
        self._block_sizes = block_sizes
        self._cached = cached

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        shared, fine_index = _decode_probe_hash(block_hash)
        if not shared:
            return None
        end_tokens = (fine_index + 1) * self.hash_block_size
        blocks = []
        for gid in kv_cache_group_ids:
            block_size = self._block_sizes[gid]
            index = end_tokens // block_size - 1
            if end_tokens % block_size or index not in self._cached.get(gid, ()):
                return None
            blocks.append(KVCacheBlock(block_id=index + 1))
        return blocks


class _RecordingPool:
    """Stands in for a `BlockPool` while the core caches a probe request: records, per group,
    which logical blocks `cache_full_blocks` would insert (mask applied), and stores nothing."""

    def __init__(self, hash_block_size: int, num_hash_lookahead_tokens: int):
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.null_block = KVCacheBlock(block_id=0)
        self.cached: dict[int, set[int]] = {}

    def cache_full_blocks(
        self,
        request: object,
        blocks: object,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
        **_: object,
    ) -> None:
        recorded = self.cached.setdefault(kv_cache_group_id, set())
        for offset, index in enumerate(range(num_cached_blocks, num_full_blocks)):
            if block_mask is None or block_mask[offset]:
                recorded.add(index)

    def cache_partial_block(self, **_: object) -> None:
        # Full attention's partial prompt tail: a sub-block entry, never a block a plan moves.
        return None


@dataclass
class _ProbeRequest:
    """The fields of a `Request` the core's `cache_blocks` reads, for a prompt with no content.

    `block_hashes` only needs the right length: the recording pool never reads a hash.
    """

    request_id: str
    num_prompt_tokens: int
    shared_prefix_boundary: int
    block_hashes: list[None]
    num_computed_tokens: int = 0
    replay_start: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens


def _probe_hash(fine_index: int, shared: bool) -> BlockHash:
    return BlockHash(bytes([shared]) + fine_index.to_bytes(8, "big"))


def _decode_probe_hash(block_hash: bytes) -> tuple[bool, int]:
    return bool(block_hash[0]), int.from_bytes(block_hash[1:9], "big")


class CacheRules:
    """vLLM's per-request cache arithmetic for one engine configuration.

    Backed by a real coordinator: the live engine's (connector) or one vLLM builds for
    a `Geometry` (CLI, tests). Every method delegates to vLLM's functions.
    """

    def __init__(self, coordinator: KVCacheCoordinator):
        self._coordinator = coordinator
        config = coordinator.kv_cache_config
        groups = []
        for gid, (group, manager) in enumerate(zip(config.kv_cache_groups, coordinator.single_type_managers)):
            spec = group.kv_cache_spec
            groups.append(
                GroupRules(
                    group_id=gid,
                    kind=group_kind(spec),
                    block_size=manager.block_size,
                    sliding_window=getattr(spec, "sliding_window", None),
                    eagle=bool(getattr(manager, "use_eagle", False)),
                    prefix_cacheable=spec.prefix_cacheable,
                )
            )
        self.groups: tuple[GroupRules, ...] = tuple(groups)
        self._probe: KVCacheCoordinator | None = None
        self._cache_probe: KVCacheCoordinator | None = None

    @classmethod
    def for_geometry(cls, geometry: Geometry) -> CacheRules:
        # The geometry's `prefix_cacheable` is in the specs vLLM was given: read it back.
        return cls(_build_coordinator(geometry))

    @classmethod
    def for_manager(cls, manager: KVCacheManager) -> CacheRules:
        return cls(manager.coordinator)

    @property
    def scheduler_block_size(self) -> int:
        return self._coordinator.scheduler_block_size

    @property
    def hash_block_size(self) -> int:
        return self._coordinator.block_pool.hash_block_size

    @property
    def alignment(self) -> int:
        """Token granularity of cache hits (the coordinator's, pushed into every manager)."""
        managers = self._coordinator.single_type_managers
        return getattr(managers[0], "cache_hit_alignment_tokens", None) or self.scheduler_block_size

    @property
    def use_eagle(self) -> bool:
        """Whether any group takes the EAGLE drop (what `cache_blocks` passes to `replay_boundaries`).

        vLLM 0.33 separates the groups that hold draft layers (`eagle_group_ids`) from
        those that drop a block (`drop_eagle_group_ids`: none under lookahead hashes);
        0.32 has only the first, which then means both.
        """
        coordinator = self._coordinator
        return bool(getattr(coordinator, "drop_eagle_group_ids", coordinator.eagle_group_ids))

    @property
    def num_hash_lookahead_tokens(self) -> int:
        """Tokens after each block its hash covers (vLLM 0.33; always 0 with a KV connector)."""
        return getattr(self._coordinator.block_pool, "num_hash_lookahead_tokens", 0)

    @property
    def retention_interval(self) -> int | None:
        return self._coordinator.retention_interval

    def replay_boundaries(self, num_prompt_tokens: int) -> tuple[int, ...]:
        return replay_boundaries(num_prompt_tokens, self.scheduler_block_size, use_eagle=self.use_eagle)

    @staticmethod
    def shared_prefix_tokens(request: Request | object) -> int | None:
        """The shared-prefix junction vLLM pinned for a live request, or None when there is none.

        The scheduler stores `get_computed_blocks`' third result in
        `Request.shared_prefix_boundary` when the request is admitted (0: no junction), so
        read it after that lookup: on the prefill engine, in `get_num_new_matched_tokens`.
        A vLLM without the attribute, or a value that is not a positive int, reads as None.
        """
        boundary = getattr(request, "shared_prefix_boundary", None)
        if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary <= 0:
            return None
        return boundary

    def cached_blocks(
        self, num_prompt_tokens: int, shared_prefix_tokens: int | None = None
    ) -> dict[int, tuple[int, ...]]:
        """Per group, the logical blocks a colocated engine's prefix cache keeps for this prompt.

        Runs the core's own `KVCacheCoordinator.cache_blocks` for the whole prompt on a
        private coordinator whose pool only records what it is asked to insert: the
        cacheable limit, the replay boundaries, the shared-prefix junction (and whatever
        else this vLLM adds to the reachable boundaries), the sliding-window mask and
        groups vLLM does not cache at all come out exactly as the engine applies them.
        """
        if num_prompt_tokens <= 0:
            raise ValueError(f"a prompt needs at least one token, got {num_prompt_tokens}")
        probe = self._cache_probe_coordinator()
        pool = _RecordingPool(self.hash_block_size, self.num_hash_lookahead_tokens)
        # The recording pool stands in for vLLM's BlockPool (duck-typed, see its docstring).
        probe.block_pool = pool  # type: ignore[assignment]  # a stand-in BlockPool
        for manager in probe.single_type_managers:
            manager.block_pool = pool  # type: ignore[assignment]  # a stand-in BlockPool
        request = _ProbeRequest(
            request_id="pdconnect-cache-probe",
            num_prompt_tokens=num_prompt_tokens,
            shared_prefix_boundary=shared_prefix_tokens or 0,
            block_hashes=[None] * (num_prompt_tokens // self.hash_block_size),
        )
        try:
            probe.cache_blocks(request, num_prompt_tokens)  # type: ignore[arg-type]  # a stand-in Request
        finally:
            # The probe keeps per-request bookkeeping like any manager; drop it so the
            # next prompt starts from nothing cached.
            for manager in probe.single_type_managers:
                manager.req_to_blocks.pop(request.request_id, None)
                manager.num_cached_block.pop(request.request_id, None)
        return {g.group_id: tuple(sorted(pool.cached.get(g.group_id, ()))) for g in self.groups}

    def skipped_tokens(self, group_id: int, num_computed_tokens: int) -> int:
        """Tokens whose blocks the group frees once `num_computed_tokens` are processed."""
        return self._coordinator.single_type_managers[group_id].get_num_skipped_tokens(num_computed_tokens)

    def cacheable_tokens(self, group_id: int, num_computed_tokens: int) -> int:
        return self._coordinator.get_num_cacheable_tokens(num_computed_tokens, group_id)

    def contiguous_blocks_for_hit(self, group_id: int) -> int:
        rules = self.groups[group_id]
        assert rules.sliding_window is not None
        return SlidingWindowManager._contiguous_blocks_for_hit(rules.sliding_window, rules.block_size, rules.eagle)

    def lookup_hit(self, cached: Mapping[int, set[int]], shared_tokens: int, num_tokens: int) -> int:
        """The hit vLLM's own lookup returns for a request of `num_tokens` tokens whose first
        `shared_tokens` match content of which `cached` (group -> logical block indices) is
        in the prefix cache. Runs the real `find_longest_cache_hit` on a probe coordinator."""
        probe = self._probe_coordinator()
        view = _IndexedCacheView(
            self.hash_block_size, [g.block_size for g in self.groups], cached, self.num_hash_lookahead_tokens
        )
        probe.block_pool = view  # type: ignore[assignment]  # a stand-in BlockPool
        for manager in probe.single_type_managers:
            manager.block_pool = view  # type: ignore[assignment]  # a stand-in BlockPool
        hashes = [
            _probe_hash(i, (i + 1) * self.hash_block_size <= shared_tokens)
            for i in range(num_tokens // self.hash_block_size)
        ]
        _, hit, _ = probe.find_longest_cache_hit(hashes, num_tokens - 1)
        return hit

    def _probe_coordinator(self) -> KVCacheCoordinator:
        if self._probe is None:
            self._probe = self._private_coordinator()
        return self._probe

    def _cache_probe_coordinator(self) -> KVCacheCoordinator:
        if self._cache_probe is None:
            self._cache_probe = self._private_coordinator()
        return self._cache_probe

    def _private_coordinator(self) -> KVCacheCoordinator:
        # A private coordinator of the same configuration: its managers' pool reference is
        # swapped for a probe view, which must never happen to the live one.
        live = self._coordinator
        # Only a vLLM that has lookahead hashes takes the argument; 0 is its default.
        # (Any: the keyword may be absent from the signature being checked against.)
        lookahead: dict[str, Any] = {"num_hash_lookahead_tokens": n} if (n := self.num_hash_lookahead_tokens) else {}
        return get_kv_cache_coordinator(
            kv_cache_config=live.kv_cache_config,
            max_model_len=1 << 30,
            max_in_flight_tokens=1 << 30,
            use_eagle=self.use_eagle,
            enable_caching=True,
            enable_kv_cache_events=False,
            dcp_world_size=1,
            pcp_world_size=1,
            scheduler_block_size=live.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            **lookahead,
        )


class BlockPoolOps:
    """The block-pool operations the connector performs outside the core's bookkeeping.

    Invariants the callers rely on:
    - every block returned by `hold` or `allocate` carries one extra reference that
      only `release` drops, so nothing the connector holds can be evicted or reused;
    - `publish` inserts freshly written blocks under the request's own hashes at their
      logical positions (padding with the null block), once: vLLM asserts on a repeat.
    """

    def __init__(self, manager: KVCacheManager):
        self._manager = manager
        self._pool: BlockPool = manager.block_pool

    @property
    def null_block_id(self) -> int:
        return self._pool.null_block.block_id

    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def request_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's per-group block tables, null blocks included (logical positions)."""
        return self._manager.coordinator.get_blocks(request_id)

    def hold(self, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        held = [b for b in blocks if not b.is_null]
        self._pool.touch(held)
        return held

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Reverse order: the pool evicts the first-freed first, so later blocks outlive earlier ones.
        self._pool.free_blocks(reversed(blocks))

    def allocate(self, count: int) -> list[KVCacheBlock]:
        return self._pool.get_new_blocks(count) if count else []

    def cached_block(self, request: Request, group_id: int, block_size: int, index: int) -> KVCacheBlock | None:
        """The block cached for logical `index` of `request` in this group, if any."""
        if block_size % self._pool.hash_block_size:
            # Finer than the hash unit: only a group vLLM does not prefix-cache (the unit is
            # the gcd of the cacheable groups), so nothing of it is ever cached.
            return None
        hashes = resolve_block_hashes(request.block_hashes, self._pool.hash_block_size, block_size)
        if index >= len(hashes):
            return None
        found = self._pool.get_cached_block(hashes[index], [group_id])
        return found[0] if found else None

    def is_cached_for(self, request: Request, group_id: int, block_size: int, index: int) -> bool:
        return self.cached_block(request, group_id, block_size, index) is not None

    def publish(self, request: Request, group_id: int, block_size: int, placed: Mapping[int, KVCacheBlock]) -> int:
        """Insert blocks written for `request` into the prefix cache at their logical indices.

        One `cache_full_blocks` call per contiguous run, because the pool derives each
        block's hash from its position. Each call covers the prompt from its first block,
        the blocks before the run null: its KV event then has no parent hash and its token
        range starts at the prompt's start, so a router can key it by content (a run's
        parent is a block the sliding window does not cache, whose hash no event lists; see
        docs/router.md). Returns the number of blocks published.
        """
        published = 0
        for run in consecutive_runs(sorted(placed)):
            padded = [self._pool.null_block] * run.stop
            for index in run:
                padded[index] = placed[index]
            self._pool.cache_full_blocks(
                request=request,
                blocks=padded,
                num_cached_blocks=0,
                num_full_blocks=run.stop,
                block_size=block_size,
                kv_cache_group_id=group_id,
            )
            published += len(run)
        return published


def unified_block_sizes(layers: Sequence[tuple[GroupKind, int, int, int | None]], block_size: int) -> list[int]:
    """Each layer's block size once vLLM has unified the layers' page sizes.

    A layer is (kind, KV heads, head size, sliding window or None), as a model's config
    gives them; `block_size` is the engine's `--block-size`. vLLM grows the block of the
    layers whose pages are smaller until every page is equally large
    (`unify_kv_cache_spec_page_size`): that is how MiMo-V2 and DeepSeek-V4 end up with
    sliding blocks of 64 tokens and full-attention blocks of 256.
    """
    specs: dict[str, KVCacheSpec] = {}
    for i, (kind, num_kv_heads, head_size, window) in enumerate(layers):
        common: _SpecFields = {
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
            "dtype": torch.float16,
        }
        specs[f"layer.{i}"] = (
            SlidingWindowSpec(sliding_window=window, **common)
            if kind == "sliding_window" and window is not None
            else FullAttentionSpec(**common)
        )
    # vLLM 0.33 moved it to `kv_cache_planning`, a module 0.32 lacks (hence no static import).
    unify: Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]] = (
        getattr(kv_cache_utils, "unify_kv_cache_spec_page_size", None)
        or importlib.import_module("vllm.v1.core.kv_cache_planning").unify_kv_cache_spec_page_size
    )
    try:
        unified = unify(specs)
    except NotImplementedError as exc:
        raise UnsupportedLayout(f"vLLM cannot unify this model's KV pages: {exc}") from None
    return [unified[f"layer.{i}"].block_size for i in range(len(layers))]


def group_kv_heads(spec: KVCacheSpec, model_config: Any, tp_size: int) -> tuple[int, bool]:
    """A group's KV heads model-wide and whether it is latent (MLA: whole on every rank).

    A rank holds `max(1, total // tp_size)` heads (vLLM's `get_num_kv_heads`), so the
    total is the per-rank count times the TP size unless a rank holds a single head on
    more ranks than there are heads (replicated heads). Only then does the model's config
    decide: its `*num_key_value_heads` counts that a rank would hold alone. 0 when it
    cannot tell (two such counts), which refuses unequal TP pairings and nothing else.
    """
    if getattr(model_config, "use_mla", False) or getattr(spec, "max_tp_shards", None) == 1:
        return 1, True
    per_rank = int(getattr(spec, "num_heads", getattr(spec, "num_kv_heads", 1)))
    if per_rank > 1 or tp_size == 1:
        return per_rank * tp_size, False
    config = model_config.hf_text_config
    counts = {
        value
        for name in dir(config)
        if name.endswith("num_key_value_heads") and isinstance(value := getattr(config, name, None), int)
    }
    counts.add(model_config.get_total_num_kv_heads())
    fitting = sorted(n for n in counts if 1 <= n <= tp_size)
    return (fitting[0], False) if len(fitting) == 1 else (0, False)


def locate_kv_head_dim(spec: KVCacheSpec, shape: Sequence[int], block_dim: int) -> int | None:
    """The heads dim of a registered KV tensor of this spec, asked of vLLM, not guessed.

    vLLM computes each layer's logical `[blocks, heads, tokens, content]` shape from the
    spec; computing it again with a sentinel head count shows which dim the heads are,
    and the registered tensor must then hold the spec's head count there. None for a
    latent (MLA) spec or one without heads.
    """
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    heads = getattr(spec, "num_heads", None)
    if not isinstance(spec, AttentionSpec) or spec.num_head_slots is not None or heads is None:
        return None
    try:
        probe = dataclasses.replace(spec, num_kv_heads=HEAD_DIM_SENTINEL, page_size_padded=None)
        probed = compute_layer_kv_cache_shape_bytes(probe, 1)
    except Exception as exc:  # noqa: BLE001 - a spec vLLM will not rebuild (MLA variants): no heads dim, logged
        raise LayoutError(f"vLLM cannot compute this spec's KV shape with another head count: {exc!r}") from None
    if len(probed) != len(shape):
        raise LayoutError(f"vLLM's KV shape {tuple(probed)} and the registered {tuple(shape)} differ in rank")
    dim = locate_head_dim(probed, HEAD_DIM_SENTINEL, block_dim=block_dim)
    if shape[dim] != heads:
        raise LayoutError(f"dim {dim} of KV tensor {tuple(shape)} should hold the spec's {heads} KV heads")
    return dim
