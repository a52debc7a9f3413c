"""The connector's scheduler half: plans, holds and leases on prefill; shadow blocks and publication on decode.

One request's path, top to bottom:

prefill engine (`kv_producer`)
  1. `get_num_new_matched_tokens` sees `do_remote_decode` and starts tracking the request
     with its plan's slack indices (`replay_slack.plan_request`).
  2. `build_connector_meta`, after every step, holds each slack block the moment it
     appears in the request's block table: the core frees sliding-window blocks as the
     window moves on, and a hold (an extra reference) keeps their KV intact.
  3. `request_finished_all_groups` turns the blocks the core still keeps (full attention,
     window tail) plus the held slack into a `TransferPlan`, returns it as
     `kv_transfer_params`, asks the core to delay freeing, and starts a lease.
  4. A `Done` or `Release` on the side channel, or the lease running out, releases the
     slack and tells the workers to report the request as sent, which frees the rest.

decode engine (`kv_consumer`)
  1. `get_num_new_matched_tokens` validates the plan and reports the prompt minus the
     local hit as external tokens (the decode engine pulls only what it lacks).
  2. `update_state_after_alloc` pairs every newly allocated block with the prefill
     block of the same logical index, allocates shadow blocks for slack the local cache
     lacks, and queues a `PullSpec` for the workers. Heartbeats keep the lease alive.
  3. `update_connector_output`, when the pull is reported, publishes the shadow blocks
     under the request's hashes and frees them into the evictable cache (or frees them
     unpublished on failure), then sends `Done` so the prefill engine frees at once.

Failure rule: anything wrong with a load becomes a failed receive for its request, so
vLLM applies `kv_load_failure_policy`; nothing is published that was not written, and
every block this half holds is released on success, failure, abort and lease expiry.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.request import RequestStatus

from connectors.compat import compat_info
from connectors.geometry import consecutive_runs
from connectors.metadata import PDConnectorMetadata, PDHandshakeMetadata, PullSpec
from connectors.replay_slack import plan_request
from connectors.stats import PDConnectorStats, StatsRecorder
from connectors.vllm_adapter import BlockPoolOps, CacheRules
from pdconnect.config import ConnectorSettings
from pdconnect.protocol import (
    Ack,
    BlockRun,
    Done,
    GroupTransfer,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Message,
    ProtocolError,
    Refusal,
    Release,
    TransferPlan,
    decode_plan,
    is_remote_decode_request,
)
from pdconnect.sidechannel import SideChannelClient, SideChannelError, SideChannelServer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDScheduler"]

logger = logging.getLogger("pdconnect.connector")

Slot = tuple[int, int]  # (kv cache group id, logical block index)


# --- prefill side ------------------------------------------------------------------


@dataclass
class _Producing:
    """A prefill-side request between arrival and finish: its slack and what is held of it."""

    request: Request
    slack: dict[int, tuple[int, ...]]
    held: dict[Slot, KVCacheBlock] = field(default_factory=dict)

    def missing(self) -> list[Slot]:
        return [(g, i) for g, indices in self.slack.items() for i in indices if (g, i) not in self.held]


@dataclass
class _Lease:
    """A finished prefill-side request whose blocks wait for the decode engine."""

    expires_at: float
    held: list[KVCacheBlock]


# --- decode side -------------------------------------------------------------------


@dataclass
class _Candidate:
    """A decode-side request between `get_num_new_matched_tokens` and allocation."""

    plan: TransferPlan | None
    failure: str | None
    local_tokens: int


@dataclass
class _Load:
    """A decode-side request whose pull is queued or running."""

    request: Request
    plan: TransferPlan | None
    shadows: dict[int, dict[int, KVCacheBlock]]  # group -> logical index -> shadow block
    aborted: bool = False

    def shadow_blocks(self) -> list[KVCacheBlock]:
        return [b for by_index in self.shadows.values() for b in by_index.values()]


class _PeerNotifier:
    """Sends heartbeats, done and release notices to prefill engines from a daemon thread.

    The scheduler thread must never wait on the network: it only enqueues.
    """

    def __init__(self, settings: ConnectorSettings, secret: bytes | None, stats: StatsRecorder) -> None:
        self._settings = settings
        self._secret = secret
        self._stats = stats
        self._outbox: queue.SimpleQueue[tuple[str, Message] | None] = queue.SimpleQueue()
        self._watched: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()
        self._clients: dict[str, SideChannelClient] = {}
        self._thread = threading.Thread(target=self._run, name="pdconnect-notifier", daemon=True)
        self._thread.start()

    def watch(self, address: str, request_id: str) -> None:
        with self._lock:
            self._watched[address].add(request_id)

    def unwatch(self, address: str, request_id: str) -> None:
        with self._lock:
            self._watched[address].discard(request_id)

    def send(self, address: str, message: Message) -> None:
        self._outbox.put((address, message))

    def close(self) -> None:
        self._outbox.put(None)
        self._thread.join(timeout=2)
        for client in self._clients.values():
            client.close()

    def _run(self) -> None:
        next_beat = time.monotonic() + self._settings.heartbeat_seconds
        while True:
            try:
                item = self._outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._deliver(*item)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._settings.heartbeat_seconds
                with self._lock:
                    beats = [(a, sorted(ids)) for a, ids in self._watched.items() if ids]
                for address, ids in beats:
                    self._deliver(address, Heartbeat(request_ids=ids))

    def _deliver(self, address: str, message: Message) -> None:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = SideChannelClient(
                address, self._secret, self._settings.handshake_timeout_seconds
            )
        try:
            client.request(message)
        except SideChannelError as exc:
            self._stats.count("notification_failures")
            logger.warning("could not send %s to %s: %s", type(message).__name__, address, exc)


class PDScheduler:
    """Scheduler-side state of a `PDConnector`; every method runs on the scheduler thread
    except the side-channel handler, which only reads immutable data or enqueues."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.engine_id: str = transfer.engine_id or ""
        self.is_producer = transfer.is_kv_producer
        self.is_consumer = transfer.is_kv_consumer
        self.settings = settings
        self.compat = compat_info(vllm_config, kv_cache_config)
        self._secret = settings.resolve_secret()
        self.stats = StatsRecorder()
        self._rules: CacheRules | None = None
        self._ops: BlockPoolOps | None = None
        # prefill side
        self._producing: dict[str, _Producing] = {}
        self._leases: dict[str, _Lease] = {}
        self._events: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._to_release: list[str] = []
        self._handshakes: dict[int, PDHandshakeMetadata] = {}
        self._server: SideChannelServer | None = None
        # decode side
        self._candidates: dict[str, _Candidate] = {}
        self._loads: dict[str, _Load] = {}
        self._new_pulls: list[PullSpec] = []
        self._settled: set[str] = set()  # loads ended (done sent) for requests still running
        self._notifier: _PeerNotifier | None = None
        if self.is_producer:
            # Data-parallel ranks on one host each get their own port (0 stays "any free port").
            base = settings.side_channel_port
            port = base + vllm_config.parallel_config.data_parallel_rank if base else 0
            self._server = SideChannelServer(settings.side_channel_host, port, self._answer, self._secret)
        if self.is_consumer:
            self._notifier = _PeerNotifier(settings, self._secret, self.stats)

    # --- wiring ------------------------------------------------------------------

    def bind(self, manager: KVCacheManager) -> None:
        self._rules = CacheRules.for_manager(manager)
        self._ops = BlockPoolOps(manager)

    @property
    def rules(self) -> CacheRules:
        assert self._rules is not None, "bind_kv_cache_manager was not called"
        return self._rules

    @property
    def ops(self) -> BlockPoolOps:
        assert self._ops is not None, "bind_kv_cache_manager was not called"
        return self._ops

    def set_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._handshakes = dict(metadata)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._notifier is not None:
            self._notifier.close()

    # --- side channel (server thread) --------------------------------------------

    def _answer(self, message: Message) -> Message:
        if isinstance(message, Handshake):
            return self._answer_handshake(message)
        if isinstance(message, (Heartbeat, Done, Release)):
            self._events.put(message)
            return Ack()
        return Refusal(reason=f"unexpected message {type(message).__name__}")

    def _answer_handshake(self, message: Handshake) -> Message:
        if message.compat != self.compat:
            self.stats.count("handshake_refusals")
            diff = "; ".join(self.compat.differences(message.compat))
            logger.warning("refused handshake from %s: incompatible (%s)", message.engine_id, diff)
            return Refusal(reason=f"incompatible engines (prefill vs decode): {diff}")
        worker = self._handshakes.get(message.tp_rank)
        if worker is None:
            self.stats.count("handshake_refusals")
            return Refusal(reason=f"no worker for TP rank {message.tp_rank} "
                                  f"(ranks here: {sorted(self._handshakes)})")
        return HandshakeReply(
            engine_id=self.engine_id,
            tp_rank=message.tp_rank,
            compat=self.compat,
            transport=worker.transport,
            transport_metadata=worker.transport_metadata,
            layouts=worker.layouts,
        )

    # --- scheduler hooks ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.is_producer and is_remote_decode_request(params):
            self._track_producer(request)
            return 0, False
        if not (self.is_consumer and params and params.get("do_remote_prefill")):
            return 0, False
        if request.request_id in self._settled:
            # Loaded already, or failed and sent back to recompute (kv_load_failure_policy):
            # never load twice.
            return 0, False
        candidate = self._candidates.get(request.request_id)
        if candidate is None:
            candidate = self._candidates[request.request_id] = self._check_plan(request, params)
            if candidate.plan is not None:
                assert self._notifier is not None
                self._notifier.watch(candidate.plan.side_channel, candidate.plan.remote_request_id)
        candidate.local_tokens = num_computed_tokens
        # Everything beyond the local hit is loaded; a bad plan is loaded too, as a
        # failure, so that vLLM's own failure policy decides the request's fate.
        return request.num_prompt_tokens - num_computed_tokens, True

    def _check_plan(self, request: Request, params: dict[str, Any]) -> _Candidate:
        try:
            plan = decode_plan(params)
        except ProtocolError as exc:
            return self._bad_params(request, None, str(exc))
        problem = None
        if plan.compat_hash != self.compat.digest():
            problem = (f"kv_transfer_params come from an incompatible prefill engine "
                       f"(compat {plan.compat_hash} vs ours {self.compat.digest()})")
        elif plan.num_prompt_tokens != request.num_prompt_tokens:
            problem = (f"prefill engine computed {plan.num_prompt_tokens} prompt tokens, "
                       f"this request has {request.num_prompt_tokens}")
        elif sorted(g.group for g in plan.groups) != list(range(len(self.rules.groups))):
            problem = f"plan names groups {[g.group for g in plan.groups]}, this engine has {len(self.rules.groups)}"
        if problem:
            return self._bad_params(request, plan, problem)
        return _Candidate(plan=plan, failure=None, local_tokens=0)

    def _bad_params(self, request: Request, plan: TransferPlan | None, reason: str) -> _Candidate:
        self.stats.count("bad_transfer_params")
        logger.error("request %s: %s", request.request_id, reason)
        return _Candidate(plan=plan, failure=reason, local_tokens=0)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        del blocks  # the full table (logical positions) comes from the manager
        candidate = self._candidates.pop(request.request_id, None)
        if candidate is None or num_external_tokens == 0:
            return
        plan = candidate.plan
        if candidate.failure is not None or plan is None:
            self._queue_failed(request, plan, candidate.failure or "no plan")
            return
        try:
            pairs, kinds, wanted_slack = self._pair_blocks(request, plan, candidate.local_tokens)
        except ValueError as exc:
            self._queue_failed(request, plan, str(exc))
            return
        shadows = self._allocate_shadows(request, list(wanted_slack))
        for group_id, by_index in shadows.items():
            pairs[group_id].extend((block.block_id, wanted_slack[(group_id, i)]) for i, block in by_index.items())
            kinds["slack"] += len(by_index)
        self._loads[request.request_id] = _Load(request, plan, shadows)
        self._new_pulls.append(PullSpec(
            request_id=request.request_id,
            remote_engine_id=plan.remote_engine_id,
            side_channel=plan.side_channel,
            compat_hash=plan.compat_hash,
            block_pairs=dict(pairs),
            blocks_by_kind=dict(kinds),
        ))

    def _pair_blocks(
        self, request: Request, plan: TransferPlan, local_tokens: int
    ) -> tuple[defaultdict[int, list[tuple[int, int]]], defaultdict[str, int], dict[Slot, int]]:
        """Local block -> remote block for every block the core allocated for the load,
        plus the slack slots the local cache still lacks, each with its remote block."""
        tables = self.ops.request_blocks(request.request_id)
        pairs: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
        kinds: defaultdict[str, int] = defaultdict(int)
        wanted: dict[Slot, int] = {}
        for transfer in plan.groups:
            group = self.rules.groups[transfer.group]
            remote = transfer.by_index()
            table = tables[transfer.group]
            for index, block in enumerate(table):
                if block.is_null or index * group.block_size < local_tokens:
                    continue
                if index not in remote:
                    raise ValueError(f"prefill engine holds no block {index} of group {transfer.group}")
                pairs[transfer.group].append((block.block_id, remote[index]))
                kinds["full_attention" if group.kind == "full_attention" else "tail"] += 1
            if not self.settings.replay_slack:
                continue
            for index in transfer.slack:
                has_slot = index < len(table) and not table[index].is_null
                if has_slot or index not in remote:
                    continue
                if not self.ops.is_cached_for(request, transfer.group, group.block_size, index):
                    wanted[(transfer.group, index)] = remote[index]
        return pairs, kinds, wanted

    def _allocate_shadows(self, request: Request, wanted: list[Slot]) -> dict[int, dict[int, KVCacheBlock]]:
        if not wanted:
            return {}
        if self.ops.num_free_blocks() < len(wanted):
            # The slack only helps later siblings; never let it starve this request's own load.
            self.stats.count("slack_skipped_pool_full")
            logger.warning("request %s: no room for %d slack blocks, loading without them",
                           request.request_id, len(wanted))
            return {}
        shadows: dict[int, dict[int, KVCacheBlock]] = defaultdict(dict)
        for (group_id, index), block in zip(wanted, self.ops.allocate(len(wanted))):
            shadows[group_id][index] = block
        return dict(shadows)

    def _queue_failed(self, request: Request, plan: TransferPlan | None, reason: str) -> None:
        self._loads[request.request_id] = _Load(request, plan, {})
        self._new_pulls.append(PullSpec(
            request_id=request.request_id,
            remote_engine_id=plan.remote_engine_id if plan else "",
            side_channel=plan.side_channel if plan else "",
            compat_hash=plan.compat_hash if plan else "",
            fail_reason=reason,
        ))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        del scheduler_output
        if self.is_producer:
            self._hold_new_slack()
            self._handle_events()
            self._expire_leases()
        meta = PDConnectorMetadata(pulls=self._new_pulls, release=self._to_release)
        self._new_pulls, self._to_release = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        failed = output.failed_recving or set()
        for request_id in output.finished_recving or ():
            load = self._loads.pop(request_id, None)
            if load is not None:
                self._finish_load(request_id, load, ok=request_id not in failed)

    def _finish_load(self, request_id: str, load: _Load, ok: bool) -> None:
        if ok and not load.aborted:
            published = 0
            for group_id, by_index in load.shadows.items():
                block_size = self.rules.groups[group_id].block_size
                published += self.ops.publish(load.request, group_id, block_size, by_index)
            self.stats.count("slack_blocks_published", published)
            self.stats.count("transfers")
        elif not load.aborted:
            self.stats.count("transfer_failures")
        # Published blocks stay cached when freed: they become evictable prefix-cache entries.
        self.ops.release(load.shadow_blocks())
        if load.plan is not None:
            self._notify_prefill(load.plan, Done(request_ids=[load.plan.remote_request_id], ok=ok))
        if not load.aborted:
            self._settled.add(request_id)  # done or failed: this request never loads again
        logger.info("request %s: load %s, %d slack blocks %s", request_id, "done" if ok else "failed",
                    len(load.shadow_blocks()), "published" if ok and not load.aborted else "freed")

    def _notify_prefill(self, plan: TransferPlan, message: Message) -> None:
        assert self._notifier is not None
        self._notifier.unwatch(plan.side_channel, plan.remote_request_id)
        self._notifier.send(plan.side_channel, message)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        if self.is_consumer:
            self._consumer_finished(request)
        producing = self._producing.pop(request_id, None)
        if producing is None:
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # Aborted or stopped before the hand-off: nobody will pull these blocks.
            self.ops.release(list(producing.held.values()))
            return False, None
        plan, held = self._build_plan(producing, block_ids)
        self._leases[request_id] = _Lease(expires_at=time.monotonic() + self.settings.lease_seconds, held=held)
        return True, msgspec.to_builtins(plan)

    def _consumer_finished(self, request: Request) -> None:
        request_id = request.request_id
        candidate = self._candidates.pop(request_id, None)
        load = self._loads.get(request_id)
        if load is not None:
            self._abort_load(request_id, load)
        elif request_id in self._settled:
            self._settled.discard(request_id)
        elif (plan := self._plan_of(request, candidate)) is not None:
            # Never loaded (aborted while queued): the prefill engine holds blocks for nobody.
            self._notify_prefill(plan, Release(request_ids=[plan.remote_request_id],
                                               reason="decode request ended before its load"))

    def _plan_of(self, request: Request, candidate: _Candidate | None) -> TransferPlan | None:
        if candidate is not None:
            return candidate.plan
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return None
        try:
            return decode_plan(params)
        except ProtocolError:
            return None

    def _abort_load(self, request_id: str, load: _Load) -> None:
        load.aborted = True
        queued = next((p for p in self._new_pulls if p.request_id == request_id), None)
        if queued is not None:
            # The workers never saw it: nothing can be writing into its blocks.
            self._new_pulls.remove(queued)
            del self._loads[request_id]
            self._finish_load(request_id, load, ok=False)
        # Otherwise in flight: the shadows stay allocated until the workers report it ended.

    # --- prefill-side holding ------------------------------------------------------

    def _track_producer(self, request: Request) -> None:
        if request.request_id in self._producing:
            return
        slack: dict[int, tuple[int, ...]] = {}
        if self.settings.replay_slack:
            plan = plan_request(self.rules, request.num_prompt_tokens)
            slack = {g.group_id: g.slack_blocks for g in plan.groups if g.slack_blocks}
        self._producing[request.request_id] = _Producing(request, slack)

    def _hold_new_slack(self) -> None:
        for producing in self._producing.values():
            if producing.request.num_computed_tokens == 0 and producing.held:
                # Preempted and reset: what we held no longer matches its computation.
                self.ops.release(list(producing.held.values()))
                producing.held.clear()
            missing = producing.missing()
            if not missing:
                continue
            tables = self.ops.request_blocks(producing.request.request_id)
            for group_id, index in missing:
                table = tables[group_id]
                if index < len(table) and not table[index].is_null:
                    producing.held[(group_id, index)] = self.ops.hold([table[index]])[0]

    def _build_plan(
        self, producing: _Producing, block_ids: tuple[list[int], ...]
    ) -> tuple[TransferPlan, list[KVCacheBlock]]:
        request = producing.request
        null_id = self.ops.null_block_id
        # Slack computed by an earlier local hit never entered the table; it is cached.
        for group_id, index in producing.missing():
            block_size = self.rules.groups[group_id].block_size
            cached = self.ops.cached_block(request, group_id, block_size, index)
            if cached is not None:
                producing.held[(group_id, index)] = self.ops.hold([cached])[0]
        groups = []
        for group_id, ids in enumerate(block_ids):
            blocks = {i: bid for i, bid in enumerate(ids) if bid != null_id}
            kept_slack = self._complete_slack_runs(producing, group_id)
            blocks.update({i: producing.held[(group_id, i)].block_id for i in kept_slack})
            groups.append(GroupTransfer(group=group_id, runs=_as_runs(blocks), slack=kept_slack))
        held = list(producing.held.values())
        self.stats.count("slack_blocks_held", len(held))
        plan = TransferPlan(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.settings.peer_host,
            remote_port=self._server.port if self._server is not None else self.settings.side_channel_port,
            compat_hash=self.compat.digest(),
            num_prompt_tokens=request.num_prompt_tokens,
            lease_expires_at=time.time() + self.settings.lease_seconds,
            groups=groups,
        )
        return plan, held

    def _complete_slack_runs(self, producing: _Producing, group_id: int) -> list[int]:
        """Slack indices of whole runs held; a run with a hole serves no lookup, so it is dropped."""
        kept: list[int] = []
        for run in consecutive_runs(producing.slack.get(group_id, ())):
            if all((group_id, i) in producing.held for i in run):
                kept.extend(run)
                continue
            self.stats.count("slack_runs_dropped")
            logger.warning("request %s: slack blocks %s of group %d were evicted before they could "
                           "be held; the decode engine will miss that replay point",
                           producing.request.request_id, run, group_id)
            for i in run:
                if (block := producing.held.pop((group_id, i), None)) is not None:
                    self.ops.release([block])
        return kept

    def _handle_events(self) -> None:
        while True:
            try:
                message = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, Heartbeat):
                deadline = time.monotonic() + self.settings.lease_seconds
                for request_id in message.request_ids:
                    if (lease := self._leases.get(request_id)) is not None:
                        lease.expires_at = deadline
            elif isinstance(message, Done):
                for request_id in message.request_ids:
                    self._end_lease(request_id, "decode done" if message.ok else "decode gave up")
            elif isinstance(message, Release):
                for request_id in message.request_ids:
                    if self._end_lease(request_id, f"released: {message.reason}"):
                        self.stats.count("releases")

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, lease in self._leases.items() if lease.expires_at <= now]:
            self.stats.count("lease_expiries")
            self._end_lease(request_id, "lease expired")

    def _end_lease(self, request_id: str, why: str) -> bool:
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self.ops.release(lease.held)
        self._to_release.append(request_id)
        logger.info("request %s: prefill blocks freed (%s)", request_id, why)
        return True

    # --- introspection --------------------------------------------------------------

    def take_stats(self) -> PDConnectorStats | None:
        return self.stats.take()


def _as_runs(blocks: dict[int, int]) -> list[BlockRun]:
    return [BlockRun(start=run.start, block_ids=[blocks[i] for i in run]) for run in consecutive_runs(sorted(blocks))]
