"""The prefill engine's half of the hand-off: hold what decode will need, lend it under a lease.

One request's path:
  1. `track` (from `get_num_new_matched_tokens`) sees `do_remote_decode` and plans the
     sliding-window blocks beyond the tail that decode's prefix cache needs: the replay
     slack and the shared-prefix junction's runs (`replay_slack.plan_request`).
  2. `hold_new_slack`, after every step, holds each planned block the moment it appears
     in the request's block table: the core frees sliding-window blocks as the window
     moves on, and a hold (an extra reference) keeps their KV intact.
  3. `finish` (from `request_finished_all_groups`) turns the blocks the core still keeps
     plus the held slack into a `TransferPlan` under a fresh lease, and asks the core
     to delay freeing.
  4. The lease desk (`connectors.lease_desk`, a process of its own) answers `Claim`,
     `Heartbeat`, `Done` and `Release` from its `LeaseTable`; `collect_ended` (each step)
     frees the blocks of every lease the desk reports ended and tells the workers to
     report the request as sent, which frees the rest.

Invariant: blocks are freed only after their lease has left the desk's table (or the
desk is gone), so any answer "held" the side channel gives is true for the whole time
since the plan was made.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.request import RequestStatus

from connectors.cache_binding import CacheBound
from connectors.geometry import consecutive_runs
from connectors.identity import prompt_digest
from connectors.lease_desk import RELEASED, DeskGone, LeaseDesk
from connectors.leases import new_lease_id
from connectors.replay_slack import plan_request
from connectors.settings import ConnectorSettings
from connectors.stats import StatsRecorder
from pdconnect.protocol import BlockRun, GroupTransfer, TransferPlan

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

__all__ = ["Producer"]

logger = logging.getLogger("pdconnect.connector")

Slot = tuple[int, int]  # (kv cache group id, logical block index)

# A prefill request hands off when it ended normally: by length (max_tokens=1, the
# router's prefill leg) or by a stop (its first token was a stop token or string).
_HANDS_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class _Producing:
    """A prefill-side request between arrival and finish: its slack and what is held of it."""

    request: Request
    slack: dict[int, tuple[int, ...]]
    held: dict[Slot, KVCacheBlock] = field(default_factory=dict)

    def missing(self) -> list[Slot]:
        return [(g, i) for g, indices in self.slack.items() for i in indices if (g, i) not in self.held]


class Producer(CacheBound):
    """Prefill-side state; every method runs on the scheduler thread."""

    def __init__(
        self, engine_id: str, settings: ConnectorSettings, compat_digest: str, stats: StatsRecorder, desk: LeaseDesk
    ) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.compat_digest = compat_digest
        self.stats = stats
        self.desk = desk
        # Request id -> the slack blocks held for its open lease (the rest the core keeps).
        self._lent: dict[str, list[KVCacheBlock]] = {}
        self._producing: dict[str, _Producing] = {}
        self.port = desk.port

    def blocks_held(self) -> int:
        """Blocks this half holds an extra reference on (slack being held or lent)."""
        producing = sum(len(p.held) for p in self._producing.values())
        return producing + sum(len(held) for held in self._lent.values())

    # --- scheduler thread -------------------------------------------------------------

    def track(self, request: Request) -> None:
        if request.request_id in self._producing:
            return
        slack: dict[int, tuple[int, ...]] = {}
        if self.settings.replay_slack:
            # vLLM's own lookup has just set the request's shared-prefix junction; the runs
            # kept below it let the next sibling of this prefix hit on decode too.
            plan = plan_request(
                self.rules, request.num_prompt_tokens, shared_prefix_tokens=self.rules.shared_prefix_tokens(request)
            )
            slack = {g.group_id: g.slack_blocks for g in plan.groups if g.slack_blocks}
        self._producing[request.request_id] = _Producing(request, slack)

    def hold_new_slack(self) -> None:
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

    def has_news(self) -> bool:
        """Whether the desk reported ended leases this step must collect."""
        return self.desk.has_ended()

    def lending(self) -> bool:
        """Whether leases are out: only their decode engines (or expiry) can end them."""
        return bool(self._lent)

    def collect_ended(self) -> list[str]:
        """Free the blocks of leases the desk reports ended; returns their request ids for
        the workers. With the desk gone, every lease has ended: nothing can confirm it."""
        ended = [(e.request_id, e.reason) for e in self.desk.take_ended()]
        if self.desk.gone:
            ended += [(request_id, "side-channel desk exited") for request_id in self._lent]
        freed = []
        for request_id, reason in ended:
            held = self._lent.pop(request_id, None)
            if held is None:
                continue  # reported twice (ended, then the desk exited)
            if reason == "lease expired":
                self.stats.count("lease_expiries")
            elif reason.startswith(RELEASED):
                self.stats.count("releases")
            self.ops.release(held)
            logger.info("request %s: prefill blocks freed (%s)", request_id, reason)
            freed.append(request_id)
        return freed

    def finish(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        producing = self._producing.pop(request.request_id, None)
        if producing is None:
            return False, None
        if request.status not in _HANDS_OFF:
            # Aborted before the hand-off: nobody will pull these blocks.
            self.ops.release(list(producing.held.values()))
            return False, None
        lease_id = new_lease_id()
        groups = self._plan_groups(producing, block_ids)
        held = list(producing.held.values())
        self.stats.count("slack_blocks_held", len(held))
        plan = TransferPlan(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.settings.peer_host,
            remote_port=self.port,
            compat_hash=self.compat_digest,
            num_prompt_tokens=request.num_prompt_tokens,
            lease_expires_at=time.time() + self.settings.lease_seconds,
            groups=groups,
            lease_id=lease_id,
            prompt_digest=prompt_digest(request),
        )
        try:
            self.desk.open(request.request_id, lease_id, plan.digest())
        except DeskGone as exc:
            # No lease can be confirmed: lend nothing, free at once (decode computes it).
            self.stats.count("handoffs_refused")
            logger.error("request %s: not handed off: %s", request.request_id, exc)
            self.ops.release(held)
            return False, None
        self._lent[request.request_id] = held
        return True, msgspec.to_builtins(plan)

    def _plan_groups(self, producing: _Producing, block_ids: tuple[list[int], ...]) -> list[GroupTransfer]:
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
        return groups

    def _complete_slack_runs(self, producing: _Producing, group_id: int) -> list[int]:
        """Slack indices of whole runs held; a run with a hole serves no lookup, so it is dropped."""
        kept: list[int] = []
        for run in consecutive_runs(producing.slack.get(group_id, ())):
            if all((group_id, i) in producing.held for i in run):
                kept.extend(run)
                continue
            self.stats.count("slack_runs_dropped")
            logger.warning(
                "request %s: slack blocks %s of group %d were evicted before they could "
                "be held; the decode engine will miss that replay point",
                producing.request.request_id,
                run,
                group_id,
            )
            for i in run:
                if (block := producing.held.pop((group_id, i), None)) is not None:
                    self.ops.release([block])
        return kept


def _as_runs(blocks: dict[int, int]) -> list[BlockRun]:
    return [BlockRun(start=run.start, block_ids=[blocks[i] for i in run]) for run in consecutive_runs(sorted(blocks))]
