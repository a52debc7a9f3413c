"""A prompt served through a real vLLM KVCacheManager in the scheduler's call order, for the kv-aware index tests.

Both index tests (`test_router_kvindex.py`, `test_router_kvindex_sweep.py`) check the
router's predicted hit against what vLLM's own manager holds after the same prompts;
they must drive the manager the one way the scheduler does, so that way lives here.
Requests come from `connectors.kvsim.make_request` (real block hashes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["events_manager", "serve_prompt"]


def events_manager(geometry: Any, num_blocks: int) -> Any:
    """vLLM's KVCacheManager for `geometry` with its KV events queued (`manager.take_events()`)."""
    from connectors.vllm_adapter import build_kv_cache_manager

    return build_kv_cache_manager(geometry, num_blocks=num_blocks, max_model_len=4096, enable_kv_cache_events=True)


def serve_prompt(manager: Any, request: Any, chunk: int, between_steps: Callable[[], object] | None = None) -> None:
    """What the scheduler does for a prompt: look it up, allocate and compute it chunk by
    chunk (sliding-window blocks behind the window are freed as it goes), then free it.

    `between_steps` runs after every step but the last, where an engine publishes a step's
    events; the caller takes the last step's and the free's events itself.
    """
    blocks, hit, _ = manager.get_computed_blocks(request)
    computed, first = hit, True
    while computed < request.num_tokens:
        step = min(chunk, request.num_tokens - computed)
        assert (
            manager.allocate_slots(
                request,
                step,
                num_new_computed_tokens=hit if first else 0,
                new_computed_blocks=blocks if first else None,
            )
            is not None
        )
        computed, first = computed + step, False
        request.num_computed_tokens = computed
        if between_steps is not None and computed < request.num_tokens:
            between_steps()
    manager.free(request)
