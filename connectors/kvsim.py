"""Drives real vLLM KV cache managers in the scheduler's call order, without an engine (tests, benchmarks).

No engine, no model: a `KVCacheManager` and its `BlockPool` built by vLLM for a given
geometry, requests with real block hashes, and the scheduler's call order for a
colocated prefill (one step or chunked), a decode-side remote load, and a sibling lookup.
`PrefillDecodePair` chains them into a P/D pair serving a sequence of requests, each
planned from the prefill engine's own junction, as the connector plans it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from connectors.replay_slack import RequestPlan, plan_request
from connectors.vllm_adapter import BlockPoolOps, CacheRules, Geometry, build_kv_cache_manager

init_none_hash(sha256)


def make_request(request_id: str, token_ids: list[int], hash_block_size: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=16),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


def random_tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(count)]


def pool_size_for(geometry: Geometry, num_tokens: int) -> int:
    """Enough blocks for two full prompts in every group, so nothing is evicted."""
    return 2 * sum(-(-num_tokens // g.block_size) + 2 for g in geometry.groups) + 16


@dataclass
class SimulatedEngine:
    """One engine's scheduler-side cache state: a real manager plus the connector's pool ops."""

    geometry: Geometry
    manager: KVCacheManager

    @classmethod
    def create(cls, geometry: Geometry, num_tokens: int, kv_events: bool = False) -> SimulatedEngine:
        """`kv_events`: the manager queues vLLM's KV events (`manager.take_events()`)."""
        manager = build_kv_cache_manager(
            geometry, pool_size_for(geometry, num_tokens), enable_kv_cache_events=kv_events
        )
        return cls(geometry, manager)

    @property
    def ops(self) -> BlockPoolOps:
        return BlockPoolOps(self.manager)

    def new_request(self, request_id: str, tokens: list[int]) -> Request:
        return make_request(request_id, tokens, self.geometry.hash_block_size)

    def prefill(self, request: Request, chunk: int | None = None, after_step: Callable[[], None] | None = None) -> int:
        """Compute the whole prompt locally, in one step or in chunks, as the scheduler would.

        Returns the local prefix-cache hit at admission. Like the scheduler, stores the
        lookup's junction in `request.shared_prefix_boundary` before allocating, so the
        core caches the junction's sliding-window run too. `after_step` runs after each
        step's allocation (a benchmark publishes the KV events an engine's step would).
        """
        blocks, hit, boundary = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        remaining = request.num_prompt_tokens - hit
        first = True
        while remaining > 0:
            step = remaining if chunk is None else min(chunk, remaining)
            allocated = self.manager.allocate_slots(
                request,
                step,
                num_new_computed_tokens=hit if first else 0,
                new_computed_blocks=blocks if first else None,
            )
            assert allocated is not None, "pool too small for the simulated prefill"
            request.num_computed_tokens += step + (hit if first else 0)
            remaining -= step
            first = False
            if after_step is not None:
                after_step()
        return hit

    def serve(self, request_id: str, tokens: list[int], chunk: int | None = None) -> int:
        """Serve one prompt colocated (prefill, then free); returns its local hit at admission."""
        request = self.new_request(request_id, tokens)
        hit = self.prefill(request, chunk)
        self.free(request)
        return hit

    def finish_for_transfer(self, request: Request) -> tuple[list[int], ...]:
        """What `_connector_finished` does before calling the connector: free out-of-window blocks."""
        self.manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens, request.num_prompt_tokens)
        return self.manager.get_block_ids_for_computed_tokens(request.request_id, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def cached_indices(self, request: Request, group_id: int) -> set[int]:
        """Logical blocks of `request`'s prompt that this engine's prefix cache holds for a group."""
        block_size = self.geometry.groups[group_id].block_size
        count = request.num_prompt_tokens // block_size
        return {i for i in range(count) if self.ops.is_cached_for(request, group_id, block_size, i)}

    def lookup(self, request: Request) -> int:
        _, hit, _ = self.manager.get_computed_blocks(request)
        return hit

    def remote_load(self, request: Request, plan: RequestPlan, publish_slack: bool = True) -> int:
        """Receive the prompt as external tokens, the way the decode engine's scheduler and
        our connector do: allocate with the load delayed, publish the slack into shadow
        blocks, then let the core cache what it allocated. Returns the local hit at admission."""
        blocks, hit, boundary = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        external = request.num_prompt_tokens - hit
        allocated = self.manager.allocate_slots(
            request,
            0,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_external_computed_tokens=external,
            delay_cache_blocks=True,
            full_sequence_must_fit=True,
        )
        assert allocated is not None, "pool too small for the simulated load"
        if publish_slack:
            ops = self.ops
            for group in plan.groups:
                wanted = [
                    i
                    for i in group.publish_blocks
                    if not ops.is_cached_for(request, group.group_id, group.block_size, i)
                ]
                shadows = ops.allocate(len(wanted))
                ops.publish(request, group.group_id, group.block_size, dict(zip(wanted, shadows)))
                ops.release(shadows)
        request.num_computed_tokens = request.num_prompt_tokens
        self.manager.cache_blocks(request, request.num_computed_tokens)
        return hit

    def real_table_indices(self, request: Request, group_id: int) -> list[int]:
        """Logical indices of the request's non-null blocks in one group."""
        return [i for i, b in enumerate(self.ops.request_blocks(request.request_id)[group_id]) if not b.is_null]


@dataclass(frozen=True)
class ServedRequest:
    """One request served by a `PrefillDecodePair`: both engines' local hits and the plan moved."""

    prefill_hit: int
    decode_hit: int
    plan: RequestPlan
    # Logical blocks the plan publishes on decode that the prefill engine did not have
    # cached when the request finished (so it could not have held and sent them).
    unheld_publish_blocks: dict[int, tuple[int, ...]]


@dataclass
class PrefillDecodePair:
    """A prefill engine and a decode engine serving requests one after another.

    Each request is prefilled on P (optionally chunked), planned from P's own junction
    (`CacheRules.shared_prefix_tokens`, read after P's lookup, where the connector reads
    it), and loaded on D, which holds only what the plan moves: the core's allocation
    for the external tokens plus the plan's publish set. `junctions=False` plans the
    replay boundaries only, as the planner did before junctions.
    """

    prefill: SimulatedEngine
    decode: SimulatedEngine
    rules: CacheRules
    chunk: int | None = None
    junctions: bool = True

    @classmethod
    def create(
        cls,
        geometry: Geometry,
        num_tokens: int,
        chunk: int | None = None,
        junctions: bool = True,
        kv_events: bool = False,
    ) -> PrefillDecodePair:
        return cls(
            SimulatedEngine.create(geometry, num_tokens, kv_events),
            SimulatedEngine.create(geometry, num_tokens, kv_events),
            CacheRules.for_geometry(geometry),
            chunk,
            junctions,
        )

    def serve(self, request_id: str, tokens: list[int]) -> ServedRequest:
        on_prefill = self.prefill.new_request(request_id, tokens)
        prefill_hit = self.prefill.prefill(on_prefill, self.chunk)
        junction = CacheRules.shared_prefix_tokens(on_prefill) if self.junctions else None
        plan = plan_request(self.rules, len(tokens), shared_prefix_tokens=junction)
        unheld = {
            group.group_id: tuple(
                i
                for i in group.publish_blocks
                if not self.prefill.ops.is_cached_for(on_prefill, group.group_id, group.block_size, i)
            )
            for group in plan.groups
        }
        self.prefill.finish_for_transfer(on_prefill)
        self.prefill.free(on_prefill)
        on_decode = self.decode.new_request(request_id, tokens)
        decode_hit = self.decode.remote_load(on_decode, plan)
        self.decode.free(on_decode)
        return ServedRequest(prefill_hit, decode_hit, plan, {g: b for g, b in unheld.items() if b})
