"""The replay-slack planner: which KV blocks a P/D request must move so decode's prefix cache works.

For a prompt of N tokens, each KV cache group's plan says:
- `tail_blocks`: the blocks the core itself keeps when the request finishes on the
  prefill engine, and allocates for external tokens on the decode engine. Full
  attention keeps every block; a sliding window keeps only the blocks its window
  still covers (`get_num_skipped_tokens`).
- `cached_blocks`: the blocks a colocated engine publishes into its prefix cache for
  this prompt: the sliding-window mask (`reachable_block_mask`) at the prompt's replay
  boundaries (`replay_boundaries`) and at its shared-prefix junction
  (`Request.shared_prefix_boundary`: where the full-attention hit ran past the sliding
  window's, so that the next sibling of the prefix hits there), below the cacheable
  limit (`get_num_cacheable_tokens`). A group vLLM does not prefix-cache at all
  (DeepSeek-V4.1's bounded sliding-window replay) caches nothing: it moves its window
  and publishes nothing.
- `slack_blocks`: cached blocks below the tail. The stock connectors never send them,
  so the decode engine never has them and its sliding-window group cannot serve a
  sibling's lookup: with EAGLE the hit collapses to 0. We keep them on the prefill
  engine, send them, and the decode connector publishes them itself
  (`publish_blocks`); the core publishes the cached part of the tail.
- `transfer_blocks`: tail plus slack: everything the decode engine needs.

Every quantity comes from vLLM's own functions through `CacheRules`, so a plan cannot
drift from the lookup it must satisfy. The expected sibling hits are answers of vLLM's
real `find_longest_cache_hit` over exactly the blocks the plan leaves cached on decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from connectors.geometry import GroupKind
from connectors.vllm_adapter import CacheRules, GroupRules

__all__ = ["GroupPlan", "RequestPlan", "plan_request", "stock_tail_blocks"]


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group's share of a request's plan; indices are logical block numbers."""

    group_id: int
    kind: GroupKind
    block_size: int
    tail_blocks: tuple[int, ...]
    cached_blocks: tuple[int, ...]
    slack_blocks: tuple[int, ...]
    transfer_blocks: tuple[int, ...]
    publish_blocks: tuple[int, ...]


@dataclass(frozen=True)
class RequestPlan:
    """What a prompt of `num_prompt_tokens` moves and caches, group by group.

    `expected_sibling_hit_tokens` is the decode-local hit of an extension sibling (the
    prompt plus new tokens) and `expected_resend_hit_tokens` that of the same prompt
    sent again, after a remote load that moved this plan; None when not computed.
    """

    num_prompt_tokens: int
    alignment: int
    replay_boundaries: tuple[int, ...]
    replay_slack: bool
    groups: tuple[GroupPlan, ...]
    expected_sibling_hit_tokens: int | None = field(default=None)
    expected_resend_hit_tokens: int | None = field(default=None)
    # The junction the plan was computed for (None: none), and the decode-local hit of a
    # later sibling that shares this prompt's first `shared_prefix_tokens + alignment`
    # tokens (capped at the prompt): the shortest shared prefix whose full-attention hit
    # still reaches the junction after EAGLE's drop, i.e. the next sibling of the prefix.
    shared_prefix_tokens: int | None = field(default=None)
    expected_junction_hit_tokens: int | None = field(default=None)

    @property
    def slack_block_count(self) -> int:
        return sum(len(g.slack_blocks) for g in self.groups)

    def decode_cached_blocks(self) -> dict[int, set[int]]:
        """Per group, the blocks the decode engine's prefix cache holds after the load."""
        cached: dict[int, set[int]] = {}
        for group in self.groups:
            received = set(group.transfer_blocks)
            cached[group.group_id] = {i for i in group.cached_blocks if i in received}
        return cached


def stock_tail_blocks(rules: CacheRules, group_id: int, num_tokens: int) -> tuple[int, ...]:
    """The blocks the core keeps after `num_tokens` are processed: all that stock connectors move."""
    group = rules.groups[group_id]
    num_blocks = -(-num_tokens // group.block_size)
    first_kept = min(rules.skipped_tokens(group_id, num_tokens) // group.block_size, num_blocks)
    return tuple(range(first_kept, num_blocks))


def _plan_group(
    rules: CacheRules, group: GroupRules, num_tokens: int, cached: tuple[int, ...], replay_slack: bool
) -> GroupPlan:
    tail = stock_tail_blocks(rules, group.group_id, num_tokens)
    first_kept = tail[0] if tail else 0
    slack = tuple(i for i in cached if i < first_kept) if replay_slack else ()
    return GroupPlan(
        group_id=group.group_id,
        kind=group.kind,
        block_size=group.block_size,
        tail_blocks=tail,
        cached_blocks=cached,
        slack_blocks=slack,
        transfer_blocks=slack + tail,
        publish_blocks=slack,
    )


def plan_request(
    rules: CacheRules,
    num_prompt_tokens: int,
    *,
    shared_prefix_tokens: int | None = None,
    replay_slack: bool = True,
    expected_hits: bool = False,
) -> RequestPlan:
    """Plan one request of `num_prompt_tokens` on an engine whose cache follows `rules`.

    `shared_prefix_tokens` is the request's shared-prefix junction on the prefill engine
    (`CacheRules.shared_prefix_tokens(request)`, read after vLLM's own lookup set it);
    None or 0 when there is none. The runs vLLM keeps below it join the slack, so the
    next sibling of the prefix hits on decode as it would on a colocated engine.
    `replay_slack=False` gives what today's connectors do (the tail only), for A/B runs.
    `expected_hits=True` also runs vLLM's lookup for the resend and extension siblings,
    and, with a junction, for the next sibling of the prefix it marks (sharing the prompt
    one alignment past the junction: `RequestPlan.expected_junction_hit_tokens`).
    """
    if num_prompt_tokens <= 0:
        raise ValueError(f"a request needs at least one prompt token, got {num_prompt_tokens}")
    if shared_prefix_tokens is not None and shared_prefix_tokens < 0:
        raise ValueError(f"shared_prefix_tokens must be >= 0, got {shared_prefix_tokens}")
    junction = shared_prefix_tokens or None
    cached = rules.cached_blocks(num_prompt_tokens, junction)
    groups = tuple(
        _plan_group(rules, group, num_prompt_tokens, cached[group.group_id], replay_slack) for group in rules.groups
    )
    plan = RequestPlan(
        num_prompt_tokens=num_prompt_tokens,
        alignment=rules.alignment,
        replay_boundaries=rules.replay_boundaries(num_prompt_tokens),
        replay_slack=replay_slack,
        groups=groups,
        shared_prefix_tokens=junction,
    )
    if not expected_hits:
        return plan
    on_decode = plan.decode_cached_blocks()
    # The extension sibling adds one alignment of new tokens: enough that the lookup is
    # capped by the shared content rather than by the sibling's own length.
    longer = num_prompt_tokens + rules.alignment
    return replace(
        plan,
        expected_sibling_hit_tokens=rules.lookup_hit(on_decode, num_prompt_tokens, longer),
        expected_resend_hit_tokens=rules.lookup_hit(on_decode, num_prompt_tokens, num_prompt_tokens),
        expected_junction_hit_tokens=(
            None
            if junction is None
            else rules.lookup_hit(on_decode, min(junction + rules.alignment, num_prompt_tokens), longer)
        ),
    )
