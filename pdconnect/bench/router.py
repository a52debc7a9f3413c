"""`make bench-router`: what the router adds to a request, and how many it can pass, next to vllm-router.

One run, one set of FAKE engines (`pdconnect.bench.fake_engine`: a prefill that answers
at once, a decode that streams `--chunks` events at once), three ways to reach them:

- direct: the client itself calls prefill, then decode with the returned params — the
  P/D flow with no router, the floor every router is measured against;
- pdconnect: `pdconnect router` (this package), default policy;
- vllm-router: the Rust P/D router from PyPI (`--vllm-pd-disaggregation`), the reference.

Latency: sequential streamed completions, interleaved across targets in small blocks so
machine noise hits all of them alike; added latency = a router's percentile minus the
direct one. Peak rate: a closed loop of `--concurrency` clients for `--duration` seconds
per target, two interleaved rounds, best round kept. Printed side by side with our/its
ratios. On a small shared machine the load generator and the fakes share the cores with
the router under test, so the absolute rates are a floor; the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec

from pdconnect.bench.cluster import Cluster, ProcessSpec

__all__ = ["main"]

_DONE = b"data: [DONE]\n\n"


@dataclass
class Target:
    name: str
    # One request, start to last byte; raises on a wrong answer.
    call: Callable[[aiohttp.ClientSession], Awaitable[None]]
    pid: int | None = None  # the router's process, for its CPU cost per request
    latencies: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    cpu_per_request: list[float] = field(default_factory=list)
    errors: int = 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bodies(chunks: int) -> tuple[bytes, bytes]:
    prompt = " ".join(f"w{i}" for i in range(64))
    client = {"model": "fake-model", "prompt": prompt, "max_tokens": chunks, "stream": True,
              "stream_options": {"include_usage": True}}
    prefill = {**client, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    prefill.pop("stream_options")
    return msgspec.json.encode(client), msgspec.json.encode(prefill)


async def _stream_to_end(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}")
    tail = b""
    async for chunk in resp.content.iter_any():
        tail = (tail + chunk)[-len(_DONE):]
    if tail != _DONE:
        raise RuntimeError("stream did not end with [DONE]")


def _via_router(url: str, body: bytes) -> Callable[[aiohttp.ClientSession], Awaitable[None]]:
    headers = {"Content-Type": "application/json"}

    async def call(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
            await _stream_to_end(resp)
    return call


def _direct(prefill_url: str, decode_url: str, client_body: bytes,
            prefill_body: bytes) -> Callable[[aiohttp.ClientSession], Awaitable[None]]:
    headers = {"Content-Type": "application/json"}
    decode_template = msgspec.json.decode(client_body)

    async def call(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{prefill_url}/v1/completions", data=prefill_body, headers=headers) as resp:
            params = msgspec.json.decode(await resp.read())["kv_transfer_params"]
        body = msgspec.json.encode({**decode_template, "kv_transfer_params": params})
        async with http.post(f"{decode_url}/v1/completions", data=body, headers=headers) as resp:
            await _stream_to_end(resp)
    return call


async def _latency(targets: list[Target], http: aiohttp.ClientSession, requests: int, block: int) -> None:
    for _ in range(max(1, requests // block)):
        for target in targets:
            for _ in range(block):
                start = time.perf_counter()
                try:
                    await target.call(http)
                except (aiohttp.ClientError, RuntimeError, KeyError):
                    target.errors += 1
                    continue
                target.latencies.append(time.perf_counter() - start)


async def _rate(target: Target, http: aiohttp.ClientSession, concurrency: int, duration: float) -> None:
    done = 0
    stop = time.perf_counter() + duration

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            try:
                await target.call(http)
                done += 1
            except (aiohttp.ClientError, RuntimeError, KeyError):
                target.errors += 1
    cpu = _cpu_seconds(target.pid) if target.pid else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    target.rates.append(done / (time.perf_counter() - start))
    if target.pid and done:
        target.cpu_per_request.append((_cpu_seconds(target.pid) - cpu) / done)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def _report(targets: list[Target], args: argparse.Namespace) -> str:
    direct, routers = targets[0], targets[1:]
    names = [t.name for t in targets]
    ratio = len(routers) == 2
    head = f"{'':<26}" + "".join(f"{n:>14}" for n in names) + (f"{'ours/ref':>12}" if ratio else "")
    rows = [head, "-" * len(head)]

    def row(label: str, values: list[float | None], fmt: str = "{:>14.3f}") -> None:
        cells = "".join(f"{'-':>14}" if v is None else fmt.format(v) for v in values)
        extra = ""
        if ratio and values[1] is not None and values[2]:
            extra = f"{values[1] / values[2]:>12.2f}"
        rows.append(f"{label:<26}{cells}{extra}")

    row("latency p50 (ms)", [_pct(t.latencies, 0.50) for t in targets])
    row("latency p99 (ms)", [_pct(t.latencies, 0.99) for t in targets])
    row("added p50 (ms)", [None] + [_pct(t.latencies, 0.50) - _pct(direct.latencies, 0.50) for t in routers])
    row("added p99 (ms)", [None] + [_pct(t.latencies, 0.99) - _pct(direct.latencies, 0.99) for t in routers])
    row("max rate (req/s)", [max(t.rates) for t in targets], "{:>14.0f}")
    row("router CPU/request (us)", [min(t.cpu_per_request) * 1e6 if t.cpu_per_request else None
                                    for t in targets], "{:>14.0f}")
    row("errors", [float(t.errors) for t in targets], "{:>14.0f}")
    lines = [f"router bench: fake P/D engines, streamed completions of {args.chunks} chunks, "
             f"{args.requests} sequential requests per target for latency, "
             f"{args.concurrency} concurrent clients x {args.duration:.0f}s x 2 rounds for rate, "
             f"{os.cpu_count()} CPUs shared with the fakes and the load generator", *rows]
    if not ratio:
        lines.append("vllm-router not found (make .venv-router-ref, or --reference PATH): no reference column")
    return "\n".join(lines)


def _figures(targets: list[Target]) -> dict[str, dict[str, float | int | None]]:
    """The printed figures as data, per target (for --json)."""
    direct = targets[0]
    return {t.name: {
        "p50_ms": _pct(t.latencies, 0.50), "p99_ms": _pct(t.latencies, 0.99),
        "added_p50_ms": None if t is direct else _pct(t.latencies, 0.50) - _pct(direct.latencies, 0.50),
        "added_p99_ms": None if t is direct else _pct(t.latencies, 0.99) - _pct(direct.latencies, 0.99),
        "max_rate_rps": max(t.rates),
        "cpu_us_per_request": min(t.cpu_per_request) * 1e6 if t.cpu_per_request else None,
        "errors": t.errors,
    } for t in targets}


def _python(*argv: str) -> tuple[str, ...]:
    return (sys.executable, *argv)


async def _measure(targets: list[Target], args: argparse.Namespace) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        for target in targets:  # warm pools, caches and JITs alike
            for _ in range(50):
                await target.call(http)
        await _latency(targets, http, args.requests, block=25)
        for _ in range(2):
            for target in targets:
                await _rate(target, http, args.concurrency, args.duration)


def run(args: argparse.Namespace) -> list[Target]:
    client_body, prefill_body = _bodies(args.chunks)
    with Cluster(progress=sys.stderr) as cluster:
        def fake(name: str) -> ProcessSpec:
            port = cluster.free_port()
            return ProcessSpec(name=name, argv=_python("-m", "pdconnect.bench.fake_engine", "--port", str(port),
                                                       "--name", name, "--chunks", str(args.chunks)),
                               health_url=f"http://127.0.0.1:{port}/health", base_url=f"http://127.0.0.1:{port}")
        prefill, decode = cluster.launch(fake("fake-prefill"), fake("fake-decode"))
        ours_port = cluster.free_port()
        specs = [ProcessSpec(
            name="pdconnect",
            argv=_python("-m", "pdconnect.cli", "router", "--host", "127.0.0.1", "--port", str(ours_port),
                         "--prefill", prefill.base_url, "--decode", decode.base_url, "--log-level", "warning"),
            health_url=f"http://127.0.0.1:{ours_port}/health", base_url=f"http://127.0.0.1:{ours_port}")]
        reference = Path(args.reference)
        if reference.is_file():
            ref_port, metrics_port = cluster.free_port(), cluster.free_port()
            specs.append(ProcessSpec(
                name="vllm-router",
                argv=(str(reference), "--vllm-pd-disaggregation", "--prefill", prefill.base_url,
                      "--decode", decode.base_url, "--host", "127.0.0.1", "--port", str(ref_port),
                      "--policy", "round_robin", "--prometheus-port", str(metrics_port), "--log-level", "warning"),
                health_url=f"http://127.0.0.1:{ref_port}/health", base_url=f"http://127.0.0.1:{ref_port}"))
        routers = cluster.launch(*specs)
        targets = [Target("direct", _direct(prefill.base_url, decode.base_url, client_body, prefill_body))]
        targets += [Target(proc.name, _via_router(proc.base_url, client_body), pid=proc.popen.pid)
                    for proc in routers]
        try:
            import uvloop
        except ImportError:
            asyncio.run(_measure(targets, args))
        else:
            uvloop.run(_measure(targets, args))
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdconnect.bench.router", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16, help="events each decode answer streams")
    parser.add_argument("--requests", type=int, default=500, help="sequential requests per target (latency)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per target and round (rate)")
    parser.add_argument("--reference", default=os.environ.get("PDCONNECT_VLLM_ROUTER", ".venv-router-ref/bin/vllm-router"),
                        help="the vllm-router executable")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    targets = run(args)
    print(_report(targets, args), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                                         "targets": _figures(targets)}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
