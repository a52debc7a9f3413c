"""The connector's scheduler half: routes vLLM's scheduler hooks to the producer and consumer state machines.

A prefill engine (`kv_producer`) runs a `Producer` (`connectors.producer`: hold, plan,
lend under a lease) and, in a process of its own, the lease desk that serves its side
channel (`connectors.lease_desk`); a decode engine (`kv_consumer`) runs
a `Consumer` (`connectors.consumer`: claim, pull, prove, publish) with a notifier that
talks to prefill engines. `kv_both` runs both. This module owns what they share: the
engine's compatibility record, the side-channel keys, the stats, the handshake replies,
and the idle wait.

The idle wait: vLLM steps its engine without pause while any request is unfinished,
also when nothing can run: a decode request waiting for its claim's answer, or a
prefill request whose blocks a lease holds until decode is done with them. Each of
those empty steps (vLLM sleeps 1 ms after one) is a broadcast to every worker, and with
tensor parallelism the workers spin on the broadcast queue between steps. So when a
step schedules nothing and all the connector waits for is a peer (a claim's answer, a
lease ending) the scheduler sleeps on an event the notifier and the lease desk set as
the answer or the end arrives, for at most `IDLE_WAIT_SECONDS`: the answer is taken
as soon as it comes, and a new request waits at most that long for its first step. It
never waits while loads are in flight (only the workers report those, one step at a
time) or while anything was scheduled, and only on engines where the sleep can hold
nothing else back (`_sleeps_when_idle`; docs/tensor-parallel.md).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from connectors.compat import compat_info
from connectors.consumer import Consumer
from connectors.describe import Describer, describe
from connectors.lease_desk import DESK_COUNTERS, LeaseDesk, Start
from connectors.metadata import PDConnectorMetadata
from connectors.producer import Producer
from connectors.refusal_notes import RefusalNotes
from connectors.settings import ConnectorSettings, side_channel_roles
from connectors.stats import PDConnectorStats, StatsRecorder
from connectors.transfer_params import Leg, ParamsGate
from connectors.vllm_adapter import BlockPoolOps, CacheRules
from pdconnect.protocol import HandshakeReply

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDScheduler"]

logger = logging.getLogger("pdconnect.connector")

# The longest an empty step waits for a peer: the most it delays a request that arrives
# meanwhile. vLLM itself sleeps 1 ms after an empty step.
IDLE_WAIT_SECONDS = 0.01


def _sleeps_when_idle(config: VllmConfig) -> bool:
    """Whether empty steps may sleep (`IDLE_WAIT_SECONDS`) on this engine.

    Only with tensor parallelism does an empty step wake worker processes; a single-rank
    engine keeps vLLM's pace (sleeping there cost its TTFT p50 18 % in `make bench-handoff`).
    Not where a step that schedules nothing may still have a batch in flight, whose output
    the sleep would hold back: pipeline parallelism and async scheduling. Not on a
    data-parallel rank: the ranks step in lockstep (their forward passes meet in
    collectives), so one asleep would hold the others.
    """
    parallel = config.parallel_config
    return (
        parallel.tensor_parallel_size > 1
        and parallel.pipeline_parallel_size == 1
        and parallel.data_parallel_size == 1
        and not config.scheduler_config.async_scheduling
    )


class PDScheduler:
    """Scheduler-side state of a `PDConnector`; every method runs on the scheduler thread."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.engine_id: str = transfer.engine_id or ""
        self.settings = settings
        self.compat = compat_info(vllm_config, kv_cache_config)
        # One secret per engine; a kv_both engine signs as prefill and as decode with it.
        roles = side_channel_roles(transfer.is_kv_producer, transfer.is_kv_consumer)
        keys = settings.resolve_keys(roles)
        self.stats = StatsRecorder()
        self.describer: Describer | None = None  # set by `bind`, once the cache rules are known
        self.params = ParamsGate(self.stats)
        self._desk_totals: dict[str, int] = {}
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._desk: LeaseDesk | None = None
        # Set by the notifier's and the desk's threads when a peer's answer arrives.
        self._news = threading.Event()
        self.idle_wait_seconds = IDLE_WAIT_SECONDS if _sleeps_when_idle(vllm_config) else 0.0
        if transfer.is_kv_producer:
            # Data-parallel ranks on one host each get their own port (0 stays "any free port").
            base = settings.side_channel_port
            port = base + vllm_config.parallel_config.data_parallel_rank if base else 0
            self._desk = LeaseDesk(Start(self.engine_id, self.compat, settings, sorted(roles), port), news=self._news)
            self.producer = Producer(self.engine_id, settings, self.compat.digest(), self.stats, self._desk)
        if transfer.is_kv_consumer:
            decode_keys = keys.acting_as("decode") if keys is not None else None
            self.consumer = Consumer(
                self.engine_id,
                settings,
                self.compat,
                decode_keys,
                self.stats,
                news=self._news,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                notes=RefusalNotes.for_server(vllm_config, decides=True),
            )

    # --- wiring ------------------------------------------------------------------

    def bind(self, manager: KVCacheManager) -> None:
        rules, ops = CacheRules.for_manager(manager), BlockPoolOps(manager)
        self.ops = ops
        self.describer = Describer(describe(rules))  # the router learns the groups from it
        for half in (self.producer, self.consumer):
            if half is not None:
                half.bind(rules, ops)

    def set_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Hand the workers' handshake data to the desk, which answers handshakes with it."""
        if self._desk is None:
            return
        replies = {
            rank: HandshakeReply(
                engine_id=self.engine_id,
                tp_rank=rank,
                compat=self.compat,
                transport=worker.transport,
                transport_metadata=worker.transport_metadata,
                layouts=worker.layouts,
                parallel=worker.parallel,
            )
            for rank, worker in metadata.items()
        }
        self._desk.set_replies(replies)

    def shutdown(self) -> None:
        if self._desk is not None:
            self._desk.close()
        if self.consumer is not None:
            self.consumer.close()

    # --- scheduler hooks ---------------------------------------------------------

    # Each hook reads the request's kv_transfer_params through `self.params` only: they
    # are client input of any JSON type (`connectors.transfer_params`).

    def on_new_request(self, request: Request) -> None:
        ask = self.params.ask(request)
        if self.consumer is not None and ask.plan is not None:
            self.consumer.arrive(request, ask.plan)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        ask = self.params.ask(request)
        if self.producer is not None and ask.leg is Leg.PREFILL:
            self.producer.track(request)
            return 0, False
        if self.consumer is not None and ask.plan is not None:
            return self.consumer.get_num_new_matched_tokens(request, num_computed_tokens, ask.plan)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        del blocks  # the full table (logical positions) comes from the manager
        if self.consumer is not None:
            self.consumer.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        if self.idle_wait_seconds > 0 and scheduler_output.total_num_scheduled_tokens == 0:
            self.wait_while_idle(self.idle_wait_seconds)
        release: list[str] = []
        if self.producer is not None:
            self.producer.hold_new_slack()
            release = self.producer.collect_ended()
        pulls = self.consumer.take_pulls() if self.consumer is not None else []
        return PDConnectorMetadata(pulls=pulls, release=release)

    def wait_while_idle(self, timeout: float) -> bool | None:
        """After a step that scheduled nothing: sleep until a peer's answer or a lease's end
        arrives, at most `timeout`, if that is all the connector waits for (the module
        docstring says why). None: it did not sleep; True: news ended the sleep; False: the
        timeout did."""
        # Cleared before looking, so news that lands after the look sets it and ends the wait.
        self._news.clear()
        producer, consumer = self.producer, self.consumer
        if (producer is not None and producer.has_news()) or (consumer is not None and consumer.has_work()):
            return None
        waiting = (producer is not None and producer.lending()) or (consumer is not None and consumer.claims_pending())
        if not waiting:
            return None
        return self._news.wait(timeout)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self.consumer is not None:
            self.consumer.update_connector_output(output)

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.params.forget(request.request_id)
        if self.consumer is not None:
            self.consumer.request_finished(request)
        if self.producer is not None:
            return self.producer.finish(request, block_ids)
        return False, None

    # --- introspection --------------------------------------------------------------

    def blocks_held(self) -> int:
        """Blocks the connector holds an extra reference on, on this engine."""
        return sum(half.blocks_held() for half in (self.producer, self.consumer) if half is not None)

    def take_stats(self) -> PDConnectorStats | None:
        self.stats.set_gauge("blocks_held", self.blocks_held())
        if self._desk is not None:
            # The desk keeps running totals; the stats carry increments.
            totals = self._desk.totals()
            for name, total in totals.items():
                if (delta := total - self._desk_totals.get(name, 0)) > 0:
                    self.stats.count(name if name in DESK_COUNTERS else f"side_channel_{name}", delta)
            self._desk_totals = totals
        return self.stats.take()
