"""`make bench-router`: what the router adds to a request, and how many it can pass, next to vllm-router.

One run, one set of FAKE engines (`pdconnect.testbed.fake_engine`: a prefill that answers
at once, a decode that streams `--chunks` events at once), three ways to reach them:

- direct: the client itself calls prefill, then decode with the returned params — the
  P/D flow with no router, the floor every router is measured against;
- pdconnect: `pdconnect router` (this package);
- vllm-router: the Rust P/D router from PyPI (`--vllm-pd-disaggregation`), the reference.

Both routers run the same kind of policy (`--policy`): round-robin on both (default: the
router's own cost, no routing logic), or affinity (our prefix-affinity against its
consistent_hash). With one engine per role the choice routes nothing differently; it
only decides what each router computes per request, so the two must match.

Latency: sequential streamed completions, interleaved across targets in small blocks, in
an order that changes every round so each target follows each other one equally often
(`round_orders`), so machine noise and switching costs hit all of them alike; added
latency = a router's percentile minus the direct one; its ratio to vllm-router's comes
with a 95 % interval from resampling whole rounds (`added_ratio_intervals`). Peak rate:
a closed loop of `--concurrency` clients for `--duration` seconds per target,
`--rate-rounds` rounds (4; every other one in reverse order), best round kept. CPU per request: the router
process's user+system CPU over a rate round divided by its requests, the least of its
rounds (on a shared machine one round's figure moves by 10 % or more with what else ran;
two rounds left a run's ratio a coin toss within that).

A request counts only if its stream ended with `[DONE]` *and* it really went prefill
then decode: every prompt starts with a unique `rid-...` word, the fake prefill records
the plan it issued for it and the fake decode the plan it received with it, and the two
must match (a router that skipped prefill, or went decode-only, does not score).

`--observed` runs both routers as a platform team would, each logging what it logs per
request at info level: ours once more per `--sample-ratios` besides the plain one, spans
exported over OTLP/HTTP to a local receiver (a process of its own that counts them,
`_span_sink`) with that share of requests sampled (by default every request,
`pdconnect@1.0`, and `PRODUCTION_RATIO` of them, `pdconnect@0.1`), JSON log lines with
the access log on (one line per request, into the router's log file); vllm-router at
`--log-level info` into `--log-dir` (it has no tracing to turn on).

One row per target, one column per figure, and per ours a row of ours/reference ratios
with their intervals.
On a small shared machine the load generator and the fakes share the cores with the
router under test, so the absolute rates are a floor; the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import aiohttp
import msgspec

from pdconnect.testbed.processes import Cluster, ProcessSpec
from pdconnect.testbed.recipes import fake_engine_server, router_argv

__all__ = ["added_ratio_intervals", "main", "round_orders", "sample_ratios"]

_DONE = b"data: [DONE]\n\n"

# --policy: (ours, vllm-router's) of one kind.
_POLICIES = {"round-robin": ("round-robin", "round_robin"), "affinity": ("prefix-affinity", "consistent_hash")}

# --observed: the sample ratio of ours' last row, the one docs/router.md suggests for
# production (a client's own sampled flag still decides for its requests).
PRODUCTION_RATIO = 0.1
# --observed's traced routers by default: every request sampled, and production's share.
SAMPLE_RATIOS = (1.0, PRODUCTION_RATIO)


Call = Callable[[aiohttp.ClientSession, bytes], Awaitable[None]]


@dataclass
class Target:
    name: str
    # One request (its `rid-...` word given), start to last byte; raises on a wrong answer.
    call: Call
    pid: int | None = None  # the router's process, for its CPU cost per request
    # Per sequential request: its id, start to last byte in seconds, its latency round.
    latencies: list[tuple[bytes, float, int]] = field(default_factory=list)
    # Per rate round: the requests it completed, its length in seconds, the router's CPU.
    rounds: list[tuple[list[bytes], float, float | None]] = field(default_factory=list)
    errors: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    def next_id(self) -> bytes:
        return f"rid-{self.name}-{next(self._ids)}".encode()


@dataclass
class Verdicts:
    """Which request ids went prefill then decode (the fakes' ledgers agree)."""

    good: set[bytes]

    def latencies(self, target: Target) -> list[float]:
        return [t for rid, t, _ in target.latencies if rid in self.good]

    def latencies_by_round(self, target: Target) -> dict[int, list[float]]:
        rounds: dict[int, list[float]] = {}
        for rid, t, round_ in target.latencies:
            if rid in self.good:
                rounds.setdefault(round_, []).append(t)
        return rounds

    def unverified(self, target: Target) -> int:
        counted = [rid for rid, _, _ in target.latencies] + [rid for done, _, _ in target.rounds for rid in done]
        return sum(rid not in self.good for rid in counted)

    def max_rate(self, target: Target) -> float:
        return max(sum(rid in self.good for rid in done) / seconds for done, seconds, _ in target.rounds)

    def cpu_per_request(self, target: Target) -> float | None:
        costs = [
            cpu / n
            for done, _, cpu in target.rounds
            if cpu is not None and (n := sum(rid in self.good for rid in done))
        ]
        return min(costs) if costs else None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bodies(chunks: int) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    """Client and prefill bodies for a request id: the id is the prompt's first word."""
    prompt = " ".join(f"w{i}" for i in range(64))
    client = {
        "model": "fake-model",
        "prompt": "\x00 " + prompt,
        "max_tokens": chunks,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prefill = {**client, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    prefill.pop("stream_options")

    def template(doc: dict[str, object]) -> Callable[[bytes], bytes]:
        head, tail = msgspec.json.encode(doc).split(b"\\u0000", 1)
        return lambda rid: head + rid + tail

    return template(client), template(prefill)


async def _stream_to_end(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}")
    tail = b""
    async for chunk in resp.content.iter_any():
        tail = (tail + chunk)[-len(_DONE) :]
    if tail != _DONE:
        raise RuntimeError("stream did not end with [DONE]")


def _via_router(url: str, body: Callable[[bytes], bytes]) -> Call:
    headers = {"Content-Type": "application/json"}

    async def call(http: aiohttp.ClientSession, rid: bytes) -> None:
        async with http.post(f"{url}/v1/completions", data=body(rid), headers=headers) as resp:
            await _stream_to_end(resp)

    return call


def _direct(
    prefill_url: str, decode_url: str, client_body: Callable[[bytes], bytes], prefill_body: Callable[[bytes], bytes]
) -> Call:
    """The P/D flow done by the client itself: the floor."""
    headers = {"Content-Type": "application/json"}

    async def call(http: aiohttp.ClientSession, rid: bytes) -> None:
        async with http.post(f"{prefill_url}/v1/completions", data=prefill_body(rid), headers=headers) as resp:
            params = msgspec.json.decode(await resp.read())["kv_transfer_params"]
        body = client_body(rid)
        body = body[:-1] + b',"kv_transfer_params":' + msgspec.json.encode(params) + b"}"
        async with http.post(f"{decode_url}/v1/completions", data=body, headers=headers) as resp:
            await _stream_to_end(resp)

    return call


def round_orders(n: int) -> list[tuple[int, ...]]:
    """Orders for successive latency rounds: every target follows every other equally often.

    A block right after another target's block is slower for a while (caches and CPU
    placement follow whoever ran; measured: the same router code ran 0.05-0.1 ms slower
    at p50 when it always followed `direct`). A plain rotation keeps the cyclic order, so
    one target would always follow the same one. Here the rounds run every permutation
    once, chained so that the junctions between rounds also pair each target with each
    other target equally often and never with itself (found by search, for the bench's 3
    to 5 targets; 6 would make the search grow).
    """
    orders = list(itertools.permutations(range(n)))
    if n < 3 or n > 5:  # 1 or 2 targets: the permutations alone are balanced; 6: too many to chain
        return orders
    junctions_per_pair = len(orders) // (n * (n - 1))

    def chain(
        done: list[tuple[int, ...]], left: set[tuple[int, ...]], used: dict[tuple[int, int], int]
    ) -> list[tuple[int, ...]] | None:
        if not left:
            closing = (done[-1][-1], done[0][0])  # the last round leads into the first again
            return done if closing[0] != closing[1] and used.get(closing, 0) < junctions_per_pair else None
        for order in sorted(left):
            pair = (done[-1][-1], order[0])
            if pair[0] == pair[1] or used.get(pair, 0) >= junctions_per_pair:
                continue
            used[pair] = used.get(pair, 0) + 1
            found = chain([*done, order], left - {order}, used)
            if found:
                return found
            used[pair] -= 1
        return None

    found = chain([orders[0]], set(orders[1:]), {})
    assert found is not None, "no balanced chain of round orders"
    return found


async def _latency(targets: list[Target], http: aiohttp.ClientSession, requests: int, block: int) -> None:
    orders = round_orders(len(targets))
    for round_ in range(max(1, requests // block)):
        for index in orders[round_ % len(orders)]:
            target = targets[index]
            for _ in range(block):
                rid = target.next_id()
                start = time.perf_counter()
                try:
                    await target.call(http, rid)
                except (aiohttp.ClientError, RuntimeError, KeyError):
                    target.errors += 1
                    continue
                target.latencies.append((rid, time.perf_counter() - start, round_))


async def _rate(target: Target, http: aiohttp.ClientSession, concurrency: int, duration: float) -> None:
    done: list[bytes] = []
    stop = time.perf_counter() + duration

    async def client() -> None:
        while time.perf_counter() < stop:
            rid = target.next_id()
            try:
                await target.call(http, rid)
                done.append(rid)
            except (aiohttp.ClientError, RuntimeError, KeyError):
                target.errors += 1

    cpu = _cpu_seconds(target.pid) if target.pid else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    target.rounds.append((done, seconds, _cpu_seconds(target.pid) - cpu if target.pid else None))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return _pct_sorted(sorted(values), q)


def _pct_sorted(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


# Draws of the round bootstrap behind each ratio's interval (seeded: a run's intervals
# follow from its latencies alone).
_DRAWS = 1000

Interval = tuple[float, float]


def added_ratio_intervals(
    direct: dict[int, list[float]],
    reference: dict[int, list[float]],
    ours: dict[str, dict[int, list[float]]],
    quantiles: tuple[float, ...] = (0.5, 0.99),
    draws: int = _DRAWS,
    seed: int = 0,
) -> dict[str, dict[float, Interval | None]]:
    """A 95 % interval for each of ours' added-latency ratios to the reference.

    At quantile q the ratio is (ours' q - direct's q) / (reference's q - direct's q), the
    report's ratio row. Its interval comes from resampling whole latency rounds with
    replacement (a percentile bootstrap): a round runs one block of every target back to
    back, so what a slow stretch of the shared machine did to all of them stays together,
    as measured. A p99 rests on a run's ~80 slowest requests; with the interval, a ratio
    that one run puts at 1.1x and the next at 0.9x reads as what it is. A draw in which
    the reference added nothing (or less) has no ratio and is left out; the interval is
    None when more than a tenth of the draws had none.
    """
    rounds = sorted(set(direct).intersection(reference, *ours.values()))
    rng = random.Random(seed)
    ratios: dict[str, dict[float, list[float]]] = {name: {q: [] for q in quantiles} for name in ours}

    def drawn(table: dict[int, list[float]], picked: list[int]) -> list[float]:
        return sorted([x for r in picked for x in table[r]])

    for _ in range(draws if rounds else 0):
        picked = rng.choices(rounds, k=len(rounds))
        floor, ref = drawn(direct, picked), drawn(reference, picked)
        floor_at = {q: _pct_sorted(floor, q) for q in quantiles}
        added_ref = {q: _pct_sorted(ref, q) - floor_at[q] for q in quantiles}
        for name, table in ours.items():
            mine = drawn(table, picked)
            for q in quantiles:
                if added_ref[q] > 0:
                    ratios[name][q].append((_pct_sorted(mine, q) - floor_at[q]) / added_ref[q])

    def interval(values: list[float]) -> Interval | None:
        if len(values) < 0.9 * draws:
            return None
        values.sort()
        return values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]

    return {name: {q: interval(values) for q, values in by_q.items()} for name, by_q in ratios.items()}


_COLUMNS = ("p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "max req/s", "CPU us/req", "errors", "not P->D")

# The figures whose ratio to vllm-router's gets an interval: its quantile, and its key.
_INTERVALS = {"added_p50_ms": (0.5, "added_p50_ratio_95"), "added_p99_ms": (0.99, "added_p99_ratio_95")}

Figures = dict[str, dict[str, float | int | Interval | None]]


def _figures(targets: list[Target], verdicts: Verdicts) -> Figures:
    """Every figure per target, from verified requests only; ours' added-latency ratio
    intervals (`added_ratio_intervals`) when vllm-router ran."""
    direct = verdicts.latencies(targets[0])
    out: Figures = {}
    for t in targets:
        lat = verdicts.latencies(t)
        cpu = verdicts.cpu_per_request(t)
        routed = t is not targets[0]
        out[t.name] = {
            "p50_ms": _pct(lat, 0.50),
            "p99_ms": _pct(lat, 0.99),
            "added_p50_ms": _pct(lat, 0.50) - _pct(direct, 0.50) if routed else None,
            "added_p99_ms": _pct(lat, 0.99) - _pct(direct, 0.99) if routed else None,
            "max_rate_rps": verdicts.max_rate(t),
            "cpu_us_per_request": cpu * 1e6 if cpu is not None else None,
            "errors": t.errors,
            "not_prefill_then_decode": verdicts.unverified(t),
        }
    reference = next((t for t in targets if t.name == "vllm-router"), None)
    if reference is not None:
        ours = {t.name: verdicts.latencies_by_round(t) for t in targets[1:] if t is not reference}
        floor = verdicts.latencies_by_round(targets[0])
        quantiles = tuple(q for q, _ in _INTERVALS.values())
        spans = added_ratio_intervals(floor, verdicts.latencies_by_round(reference), ours, quantiles)
        for name, by_q in spans.items():
            for q, key in _INTERVALS.values():
                out[name][key] = by_q[q]
    return out


def _report(targets: list[Target], figures: Figures, args: argparse.Namespace) -> str:
    keys = (
        "p50_ms",
        "p99_ms",
        "added_p50_ms",
        "added_p99_ms",
        "max_rate_rps",
        "cpu_us_per_request",
        "errors",
        "not_prefill_then_decode",
    )
    formats = ("{:.3f}", "{:.3f}", "{:.3f}", "{:.3f}", "{:.0f}", "{:.0f}", "{:.0f}", "{:.0f}")
    width = 14
    head = f"{'target':<18}" + "".join(f"{c:>{width}}" for c in _COLUMNS)
    rows = [head, "-" * len(head)]
    for t in targets:
        cells = "".join(
            f"{'-' if v is None else fmt.format(v):>{width}}"
            for v, fmt in zip((figures[t.name][k] for k in keys), formats)
        )
        rows.append(f"{t.name:<18}{cells}")
    names = [t.name for t in targets]
    for name in (n for n in names if n.startswith("pdconnect") and "vllm-router" in names):
        ours, ref = figures[name], figures["vllm-router"]
        cells, spans = "", ""
        for k in keys:
            a, b = ours[k], ref[k]
            ratio = f"{a / b:.2f}x" if isinstance(a, float | int) and isinstance(b, float | int) and b else "-"
            cells += f"{'' if k in ('errors', 'not_prefill_then_decode') else ratio:>{width}}"
            span = ours.get(_INTERVALS[k][1]) if k in _INTERVALS else None
            spans += f"{f'{span[0]:.2f}-{span[1]:.2f}x' if isinstance(span, tuple) else '':>{width}}"
        rows.append(f"{'ours/vllm-router' if name == 'pdconnect' else name + '/ref':<18}{cells}")
        rows.append(f"{'  95% interval':<18}{spans}")
    lines = [
        (
            f"router bench: fake P/D engines, streamed completions of {args.chunks} chunks, "
            f"{args.policy} policy on both routers ({' vs '.join(_POLICIES[args.policy])}), "
            f"{_observed_line(args.sample_ratios) if args.observed else ''}"
            f"{args.requests} sequential requests per target for latency, "
            f"{args.concurrency} concurrent clients x {args.duration:.0f}s x {args.rate_rounds} rounds for rate, "
            f"{os.cpu_count()} CPUs shared with the fakes and the load generator; "
            "only requests that went prefill then decode count (not P->D: ended [DONE] but did not)"
        ),
        *rows,
    ]
    if "vllm-router" not in names:
        lines.append("vllm-router not found (make .venv-router-ref, or --reference PATH): no reference row")
    return "\n".join(lines)


async def _measure(targets: list[Target], args: argparse.Namespace) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        for target in targets:  # warm pools, caches and JITs alike
            for _ in range(50):
                await target.call(http, target.next_id())
        await _latency(targets, http, args.requests, block=25)
        for round_ in range(args.rate_rounds):
            for target in targets if round_ % 2 == 0 else targets[::-1]:
                await _rate(target, http, args.concurrency, args.duration)


async def _verdicts(prefill_url: str, decode_url: str) -> Verdicts:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{prefill_url}/fake/ledger") as resp:
            issued = msgspec.json.decode(await resp.read())["prefill"]
        async with http.get(f"{decode_url}/fake/ledger") as resp:
            received = msgspec.json.decode(await resp.read())["decode"]
    return Verdicts({rid.encode() for rid, plan in received.items() if issued.get(rid) == plan})


def _observed_line(ratios: tuple[float, ...]) -> str:
    names = " and ".join(f"pdconnect@{ratio}" for ratio in ratios)
    return (
        f"ours plain and, as {names}, with OTLP tracing at that sample ratio, JSON logs at info "
        "and the access log, vllm-router at --log-level info into --log-dir, "
    )


def _observed_args(traces_url: str | None, ratio: float | None) -> tuple[str, ...]:
    """Our router's logging and tracing options: quiet without a `ratio` (or `traces_url`);
    with both, spans there (`ratio` of them sampled), JSON lines at info level with the
    access log (what `--observed` measures)."""
    if traces_url is None or ratio is None:
        return ("--log-level", "warning")
    return (
        *("--log-level", "info", "--log-format", "json", "--access-log"),
        *("--otlp-traces-endpoint", traces_url, "--otlp-traces-sample-ratio", str(ratio)),
    )


def _reference_logging(log_dir: Path | None) -> tuple[str, ...]:
    """vllm-router's: warning without `log_dir`; with it, info (its per-request lines) into it."""
    if log_dir is None:
        return ("--log-level", "warning")
    return ("--log-level", "info", "--log-dir", str(log_dir))


def _log_lines(path: Path) -> int:
    """Lines a router wrote to a log file, or to every file under a log directory."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return sum(f.read_bytes().count(b"\n") for f in files)


def _serve_spans(port: Connection, spans: Synchronized[int]) -> None:
    """An OTLP/HTTP trace receiver that counts the spans of each export, until killed."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.otlp_receiver import otlp_server  # the repository's receiver; run from its root

    def count(body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with spans.get_lock():
            spans.value += sum(len(scope.spans) for res in request.resource_spans for scope in res.scope_spans)

    server = otlp_server(count)
    port.send(server.server_address[1])
    server.serve_forever()


@contextlib.contextmanager
def _span_sink() -> Iterator[tuple[str, Callable[[], int]]]:
    """The traces endpoint of `--observed` and its count of spans received. A process of its
    own: in the load generator's (as `tests/otlp_receiver.py`, which keeps every span as
    Python objects) it took the generator's interpreter lock while a traced router ran, and
    the rows of the traced routers were measured with a slower client than the others."""
    context = multiprocessing.get_context("spawn")
    spans = context.Value("q", 0)
    ours, theirs = context.Pipe()
    sink = context.Process(target=_serve_spans, args=(theirs, spans), name="otlp-sink", daemon=True)
    sink.start()
    try:
        if not ours.poll(60):
            raise SystemExit("--observed: the span sink did not start")
        yield f"http://127.0.0.1:{ours.recv()}/v1/traces", lambda: int(spans.value)
    finally:
        sink.kill()
        sink.join()


def run(args: argparse.Namespace) -> tuple[list[Target], Verdicts]:
    with contextlib.ExitStack() as stack:
        traces_url, received = None, None
        if args.observed:
            traces_url, received = stack.enter_context(_span_sink())
        targets, verdicts = _run(args, traces_url)
        if received is not None:
            spans = received()
            print(f"observed: the receiver got {spans} spans from the routers", file=sys.stderr, flush=True)
            if not spans:
                raise SystemExit("--observed: the router exported no spans")
    return targets, verdicts


def _run(args: argparse.Namespace, traces_url: str | None) -> tuple[list[Target], Verdicts]:
    client_body, prefill_body = _bodies(args.chunks)
    with Cluster(progress=sys.stderr) as cluster:

        def fake(name: str) -> ProcessSpec:
            return fake_engine_server(name, port=cluster.free_port(), args=("--chunks", str(args.chunks)))

        prefill, decode = cluster.launch(fake("fake-prefill"), fake("fake-decode"))
        ours_policy, ref_policy = _POLICIES[args.policy]
        # Plain always; with --observed, traced and JSON-logging at each ratio besides, so
        # one run shows what observing costs next to the plain router and vllm-router.
        ours: list[tuple[str, float | None]] = [("pdconnect", None)]
        if traces_url is not None:
            ours += [(f"pdconnect@{ratio}", ratio) for ratio in args.sample_ratios]
        specs = []
        for name, ratio in ours:
            ours_port = cluster.free_port()
            specs.append(
                ProcessSpec(
                    name=name,
                    argv=router_argv(
                        port=ours_port,
                        prefill=[prefill.base_url],
                        decode=[decode.base_url],
                        args=(*_observed_args(traces_url, ratio), "--policy", ours_policy),
                    ),
                    health_url=f"http://127.0.0.1:{ours_port}/health",
                    base_url=f"http://127.0.0.1:{ours_port}",
                )
            )
        reference = Path(args.reference)
        ref_logs = cluster.log_dir / f"vllm-router-{os.getpid()}-{time.time_ns()}" if traces_url else None
        if reference.is_file():
            ref_port, metrics_port = cluster.free_port(), cluster.free_port()
            specs.append(
                ProcessSpec(
                    name="vllm-router",
                    argv=(
                        str(reference),
                        "--vllm-pd-disaggregation",
                        "--prefill",
                        prefill.base_url,
                        "--decode",
                        decode.base_url,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(ref_port),
                        "--policy",
                        ref_policy,
                        "--prometheus-port",
                        str(metrics_port),
                        *_reference_logging(ref_logs),
                    ),
                    health_url=f"http://127.0.0.1:{ref_port}/health",
                    base_url=f"http://127.0.0.1:{ref_port}",
                )
            )
        routers = cluster.launch(*specs)
        targets = [Target("direct", _direct(prefill.base_url, decode.base_url, client_body, prefill_body))]
        targets += [Target(proc.name, _via_router(proc.base_url, client_body), pid=proc.popen.pid) for proc in routers]
        try:
            import uvloop
        except ImportError:
            asyncio.run(_measure(targets, args))
        else:
            uvloop.run(_measure(targets, args))
        verdicts = asyncio.run(_verdicts(prefill.base_url, decode.base_url))
        for proc in routers:  # what each side logged: the observed rows' logging is like for like
            log = ref_logs if proc.name == "vllm-router" and ref_logs is not None else proc.log_path
            print(f"{proc.name} wrote {_log_lines(log)} log lines ({log})", file=sys.stderr, flush=True)
    return targets, verdicts


def sample_ratios(text: str) -> tuple[float, ...]:
    """`--sample-ratios`: distinct ratios in [0, 1], one or two (with direct, the plain
    router and vllm-router, the 5 targets `round_orders` chains)."""
    try:
        ratios = tuple(dict.fromkeys(float(part) for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not 1 <= len(ratios) <= 2 or not all(0.0 <= r <= 1.0 for r in ratios):
        raise argparse.ArgumentTypeError(f"one or two distinct ratios in [0, 1], got {text!r}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16, help="events each decode answer streams")
    parser.add_argument(
        "--requests",
        type=int,
        default=8000,
        help="sequential requests per target (latency; p99 is the 80th slowest of 8000)",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--policy",
        choices=sorted(_POLICIES),
        default="round-robin",
        help="the same kind of routing policy on both routers",
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per target and round (rate)")
    parser.add_argument("--rate-rounds", type=int, default=4, help="rate rounds per target, the best kept")
    parser.add_argument(
        "--reference",
        default=os.environ.get("PDCONNECT_VLLM_ROUTER", ".venv-router-ref/bin/vllm-router"),
        help="the vllm-router executable",
    )
    parser.add_argument(
        "--observed",
        action="store_true",
        help="our router with OTLP tracing (to a local receiver), JSON logs at info level and the access log",
    )
    parser.add_argument(
        "--sample-ratios",
        type=sample_ratios,
        default=SAMPLE_RATIOS,
        help="with --observed: one traced router per sample ratio, comma-separated "
        f"(default {','.join(map(str, SAMPLE_RATIOS))}; two at most)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    targets, verdicts = run(args)
    figures = _figures(targets, verdicts)
    print(_report(targets, figures, args), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"config": {k: v for k, v in vars(args).items() if k != "json"}, "targets": figures},
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
