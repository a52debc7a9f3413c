"""The connector's worker half: registers this rank's KV tensors and runs the pulls the scheduler plans.

Each worker registers its KV cache memory with the transport and describes every layer's
tensor by its real shape and strides (`pdconnect.kvlayout`), so the CPU layout (K and V
packed in one block range) and the CUDA layouts (K and V planes, HND permutations) need
no special cases. A decode worker handshakes once per prefill engine over the side
channel: with prefill rank 0 first, whose reply gives the prefill engine's TP size, then
with every other prefill rank it reads (`pdconnect.tpmap`: with equal TP sizes, its own
rank's twin; otherwise one or several ranks, each for a slice of the KV heads). It pulls
each request's block pairs from each of those ranks in one merged batch per rank. The
prefill engine frees every rank's copy of a block when the lease ends (leases and block
ids are per engine), so ranks no decode rank read leak nothing. Pulls start after the
forward pass is launched and are polled each step, so the forward pass never waits on
the network; the workers report each pull exactly once, when it is finished and the
transport no longer writes into its blocks.

A finished read is not yet a load: the worker then claims the plan's lease again, and
only a prefill engine answering "still held, by you" proves the bytes read were that
engine's KV for this prompt rather than memory it had freed and reused meanwhile.

Threads: the step thread only submits work to the transport thread and collects
answers; it never waits on the network or on a lock the transport thread holds.
Anything raised on the transport thread becomes a failed receive for its request.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from connectors.compat import compat_info, judge
from connectors.leases import confirm_claim
from connectors.metadata import PDConnectorMetadata, PDHandshakeMetadata, PullSpec, decode_layouts, encode_layouts
from connectors.refusal_notes import RefusalNotes, notes_key
from connectors.settings import ConnectorSettings, side_channel_roles
from connectors.stats import PDConnectorStats, StatsRecorder
from connectors.vllm_adapter import locate_kv_head_dim
from pdconnect.kvlayout import LayoutError, TensorLayout, locate_block_dim, pull_ranges_for_layers
from pdconnect.protocol import Claim, Handshake, HandshakeReply, ParallelShape
from pdconnect.sidechannel import NoAnswer, RefusedByPeer, SideChannelClient, SideChannelError
from pdconnect.tpmap import (
    GroupHeads,
    HeadRead,
    PairingError,
    check_rank_heads,
    describe,
    reads_for_rank,
    source_ranks,
)
from pdconnect.transfer import (
    MemoryRegion,
    Transfer,
    TransferError,
    TransferState,
    Transport,
    create_transport,
    merge_range_groups,
)
from pdconnect.transfer.transport import FailedTransfer

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PDWorker"]

logger = logging.getLogger("pdconnect.connector")

# A poll round waits up to this long for pulls posted within `_YOUNG_PULL_SECONDS`, so a
# read the library finishes asynchronously in a few milliseconds (Mooncake's TCP path:
# p50 0.8-2 ms for 1.5 MiB) is seen in the round that follows its posting, as a NIXL
# loopback read, finished inside the posting call, is; otherwise it waits a whole step for
# the next round (in-engine p50 23.5 ms, against 6.7 ms with a 3 ms window). The transport
# thread sleeps meanwhile (no core, no interpreter lock), gives way as soon as new pulls
# are queued behind it, and the step thread never waits for a round.
_SETTLE_SECONDS = 10e-3
_YOUNG_PULL_SECONDS = 20e-3


class LoadError(RuntimeError):
    """A pull cannot be started: handshake refused, unknown engine, layout mismatch."""


@dataclass(frozen=True)
class _Source:
    """One prefill rank this decode rank reads, and which heads of each group's blocks."""

    peer: str
    layouts: dict[int, list[TensorLayout]]  # that rank's, per group
    reads: dict[int, list[HeadRead]]  # per group: what comes from that rank


@dataclass(frozen=True)
class _Remote:
    """A prefill engine we have handshaken with: the ranks this decode rank reads."""

    sources: tuple[_Source, ...]


