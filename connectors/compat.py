"""What two engines must agree on before KV blocks can move between them, read from vLLM's config."""

from __future__ import annotations

import math

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from connectors.vllm_adapter import group_kind
from pdconnect.protocol import CompatInfo, GroupCompat

__all__ = ["compat_info"]


def _speculative(vllm_config: VllmConfig) -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        return "none"
    return f"{spec.method}:{spec.num_speculative_tokens}"


def compat_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CompatInfo:
    """The same object on both halves of both engines when (and only when) blocks are interchangeable.

    Block sizes, windows and EAGLE flags decide which logical block is which; page
    bytes and dtypes decide whether a block's bytes mean the same thing; the
    speculative config decides the EAGLE drop (and so which blocks a plan names).
    """
    groups = tuple(
        GroupCompat(
            kind=group_kind(g.kv_cache_spec),
            block_size=g.kv_cache_spec.block_size,
            sliding_window=getattr(g.kv_cache_spec, "sliding_window", None),
            eagle=g.is_eagle_group,
            page_bytes=g.kv_cache_spec.page_size_bytes,
        )
        for g in kv_cache_config.kv_cache_groups
    )
    alignment = kv_cache_config.cache_hit_alignment_tokens or math.lcm(*(g.block_size for g in groups))
    return CompatInfo(
        model=str(vllm_config.model_config.model),
        dtype=str(vllm_config.model_config.dtype),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        groups=groups,
        cache_hit_alignment=alignment,
        speculative=_speculative(vllm_config),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        kv_layout=str(kv_cache_config.kv_cache_layout or "default"),
    )
