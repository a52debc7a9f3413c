"""`pdconnect bench`: run one benchmark scenario against any running P/D deployment.

    pdconnect bench SCENARIO --router URL --prefill-metrics URL... --decode-metrics URL...
                             [--reference URL] [options]
    pdconnect bench compare A.json B.json

Requests go to the router (streamed `/v1/completions`, token ids or text); hit counters
are read from the engines' own `/metrics` before and after each step. Prints a table
and, with `--json`, writes every figure (and each request's TTFT). Scenario options are
generated from the scenario dataclasses in `pdconnect.bench.scenarios`, so the defaults
shown by `--help` are the ones used. `--reference` names a colocated engine (same model
and flags, no connector): each step's prompts are replayed on it and its local hit is
shown beside decode's — for `multi-turn`, per turn, on the very token sequences the
deployment saw. `compare` puts two runs' JSON side by side with
their ratio (on a cluster: the same scenario and `--seed` against a slack-on and a
slack-off deployment).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from pdconnect.bench.loadgen import Deployment, LoadGenerator, RunResult, run_scenario
from pdconnect.bench.report import format_comparison, format_run, write_chart, write_json
from pdconnect.bench.scenarios import (
    MultiTurnScenario,
    PrefixRepetitionScenario,
    ProbeScenario,
    Scenario,
    SharedPrefixScenario,
    TokenSource,
)

__all__ = ["SCENARIOS", "main"]

COMPARE = "compare"
SCENARIOS: dict[str, type[Any]] = {
    cls.name: cls for cls in (ProbeScenario, PrefixRepetitionScenario, SharedPrefixScenario, MultiTurnScenario)
}


CHART_HELP = "also draw decode's hit tokens and TTFT per scenario here, as `make demo` does (PNG; needs matplotlib)"


def _add_common(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("deployment")
    where.add_argument("--router", required=True, metavar="URL", help="the router (OpenAI-compatible)")
    where.add_argument(
        "--prefill-metrics",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="prefill engines' base or /metrics URLs (counters summed over them)",
    )
    where.add_argument(
        "--decode-metrics",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="decode engines' base or /metrics URLs",
    )
    where.add_argument("--model", help="served model name (default: the router's first /v1/models entry)")
    where.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="sent with every request to the router (repeatable), e.g. 'Authorization: Bearer $KEY'",
    )
    where.add_argument(
        "--reference",
        metavar="URL",
        help="a colocated engine (same model and flags, no KV connector): every step's "
        "prompts are replayed on it after the deployment served them, and its local "
        "prefix-cache hit is shown beside decode's",
    )
    where.add_argument(
        "--reference-concurrency",
        type=int,
        metavar="N",
        help="requests the reference replays at once (default: as the step sends them; "
        "1 = what serial siblings hit, the figure coalescing is held to)",
    )
    how = parser.add_argument_group("requests")
    how.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="token-id prompts, or words 'wN' (one token each on the tiny models)",
    )
    how.add_argument(
        "--token-range",
        default="16:1000",
        metavar="LOW:HIGH",
        help="random token ids are drawn from [LOW, HIGH) (default: %(default)s)",
    )
    how.add_argument(
        "--request-rate",
        type=float,
        metavar="PER_SECOND",
        help="open loop: Poisson arrivals at this rate, each step's concurrency capping only "
        "requests in flight (default: closed loop, concurrency workers back to back)",
    )
    how.add_argument(
        "--seed",
        type=int,
        help="same seed, same prompts (default: a fresh one, printed and saved): reuse it "
        "only against fresh engines, or the prompts meet their own cached prefixes",
    )
    how.add_argument(
        "--warmups", type=int, default=1, help="unmeasured requests with unrelated prompts first (default: %(default)s)"
    )
    how.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per request")
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    out.add_argument("--label", help="the run's name in the table and JSON")
    out.add_argument("--chart", type=Path, metavar="PATH", help=CHART_HELP)
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars (default: on a terminal, for steps of 8+ requests)",
    )


def _add_scenario_options(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    group = parser.add_argument_group(f"{cls.name} options")
    for f in dataclasses.fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type in ("bool", bool):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=f"default: {f.default}"
            )
        else:
            group.add_argument(flag, type=int, default=f.default, metavar="N", help=f"default: {f.default}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdconnect bench",
        description="Run one benchmark scenario against a running P/D deployment: requests through the "
        "router, prefix-cache hits from the engines' /metrics.",
    )
    sub = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, cls in SCENARIOS.items():
        child = sub.add_parser(name, help=(cls.__doc__ or "").splitlines()[0], description=cls.__doc__)
        _add_common(child)
        _add_scenario_options(child, cls)
    compare = sub.add_parser(
        COMPARE,
        help="two runs' JSON side by side, with the ratio A/B",
        description="Compare the first run of each file (e.g. the same scenario "
        "and --seed against a slack-on and a slack-off deployment).",
    )
    compare.add_argument("a", type=Path, metavar="A.json")
    compare.add_argument("b", type=Path, metavar="B.json")
    compare.add_argument("--chart", type=Path, metavar="PATH", help=CHART_HELP)
    return parser


def _chart(path: Path | None, runs: list[RunResult], title: str) -> None:
    """`--chart`: `make demo`'s bars, or why there are none (the bench runs without matplotlib)."""
    if path is None:
        return
    if write_chart(path, runs, title):
        print(f"chart: {path}")
    else:
        print("no chart: matplotlib is not installed (pip install 'pdconnect[bench]')", file=sys.stderr)


