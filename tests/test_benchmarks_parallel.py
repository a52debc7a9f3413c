"""`benchmarks.parallel`'s pure parts and `benchmarks.rank_bytes`: the bytes a decode rank
needs, read from the model's geometry, and each rank's pulled bytes read from /metrics text. Expected figures are
worked out by hand below, never by the code under test."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from benchmarks.parallel import (
    SHAPES,
    ShapeResult,
    _engine_names,
    _keep_for,
    _parse_shapes,
    admission_order,
    engine_ranks,
    format_results,
    last_error_line,
    model_spec,
    order_changes,
)
from benchmarks.rank_bytes import (
    RankBytes,
    heads_per_rank,
    model_geometry,
    needed_bytes_per_rank,
    rank_bytes_between,
)
from pdconnect.bench.loadgen import RoleCounters, StepResult
from pdconnect.bench.scrape import MetricsSnapshot
from pdconnect.testbed.recipes import SPEC

# The tiny hybrid Llama's config.json (pdconnect.testbed.tinymodel SPEC), the fields read.
TINY_LLAMA = {
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_size": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
GEOMETRY = model_geometry(TINY_LLAMA, block_size=128, dtype="float32")
# One block of one group (2 layers), K and V, both heads, float32: 2 * 2 * 128 * 2 * 32 * 4.
BLOCK_BYTES_TP1 = 131072


def test_the_tiny_llama_geometry_is_two_groups_of_two_layers():
    assert [(g.kind, g.layers, g.kv_heads, g.head_dim) for g in GEOMETRY.groups] == [
        ("full_attention", 2, 2, 32),
        ("sliding_attention", 2, 2, 32),
    ]
    assert GEOMETRY.dtype_bytes == 4


def test_a_config_without_layer_types_is_all_full_attention_and_head_dim_defaults():
    config = {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512}
    geometry = model_geometry(config, block_size=16, dtype="bfloat16")
    assert [(g.kind, g.layers, g.head_dim) for g in geometry.groups] == [("full_attention", 3, 64)]
    # 2 (K, V) * 3 layers * 16 tokens * 8 heads * 64 * 2 bytes, one block, TP1.
    assert needed_bytes_per_rank(geometry, 1, {"full_attention": 1}) == 98304


@pytest.mark.parametrize(
    ("tp", "blocks", "want"),
    [
        (1, {"full_attention": 6, "tail": 2, "slack": 1}, 9 * BLOCK_BYTES_TP1),
        (2, {"full_attention": 6, "tail": 2, "slack": 1}, 9 * 65536),  # one of 2 heads per rank
        (2, {"full_attention": 6}, 6 * 65536),
        (4, {"full_attention": 1}, 65536),  # 2 heads over 4 ranks: one replicated head each
        (4, {"full_attention": 3, "tail": 1}, 4 * 65536),  # the same, 4 blocks
    ],
)
def test_needed_bytes_per_rank_by_hand(tp: int, blocks: dict[str, float], want: int):
    assert needed_bytes_per_rank(GEOMETRY, tp, blocks) == want


def test_heads_per_rank_splits_replicates_and_refuses():
    assert [heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ValueError, match="do not split"):
        heads_per_rank(3, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        heads_per_rank(2, 3)


def test_blocks_of_a_group_the_model_lacks_are_refused():
    full_only = model_geometry({**TINY_LLAMA, "layer_types": ["full_attention"] * 4}, 128, "float32")
    with pytest.raises(ValueError, match="no sliding_attention layers"):
        needed_bytes_per_rank(full_only, 1, {"tail": 1})


def _metrics(rank_bytes: dict[tuple[str, str], float], blocks: dict[str, dict[str, float]]) -> MetricsSnapshot:
    lines = ["# TYPE pdconnect:rank_bytes_transferred counter"]
    lines += [
        f'pdconnect:rank_bytes_transferred_total{{engine="{e}",model_name="tiny",tp_rank="{r}"}} {v}'
        for (e, r), v in rank_bytes.items()
    ]
    for kind in ("full_attention", "tail", "slack"):
        lines.append(f"# TYPE pdconnect:blocks_{kind} counter")
        lines += [
            f'pdconnect:blocks_{kind}_total{{engine="{e}",model_name="tiny"}} {counts.get(kind, 0)}'
            for e, counts in blocks.items()
        ]
    return MetricsSnapshot.parse("\n".join(lines) + "\n")


def test_each_tp_rank_pulled_against_needed_and_a_duplicate_block_shows():
    before = _metrics({("0", "0"): 1000, ("0", "1"): 1000}, {"0": {"full_attention": 2}})
    # 6 full, 2 tail, 1 slack blocks, counted by both ranks; rank 1 pulled one block twice.
    after = _metrics(
        {("0", "0"): 1000 + 9 * 65536, ("0", "1"): 1000 + 10 * 65536},
        {"0": {"full_attention": 2 + 12, "tail": 4, "slack": 2}},
    )
    assert rank_bytes_between(before, after, GEOMETRY, tp_size=2) == [
        RankBytes("0", "0", 9 * 65536, 9 * 65536),
        RankBytes("0", "1", 10 * 65536, 9 * 65536),
    ]
    assert [r.excess for r in rank_bytes_between(before, after, GEOMETRY, tp_size=2)] == [0, 65536]


def test_a_data_parallel_rank_that_pulled_nothing_is_still_owed_its_blocks():
    before = _metrics({}, {"0": {}, "1": {}})
    after = _metrics({("0", "0"): 2 * BLOCK_BYTES_TP1}, {"0": {"full_attention": 2}, "1": {"full_attention": 1}})
    assert rank_bytes_between(before, after, GEOMETRY, tp_size=1) == [
        RankBytes("0", "0", 2 * BLOCK_BYTES_TP1, 2 * BLOCK_BYTES_TP1),
        RankBytes("1", "0", 0, BLOCK_BYTES_TP1),
    ]


def test_shapes_parse_and_map_to_engines():
    assert _parse_shapes("tp2-tp1, tp1-dp2") == ["tp2-tp1", "tp1-dp2"]
    with pytest.raises(argparse.ArgumentTypeError, match="subset of"):
        _parse_shapes("tp8-tp1")
    # (prefill, decode, colocated reference) by shape.
    expected = {
        # Equal TP: a second engine of the shape; vLLM's NixlConnector on engines of its own.
        "tp2-tp2": ("ours-tp2", "ours-tp2b", "colocated-tp2"),
        "tp1-tp2": ("ours-tp1", "ours-tp2", "colocated-tp2"),
        "nixl-tp2-tp1": ("nixl-tp2", "nixl-tp1", "colocated-tp1"),
        # The 4-KV-head model's engines are others than the default model's of the same TP.
        "tp1-tp4-kv4": ("ours-tp1@kv4", "ours-tp4@kv4", "colocated-tp4@kv4"),
        "nixl-tp1-tp4-kv4": ("nixl-tp1@kv4", "nixl-tp4@kv4", "colocated-tp4@kv4"),
        # Data parallelism on either side (a DP decode's reference has one rank's TP).
        "tp1-dp2": ("ours-tp1", "decode-dp2", "colocated-tp1"),
        "tp2-dp2xtp2": ("ours-tp2", "decode-dp2tp2", "colocated-tp2"),
        "dp2-dp2": ("prefill-dp2", "decode-dp2", "colocated-tp1"),
        # Our connector over NIXL: engines of their own, TP and DP.
        "tp4-tp1-ournixl": ("ournixl-tp4", "ournixl-tp1", "colocated-tp1"),
        "dp2-tp2-ournixl": ("nixlprefill-dp2", "ournixl-tp2", "colocated-tp2"),
    }
    assert {name: _engine_names(SHAPES[name]) for name in expected} == expected
    assert SHAPES["tp2-dp2xtp2"].label == "P TP2 -> D DP2xTP2, 2 KV heads (ours, Mooncake)"
    assert SHAPES["tp1-tp4-kv4-ournixl"].label == "P TP1 -> D TP4, 4 KV heads (ours, NIXL)"


def test_idle_engines_are_kept_for_later_shapes_only_within_the_rank_budget():
    assert [engine_ranks(n) for n in ("ours-tp4@kv4", "ours-tp2b", "colocated-tp1", "decode-dp2")] == [4, 2, 1, 2]
    assert [engine_ranks(n) for n in ("decode-dp2tp2", "decode-dp4", "nixlprefill-dp2", "ournixl-tp4@kv4")] == [
        4,
        4,
        2,
        4,
    ]
    # What was alive when a worker was OOM-killed: 13 ranks with tp4-tp2-kv4's own.
    started = ["ours-tp4@kv4", "colocated-tp4@kv4", "colocated-tp1", "ours-tp1@kv4"]
    rest = [SHAPES[n] for n in ("tp4-tp2-kv4", "nixl-tp4-tp1", "nixl-tp1-tp4-kv4")]
    # Its own 8 ranks, then colocated-tp1 (nixl-tp4-tp1 needs it: 9); the idle TP4 would make 13.
    assert _keep_for(rest, started, budget=10) == {"ours-tp4@kv4", "ours-tp2@kv4", "colocated-tp2@kv4", "colocated-tp1"}
    assert "colocated-tp4@kv4" in _keep_for(rest, started, budget=13)
    # The TP2 shapes fit whole: 6 ranks of tp2-tp2's, then the TP1 pair's 2.
    rest = [SHAPES[n] for n in ("tp2-tp2", "tp2-tp1", "tp1-tp2")]
    started = ["ours-tp2", "ours-tp2b", "colocated-tp2", "ours-tp1", "colocated-tp1"]
    assert _keep_for(rest, started, budget=10) == set(started)


def test_the_four_head_model_splits_one_head_per_rank_at_tp4():
    spec = model_spec(4)
    assert (spec.num_kv_heads, spec.num_heads) == (4, 4)
    assert model_spec(2) == SPEC  # the default shapes run the testbed's own tiny model
    config = {**TINY_LLAMA, "num_key_value_heads": 4}
    geometry = model_geometry(config, block_size=128, dtype="float32")
    # One full-attention block, 2 layers, K and V, 128 tokens, one head of 32 float32 per rank.
    assert needed_bytes_per_rank(geometry, 4, {"full_attention": 1}) == 2 * 2 * 128 * 1 * 32 * 4
    # At TP2 each rank holds two of the four heads.
    assert needed_bytes_per_rank(geometry, 2, {"full_attention": 1}) == 2 * 2 * 128 * 2 * 32 * 4


def test_a_shape_that_did_not_run_prints_its_reason_and_the_engines_last_error():
    log = "INFO starting\nERROR worker: AssertionError: heterogeneous TP needs a device buffer\nINFO shutting down\n"
    reason = last_error_line(log)
    assert reason == "ERROR worker: AssertionError: heterogeneous TP needs a device buffer"
    table = format_results([ShapeResult(SHAPES["nixl-tp1-tp2"], error=reason)])
    assert "P TP1 -> D TP2, 2 KV heads (vLLM NixlConnector)" in table and "not run: ERROR worker" in table
    assert last_error_line("INFO all fine\n") is None


def test_the_engines_reason_is_its_exception_not_an_access_log_line():
    # vLLM 0.32's NixlConnector at P TP4 -> D TP1 with replicated heads, as its log reads.
    log = (
        '(Worker pid=1) ERROR [base_worker.py:1354]   File "/x/nixl/base_worker.py", line 2450, in '
        "_validate_remote_agent_handshake\n"
        "(Worker pid=1) ERROR [base_worker.py:1354]     tp_ratio < 0 and self.transfer_topo.is_kv_replicated(e)\n"
        "(Worker pid=1) ERROR [base_worker.py:1354] AssertionError\n"
        'INFO:     127.0.0.1:52474 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
    )
    assert last_error_line(log) == (
        "(Worker pid=1) ERROR [base_worker.py:1354] AssertionError "
        "(at base_worker.py line 2450, in _validate_remote_agent_handshake)"
    )


# What vLLM 0.32's API server logs with --enable-log-requests, one line per request as it
# arrives (the router's X-Request-Id inside `cmpl-...-0`), among other lines.
DECODE_LOG = """\
(APIServer pid=7) INFO 12-05 04:40:01 [request_logger.py:66] Received request cmpl-warm-0: params: SamplingParams(n=1)
(APIServer pid=7) INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK
(APIServer pid=7) INFO 12-05 04:40:02 [request_logger.py:66] Received request cmpl-bb-0: params: SamplingParams(n=1)
(EngineCore pid=8) INFO [consumer.py:414] request cmpl-cc-0: waits for the load of cmpl-bb-0
(APIServer pid=7) INFO 12-05 04:40:02 [request_logger.py:66] Received request cmpl-aa-0: params: SamplingParams(n=1)
(APIServer pid=7) INFO 12-05 04:40:02 [request_logger.py:66] Received request cmpl-cc-r1-0: params: SamplingParams(n=1)
(APIServer pid=7) INFO 12-05 04:40:03 [request_logger.py:66] Received request cmpl-dd-0: params: SamplingParams(n=1)
"""


def test_the_decode_admission_order_is_read_from_its_request_log_by_the_routers_ids():
    # Prompt order aa, bb, cc-r1, dd, ee; ee never reached decode, the 6th got no id back.
    ids = ("aa", "bb", "cc-r1", "dd", "ee", "")
    assert admission_order(DECODE_LOG, ids) == [1, 0, 2, 3, 4, 5]
    assert admission_order(DECODE_LOG, ("xx", "yy")) is None  # nothing to go by: replay as sent
    assert admission_order("", ids) is None


def test_order_changes_name_each_group_whose_siblings_decode_admitted_out_of_send_order():
    groups = (0, 1, 0, 1, 0, 1)
    assert order_changes(groups, ()) == []  # as sent
    assert order_changes(groups, [1, 0, 3, 2, 5, 4]) == []  # only groups interleaved differently
    assert order_changes(groups, [2, 0, 1, 3, 4, 5]) == ["group 0: sent [0, 2, 4], decode admitted [2, 0, 4]"]


def _step(groups: tuple[int, ...], reference_order: tuple[int, ...]) -> StepResult:
    n, one = len(groups), RoleCounters(engines=1)
    # scenario, step, requests, concurrency, output_len, ok, fallbacks, prompt and output tokens, wall, TTFTs
    step = StepResult("shared-prefix", "s", n, 3, 8, n, 0, 0, 0, 1.0, (0.1,) * n, decode=one, prefill=one)
    return dataclasses.replace(
        step, reference=one, reference_same_outputs=n, groups=groups, reference_order=reference_order
    )


def test_the_table_says_whether_decode_received_siblings_in_the_order_sent():
    shape = SHAPES["tp1-tp4"]
    groups = (0, 0, 1, 1)
    rows = format_results(
        [
            ShapeResult(shape, _step(groups, ()), order_known=True),
            ShapeResult(shape, _step(groups, (1, 0, 2, 3)), order_known=True),
            ShapeResult(shape, _step(groups, (1, 0, 3, 2)), order_known=True),
            ShapeResult(shape, _step(groups, ()), order_known=False),
        ]
    ).splitlines()
    assert "D order" in rows[0]
    cells = [re.split(r"\s{2,}", row)[4] for row in rows[2:]]
    assert cells == ["as sent", "1 group differs", "2 groups differ", "unknown"]
