"""Decode-side plan validation against the real vLLM Request and cache rules: nothing outside the prompt passes."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from connectors.geometry import Geometry, GroupGeometry
from connectors.identity import prompt_digest
from connectors.kvsim import random_tokens
from connectors.plan_checks import PlanRejected, check_plan
from connectors.replay_slack import plan_request
from connectors.vllm_adapter import CacheRules
from pdconnect.protocol import BlockRun, GroupTransfer, ProtocolError, TransferPlan, decode_plan

GEOMETRY = Geometry(
    (  # DeepSeek-V4-like, as the scheduler-level tests use
        GroupGeometry("full_attention", 256, eagle=True),
        GroupGeometry("sliding_window", 64, 128, eagle=True),
    )
)
RULES = CacheRules.for_geometry(GEOMETRY)
COMPAT = "c0ffee"
N = 5131


def _request(tokens: list[int], salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt)


def _valid_plan(request: Request) -> TransferPlan:
    """The plan a prefill engine of GEOMETRY would send for `request` (ids are made up)."""
    planned = plan_request(RULES, request.num_prompt_tokens)
    groups = []
    for group in planned.groups:
        indices = sorted(set(group.transfer_blocks))
        runs = [BlockRun(start=i, block_ids=[1000 + i]) for i in indices]
        groups.append(GroupTransfer(group=group.group_id, runs=runs, slack=list(group.slack_blocks)))
    return TransferPlan(
        remote_engine_id="p",
        remote_request_id="r",
        remote_host="127.0.0.1",
        remote_port=5700,
        compat_hash=COMPAT,
        num_prompt_tokens=request.num_prompt_tokens,
        # Far ahead: the module is built at collection time, possibly minutes before it runs.
        lease_expires_at=time.time() + 86_400,
        groups=groups,
        lease_id="L",
        prompt_digest=prompt_digest(request),
    )


REQUEST = _request(random_tokens(N, seed=1))
VALID = _valid_plan(REQUEST)


def test_the_plan_a_prefill_engine_sends_passes():
    check_plan(VALID, REQUEST, RULES, COMPAT)


@pytest.mark.parametrize(
    ("label", "change", "reason"),
    [
        ("no lease", {"lease_id": ""}, "no lease id"),
        ("no prompt", {"prompt_digest": ""}, "does not name its prompt"),
        ("expired", {"lease_expires_at": 1.0}, "expired"),
        ("compat", {"compat_hash": "other"}, "incompatible"),
        ("length", {"num_prompt_tokens": N - 1}, "prompt tokens"),
    ],
)
def test_plan_fields_that_do_not_fit_this_engine_are_refused(label, change, reason):
    with pytest.raises(PlanRejected, match=reason):
        check_plan(msgspec.structs.replace(VALID, **change), REQUEST, RULES, COMPAT)


def test_a_plan_for_another_prompt_of_the_same_length_is_refused():
    other = _request(random_tokens(N, seed=2))
    with pytest.raises(PlanRejected, match="another prompt"):
        check_plan(VALID, other, RULES, COMPAT)


def test_the_same_tokens_under_another_cache_salt_are_another_prompt():
    salted = _request(list(REQUEST.prompt_token_ids), salt="tenant-b")
    with pytest.raises(PlanRejected, match="another prompt"):
        check_plan(VALID, salted, RULES, COMPAT)


def _with_group(plan: TransferPlan, group_id: int, **change: object) -> TransferPlan:
    groups = list(plan.groups)
    groups[group_id] = msgspec.structs.replace(groups[group_id], **change)
    return msgspec.structs.replace(plan, groups=groups)


@pytest.mark.parametrize(
    ("label", "group", "change", "reason"),
    [
        ("index past the prompt", 0, {"runs": [BlockRun(start=21, block_ids=[1])]}, "the prompt has 21"),
        ("index twice", 0, {"runs": [BlockRun(start=3, block_ids=[1, 2]), BlockRun(start=4, block_ids=[3])]}, "twice"),
        ("huge block id", 0, {"runs": [BlockRun(start=0, block_ids=[2**40])]}, "out of range"),
        ("slack on full attention", 0, {"slack": [1]}, "slack on a full_attention"),
        ("slack past the full blocks", 1, {"slack": [80]}, "not a full block"),
        ("slack not held", 1, {"slack": [3]}, "not held"),
    ],
)
def test_indices_outside_this_engine_geometry_are_refused(label, group, change, reason):
    with pytest.raises(PlanRejected, match=reason):
        check_plan(_with_group(VALID, group, **change), REQUEST, RULES, COMPAT)


def test_negative_indices_are_refused_at_decoding():
    params = msgspec.to_builtins(VALID)
    params["groups"][1]["slack"] = [-1]
    with pytest.raises(ProtocolError):
        decode_plan(params)


@settings(max_examples=1500, deadline=None, database=None, derandomize=True)
@given(
    group=st.integers(0, 1),
    start=st.integers(0, 200),
    length=st.integers(1, 4),
    slack=st.lists(st.integers(0, 200), max_size=4),
)
def test_random_runs_pass_only_inside_the_prompt(group, start, length, slack):
    """A plan passes only if every block it names exists in this prompt (property-based)."""
    runs = [BlockRun(start=start, block_ids=list(range(length)))]
    plan = _with_group(VALID, group, runs=runs, slack=slack)
    block_size = GEOMETRY.groups[group].block_size
    inside = start + length <= -(-N // block_size)
    slack_ok = not slack or (
        group == 1
        and len(set(slack)) == len(slack)
        and all(start <= i < start + length and i < N // block_size for i in slack)
    )
    try:
        check_plan(plan, REQUEST, RULES, COMPAT)
    except PlanRejected:
        assert not (inside and slack_ok)
    else:
        assert inside and slack_ok
