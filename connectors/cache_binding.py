"""The live engine's cache rules and block pool, for a state machine built before vLLM binds them.

vLLM constructs the connector before its KV cache manager exists and hands the manager
over later (`bind_kv_cache_manager`); the producer and consumer halves inherit this so
"not bound yet" fails loudly in one place.
"""

from __future__ import annotations

from connectors.vllm_adapter import BlockPoolOps, CacheRules

__all__ = ["CacheBound"]


class CacheBound:
    """Holds the `CacheRules` and `BlockPoolOps` of the engine once bound."""

    _rules: CacheRules | None = None
    _ops: BlockPoolOps | None = None

    def bind(self, rules: CacheRules, ops: BlockPoolOps) -> None:
        self._rules, self._ops = rules, ops

    @property
    def rules(self) -> CacheRules:
        assert self._rules is not None, "bind_kv_cache_manager was not called"
        return self._rules

    @property
    def ops(self) -> BlockPoolOps:
        assert self._ops is not None, "bind_kv_cache_manager was not called"
        return self._ops