def _compare(a_path: Path, b_path: Path, chart: Path | None = None) -> int:
    try:
        a, b = (RunResult.from_json(json.loads(p.read_text())["runs"][0]) for p in (a_path, b_path))
    except (OSError, ValueError, KeyError, IndexError, msgspec.ValidationError) as exc:
        print(f"pdconnect bench compare: {exc}", file=sys.stderr)
        return 2
    if a.label == b.label:  # e.g. two default labels: name the columns after the files
        a, b = dataclasses.replace(a, label=a_path.stem), dataclasses.replace(b, label=b_path.stem)
    print(format_comparison(a, b))
    _chart(chart, [a, b], f"{a.label} vs {b.label}")
    return 0


def _scenario(args: argparse.Namespace) -> Scenario:
    cls = SCENARIOS[args.scenario]
    scenario: Scenario = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    return scenario


def _headers(given: list[str]) -> tuple[tuple[str, str], ...]:
    """`--header` values ('NAME: VALUE') as pairs; ValueError names a malformed one."""
    pairs = []
    for header in given:
        name, sep, value = header.partition(":")
        if not sep or not name.strip() or name != name.strip():
            raise ValueError(f"--header {header!r}: expected 'NAME: VALUE'")
        pairs.append((name, value.strip()))
    return tuple(pairs)


def _served_model(router: str, timeout: float, headers: tuple[tuple[str, str], ...]) -> str:
    response = httpx.get(f"{router.rstrip('/')}/v1/models", timeout=timeout, headers=dict(headers))
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _run(
    deployment: Deployment,
    scenario: Scenario,
    tokens: TokenSource,
    warmups: int,
    progress: bool | None,
    label: str,
    request_rate: float | None = None,
    seed: int = 0,
) -> RunResult:
    async with LoadGenerator(deployment, progress=progress, request_rate=request_rate, arrival_seed=seed) as generator:
        steps = await run_scenario(generator, scenario, tokens, warmups)
        transport = await generator.transport() if deployment.decode_metrics else None
    # Every scenario is a dataclass; the Scenario protocol cannot say so.
    settings = {
        "scenario": scenario.name,
        **dataclasses.asdict(scenario),  # type: ignore[call-overload]
        "request_rate": request_rate,
        "router": deployment.router,
        "model": deployment.model,
        "prompt_format": deployment.prompt_format,
        "seed": tokens.seed,
        "reference": deployment.reference,
    }
    return RunResult(label=label, steps=tuple(steps), settings=settings, transport=transport)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.scenario == COMPARE:
        return _compare(args.a, args.b, args.chart)
    try:
        scenario = _scenario(args)
        if isinstance(scenario, MultiTurnScenario) and args.prompt_format != "ids":
            raise ValueError(
                "multi-turn sends token ids: each turn appends the answer's generated ids, "
                "which words would not spell back exactly"
            )
        if args.reference_concurrency is not None and args.reference_concurrency < 1:
            raise ValueError(f"--reference-concurrency must be >= 1, got {args.reference_concurrency}")
        if args.request_rate is not None and not args.request_rate > 0:
            raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
        tokens = TokenSource.parse_range(args.token_range, seed=seed)
        headers = _headers(args.header)
        model = args.model or _served_model(args.router, timeout=30.0, headers=headers)
    except (ValueError, httpx.HTTPError, KeyError, IndexError) as exc:
        print(f"pdconnect bench: {exc}", file=sys.stderr)
        return 2
    deployment = Deployment(
        router=args.router,
        prefill_metrics=tuple(args.prefill_metrics),
        decode_metrics=tuple(args.decode_metrics),
        model=model,
        prompt_format=args.prompt_format,
        request_timeout_s=args.timeout,
        reference=args.reference,
        reference_concurrency=args.reference_concurrency,
        headers=headers,
    )
    label = args.label or f"{scenario.name} via {deployment.router}"
    try:
        run = asyncio.run(
            _run(deployment, scenario, tokens, args.warmups, args.progress, label, args.request_rate, seed)
        )
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"pdconnect bench: {exc}", file=sys.stderr)
        return 1
    print(format_run(run))
    print(f"seed {seed}: the same --seed sends the same prompts", flush=True)
    if args.json is not None:
        write_json(args.json, [run])
        print(f"results: {args.json}")
    _chart(args.chart, [run], label)
    return 0 if all(s.failed == 0 for s in run.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
