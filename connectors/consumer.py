"""The decode engine's half of the hand-off: claim the loan, pull what is missing, publish what was proven.

One request's path:
  1. `arrive` (vLLM's `on_new_request`, long before the request reaches the head of the
     queue) validates the plan against this engine and this prompt
     (`connectors.plan_checks`), claims its lease on the prefill engine and starts the
     heartbeats that keep it alive while the request waits. A plan whose compat digest
     is not this engine's is refused, after a handshake with its prefill engine (once
     per engine and digest, `connectors.compat.PeerVerdicts`) that names each field
     that differs with both values.
  2. `get_num_new_matched_tokens` answers "ask again later" (None) while the claim is
     unanswered (answers arrive on the notifier's thread and are taken once per
     scheduling pass, so the queue keeps vLLM's order among answered claims), or
     while a sibling's load in flight will publish blocks this request would otherwise
     pull again (coalescing); then reports the prompt minus the local hit as external
     tokens.
  3. `update_state_after_alloc` pairs every newly allocated block with the prefill
     block of the same logical index, allocates shadow blocks for slack the local
     cache lacks, and queues a `PullSpec` for the workers. The workers read the blocks
     and then claim the lease again: only a lease still held proves the bytes read
     were the prefill engine's KV for this prompt, not reused memory.
  4. `update_connector_output`, when the pull is reported, publishes the shadow blocks
     under the request's hashes (or frees them unpublished on failure), then sends
     `Done` so the prefill engine frees at once.

Failure rule: anything wrong with a load becomes a failed receive for its request, so
vLLM applies `kv_load_failure_policy`; nothing is published that was not proven, and
every block this half holds is released on success, failure, abort and timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from connectors.cache_binding import CacheBound
from connectors.compat import Key, PeerVerdicts
from connectors.leases import CLAIM_ATTEMPTS
from connectors.metadata import PullSpec
from connectors.plan_checks import PlanRejected, check_plan
from connectors.refusal_notes import RefusalNotes
from connectors.replay_slack import plan_request
from connectors.settings import ConnectorSettings
from connectors.stats import StatsRecorder
from pdconnect.keyring import Keyring
from pdconnect.notifier import PeerNotifier
from pdconnect.protocol import Ack, Claim, Done, Handshake, Heartbeat, ParallelShape, Release

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pdconnect.protocol import CompatInfo, Message, TransferPlan

__all__ = ["Consumer", "claimant_of"]

logger = logging.getLogger("pdconnect.connector")

Slot = tuple[int, int]  # (kv cache group id, logical block index)
# Ended loads' leases remembered: vLLM's clean-up notice follows its request's error at once.
_ENDED_LEASES_KEPT = 1024


def claimant_of(engine_id: str, request_id: str) -> str:
    """The name one decode request claims a lease under (unique across decode engines)."""
    return f"{engine_id}/{request_id}"


class ClaimState(Enum):
    PENDING = "pending"
    HELD = "held"
    LOST = "lost"


@dataclass
class _Incoming:
    """A decode-side request from arrival until its load is queued (or it ends)."""

    request: Request
    plan: TransferPlan | None
    failure: str | None
    claim: ClaimState = ClaimState.PENDING
    claimed_at: float = field(default_factory=time.monotonic)
    claim_attempts: int = 0
    local_tokens: int = 0
    waiting_on: str | None = None  # the request id of the load this one waits for
    wait_started: float = 0.0
    compat_key: Key | None = None  # a plan of another compat digest, waiting for the handshake's verdict


@dataclass
class _Load:
    """A decode-side request whose pull is queued or running."""

    request: Request
    plan: TransferPlan | None
    shadows: dict[int, dict[int, KVCacheBlock]]  # group -> logical index -> shadow block
    aborted: bool = False

    def shadow_blocks(self) -> list[KVCacheBlock]:
        return [b for by_index in self.shadows.values() for b in by_index.values()]


class Consumer(CacheBound):
    """Decode-side state; every method runs on the scheduler thread.

    The notifier's callbacks run on its threads and only enqueue; the queue is drained
    at the top of each scheduler hook.
    """

    def __init__(
        self,
        engine_id: str,
        settings: ConnectorSettings,
        compat: CompatInfo,
        keys: Keyring | None,
        stats: StatsRecorder,
        news: threading.Event | None = None,
        tp_size: int = 1,
        notes: RefusalNotes | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.compat = compat
        self.compat_digest = compat.digest()
        self.tp_size = tp_size
        self.stats = stats
        self._peers = PeerVerdicts(compat, notes=notes)  # notes: the client's error names the refusal
        # (address, the handshake's answer or None, why none), from the notifier's threads.
        self._compat_answers: queue.SimpleQueue[tuple[str, Message | None, str]] = queue.SimpleQueue()
        self._incoming: dict[str, _Incoming] = {}
        self._by_lease: dict[str, str] = {}  # lease id -> request id, while incoming
        self._loads: dict[str, _Load] = {}
        self._new_pulls: list[PullSpec] = []
        self._settled: set[str] = set()  # loads ended (done sent) for requests still running
        # Leases of loads that ended lately (insertion order, oldest first), so vLLM's
        # notice for a request that failed after its load is known for what it is.
        self._ended_leases: dict[str, None] = {}
        # (lease id, why lost or "", whether the prefill engine may not have seen the claim)
        self._replies: queue.SimpleQueue[tuple[str, str, bool]] = queue.SimpleQueue()
        # Answers are taken once per scheduling pass, at its first lookup: one that lands
        # mid-pass waits for the next, so answers never reorder vLLM's waiting queue.
        self._replies_taken_this_pass = False
        # Set as an answer is queued: what an idle scheduler waits for (`connectors.scheduler`).
        self._news = news if news is not None else threading.Event()
        self._notifier = PeerNotifier(
            sender="decode",
            keys=keys,
            timeout_seconds=settings.handshake_timeout_seconds,
            heartbeat_seconds=settings.heartbeat_seconds,
            count=stats.count,
            on_reply=self._on_reply,
            on_failure=self._on_failure,
        )

    def close(self) -> None:
        self._notifier.close()

    def blocks_held(self) -> int:
        return sum(len(load.shadow_blocks()) for load in self._loads.values())

    # --- notifier threads: enqueue only ---------------------------------------------

    def _on_reply(self, address: str, sent: Message, reply: Message) -> None:
        if isinstance(sent, Handshake):  # answered, or refused with the prefill engine's record
            self._compat_answers.put((address, reply, ""))
            self._news.set()
            return
        if isinstance(reply, Ack) and isinstance(sent, (Claim, Heartbeat)):
            if isinstance(sent, Claim) and not reply.unknown:
                self._replies.put((sent.lease_id, "", False))
            for lease_id in reply.unknown:
                self._replies.put((lease_id, f"the prefill engine at {address} no longer holds the blocks", False))
            self._news.set()

    def _on_failure(self, address: str, sent: Message, reason: str, unanswered: bool) -> None:
        if isinstance(sent, Handshake):
            self._compat_answers.put((address, None, reason))
            self._news.set()
        if isinstance(sent, Claim):
            self._replies.put((sent.lease_id, f"claim refused or unanswered by {address}: {reason}", unanswered))
            self._news.set()

    # --- scheduler thread -------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether this step has something to hand the workers or to take from them:
        answers queued, pulls to post, or loads whose results only the workers report."""
        return (
            not self._replies.empty() or not self._compat_answers.empty() or bool(self._new_pulls) or bool(self._loads)
        )

    def claims_pending(self) -> bool:
        """Whether a request waits for its claim's answer, which only the prefill engine gives."""
        return any(incoming.claim is ClaimState.PENDING for incoming in self._incoming.values())

    def _take_replies(self) -> None:
        while True:
            try:
                address, answer, failure = self._compat_answers.get_nowait()
            except queue.Empty:
                break
            self._peers.answer(address, answer, failure)
        while True:
            try:
                lease_id, lost, unanswered = self._replies.get_nowait()
            except queue.Empty:
                return
            incoming = self._incoming.get(self._by_lease.get(lease_id, ""))
            if incoming is None or incoming.claim is ClaimState.LOST:
                continue
            if lost and unanswered and incoming.claim_attempts < CLAIM_ATTEMPTS:
                self.stats.count("claim_retries")
                logger.warning("request %s: %s; claiming again", incoming.request.request_id, lost)
                self._claim(incoming)
            elif lost:
                self.stats.count("leases_lost")
                assert incoming.plan is not None
                self._notifier.unwatch(incoming.plan.side_channel, incoming.plan.remote_engine_id, lease_id)
                incoming.claim = ClaimState.LOST
                incoming.failure = incoming.failure or lost
                logger.error("request %s: %s", incoming.request.request_id, lost)
            else:
                incoming.claim = ClaimState.HELD

    # --- scheduler hooks --------------------------------------------------------------

    def arrive(self, request: Request, plan: TransferPlan) -> None:
        """First sight of a P/D request: check its plan (decoded by `connectors.transfer_params`),
        claim the lease, keep it alive."""
        request_id = request.request_id
        if request_id in self._incoming or request_id in self._loads or request_id in self._settled:
            return
        if getattr(request, "abort_immediately", False):  # the attribute is vLLM 0.32's
            self._rejection_notice(request, plan)
            return
        if plan.compat_hash != self.compat_digest and self.settings.may_dial(plan.remote_host):
            # Refused whatever the answer (`connectors.plan_checks`); the handshake finds
            # out which fields differ, so the refusal can name them with both values.
            key = (plan.remote_engine_id, plan.side_channel, plan.compat_hash)
            self._incoming[request_id] = _Incoming(request, None, None, compat_key=key)
            if self._peers.ask(key):
                self._notifier.send(
                    plan.side_channel,
                    Handshake(
                        engine_id=self.engine_id,
                        tp_rank=0,
                        compat=self.compat,
                        parallel=ParallelShape(tp_size=self.tp_size, tp_rank=0),
                    ),
                )
            return
        failure = self._check(request, plan)
        if failure is not None:
            # A refused plan is never acted on, not even to release it: it may name
            # somebody else's lease.
            self._incoming[request_id] = _Incoming(request, None, failure, claim=ClaimState.LOST)
            return
        incoming = self._incoming[request_id] = _Incoming(request, plan, None)
        self._by_lease[plan.lease_id] = request_id
        self._claim(incoming)
        self._notifier.watch(plan.side_channel, plan.remote_engine_id, plan.lease_id)

    def _rejection_notice(self, request: Request, plan: TransferPlan) -> None:
        """vLLM's serving layer answered a P/D request with an error and submitted a copy
        of it (prompt `[0]`, aborted at once) only so that a connector frees what the plan
        pinned (`AsyncLLM.notify_kv_transfer_request_rejected`). It asks for no load, so
        it is no bad input: not checked, counted or logged as refused params. Its lease
        is never released from here: a notice carries no prompt to prove the plan by, so
        a lease it names ends with our load's `Done` or at its expiry."""
        if plan.lease_id in self._ended_leases or plan.lease_id in self._by_lease:
            why = "whose load has ended" if plan.lease_id in self._ended_leases else "whose load is pending"
            logger.debug("request %s: vLLM's clean-up notice for lease %s, %s", request.request_id, plan.lease_id, why)
            return
        logger.info(
            "request %s: vLLM's notice of a P/D request rejected before this engine saw it; lease %s "
            "on prefill engine %s ends at its expiry",
            request.request_id,
            plan.lease_id,
            plan.remote_engine_id,
        )

    def _claim(self, incoming: _Incoming) -> None:
        assert incoming.plan is not None
        incoming.claim_attempts += 1
        plan = incoming.plan
        self._notifier.send(
            plan.side_channel,
            Claim(
                to_engine=plan.remote_engine_id,
                lease_id=plan.lease_id,
                claimant=claimant_of(self.engine_id, incoming.request.request_id),
                plan_digest=plan.digest(),
            ),
        )

    def _check(self, request: Request, plan: TransferPlan) -> str | None:
        """Why this engine must not load `plan` for `request`, or None."""
        if not self.settings.may_dial(plan.remote_host):
            # Unsigned answers from another machine could be anyone's: bytes and "held" alike.
            return self._bad_params(
                request,
                f"the plan names {plan.remote_host}, not this machine, and this engine has no side-channel keys",
            )
        try:
            check_plan(plan, request, self.rules, self.compat_digest)
        except PlanRejected as exc:
            return self._bad_params(request, str(exc))
        return None

    def _judged(self, incoming: _Incoming) -> bool:
        """Whether the refusal of a plan of another compat digest is decided (and set as
        the request's failure); False while the handshake has not answered."""
        key = incoming.compat_key
        assert key is not None
        verdict = self._peers.verdict(key)
        if verdict is None:
            # The notifier answers or fails every handshake within its timeout; the backstop.
            if time.monotonic() - incoming.claimed_at < 2 * self.settings.handshake_timeout_seconds:
                return False
            self._peers.answer(key[1], None, "no answer reported")
            verdict = self._peers.verdict(key)
            assert verdict is not None
        incoming.compat_key = None
        incoming.claim = ClaimState.LOST
        self.stats.count("bad_transfer_params")
        self.stats.count_reason("compat_refusals", verdict.reason)
        # Every field was logged once for the prefill engine (`PeerVerdicts.answer`).
        logger.error("request %s: refusing kv_transfer_params: %s", incoming.request.request_id, verdict.short)
        incoming.failure = verdict.short
        return True

    def _bad_params(self, request: Request, reason: str) -> str:
        self.stats.count("bad_transfer_params")
        logger.error("request %s: refusing kv_transfer_params: %s", request.request_id, reason)
        return reason

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, plan: TransferPlan
    ) -> tuple[int | None, bool]:
        request_id = request.request_id
        if request_id in self._settled:
            # Loaded already, or failed and sent back to recompute (kv_load_failure_policy):
            # never load twice.
            return 0, False
        if not self._replies_taken_this_pass:
            self._take_replies()
            self._replies_taken_this_pass = True
        incoming = self._incoming.get(request_id)
        if incoming is None:
            self.arrive(request, plan)
            incoming = self._incoming[request_id]
        if incoming.compat_key is not None and not self._judged(incoming):
            return None, False  # the handshake's answer comes within the handshake timeout
        if incoming.claim is ClaimState.PENDING:
            # The notifier answers every attempt within the handshake timeout; this is the
            # backstop should a reply never be reported.
            if time.monotonic() - incoming.claimed_at < (CLAIM_ATTEMPTS + 1) * self.settings.handshake_timeout_seconds:
                return None, False  # ask again next step; the request holds no blocks meanwhile
            incoming.claim = ClaimState.LOST
            incoming.failure = "the prefill engine did not answer the claim"
        if incoming.failure is None and self._should_wait(incoming, num_computed_tokens):
            return None, False
        incoming.local_tokens = num_computed_tokens
        # Everything beyond the local hit is loaded; a bad plan is loaded too, as a
        # failure, so that vLLM's own failure policy decides the request's fate.
        return request.num_prompt_tokens - num_computed_tokens, True

    # --- coalescing -------------------------------------------------------------------

    def _should_wait(self, incoming: _Incoming, num_computed_tokens: int) -> bool:
        """True while a sibling's load in flight will publish blocks this request would pull.

        A follower waits only on loads already allocated and pulling, which wait on
        nothing: no cycle, so no deadlock. It stops waiting when the leader's load has
        ended (published, failed or aborted: the core has then cached what it will) or
        after `coalesce_wait_seconds`, and then looks up the local cache afresh.
        """
        if not self.settings.coalesce:
            return False
        if incoming.waiting_on is not None:
            leader = self._loads.get(incoming.waiting_on)
            if leader is None or leader.aborted or leader.request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                incoming.waiting_on = None
                return False
            if time.monotonic() - incoming.wait_started >= self.settings.coalesce_wait_seconds:
                self.stats.count("coalesce_timeouts")
                logger.warning(
                    "request %s: gave up waiting for the load of %s after %.1f s",
                    incoming.request.request_id,
                    leader.request.request_id,
                    self.settings.coalesce_wait_seconds,
                )
                incoming.waiting_on = None
                incoming.wait_started = -1.0  # never wait again
                return False
            return True
        if incoming.wait_started < 0:
            return False
        leader_id = self._best_leader(incoming.request, num_computed_tokens)
        if leader_id is None:
            return False
        incoming.waiting_on, incoming.wait_started = leader_id, time.monotonic()
        self.stats.count("coalesced_waits")
        logger.info(
            "request %s: waits for the load of %s, which shares its prefix", incoming.request.request_id, leader_id
        )
        return True

    def _best_leader(self, request: Request, num_computed_tokens: int) -> str | None:
        """The in-flight load whose publication raises this request's local hit the most."""
        best, best_hit = None, num_computed_tokens
        hash_tokens = self.rules.hash_block_size
        for leader_id, load in self._loads.items():
            if load.aborted or load.plan is None or load.request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            shared = _shared_hashes(request.block_hashes, load.request.block_hashes) * hash_tokens
            if shared <= best_hit:
                continue
            cached = plan_request(
                self.rules, load.request.num_prompt_tokens, replay_slack=self.settings.replay_slack
            ).decode_cached_blocks()
            for transfer in load.plan.groups:
                # The slack the leader receives includes the runs at its prefill-side
                # junction, which only the prefill engine could plan: it is published too.
                cached.setdefault(transfer.group, set()).update(transfer.slack)
            hit = self.rules.lookup_hit(cached, shared, request.num_tokens)
            if hit > best_hit:
                best, best_hit = leader_id, hit
        return best

    # --- allocation and pulls -----------------------------------------------------------

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        incoming = self._incoming.get(request.request_id)
        if incoming is None or num_external_tokens == 0:
            return
        self._forget_incoming(request.request_id)
        plan = incoming.plan
        if incoming.failure is not None or plan is None:
            self._queue_failed(request, plan, incoming.failure or "no plan")
            return
        try:
            pairs, kinds, wanted_slack = self._pair_blocks(request, plan, incoming.local_tokens)
        except ValueError as exc:
            self._queue_failed(request, plan, str(exc))
            return
        shadows = self._allocate_shadows(request, list(wanted_slack))
        for group_id, by_index in shadows.items():
            pairs[group_id].extend((block.block_id, wanted_slack[(group_id, i)]) for i, block in by_index.items())
            kinds["slack"] += len(by_index)
        self._loads[request.request_id] = _Load(request, plan, shadows)
        self._new_pulls.append(
            PullSpec(
                request_id=request.request_id,
                remote_engine_id=plan.remote_engine_id,
                side_channel=plan.side_channel,
                compat_hash=plan.compat_hash,
                block_pairs=dict(pairs),
                blocks_by_kind=dict(kinds),
                lease_id=plan.lease_id,
                claimant=claimant_of(self.engine_id, request.request_id),
                plan_digest=plan.digest(),
            )
        )

    def _forget_incoming(self, request_id: str) -> _Incoming | None:
        incoming = self._incoming.pop(request_id, None)
        if incoming is not None and incoming.plan is not None:
            self._by_lease.pop(incoming.plan.lease_id, None)
        return incoming

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
            logger.warning(
                "request %s: no room for %d slack blocks, loading without them", request.request_id, len(wanted)
            )
            return {}
        shadows: dict[int, dict[int, KVCacheBlock]] = defaultdict(dict)
        for (group_id, index), block in zip(wanted, self.ops.allocate(len(wanted))):
            shadows[group_id][index] = block
        return dict(shadows)

    def _queue_failed(self, request: Request, plan: TransferPlan | None, reason: str) -> None:
        self._loads[request.request_id] = _Load(request, plan, {})
        self._new_pulls.append(
            PullSpec(
                request_id=request.request_id,
                remote_engine_id=plan.remote_engine_id if plan else "",
                side_channel=plan.side_channel if plan else "",
                compat_hash=plan.compat_hash if plan else "",
                fail_reason=reason,
            )
        )

    def take_pulls(self) -> list[PullSpec]:
        """The pulls this scheduling pass allocated; called once at the end of every pass."""
        self._take_replies()
        self._replies_taken_this_pass = False
        pulls, self._new_pulls = self._new_pulls, []
        return pulls

    # --- results ---------------------------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        failed = output.failed_recving or set()
        for request_id in output.finished_recving or ():
            load = self._loads.pop(request_id, None)
            if load is not None:
                self._finish_load(request_id, load, ok=request_id not in failed)

    def _finish_load(self, request_id: str, load: _Load, ok: bool, reported: bool = True) -> None:
        """End a load the workers `reported` (ok or failed), or one aborted before they saw it."""
        published = 0
        if ok and not load.aborted:
            published = self._publish(load)
            self.stats.count("slack_blocks_published", published)
            self.stats.count("transfers")
        elif not ok and reported:
            # Counted even when the request already ended: under kv_load_failure_policy
            # "fail" vLLM finishes the request (our `request_finished`, which marks the
            # load aborted) before it hands the connector the failed report.
            self.stats.count("transfer_failures")
        # Published blocks stay cached when freed: they become evictable prefix-cache entries.
        self.ops.release(load.shadow_blocks())
        if load.plan is not None:
            self._ended_leases[load.plan.lease_id] = None
            if len(self._ended_leases) > _ENDED_LEASES_KEPT:
                del self._ended_leases[next(iter(self._ended_leases))]
            self._tell_prefill(
                load.plan,
                request_id,
                Done(
                    to_engine=load.plan.remote_engine_id,
                    request_ids=[load.plan.lease_id],
                    ok=ok,
                    claimant=claimant_of(self.engine_id, request_id),
                ),
            )
        if not load.aborted:
            self._settled.add(request_id)  # done or failed: this request never loads again
        logger.info(
            "request %s: load %s, %d of %d slack blocks published",
            request_id,
            "done" if ok else "failed",
            published,
            len(load.shadow_blocks()),
        )

    def _publish(self, load: _Load) -> int:
        published = 0
        for group_id, by_index in load.shadows.items():
            block_size = self.rules.groups[group_id].block_size
            try:
                published += self.ops.publish(load.request, group_id, block_size, by_index)
            except Exception:  # a plan that slipped past the checks must not kill the scheduler
                self.stats.count("bad_transfer_params")
                logger.exception(
                    "request %s: could not publish slack of group %d; left unpublished",
                    load.request.request_id,
                    group_id,
                )
        return published

    def _tell_prefill(self, plan: TransferPlan, request_id: str, message: Message) -> None:
        self._notifier.unwatch(plan.side_channel, plan.remote_engine_id, plan.lease_id)
        self._notifier.send(plan.side_channel, message)

    def request_finished(self, request: Request) -> None:
        request_id = request.request_id
        incoming = self._forget_incoming(request_id)
        load = self._loads.get(request_id)
        if load is not None:
            self._abort_load(request_id, load)
        elif request_id in self._settled:
            self._settled.discard(request_id)
        elif incoming is not None and incoming.plan is not None:
            # Never loaded (aborted while queued): the prefill engine holds blocks for nobody.
            self._tell_prefill(
                incoming.plan,
                request_id,
                Release(
                    to_engine=incoming.plan.remote_engine_id,
                    request_ids=[incoming.plan.lease_id],
                    reason="decode request ended before its load",
                    claimant=claimant_of(self.engine_id, request_id),
                ),
            )

    def _abort_load(self, request_id: str, load: _Load) -> None:
        load.aborted = True
        queued = next((p for p in self._new_pulls if p.request_id == request_id), None)
        if queued is not None:
            # The workers never saw it: nothing can be writing into its blocks.
            self._new_pulls.remove(queued)
            del self._loads[request_id]
            self._finish_load(request_id, load, ok=False, reported=False)
        # Otherwise in flight: the shadows stay allocated until the workers report it ended.


def _shared_hashes(ours: list[Any], theirs: list[Any]) -> int:
    """How many leading block hashes two requests share."""
    shared = 0
    for mine, other in zip(ours, theirs):
        if mine != other:
            break
        shared += 1
    return shared