@dataclass(frozen=True)
class _Posted:
    """A pull handed to the transport: what it moves, and when it was posted."""

    transfers: tuple[Transfer, ...]  # one per prefill rank read
    nbytes: int
    ranges: int
    posted: float


@dataclass
class _Pull:
    spec: PullSpec
    submitted: Future[_Posted] | None  # None when the scheduler already failed it
    failure: str | None = None


def _posted_within(pull: _Pull, now: float, seconds: float) -> bool:
    """Whether `pull` reached the transport less than `seconds` ago."""
    submitted = pull.submitted
    if submitted is None or not submitted.done() or submitted.exception() is not None:
        return False
    return now - submitted.result().posted < seconds


def _advertised_host(settings: ConnectorSettings) -> str:
    host = settings.peer_host
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class PDWorker:
    """Worker-side state of a `PDConnector` for one TP rank."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings, tp_rank: int
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.engine_id: str = transfer.engine_id or ""
        self.settings = settings
        self.tp_rank = tp_rank
        self.parallel = ParallelShape(tp_size=vllm_config.parallel_config.tensor_parallel_size, tp_rank=tp_rank)
        self.compat = compat_info(vllm_config, kv_cache_config)
        # The worker only asks (handshakes, claims): as decode, with the engine's keys.
        keys = settings.resolve_keys(side_channel_roles(transfer.is_kv_producer, transfer.is_kv_consumer))
        self._keys = keys.acting_as("decode") if keys is not None and transfer.is_kv_consumer else None
        self._kv_cache_config = kv_cache_config
        self._transport: Transport[Any] | None = None
        self._layouts: dict[int, list[TensorLayout]] = {}
        # Transport thread only: peers handshaken with, side-channel clients for claims.
        self._remotes: dict[tuple[str, str], _Remote] = {}
        self._claim_clients: dict[str, SideChannelClient] = {}
        # The transport thread: handshakes, submissions and polls, in order. They may block on
        # the network, never on the step thread, and the libraries see a single caller.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdconnect-transport")
        self._polling: Future[dict[str, bool]] | None = None
        # Set by the step thread when it queues pulls, cleared by the transport thread as it
        # takes one: a settling poll round ends early rather than hold them up.
        self._pulls_queued = threading.Event()
        self._pulls: dict[str, _Pull] = {}
        self._released: set[str] = set()
        self.stats = StatsRecorder(tp_rank=tp_rank)
        # Why a pairing was refused, for the client; a decode worker decides, and clears old notes.
        self._notes = RefusalNotes.for_server(vllm_config, decides=transfer.is_kv_consumer)

    # --- registration ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._layouts = {
            group_id: [
                self._layout(kv_caches[name], num_blocks, name, group.kv_cache_spec) for name in group.layer_names
            ]
            for group_id, group in enumerate(self._kv_cache_config.kv_cache_groups)
        }
        # Layers of different groups share one allocation under HMA: register each once.
        regions = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in kv_caches.values()}
        self._transport = create_transport(
            self.settings.transport,
            host=_advertised_host(self.settings),
            protocol=self.settings.protocol,
            device_name=self.settings.device_name,
            require_rdma=self.settings.require_rdma,
            nixl_progress_delay_us=self.settings.nixl_progress_delay_us,
            # A stalled session is dropped and the read made again within the same
            # transfer timeout: a third of it leaves room for at least two more reads.
            mooncake_stall_seconds=self.settings.transfer_timeout_seconds / 3,
        )
        self._transport.register([MemoryRegion(addr, length) for addr, length in sorted(regions)])
        self.stats = StatsRecorder(f"{self._transport.name}/{self._transport.effective_protocol}", tp_rank=self.tp_rank)
        logger.info(
            "rank %d: registered %d KV tensors (%d regions, %.1f MiB) with %s over %s",
            self.tp_rank,
            len(kv_caches),
            len(regions),
            sum(n for _, n in regions) / 2**20,
            self._transport.name,
            self._transport.effective_protocol,
        )

    @staticmethod
    def _layout(tensor: torch.Tensor, num_blocks: int, name: str, spec: Any) -> TensorLayout:
        try:
            block_dim = locate_block_dim(tuple(tensor.shape), num_blocks)
        except LayoutError as exc:
            raise LayoutError(f"KV cache of layer {name}: {exc}") from None
        try:
            head_dim = locate_kv_head_dim(spec, tuple(tensor.shape), block_dim)
        except LayoutError as exc:
            # Equal TP sizes still pull whole blocks; unequal ones are refused at handshake.
            logger.warning("KV cache of layer %s: no heads dim (%s): unequal TP cannot be served", name, exc)
            head_dim = None
        return TensorLayout.of(tensor, block_dim=block_dim, head_dim=head_dim)

    def handshake_metadata(self) -> PDHandshakeMetadata | None:
        if self._transport is None:
            return None
        return PDHandshakeMetadata(
            tp_rank=self.tp_rank,
            transport=self._transport.name,
            transport_metadata=self._transport.metadata(),
            layouts=encode_layouts(self._layouts),
            parallel=self.parallel,
        )

    # --- loads --------------------------------------------------------------------------

    def start(self, metadata: PDConnectorMetadata) -> None:
        """Queue this step's pulls on the transport thread, and a poll round right behind them.

        The round runs while the step computes, so a read the library ends within the
        settle window is known by this step's `transfer_results`, not the next one's: a
        round submitted there is collected a step later.
        """
        self._released.update(metadata.release)
        posted = False
        for spec in metadata.pulls:
            if spec.fail_reason is not None:
                self._pulls[spec.request_id] = _Pull(spec, None, spec.fail_reason)
                continue
            self._pulls_queued.set()  # before the submission, which clears it: a settling round gives way
            try:
                self._pulls[spec.request_id] = _Pull(spec, self._executor.submit(self._submit, spec))
                posted = True
            except RuntimeError as exc:  # the executor is shut down: the engine is stopping
                self._pulls[spec.request_id] = _Pull(spec, None, f"cannot start the pull: {exc}")
        if posted and self._polling is None:
            self._polling = self._executor.submit(self._poll, self._pollable())

    def _submit(self, spec: PullSpec) -> _Posted:
        self._pulls_queued.clear()
        assert self._transport is not None
        remote = self._remote(spec)
        batches = [(source.peer, self._ranges(spec, source)) for source in remote.sources]
        posted = time.monotonic()  # after the handshake: the metric times the transfer alone
        transfers = []
        try:
            for peer, ranges in batches:
                transfers.append(self._transport.pull(peer, ranges, timeout=self.settings.transfer_timeout_seconds))
        except Exception:
            # The pulls already posted still write into our blocks: the request's failure
            # waits for them (`_outcome`), so hand them over rather than drop them.
            if not transfers:
                raise
            logger.exception("request %s: posting a pull failed after %d others", spec.request_id, len(transfers))
            transfers.append(FailedTransfer(spec.request_id, "posting the next rank's pull failed"))
        return _Posted(
            tuple(transfers), sum(r.total_bytes for _, r in batches), sum(len(r) for _, r in batches), posted
        )

    def _ranges(self, spec: PullSpec, source: _Source) -> Any:
        """One prefill rank's share of a request: each group's head slices, merged once."""
        parts = []
        for group_id, pairs in spec.block_pairs.items():
            for read in source.reads.get(group_id, ()):
                try:
                    local = [layout.head_slice(read.local_start, read.count) for layout in self._layouts[group_id]]
                    theirs = [layout.head_slice(read.remote_start, read.count) for layout in source.layouts[group_id]]
                    parts.append(pull_ranges_for_layers(local, theirs, pairs, merged=False))
                except LayoutError as exc:
                    raise LoadError(f"group {group_id} from {source.peer}: {exc}") from None
        # One merging pass over every group's numpy table: no per-range tuples.
        return merge_range_groups(parts)

    def _remote(self, spec: PullSpec) -> _Remote:
        key = (spec.remote_engine_id, spec.side_channel)
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._remotes[key] = self._handshake(spec)
        return remote

    def _forget(self, spec: PullSpec) -> None:
        """Drop a peer after a failure (transport thread): a restarted prefill engine needs a
        fresh handshake."""
        self._remotes.pop((spec.remote_engine_id, spec.side_channel), None)
        client = self._claim_clients.pop(spec.side_channel, None)
        if client is not None:
            client.close()

    def _still_held(self, spec: PullSpec) -> str | None:
        """Claim the lease again after the read (transport thread); None if it was held
        throughout, else why the bytes read cannot be trusted."""
        client = self._claim_clients.get(spec.side_channel)
        if client is None:
            client = self._claim_clients[spec.side_channel] = SideChannelClient(
                spec.side_channel, "decode", self._keys, self.settings.handshake_timeout_seconds
            )

        def retrying(exc: NoAnswer) -> None:
            self.stats.count("claim_retries")
            logger.warning("request %s: %s; confirming again", spec.request_id, exc)

        claim = Claim(
            to_engine=spec.remote_engine_id,
            lease_id=spec.lease_id,
            claimant=spec.claimant,
            plan_digest=spec.plan_digest,
        )
        return confirm_claim(client, claim, retrying)

    def _handshake(self, spec: PullSpec) -> _Remote:
        """Handshake with the prefill engine's rank 0, map the two TP shapes, then with every
        other prefill rank this rank reads; connect the transport to each rank read."""
        assert self._transport is not None
        started = time.monotonic()
        first = self._ask(spec, 0)
        prefill_tp = first.parallel.tp_size
        reads = self._reads(spec, prefill_tp)
        replies = {0: first}
        for rank in source_ranks(reads):
            if rank not in replies:
                reply = replies[rank] = self._ask(spec, rank)
                if reply.parallel.tp_size != prefill_tp:
                    raise LoadError(
                        f"{spec.side_channel}: prefill rank {rank} reports tp_size "
                        f"{reply.parallel.tp_size}, rank 0 {prefill_tp}"
                    )
        answered = time.monotonic()
        sources = []
        for rank in source_ranks(reads):
            reply = replies[rank]
            peer = f"{reply.engine_id}/rank{rank}"
            try:
                self._transport.connect(peer, reply.transport_metadata)
            except TransferError as exc:
                raise LoadError(f"cannot connect {self._transport.name} to {peer}: {exc}") from None
            layouts = decode_layouts(reply.layouts)
            if prefill_tp != self.parallel.tp_size:
                try:  # the prefill rank's real tensors must hold the heads the mapping addresses
                    check_rank_heads("prefill", prefill_tp, self._group_heads(), rank, _heads(layouts))
                except PairingError as exc:
                    raise self._refused(
                        spec, f"prefill engine {spec.remote_engine_id} cannot serve this engine: {exc}"
                    ) from None
            mine = {g: [r for r in group if r.prefill_rank == rank] for g, group in reads.items()}
            sources.append(_Source(peer, layouts, {g: r for g, r in mine.items() if r}))
        logger.info(
            "rank %d of %d: reads prefill engine %s (tp_size %d) ranks %s via %s (handshakes %.3f s, connect %.3f s)",
            self.tp_rank,
            self.parallel.tp_size,
            spec.remote_engine_id,
            prefill_tp,
            source_ranks(reads),
            first.transport,
            answered - started,
            time.monotonic() - answered,
        )
        return _Remote(tuple(sources))

    def _ask(self, spec: PullSpec, rank: int) -> HandshakeReply:
        """One handshake, for prefill rank `rank`; checked against the plan and our compat."""
        client = SideChannelClient(spec.side_channel, "decode", self._keys, self.settings.handshake_timeout_seconds)
        try:
            reply = client.request(
                Handshake(engine_id=self.engine_id, tp_rank=rank, compat=self.compat, parallel=self.parallel)
            )
        except RefusedByPeer as exc:
            self.stats.count("handshake_refusals")
            if exc.refusal.compat is None:
                raise LoadError(f"handshake with {spec.side_channel} (prefill rank {rank}) refused: {exc}") from None
            key = (spec.remote_engine_id, spec.side_channel, spec.compat_hash)
            raise self._refused(spec, judge(self.compat, key, exc.refusal).message) from None
        except SideChannelError as exc:
            self.stats.count("handshake_refusals")
            raise LoadError(
                f"handshake with {spec.side_channel} (prefill rank {rank}) failed: {exc} "
                f"(this decode engine: tp_size {self.parallel.tp_size}, {self._describe_groups()})"
            ) from None
        finally:
            client.close()
        if not isinstance(reply, HandshakeReply):
            raise LoadError(f"{spec.side_channel} answered {type(reply).__name__} to a handshake")
        if reply.engine_id != spec.remote_engine_id:
            self.stats.count("handshake_refusals")
            raise LoadError(
                f"unknown engine: {spec.side_channel} is engine {reply.engine_id!r}, "
                f"the plan names {spec.remote_engine_id!r}"
            )
        if reply.compat != self.compat:
            key = (spec.remote_engine_id, spec.side_channel, spec.compat_hash)
            raise self._refused(spec, judge(self.compat, key, reply).message)
        if reply.tp_rank != rank or reply.parallel.tp_rank != rank:
            raise LoadError(f"{spec.side_channel} answered for rank {reply.tp_rank} when asked for rank {rank}")
        return reply

    def _reads(self, spec: PullSpec, prefill_tp: int) -> dict[int, list[HeadRead]]:
        """Per group, what this rank reads from which prefill rank; LoadError naming both
        sides' values when the pairing cannot work."""
        try:
            return reads_for_rank(
                prefill_tp, self.parallel.tp_size, self._group_heads(), self.tp_rank, _heads(self._layouts)
            )
        except PairingError as exc:
            raise self._refused(
                spec, f"prefill engine {spec.remote_engine_id} cannot serve this engine: {exc}"
            ) from None

    def _refused(self, spec: PullSpec, message: str) -> LoadError:
        """A pairing that cannot work: counted, and noted for the API server, whose answer
        to the failed request then says `message` (`connectors.refusal_notes`)."""
        self.stats.count("handshake_refusals")
        self._notes.write(notes_key(spec.remote_engine_id, spec.side_channel, spec.compat_hash), message)
        return LoadError(message)

    def _group_heads(self) -> list[GroupHeads]:
        return [GroupHeads(g.kv_heads, g.latent) for g in self.compat.groups]

    def _describe_groups(self) -> str:
        return ", ".join(
            f"group {g}: {c.kind} block {c.block_size}, {describe(GroupHeads(c.kv_heads, c.latent))}"
            for g, c in enumerate(self.compat.groups)
        )

    def transfer_results(self) -> KVConnectorTransferResults:
        """Pulls that ended since the last call; never touches the transport itself.

        Polling runs on the transport thread (one poll round in flight at a time) and its
        answer is collected here on a later step: NIXL agents have no internal locking,
        so one thread must do every call into the library.
        """
        outcomes: dict[str, bool] = {}
        if self._polling is not None and self._polling.done():
            try:
                outcomes = self._polling.result()
            except Exception as exc:  # a poll round that broke: fail what it was polling
                logger.exception("rank %d: a poll round failed", self.tp_rank)
                outcomes = {
                    r: self._failed(p.spec, f"poll failed: {exc}", forget=False)
                    for r, p in self._pulls.items()
                    if p.submitted is not None and p.submitted.done()
                }
            self._polling = None
        for request_id, pull in list(self._pulls.items()):
            if pull.failure is not None:
                # Failed before reaching the transport thread: no peer to forget.
                outcomes[request_id] = self._failed(pull.spec, pull.failure, forget=False)
        for request_id in outcomes:
            del self._pulls[request_id]
        if self._polling is None and self._pulls:
            self._polling = self._executor.submit(self._poll, self._pollable())
        done = {r for r, ok in outcomes.items() if ok}
        failed = set(outcomes) - done
        sending, self._released = self._released, set()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=done | failed, failed_recving=failed
        )

    def _pollable(self) -> list[_Pull]:
        """The pulls a poll round asks about: those handed to the transport thread."""
        return [pull for pull in self._pulls.values() if pull.submitted is not None]

    def _poll(self, pulls: list[_Pull]) -> dict[str, bool]:
        """One poll round on the transport thread: request id -> outcome, for ended pulls.

        While a pull posted moments ago is still running, the round polls again with a
        growing pause, for at most `_SETTLE_SECONDS`, so the step that collects this round
        learns of it (why: see `_SETTLE_SECONDS`), unless new pulls wait behind the round.
        """
        outcomes = self._poll_once(pulls)
        settle_until = time.monotonic() + _SETTLE_SECONDS
        pause = 20e-6
        while True:
            now = time.monotonic()
            young = [
                pull
                for pull in pulls
                if pull.spec.request_id not in outcomes and _posted_within(pull, now, _YOUNG_PULL_SECONDS)
            ]
            if not young or now >= settle_until or self._pulls_queued.is_set():
                return outcomes
            time.sleep(min(pause, settle_until - now))
            pause = min(pause * 2, 1e-3)
            outcomes.update(self._poll_once(young))

    def _poll_once(self, pulls: list[_Pull]) -> dict[str, bool]:
        outcomes = {}
        for pull in pulls:
            try:
                outcome = self._outcome(pull)
            except Exception as exc:  # any bug or library error fails this request, not the thread
                logger.exception("request %s: pull failed unexpectedly", pull.spec.request_id)
                outcome = self._failed(pull.spec, f"unexpected error: {exc!r}")
            if outcome is not None:
                outcomes[pull.spec.request_id] = outcome
        return outcomes

    def _outcome(self, pull: _Pull) -> bool | None:
        """True done, False failed (and quiescent), None still running. Transport thread only."""
        spec = pull.spec
        assert pull.submitted is not None
        if not pull.submitted.done():
            return None
        try:
            posted = pull.submitted.result()
        except Exception as exc:  # noqa: BLE001 - refused handshake, bad address, layout, library: a failed pull
            return self._failed(spec, str(exc) or repr(exc))
        states = [transfer.poll() for transfer in posted.transfers]
        if TransferState.PENDING in states:
            return None  # even when another rank's read failed: this one still writes into our blocks
        failed = [t for t, state in zip(posted.transfers, states) if state is TransferState.FAILED]
        if failed:
            # The library may still be writing into our blocks: report only once it stopped.
            if not all(t.quiescent for t in failed):
                return None
            return self._failed(spec, "; ".join(f"{t.description}: {t.error or 'transfer failed'}" for t in failed))
        elapsed = time.monotonic() - posted.posted
        if (lost := self._still_held(spec)) is not None:
            self.stats.count("leases_lost")
            return self._failed(spec, lost)
        self.stats.observe_transfer(elapsed, posted.nbytes)
        self.stats.count("bytes_transferred", posted.nbytes)
        self.stats.count("ranges_transferred", posted.ranges)
        for kind, count in spec.blocks_by_kind.items():
            self.stats.count(f"blocks_{kind}", count)
        logger.debug("request %s: pulled %d bytes from %s", spec.request_id, posted.nbytes, spec.remote_engine_id)
        return True

    def _failed(self, spec: PullSpec, reason: str, forget: bool = True) -> bool:
        if forget:
            self._forget(spec)
        logger.error("request %s: KV load from %s failed: %s", spec.request_id, spec.remote_engine_id or "?", reason)
        return False

    def take_stats(self) -> PDConnectorStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for client in self._claim_clients.values():
            client.close()
        if self._transport is not None:
            self._transport.close()


def _heads(layouts: dict[int, list[TensorLayout]]) -> dict[int, int]:
    """Group id -> KV heads in each block of that group's tensors."""
    return {g: group[0].num_heads for g, group in layouts.items() if group}
