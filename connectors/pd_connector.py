"""`PDConnector`: the class vLLM loads; it hands each call to the scheduler half or the worker half.

Usable by name (`"kv_connector": "PDConnector"`, registered by our vLLM plugin) or by
module path (`"kv_connector_module_path": "connectors.pd_connector"`). Settings come
from `kv_connector_extra_config`, parsed once into `connectors.settings.ConnectorSettings`;
an unknown key or bad value stops the engine at start-up with the key's name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.logs import log_like_vllm
from connectors.metadata import PDConnectorMetadata
from connectors.scheduler import PDScheduler
from connectors.settings import ConnectorSettings
from connectors.stats import PDConnectorStats, PDPromMetrics
from connectors.worker import PDWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDConnector"]


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV transfer that also restores the decode engine's prefix cache."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_like_vllm()
        settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: PDScheduler | None = None
        self._worker: PDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PDScheduler(vllm_config, kv_cache_config, settings)
        else:
            self._worker = PDWorker(vllm_config, kv_cache_config, settings, get_tensor_model_parallel_rank())

    @property
    def scheduler_half(self) -> PDScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker_half(self) -> PDWorker:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    # --- scheduler side ----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_half.bind(kv_cache_manager)

    def take_events(self) -> Iterable[Any]:
        """This engine's KV cache groups for the router when due (`connectors.describe`); vLLM
        publishes them with its own KV events (its encoder takes any msgspec struct)."""
        half = self._scheduler
        if half is None or half.describer is None:
            return ()
        return half.describer.take()

    def on_new_request(self, request: Request) -> None:
        self.scheduler_half.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_half.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_half.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load writes every transferable group; none of them may be zeroed under it.
        return self._kv_cache_config.transfer_group_ids

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler_half.set_handshake_metadata(metadata)

    # --- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_half.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker_half.handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PDConnectorMetadata)
        self.worker_half.start(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the decode side pulls; nothing is pushed per layer

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker_half.transfer_results()

    # --- both -------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> PDConnectorStats | None:
        half = self._scheduler or self._worker
        assert half is not None
        return half.take_stats()

    def shutdown(self) -> None:
        half = self._scheduler or self._worker
        assert half is not None
        half.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDConnectorStats:
        return PDConnectorStats(data=data) if data else PDConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
