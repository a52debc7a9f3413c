"""`make bench-routing`'s pure pieces, no engine: the load bound it holds our policies to, the
arguments it starts engines and routers with, how it reads load from /metrics, when it fails,
and the table and verdicts it prints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.routing import (
    VARIANTS,
    EngineFigures,
    EngineSpec,
    EventsView,
    ScenarioRun,
    consistency_problems,
    format_events_view,
    format_ratios,
    format_routing_table,
    goal_verdicts,
    in_flight_by_engine,
    kv_events_config,
    load_bound,
    parse_args,
    pdconnect_router_args,
    requests_in_flight,
    requests_served,
    router_kv_events_config,
    setup_from_args,
    vllm_router_argv,
)
from pdconnect.bench.loadgen import RoleCounters, StepResult
from pdconnect.bench.scenarios import PrefixRepetitionScenario
from pdconnect.bench.scrape import MetricsSnapshot, PrefixCacheCounters
from pdconnect.router.options import parse_args as parse_router_args
from pdconnect.router.policy import LoadBound
from tests.waiting import wait_until

# --- the load bound ---------------------------------------------------------------------------


def test_load_bound_is_the_factor_times_the_mean_of_what_the_client_keeps_in_flight() -> None:
    assert load_bound(LoadBound(1.5, floor=1), concurrency=4, engines=2) == 3  # ceil(1.5 * 4 / 2)
    assert load_bound(LoadBound(1.25, floor=1), concurrency=8, engines=2) == 5
    assert load_bound(LoadBound(1.5, floor=1), concurrency=2, engines=2) == 2
    assert load_bound(LoadBound(3.0, floor=1), concurrency=2, engines=2) == 2  # never above the concurrency
    # The floor: below it the factor's bound does not apply; above it, it does.
    assert load_bound(LoadBound(1.5, floor=8), concurrency=4, engines=2) == 4
    assert load_bound(LoadBound(1.5, floor=8), concurrency=12, engines=2) == 9
    assert load_bound(LoadBound(1.5, floor=8), concurrency=10, engines=2) == 8
    with pytest.raises(ValueError):
        load_bound(LoadBound(), concurrency=0, engines=2)


# --- process arguments --------------------------------------------------------------------------


def _engines() -> tuple[EngineSpec, ...]:
    return (
        EngineSpec("prefill", 0, 8100, 9100, 9101),
        EngineSpec("prefill", 1, 8101, 9102, 9103),
        EngineSpec("decode", 0, 8200, 9200, 9201),
        EngineSpec("decode", 1, 8201, 9202, 9203),
    )


def test_engines_bind_their_event_sockets_which_vllm_does_only_for_wildcard_endpoints() -> None:
    config = kv_events_config(9100, 9101)
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:9100",
        "replay_endpoint": "tcp://*:9101",
    }


def test_kv_aware_router_config_names_every_engines_own_endpoints_and_is_accepted_by_the_router(tmp_path: Path) -> None:
    engines = _engines()
    data = router_kv_events_config(engines)
    assert data["kv_events_endpoints"]["http://127.0.0.1:8200"] == ["tcp://127.0.0.1:9200", "tcp://127.0.0.1:9201"]
    assert set(data["kv_events_endpoints"]) == {e.url for e in engines}
    path = tmp_path / "router.json"
    path.write_text(json.dumps(data))
    args = pdconnect_router_args(VARIANTS["kv-aware"], tokenizer=tmp_path, load=LoadBound(1.5, 6), config=path)
    # What cluster.router_server puts before them, then ours: the router's own parser accepts it all.
    config = parse_router_args(
        ["--prefill", *[e.url for e in engines[:2]], "--decode", *[e.url for e in engines[2:]], *args]
    )
    assert config.policy == "kv-aware" and config.tokenizer == str(tmp_path)
    assert config.kv_events_endpoints["http://127.0.0.1:8101"] == ["tcp://127.0.0.1:9102", "tcp://127.0.0.1:9103"]
    assert config.affinity_load_factor == 1.5 and config.affinity_min_load == 6 and config.fallback is False


def test_affinity_router_gets_the_tokenizer_and_no_events_config(tmp_path: Path) -> None:
    args = pdconnect_router_args(VARIANTS["affinity"], tokenizer=tmp_path, load=LoadBound(2.0, 3), config=None)
    config = parse_router_args(["--decode", "http://127.0.0.1:8200", *args])
    assert config.policy == "prefix-affinity" and config.affinity_load_factor == 2.0 and config.affinity_min_load == 3
    assert "--config" not in args and config.tokenizer == str(tmp_path)


def test_vllm_router_runs_in_pd_mode_with_one_policy_for_both_roles() -> None:
    argv = vllm_router_argv(
        Path("/bin/vllm-router"),
        VARIANTS["consistent-hash"],
        prefill=["http://p0", "http://p1"],
        decode=["http://d0", "http://d1"],
        port=30001,
        prometheus_port=30002,
    )
    assert argv[:2] == ("/bin/vllm-router", "--vllm-pd-disaggregation")
    text = " ".join(argv)
    assert "--prefill http://p0 --prefill http://p1 --decode http://d0 --decode http://d1" in text
    assert "--policy consistent_hash" in text and "--prometheus-port 30002" in text
    assert VARIANTS["cache-aware"].policy == "cache_aware"


# --- load from /metrics -------------------------------------------------------------------------


def test_engine_load_is_running_plus_waiting_from_vllm_gauges() -> None:
    snapshot = MetricsSnapshot.parse(
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0\n'
    )
    assert requests_in_flight(snapshot) == 3


def test_requests_served_count_every_finish_reason() -> None:
    snapshot = MetricsSnapshot.parse(
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 7.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0\n'
    )
    assert requests_served(snapshot) == 9


def test_router_load_is_read_per_engine_url() -> None:
    snapshot = MetricsSnapshot.parse(
        "# TYPE pdconnect_router_engine_in_flight gauge\n"
        'pdconnect_router_engine_in_flight{engine="http://127.0.0.1:8200",role="decode"} 3.0\n'
        'pdconnect_router_engine_in_flight{engine="http://127.0.0.1:8100",role="prefill"} 0.0\n'
    )
    assert in_flight_by_engine(snapshot) == {"http://127.0.0.1:8200": 3, "http://127.0.0.1:8100": 0}


# --- argument parsing ---------------------------------------------------------------------------


def test_defaults_run_both_scenarios_through_all_four_variants_with_seeds_s_and_s_plus_one() -> None:
    setup = setup_from_args(parse_args([]))
    assert setup.variants == ("kv-aware", "affinity", "cache-aware", "consistent-hash")
    (pr, pr_seed, _pr_format), (mt, mt_seed, mt_format) = setup.scenarios
    assert (pr.name, mt.name) == ("prefix-repetition", "multi-turn")
    assert mt_seed == pr_seed + 1 and mt_format == "ids"
    # More prefixes than decode engines, and the router's own load bound.
    assert isinstance(pr, PrefixRepetitionScenario)
    assert pr.num_prefixes > 2 and setup.load == LoadBound()


def test_scenario_sizes_and_variants_come_from_the_command_line() -> None:
    setup = setup_from_args(
        parse_args(
            [
                "--variants",
                "affinity",
                "cache-aware",
                "--seed",
                "7",
                "--prompt-format",
                "text",
                "--prefix-repetition-num-requests",
                "32",
                "--prefix-repetition-concurrency",
                "8",
                "--multi-turn-turns",
                "5",
                "--no-prefix-repetition-shuffle",
                "--affinity-load-factor",
                "1.25",
                "--affinity-min-load",
                "2",
            ]
        )
    )
    assert setup.variants == ("affinity", "cache-aware") and setup.seed == 7
    assert setup.prefix_repetition.num_requests == 32 and setup.prefix_repetition.concurrency == 8
    assert setup.prefix_repetition.shuffle is False and setup.multi_turn.turns == 5
    assert setup.prefix_repetition_format == "text" and setup.scenarios[1][2] == "ids"
    assert setup.load == LoadBound(1.25, 2)


@pytest.mark.parametrize(
    "argv",
    [
        ["--affinity-load-factor", "0.9"],
        ["--affinity-min-load", "0"],
        ["--sample-interval", "0"],
        ["--multi-turn-question-len-jitter", "500"],
    ],
)
def test_impossible_setups_are_refused(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        setup_from_args(parse_args(argv))


def test_unknown_variant_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--variants", "round-robin"])


# --- results, table, verdicts -------------------------------------------------------------------


def _step(
    requests: int,
    ok: int,
    d_local: float,
    pulled: float,
    p_local: float,
    ttfts: tuple[float, ...],
    errors: tuple[str, ...] = (),
) -> StepResult:
    def role(hits: float, external: float) -> RoleCounters:
        return RoleCounters(engines=2, cache=PrefixCacheCounters(0.0, hits, 0.0, external))

    return StepResult(
        scenario="x",
        step="s",
        requests=requests,
        concurrency=4,
        output_len=16,
        ok=ok,
        fallbacks=0,
        prompt_tokens=0,
        output_tokens=0,
        duration_s=1.0,
        ttft_s=ttfts,
        decode=role(d_local, pulled),
        prefill=role(p_local, 0.0),
        errors=errors,
    )


def _run(
    key: str,
    scenario: str,
    d_local: float,
    *,
    ok: int = 16,
    requests: int = 16,
    loads: tuple[int, int, int, int] = (1, 1, 2, 2),
    router_loads: tuple[int, ...] | None = None,
) -> ScenarioRun:
    variant = VARIANTS[key]
    specs = _engines()
    router = router_loads if variant.ours else None
    engines = tuple(
        EngineFigures(
            role=s.role,
            name=s.name,
            url=s.url,
            cache=PrefixCacheCounters(0, 0, 0, 0),
            max_in_flight=load,
            router_max_in_flight=None if router is None else router[i],
            requests=(8, 8, 11, 5)[i],
        )
        for i, (s, load) in enumerate(zip(specs, loads, strict=True))
    )
    step = _step(
        requests,
        ok,
        d_local,
        17408 - d_local,
        5000,
        (0.1, 0.2, 0.3, 0.4, 0.5),
        errors=("HTTP 500: boom",) if ok < requests else (),
    )
    return ScenarioRun(
        variant=variant.label,
        scenario=scenario,
        concurrency=4,
        steps=(step,),
        engines=engines,
        bound={"prefill": 3, "decode": 3} if variant.ours else None,
    )


def _all(scores: dict[str, float], **kw: Any) -> list[ScenarioRun]:
    return [_run(k, "prefix-repetition", v, router_loads=(1, 1, 2, 2), **kw) for k, v in scores.items()]


def test_table_has_one_row_per_variant_and_scenario_with_loads_per_engine_and_our_bound() -> None:
    runs = _all({"kv-aware": 10752, "affinity": 10752, "cache-aware": 9856, "consistent-hash": 8064})
    table = format_routing_table(runs)
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert "D-local hit" in lines[0] and "TTFT p90" in lines[0] and "bound P/D" in lines[0]
    kv, _, vllm_row, _ = lines[2:]
    assert "pdconnect kv-aware" in kv and "10752" in kv and "16/0" in kv and "3/3" in kv
    # Where requests went, the load vLLM saw, and our router's own count, per engine.
    assert "8/8 11/5" in kv and kv.count("1/1 2/2") == 2
    assert "300 ms" in kv and "460 ms" in kv  # p50, p90 of 100..500 ms
    assert "vllm-router cache_aware" in vllm_row and vllm_row.rstrip().endswith("-")


def test_ratios_divide_decode_local_hits_of_the_pairs_the_issue_names() -> None:
    runs = _all({"kv-aware": 10752, "affinity": 8960, "cache-aware": 8960, "consistent-hash": 0})
    table = format_ratios(runs)
    header, _, row = table.splitlines()
    assert "kv-aware/affinity" in header and "affinity/vllm-router consistent_hash" in header
    assert row.split()[1:] == ["1.20x", "1.00x", "inf"]


def test_goal_verdict_names_the_comparison_that_failed() -> None:
    met = goal_verdicts(_all({"kv-aware": 10752, "affinity": 10752, "cache-aware": 9856, "consistent-hash": 9856}))
    assert met[0].startswith("prefix-repetition: GOAL MET")
    assert "no engine over its bound" in met[-1]
    missed = goal_verdicts(_all({"kv-aware": 8960, "affinity": 10752, "cache-aware": 9856, "consistent-hash": 0}))
    assert "GOAL NOT MET" in missed[0] and "kv-aware >= affinity: NO" in missed[0]
    assert "affinity >= vllm-router cache_aware: yes" in missed[0]


def test_an_engine_over_its_bound_is_reported_with_which_count_saw_it() -> None:
    runs = [_run("affinity", "prefix-repetition", 100, loads=(1, 1, 4, 1), router_loads=(1, 1, 3, 1))]
    lines = goal_verdicts(runs)
    assert any(
        "OVER THE LOAD BOUND" in line and "routing-decode0 4 > 3" in line and "router's count: none" in line
        for line in lines
    )


def test_a_failed_request_or_a_different_request_count_fails_the_run() -> None:
    assert consistency_problems(_all({"kv-aware": 1, "affinity": 1})) == []
    failed = consistency_problems([_run("kv-aware", "multi-turn", 0, ok=15), _run("affinity", "multi-turn", 0)])
    assert any("1 of 16 requests failed" in p and "HTTP 500" in p for p in failed)
    assert any("served different numbers of requests across variants" in p for p in failed)


def test_json_record_carries_the_figures_and_the_load_source() -> None:
    run = _run("kv-aware", "multi-turn", 512, router_loads=(0, 1, 2, 3))
    data = run.to_json()
    assert data["decode_local_hit_tokens"] == 512 and data["failed"] == 0
    assert "vllm:num_requests_running" in data["in_flight_source"]
    assert [e["router_max_in_flight"] for e in data["engines"]] == [0, 1, 2, 3]
    assert math.isclose(data["ttft_p90_s"], 0.46)
    json.dumps(data)


# --- what kv-aware can see ----------------------------------------------------------------------


def test_events_view_reports_what_the_routers_own_index_makes_of_the_published_events() -> None:
    """Fed what a decode engine publishes after a remote load with replay slack (the full-attention
    blocks from the start, the sliding-window run from the window tail only, its parent a block
    that engine never stored), the view shows per group what the router's index holds and drops,
    and the hit it reports: the same as an index fed the batch directly."""
    import msgspec
    import zmq

    from pdconnect.router.kvindex import EngineKVIndex
    from pdconnect.router.kvwire import BlockStored, KVEventBatch
    from pdconnect.router.prompt import RoutingPrompt

    tokens = list(range(100, 100 + 4 * 128))
    full = BlockStored(
        block_hashes=[1, 2, 3, 4], token_ids=tokens, block_size=128, group_idx=1, kv_cache_spec_kind="full_attention"
    )
    window = BlockStored(
        block_hashes=[3, 4],
        parent_block_hash=2,
        token_ids=tokens[256:],
        block_size=128,
        group_idx=0,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
    )
    batch = KVEventBatch(ts=0.0, events=[window, full])
    reference = EngineKVIndex()
    reference.apply(batch)
    encode = msgspec.msgpack.Encoder().encode
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    spec = EngineSpec("decode", 0, 8200, port, port + 1)
    seq = 0

    def publish(batch: KVEventBatch) -> None:
        nonlocal seq
        publisher.send_multipart([b"", seq.to_bytes(8, "big"), encode(batch)])
        seq += 1

    try:
        with EventsView([spec]) as view:

            def batches() -> int:
                return int(view.summary([])[spec.name]["batches"])

            def heard_an_empty_batch() -> bool:  # SUB joins asynchronously: publish until heard
                publish(KVEventBatch(ts=0.0, events=[]))
                return batches() > 0

            wait_until(heard_an_empty_batch, "the view to hear the publisher", observe=batches)
            publish(batch)

            def groups() -> list[object]:
                return list(view.summary([tokens])[spec.name]["groups"])

            # Not "one more batch heard": empty batches published while the SUB joined may
            # still be queued behind the one heard. Only the batch itself fills a group.
            wait_until(lambda: bool(groups()), "the view to take in the batch", observe=batches)
            seen = view.summary([tokens])[spec.name]
    finally:
        publisher.close(linger=0)
        context.term()
    assert seen["groups"] == [
        {"group": g, "sliding_window": gi.sliding_window, "blocks": len(gi.present), "orphan_stores": gi.orphans}
        for g, gi in sorted(reference.groups.items())
    ]
    assert seen["groups"][1] == {"group": 1, "sliding_window": None, "blocks": 4, "orphan_stores": 0}
    assert seen["index_hit_tokens"] == reference.hit_tokens(RoutingPrompt(tokens))
    run = _run("kv-aware", "prefix-repetition", 896)
    [decode0] = [e for e in run.engines if e.name == spec.name]
    table = format_events_view({spec.name: seen}, run)
    assert "g1 full 4/0" in table and "index hit" in table and table.splitlines()[-1].split()[-1] == "0"
    assert decode0.cache.hits == 0
