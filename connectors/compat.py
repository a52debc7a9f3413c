"""What two engines must agree on before KV blocks can move between them, read from vLLM's config."""

from __future__ import annotations

import math

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from connectors.vllm_adapter import group_kind, group_kv_heads
from pdconnect.protocol import CompatInfo, GroupCompat

__all__ = ["compat_info"]


def _speculative(vllm_config: VllmConfig) -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        return "none"
    return f"{spec.method}:{spec.num_speculative_tokens}"


def compat_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CompatInfo:
    """The same object on both halves of both engines when (and only when) blocks are interchangeable.

    Block sizes, windows and EAGLE flags decide which logical block is which; heads,
    bytes per head and dtypes decide whether a block's bytes mean the same thing; the
    speculative config decides the EAGLE drop (and so which blocks a plan names). The
    TP size is left out on purpose: engines of different TP sizes exchange blocks head
    by head (`pdconnect.tpmap`), and each side's shape travels in the handshake instead.
    """
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kv_heads, latent = group_kv_heads(spec, vllm_config.model_config, tp_size)
        per_rank = 1 if latent else int(getattr(spec, "num_heads", 1))
        groups.append(
            GroupCompat(
                kind=group_kind(spec),
                block_size=spec.block_size,
                sliding_window=getattr(spec, "sliding_window", None),
                eagle=g.is_eagle_group,
                kv_heads=kv_heads,
                latent=latent,
                head_page_bytes=spec.page_size_bytes // per_rank,
            )
        )
    alignment = kv_cache_config.cache_hit_alignment_tokens or math.lcm(*(g.block_size for g in groups))
    return CompatInfo(
        model=str(vllm_config.model_config.model),
        dtype=str(vllm_config.model_config.dtype),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        groups=tuple(groups),
        cache_hit_alignment=alignment,
        speculative=_speculative(vllm_config),
        kv_layout=str(kv_cache_config.kv_cache_layout or "default"),
    )
