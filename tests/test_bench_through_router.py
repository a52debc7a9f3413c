"""`pdconnect bench` through the real router in front of fake engines: auth, TPOT and ITL, open loop, request ids."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from pdconnect.bench import cli
from pdconnect.bench.loadgen import (
    Deployment,
    LoadGenerator,
    RequestResult,
    RunResult,
    in_prompt_order,
    poisson_arrivals,
    reordered,
    replay_order,
)
from pdconnect.bench.report import format_run, write_json
from pdconnect.bench.scenarios import Step
from tests.router_support import start_setup

KEY = "bench-test-key"
STEP = Step("keyed", prompts=((11, 12, 13, 14),), output_len=2)


async def _step_ok(router: str, headers: tuple[tuple[str, str], ...]) -> bool:
    deployment = Deployment(router=router, model="fake-model", headers=headers)
    async with LoadGenerator(deployment, progress=False) as generator:
        result = await generator.run_step("headers", STEP)
    return result.ok == result.requests


@pytest.mark.asyncio
async def test_the_bench_sends_its_authorization_header_to_engines_that_want_a_key() -> None:
    """Fake engines (like `vllm serve --api-key`) behind the real router: without the
    header every request is refused, with the one `--header` gives it is served."""
    setup = await start_setup()
    try:
        for engine in setup.p + setup.d:
            engine.api_key = KEY
        assert not await _step_ok(setup.router.url, ())
        headers = cli._headers([f"Authorization: Bearer {KEY}"])
        assert headers == (("Authorization", f"Bearer {KEY}"),)
        assert await _step_ok(setup.router.url, headers)
    finally:
        await setup.http.close()
        await setup.router.close()
        await setup.fakes.close()


@pytest.mark.parametrize("bad", ["Authorization", ": x", " Authorization: x"])
def test_a_malformed_header_is_refused_with_its_text(bad: str) -> None:
    with pytest.raises(ValueError, match="expected 'NAME: VALUE'"):
        cli._headers([bad])


@pytest.mark.asyncio
async def test_each_request_reports_its_inter_token_gaps_and_the_step_its_tpot() -> None:
    """The fake engines stream one token per event (8 by default) through the real
    router: 7 gaps per request, and a TPOT for every request of two tokens or more."""
    setup = await start_setup()
    try:
        chunks = setup.d[0].chunks
        deployment = Deployment(router=setup.router.url, model="fake-model")
        step = Step("stream", prompts=((21, 22, 23), (31, 32, 33)), output_len=chunks)
        async with LoadGenerator(deployment, progress=False) as generator:
            result = await generator.run_step("stream", step)
        assert result.ok == 2, result.errors
        assert len(result.itl_s) == 2 * (chunks - 1)
        assert len(result.tpot_s) == 2
        assert "TPOT mean" in format_run(RunResult("stream", (result,)))
    finally:
        await setup.http.close()
        await setup.router.close()
        await setup.fakes.close()


def test_poisson_arrivals_start_at_once_and_average_one_over_the_rate() -> None:
    arrivals = poisson_arrivals(4001, 20.0, random.Random(7))
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert arrivals[0] == 0.0 and min(gaps) >= 0.0
    # 4000 exponential gaps of mean 50 ms: their mean is within 5% (about 3 sigma).
    assert abs(sum(gaps) / len(gaps) - 0.05) < 0.0025
    assert poisson_arrivals(5, 20.0, random.Random(7)) == arrivals[:5]  # a seed is a schedule
    with pytest.raises(ValueError, match="positive"):
        poisson_arrivals(3, 0.0, random.Random(7))


@pytest.mark.asyncio
async def test_open_loop_serves_every_request_in_arrival_order_under_its_in_flight_cap() -> None:
    """Open loop, 6 Poisson arrivals, at most 2 in flight: every request is served and
    sent in arrival order (the schedule itself: the test above; no timing is asserted),
    and each result carries the router's request id."""
    setup = await start_setup()
    try:
        deployment = Deployment(router=setup.router.url, model="fake-model")
        step = Step("open", prompts=tuple((40 + i, 41, 42) for i in range(6)), output_len=2, concurrency=2)
        async with LoadGenerator(deployment, progress=False, request_rate=50.0, arrival_seed=3) as generator:
            result = await generator.run_step("open", step)
        assert result.ok == 6, result.errors
        assert sorted(range(6), key=lambda i: result.sent_s[i]) == list(range(6))
        # Each request's id is the one the router sent the decode engine with its prompt.
        decoded = {seen.request_id: tuple(seen.body["prompt"]) for seen in setup.d[0].seen}
        assert [decoded[rid] for rid in result.request_ids] == list(step.prompts)
    finally:
        await setup.http.close()
        await setup.router.close()
        await setup.fakes.close()


@pytest_asyncio.fixture
async def measured_run() -> RunResult:
    """One step measured through the real router, as `pdconnect bench` records it."""
    setup = await start_setup()
    try:
        deployment = Deployment(router=setup.router.url, model="fake-model")
        async with LoadGenerator(deployment, progress=False) as generator:
            result = await generator.run_step("charted", STEP)
        return RunResult("charted", (result,))
    finally:
        await setup.http.close()
        await setup.router.close()
        await setup.fakes.close()


@pytest.mark.asyncio
async def test_compare_draws_the_demos_chart_or_says_why_not(
    measured_run: RunResult, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [tmp_path / "on.json", tmp_path / "off.json"]
    for path in files:
        write_json(path, [measured_run])
    chart = tmp_path / "chart.png"
    assert cli.main(["compare", *map(str, files), "--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart: {chart}" in capsys.readouterr().out
    # Without matplotlib (the bench extra) the comparison still prints, and says so.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    missing = tmp_path / "missing.png"
    assert cli.main(["compare", *map(str, files), "--chart", str(missing)]) == 0
    assert not missing.exists()
    assert "no chart: matplotlib is not installed" in capsys.readouterr().err


def test_a_reference_replays_a_step_in_the_order_given_and_its_results_come_back_in_prompt_order() -> None:
    step = Step("s", prompts=((1,), (2,), (3,), (4,)), output_len=1, concurrency=3, groups=(0, 1, 0, 1))
    order = replay_order([2, 0, 3, 1], 4)
    replay = reordered(step, order)
    assert replay.prompts == ((3,), (1,), (4,), (2,)) and replay.groups == (0, 0, 1, 1)
    sent = [RequestResult(True, 0.1, output_ids=p) for p in replay.prompts]
    assert [r.output_ids for r in in_prompt_order(sent, order)] == list(step.prompts)
    # The order sent, or none: replayed as sent.
    assert replay_order(None, 4) == replay_order([0, 1, 2, 3], 4) == ()
    assert reordered(step, ()) is step and in_prompt_order(sent, ()) == sent
    with pytest.raises(ValueError, match="permutation"):
        replay_order([0, 0, 1, 2], 4)
