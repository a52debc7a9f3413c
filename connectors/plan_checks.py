"""Decode-side validation of a transfer plan against this engine's own geometry and prompt.

Everything in `kv_transfer_params` is input from outside the engine. The wire types
(`pdconnect.protocol`) check shapes and signs; this module checks what only the decode
engine knows: its groups, their block sizes, the prompt it is about to serve. A plan
that fails here never reaches the block pool: the load fails with the reason in the
log, the request follows `kv_load_failure_policy`, and the engine keeps serving.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from connectors.identity import prompt_digest
from pdconnect.protocol import TransferPlan

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from connectors.vllm_adapter import CacheRules

__all__ = ["PlanRejected", "check_plan"]

# Block ids are the prefill engine's, which this engine cannot bound exactly; a pool of
# more than 2**31 blocks does not exist, and the transports index with 32-bit ints.
MAX_BLOCK_ID = 2**31 - 1


class PlanRejected(ValueError):
    """A plan this engine must not load; the message says why, for the log."""


def check_plan(
    plan: TransferPlan, request: Request, rules: CacheRules, compat_digest: str, *, now: float | None = None
) -> None:
    """Raise PlanRejected unless `plan` can only name blocks of this very prompt."""
    if plan.compat_hash != compat_digest:
        raise PlanRejected("kv_transfer_params come from an incompatible prefill engine")
    if not plan.lease_id:
        raise PlanRejected("the plan carries no lease id: the prefill engine's ownership cannot be checked")
    if not plan.prompt_digest:
        raise PlanRejected("the plan does not name its prompt")
    if plan.num_prompt_tokens != request.num_prompt_tokens:
        raise PlanRejected(
            f"prefill engine computed {plan.num_prompt_tokens} prompt tokens, "
            f"this request has {request.num_prompt_tokens}"
        )
    if plan.prompt_digest != prompt_digest(request):
        raise PlanRejected("the plan was made for another prompt (prompt digest differs)")
    if plan.lease_expires_at <= (time.time() if now is None else now):
        raise PlanRejected("the plan's lease had expired before this engine saw the request")
    groups = [g.group for g in plan.groups]
    if sorted(groups) != list(range(len(rules.groups))):
        raise PlanRejected(f"plan names groups {groups}, this engine has {len(rules.groups)}")
    for transfer in plan.groups:
        group = rules.groups[transfer.group]
        num_blocks = -(-plan.num_prompt_tokens // group.block_size)
        seen: set[int] = set()
        for run in transfer.runs:
            indices = range(run.start, run.start + len(run.block_ids))
            if indices.stop > num_blocks:
                raise PlanRejected(
                    f"group {transfer.group}: blocks up to {indices.stop - 1}, the prompt has {num_blocks}"
                )
            if seen.intersection(indices):
                raise PlanRejected(f"group {transfer.group}: a block index appears twice")
            seen.update(indices)
            if any(block_id > MAX_BLOCK_ID for block_id in run.block_ids):
                raise PlanRejected(f"group {transfer.group}: block id out of range")
        if not transfer.slack:
            continue
        if group.kind != "sliding_window":
            raise PlanRejected(f"group {transfer.group}: slack on a {group.kind} group")
        # Slack is published under the request's hashes: only full blocks have one.
        full_blocks = plan.num_prompt_tokens // group.block_size
        for index in transfer.slack:
            if index >= full_blocks:
                raise PlanRejected(
                    f"group {transfer.group}: slack block {index} is not a full "
                    f"block of the prompt ({full_blocks} full blocks)"
                )
            if index not in seen:
                raise PlanRejected(f"group {transfer.group}: slack block {index} is not held")
        if len(set(transfer.slack)) != len(transfer.slack):
            raise PlanRejected(f"group {transfer.group}: a slack index appears twice")
